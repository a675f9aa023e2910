"""Optimizer, learning-rate schedule and gradient clipping of an hlat run (HLAT recipe).

Rules:
- `lr_at(step)` takes the 0-based step about to run; warmup uses (step + 1) / warmup_steps.
- 'cosine' decays to `lr * min_lr_ratio` at the horizon; 'wsd' holds the peak, then decays as 1 - sqrt(p)
  (Hägele et al. 2024, https://arxiv.org/abs/2405.18392, section 3).
- a resume under a schedule that changes a past step's lr is refused.
- AdamW decays every parameter, norms included (HLAT).
- 'bf16-sr' rounds updates stochastically, seeded by (seed, step, parameter): small updates survive, resumes match.
docs/training.md ("Schedules") covers WSD and extending a run.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hlat.core.config import TrainingConfig

PRECISIONS = ("fp32", "bf16-mixed", "bf16-sr")

# An FP32 bit pattern keeps its BF16 part in the high 16 bits; these are the low ones that rounding drops.
_LOW_BITS = 16
_HIGH_MASK = -(1 << _LOW_BITS)  # 0xFFFF0000 as a (negative) int32


# -- learning-rate schedule --------------------------------------------------------------------------------


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """Learning rate of the 0-based optimizer step `step`."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup = cfg.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    horizon = cfg.schedule_horizon
    if cfg.schedule == "wsd":
        return _wsd_after_warmup(step, cfg.decay_start, horizon, peak, floor)
    decay_steps = horizon - warmup
    if decay_steps <= 0:
        # A horizon inside the warmup leaves no room for a cosine: hold the floor once warmup ends.
        return floor
    progress = min(1.0, (step - warmup) / decay_steps)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _wsd_after_warmup(step: int, decay_start: int, horizon: int, peak: float, floor: float) -> float:
    """WSD past the warm-up: the peak until decay_start, then 1-sqrt to the floor at the horizon's last step."""
    if step < decay_start:
        return peak
    length = horizon - decay_start
    if length <= 0:  # a horizon inside the warm-up: hold the floor once it ends, as the cosine does
        return floor
    progress = min(1.0, (step - decay_start + 1) / length)
    return floor + (peak - floor) * (1.0 - math.sqrt(progress))


SCHEDULE_FIELDS = ("schedule", "lr", "min_lr_ratio", "warmup_steps", "max_steps", "schedule_steps", "decay_steps")
"""The TrainingConfig fields `lr_at` reads, recorded in the scheduler's state."""


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """`lr_at` as a LambdaLR whose state records its schedule, so resumes are checked."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: TrainingConfig) -> None:
        self.schedule = cfg.model_dump(include=set(SCHEDULE_FIELDS))
        self._cfg = cfg

        # A plain function, not a callable object: LambdaLR.state_dict() stores a callable object's __dict__ (here
        # it would hold the pydantic config, which `torch.load(weights_only=True)` refuses), but skips functions.
        def factor(step: int) -> float:
            return lr_at(step, cfg) / cfg.lr

        super().__init__(optimizer, factor)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().state_dict().items() if k != "_cfg"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume; ValueError when the saved schedule gave a past step another learning rate."""
        saved = state_dict.get("schedule")
        if saved is not None:
            problem = TrainingConfig(**saved).extension_problem(self._cfg, int(state_dict["last_epoch"]))
            if problem is not None:
                raise ValueError(problem)
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "schedule"})


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_at` as a LambdaLR (`Schedule`) over groups created with lr=cfg.lr."""
    return Schedule(optimizer, cfg)


# -- stochastic rounding -----------------------------------------------------------------------------------


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round an FP32 tensor to BF16, up or down with probabilities that make the result unbiased.

    Exact BF16 values, zeros, ±inf and NaN pass unchanged.
    `generator` must live on x's device (None: the global one, not reproducible).
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
    """The rounding seed of parameter `index` on step `step` (a 63-bit hash)."""
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


def _adamw_defaults(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> dict[str, Any]:
    """The hyper-parameters every AdamW here takes, checked."""
    if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"invalid AdamW hyper-parameters: lr={lr} betas={betas} eps={eps} wd={weight_decay}")
    return {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update in place, as `torch.optim.AdamW` computes it; `step` is 1 on the first update."""
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias1)


class AdamWStochasticRounding(torch.optim.Optimizer):
    """AdamW for pure BF16 training: BF16 parameters and states, FP32 arithmetic, stochastic rounding.

    Rounding bits come from `sr_seed`, so the state_dict alone resumes bitwise.
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
        defaults = {**_adamw_defaults(lr, betas, eps, weight_decay), "seed": seed}
        super().__init__(params, {**defaults, "stochastic_rounding": stochastic_rounding})
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

                adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, wd)

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


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW with FP32 master weights for BF16 compute on XLA (HLAT 70B's `bf16-mixed`).

    Under XLA_DOWNCAST_BF16=1 float64 tensors are FP32 on the device, so masters and moments are float64-typed.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, _adamw_defaults(lr, betas, eps, weight_decay))
        for group in self.param_groups:
            for p in group["params"]:  # the masters start as the parameters themselves, before any step
                master = p.detach().to(torch.float64)
                self.state[p].update(step=0, master=master, exp_avg=torch.zeros_like(master))
                self.state[p]["exp_avg_sq"] = torch.zeros_like(master)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but the float64-typed state keeps its dtype (a cast would make it BF16 on the device)."""
        tensors = {
            int(i): {k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for i, s in state_dict["state"].items()
        }
        plain = {
            i: {k: v for k, v in s.items() if not isinstance(v, torch.Tensor)} for i, s in state_dict["state"].items()
        }
        super().load_state_dict({**state_dict, "state": plain})
        params = [p for group in self.param_groups for p in group["params"]]
        for index, values in tensors.items():
            p = params[index]
            self.state[p].update({k: v.to(device=p.device, dtype=torch.float64) for k, v in values.items()})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] = step = int(state["step"]) + 1
                master = state["master"]
                grad = p.grad.to(torch.float64)
                adamw_update(master, grad, state["exp_avg"], state["exp_avg_sq"], step, lr, beta1, beta2, eps, wd)
                p.copy_(master)
        return loss


def masked_step(optimizer: torch.optim.Optimizer, apply: torch.Tensor) -> None:
    """`optimizer.step()`, kept only where the device bool `apply` is true; no host read.

    A skipped step leaves parameters and tensor state unchanged; host-side counters advance.
    """

    def tensors(p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = optimizer.state.get(p, {})
        found = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        return {"": p, **{k: v for k, v in found.items() if v.device == apply.device}}

    params = [p for group in optimizer.param_groups for p in group["params"]]
    before = [{k: t.detach().clone() for k, t in tensors(p).items()} for p in params]
    optimizer.step()
    with torch.no_grad():
        for p, kept in zip(params, before, strict=True):
            for key, tensor in tensors(p).items():
                # State the step created (moments on a first step) starts from zeros, as the optimizers create it.
                old = kept[key] if key in kept else torch.zeros_like(tensor)
                tensor.copy_(torch.where(apply, tensor, old))


# -- building ----------------------------------------------------------------------------------------------


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    return params


def optimizer_recipe(
    params: list[nn.Parameter],
    cfg: TrainingConfig,
    precision: str,
    device_type: str = "cpu",
    zero1: bool = False,
    flags: bool | None = None,
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and its arguments for `params`: AdamW, one group, weight decay on all (HLAT).

    Under torch-xla's precision flags the device does the work: 'bf16-sr' is plain AdamW,
    'bf16-mixed' is `MasterWeightAdamW` unless ZeRO-1 keeps the masters (`zero1`).
    Elsewhere 'bf16-sr' uses `AdamWStochasticRounding`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if flags is None:
        flags = device_type == "xla"
    hyper: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
    }
    if precision == "bf16-sr" and not flags:
        if device_type == "xla":  # a BF16 model; the NeuronCore rounds the update (NEURON_RT_STOCHASTIC_ROUNDING_EN)
            return torch.optim.AdamW, {**hyper, "fused": False}
        return AdamWStochasticRounding, {**hyper, "seed": cfg.seed}
    wrong = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if wrong:
        raise TypeError(
            f"precision {precision!r} keeps FP32 parameters (master weights), but the model has {', '.join(wrong)} "
            "ones; do not cast the model (bf16-mixed computes in BF16 under torch.autocast)"
        )
    if precision == "bf16-mixed" and flags and not zero1:
        return MasterWeightAdamW, hyper
    # Fused (one kernel for every parameter's update) on CUDA; elsewhere the fused kernels do not exist on every
    # device this runs on (CPU builds, XLA), and foreach is left to torch (on where supported).
    return torch.optim.AdamW, {**hyper, "fused": device_type == "cuda"}


def build_optimizer(
    model: nn.Module, cfg: TrainingConfig, precision: str, device_type: str = "cpu", flags: bool | None = None
) -> torch.optim.Optimizer:
    """`optimizer_recipe` over every trainable parameter of `model`."""
    params = trainable_parameters(model)
    optimizer_class, arguments = optimizer_recipe(params, cfg, precision, device_type, flags=flags)
    return optimizer_class(params, **arguments)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip gradients to a global L2 norm of max_norm (0: no clip); return the pre-clip norm on the device.

    Non-finite norms are returned, not raised: nan_policy decides.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    norm = (
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        if max_norm > 0
        else torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    )
    # FSDP2's gradients are DTensor shards: their norm is a DTensor, reduced over the ranks on full_tensor().
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if full_tensor is not None else norm
