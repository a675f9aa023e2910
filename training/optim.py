"""Optimizer, learning-rate schedule and gradient clipping of an hlat run (HLAT recipe).

- `lr_at(step, cfg)`: linear warmup, then cosine decay to `lr * min_lr_ratio` over the horizon
  (`schedule_steps or max_steps`), flat at that floor afterwards. `step` is the 0-based index of the optimizer
  step about to be taken; warmup uses `(step + 1) / warmup_steps`, so step 0 already learns (lr/warmup) and the
  last warmup step (warmup_steps - 1) runs at the peak. The cosine starts at the peak on step `warmup_steps`.
- `build_scheduler(optimizer, cfg)`: the same schedule as a stateful `LambdaLR` (its state_dict holds only
  plain numbers, so it checkpoints under `torch.load(weights_only=True)`). The optimizer's lr during step k is
  `lr_at(k)` when the loop calls `scheduler.step()` once after every `optimizer.step()`.
- `build_optimizer(model, cfg, precision)`: AdamW with weight decay on every parameter, norms included (HLAT).
  'fp32' and 'bf16-mixed' use `torch.optim.AdamW` on FP32 parameters: in 'bf16-mixed' the parameters *are* the
  FP32 master weights and the training loop runs forward/backward under `torch.autocast(dtype=bfloat16)`, so
  nothing here is BF16. 'bf16-sr' uses `AdamWStochasticRounding`: pure BF16 parameters and BF16 Adam states,
  the update computed in FP32 and written back with stochastic rounding (HLAT 7B).
- `stochastic_round_to_bf16(x, generator)`: unbiased rounding of FP32 to BF16.
- `clip_grad_norm(params, max_norm)`: clip to a global norm, returning the pre-clip norm.

Why stochastic rounding: a BF16 weight has 8 significant bits, so an update smaller than half its ulp is lost
entirely under round-to-nearest (late in training most updates are). Rounding up with probability equal to
the fraction of the ulp makes the rounded value equal the exact one in expectation, so small updates
accumulate. The random bits come from a `torch.Generator` seeded from (seed, step, parameter index): the
same step rounds the same way after a resume (bitwise-exact restarts) with no generator state to checkpoint,
and every data-parallel replica draws the same bits, so replicas holding identical weights and gradients stay
identical without communication.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from training.config import TrainingConfig

PRECISIONS = ("fp32", "bf16-mixed", "bf16-sr")

# An FP32 bit pattern keeps its BF16 part in the high 16 bits; these are the low ones that rounding drops.
_LOW_BITS = 16
_HIGH_MASK = -(1 << _LOW_BITS)  # 0xFFFF0000 as a (negative) int32


# -- learning-rate schedule --------------------------------------------------------------------------------


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """Learning rate of the 0-based optimizer step `step` (see the module docstring for the exact shape)."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup = cfg.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    horizon = cfg.schedule_steps or cfg.max_steps
    decay_steps = horizon - warmup
    if decay_steps <= 0:
        # A horizon inside the warmup leaves no room for a cosine: hold the floor once warmup ends.
        return floor
    progress = min(1.0, (step - warmup) / decay_steps)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_at` as a LambdaLR over an optimizer whose groups were created with lr=cfg.lr."""

    # A plain function, not a callable object: LambdaLR.state_dict() stores a callable object's __dict__ (here
    # it would hold the pydantic config, which `torch.load(weights_only=True)` refuses), but skips functions.
    def factor(step: int) -> float:
        return lr_at(step, cfg) / cfg.lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# -- stochastic rounding -----------------------------------------------------------------------------------


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round an FP32 tensor to BF16, up or down with probabilities that make the result unbiased.

    The FP32 bit pattern is read as int32, 16 uniformly random bits are added to its low half, and the low
    half is cleared. FP32 is sign-magnitude, so this adds to the magnitude for either sign: a value a
    fraction f of the way from its lower-magnitude BF16 neighbour to the next is rounded away from zero with
    probability f, and E[result] == x exactly (a carry into the exponent is just the next BF16 number).
    Exact BF16 values, zeros (of either sign), ±inf and NaN come out unchanged. A finite value beyond the
    largest BF16 number (3.39e38) rounds to ±inf with the probability it would round up, inf being the next
    value past the end of the BF16 range; round-to-nearest overflows the same way.

    `generator` must live on x's device (None: the global generator, not reproducible across resumes).
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_to_bf16 expects a float32 tensor, got {x.dtype}")
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << _LOW_BITS, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    # The low 16 bits are zero, so the conversion to BF16 below is exact (no second rounding).
    rounded = ((bits + noise) & _HIGH_MASK).view(torch.float32).to(torch.bfloat16)
    # NaNs whose payload sits only in the low bits would otherwise truncate to inf; the int32 sum could also
    # wrap for NaN patterns near 0x7FFFFFFF. Let the ordinary conversion handle them.
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), rounded)


def sr_seed(seed: int, step: int, index: int) -> int:
    """The generator seed for rounding parameter number `index` on optimizer step `step` (a 63-bit hash)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    # CPU and CUDA have device generators; elsewhere (e.g. XLA) the bits are drawn on the CPU (see _noise_device).
    gen = torch.Generator(device=device if device.type in ("cpu", "cuda") else "cpu")
    gen.manual_seed(seed)
    return gen


def _round(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if generator.device == x.device:
        return stochastic_round_to_bf16(x, generator)
    return stochastic_round_to_bf16(x.cpu(), generator).to(x.device)


class AdamWStochasticRounding(torch.optim.Optimizer):
    """AdamW for pure BF16 training: BF16 parameters and BF16 states, FP32 arithmetic, stochastic rounding.

    Each step, per parameter: upcast the parameter, its gradient and both moments to FP32; apply decoupled
    weight decay (`p *= 1 - lr * weight_decay`) and the bias-corrected Adam update exactly as
    `torch.optim.AdamW` does; then round the parameter and both moments back to BF16 stochastically (with
    `stochastic_rounding=False`: to nearest, for ablations). The random bits of parameter number i (counted
    over all groups in order) on its k-th step come from a generator seeded with `sr_seed(seed, k, i)`, so the
    optimizer's state_dict (moments, step counts, hyper-parameters) is all a bitwise-exact resume needs.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        seed: int = 0,
        stochastic_rounding: bool = True,
    ) -> None:
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AdamW hyper-parameters: lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "seed": seed,
            "stochastic_rounding": stochastic_rounding,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise TypeError(
                        f"AdamWStochasticRounding expects bfloat16 parameters, got {p.dtype} "
                        f"(shape {tuple(p.shape)}); precision 'bf16-sr' trains a pure BF16 model: "
                        "call model.to(torch.bfloat16) before building the optimizer"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index += 1  # counted for every parameter, with or without a gradient, so indices stay stable
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamWStochasticRounding does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] = step = int(state["step"]) + 1

                param = p.float()
                grad = p.grad.float()
                exp_avg = state["exp_avg"].float()
                exp_avg_sq = state["exp_avg_sq"].float()

                param.mul_(1.0 - lr * wd)
                exp_avg.lerp_(grad, 1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                bias1 = 1.0 - beta1**step
                bias2 = 1.0 - beta2**step
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-lr / bias1)

                if group["stochastic_rounding"]:
                    # One generator per (step, parameter) and a fixed draw order: parameter, exp_avg, exp_avg_sq.
                    gen = _generator(p.device, sr_seed(group["seed"], step, index))
                    p.copy_(_round(param, gen))
                    state["exp_avg"].copy_(_round(exp_avg, gen))
                    state["exp_avg_sq"].copy_(_round(exp_avg_sq, gen))
                else:
                    p.copy_(param)
                    state["exp_avg"].copy_(exp_avg)
                    state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss


# -- building ----------------------------------------------------------------------------------------------


def build_optimizer(model: nn.Module, cfg: TrainingConfig, precision: str) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter of `model`, one group, weight decay on all of them (HLAT).

    precision 'fp32' / 'bf16-mixed' need FP32 parameters (in 'bf16-mixed' they are the master weights; the
    training loop casts compute to BF16 with autocast); 'bf16-sr' needs a BF16 model.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    hyper: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
    }
    if precision == "bf16-sr":
        return AdamWStochasticRounding(params, seed=cfg.seed, **hyper)
    wrong = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if wrong:
        raise TypeError(
            f"precision {precision!r} keeps FP32 parameters (master weights), but the model has {', '.join(wrong)} "
            "ones; do not cast the model (bf16-mixed computes in BF16 under torch.autocast)"
        )
    # fused=False: the fused kernels do not exist on every device this runs on (CPU builds, XLA); foreach is
    # left to torch (on where supported).
    return torch.optim.AdamW(params, fused=False, **hyper)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip gradients to a global L2 norm of max_norm; return the norm before clipping (max_norm 0: no clip).

    Non-finite norms are returned, not raised: the loop's nan_policy decides what a NaN step does.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return float(norm)
