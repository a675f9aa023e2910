"""Optimizer, learning-rate schedule and gradient clipping of an hlat run (HLAT recipe).

- `lr_at(step, cfg)`: linear warmup, then (training.schedule='cosine') cosine decay to `lr * min_lr_ratio` over
  the horizon (`TrainingConfig.schedule_horizon`: schedule_steps or max_steps), flat at that floor afterwards.
  `step` is the 0-based index of the optimizer step about to be taken; warmup uses `(step + 1) / warmup_steps`, so
  step 0 already learns (lr/warmup) and the last warmup step (warmup_steps - 1) runs at the peak. The cosine starts
  at the peak on step `warmup_steps`.
  With schedule='wsd' (warmup-stable-decay) the peak is held after the warm-up until `TrainingConfig.decay_start`,
  then a "1-sqrt" decay, lr = floor + (peak - floor) * (1 - sqrt(p)) with p = (step - decay_start + 1) / decay
  length, reaches the floor on the horizon's last step (flat afterwards). 1-sqrt rather than linear: Hägele et al.
  2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations" (https://arxiv.org/abs/2405.18392,
  section 3) find it matches a cosine's final loss with a short (~20%) cooldown and beats the linear one. A longer
  horizon only moves the decay's start, so a WSD run extended before its decay began keeps every learning rate it
  already used: no re-warm, no kink.
- `build_scheduler(optimizer, cfg)`: the same schedule as a stateful `LambdaLR` (its state_dict holds only
  plain numbers, so it checkpoints under `torch.load(weights_only=True)`). The optimizer's lr during step k is
  `lr_at(k)` when the loop calls `scheduler.step()` once after every `optimizer.step()`. Its state records the
  schedule it ran under; loading it under a schedule that gives any step already taken another learning rate (a WSD
  run extended after its decay began) is refused (`TrainingConfig.extension_problem`).
- `build_optimizer(model, cfg, precision)`: AdamW with weight decay on every parameter, norms included (HLAT);
  `optimizer_recipe` gives its class and arguments (NxD's optimizer wrapper builds from them).
  'fp32' and 'bf16-mixed' use `torch.optim.AdamW` on FP32 parameters: in 'bf16-mixed' the parameters *are* the
  FP32 master weights and the training loop runs forward/backward under `torch.autocast(dtype=bfloat16)`, so
  nothing here is BF16. 'bf16-sr' uses `AdamWStochasticRounding`: pure BF16 parameters and BF16 Adam states,
  the update computed in FP32 and written back with stochastic rounding (HLAT 7B).
- `stochastic_round_to_bf16(x, generator)`: unbiased rounding of FP32 to BF16.
- `clip_grad_norm(params, max_norm)`: clip to a global norm, returning the pre-clip norm (a device tensor).
- `masked_step(optimizer, apply)`: an optimizer step kept only where a device-side flag says so (nan_policy=skip
  without a host read).

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

from hlat.core.config import TrainingConfig

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
    """WSD past the warm-up: the peak until decay_start, then 1-sqrt down to the floor on step horizon - 1."""
    if step < decay_start:
        return peak
    length = horizon - decay_start
    if length <= 0:  # a horizon inside the warm-up: hold the floor once it ends, as the cosine does
        return floor
    progress = min(1.0, (step - decay_start + 1) / length)
    return floor + (peak - floor) * (1.0 - math.sqrt(progress))


SCHEDULE_FIELDS = ("schedule", "lr", "min_lr_ratio", "warmup_steps", "max_steps", "schedule_steps", "decay_steps")
"""The TrainingConfig fields `lr_at` reads: the schedule record a scheduler's state carries."""


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """`lr_at` as a LambdaLR whose state also records the schedule (`SCHEDULE_FIELDS`, plain values) it ran under,
    so that a resume under another schedule is checked against the steps already taken."""

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
        """Resume, refusing (ValueError, one line) when the saved schedule and this one give a step already taken
        different learning rates: the weights would not be the ones this schedule computes. States saved before
        the record existed are taken as they are."""
        saved = state_dict.get("schedule")
        if saved is not None:
            problem = TrainingConfig(**saved).extension_problem(self._cfg, int(state_dict["last_epoch"]))
            if problem is not None:
                raise ValueError(problem)
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "schedule"})


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_at` as a LambdaLR (`Schedule`) over an optimizer whose groups were created with lr=cfg.lr."""
    return Schedule(optimizer, cfg)


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
    """One AdamW update, in place, exactly as `torch.optim.AdamW` computes it (decoupled weight decay, bias-corrected
    moments); `step` is 1 on the first update. The tensors are the high-precision working copies."""
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias1)


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
    """AdamW with FP32 master weights for BF16 compute on XLA (HLAT 70B's recipe, `bf16-mixed` on trn1).

    Under XLA_DOWNCAST_BF16=1 the device keeps every float32 tensor in BF16 and every float64 tensor in FP32. The
    parameters are float32 tensors, so the model computes in BF16; this optimizer keeps a float64-typed master copy
    of each parameter and float64-typed moments, which live in FP32 on the device: the update is computed and
    accumulated in FP32, then written to the BF16 parameter (rounded to nearest: stochastic rounding is off in this
    mode). The masters are part of the optimizer's state, so checkpoints carry them. Off XLA (no downcast) the
    masters would be real float64: CPU and CUDA use torch.autocast with FP32 parameters instead.
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
        """As torch's, except that the FP64-typed masters and moments keep their dtype: torch's loader would cast
        them to the parameters' float32, which the device would then store in BF16."""
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
    """`optimizer.step()`, kept only where the boolean device tensor `apply` is true: otherwise the parameters and
    the optimizer's tensor state are left as they were (a skipped step), decided on the device, with no host read.
    Costs one copy of the parameters and tensor states while it runs. Step counters kept as Python numbers or host
    tensors advance either way (as the learning-rate schedule does for a skipped step)."""

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
    """The optimizer class and its arguments for `params`: AdamW, one group, weight decay on all of them (HLAT).

    Precision 'fp32' / 'bf16-mixed' need FP32 parameters (in 'bf16-mixed' they are the master weights; the training
    loop casts compute to BF16 with autocast); 'bf16-sr' needs a BF16 model, updated with software stochastic
    rounding on CPU and CUDA, and by plain AdamW on XLA, where the NeuronCore rounds stochastically.
    Under torch-xla's precision flags (`flags`, by default on XLA: Neuron 2.24, `core.environment.precision_by_flags`)
    the model stays FP32-typed and the device does the work: 'bf16-sr' is plain AdamW whose BF16 storage the
    NeuronCore rounds stochastically (HLAT 7B), 'bf16-mixed' is `MasterWeightAdamW` (HLAT 70B), unless ZeRO-1 keeps
    the FP32 masters itself (`zero1`: NxD's optimizer, `training.parallel.neuron.parallel_optimizer`, wraps plain
    AdamW).
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
    """Clip gradients to a global L2 norm of max_norm; return the norm before clipping (max_norm 0: no clip), as a
    0-dim tensor on the gradients' device: reading it is the caller's choice (a host sync on CUDA and XLA).

    Non-finite norms are returned, not raised: the loop's nan_policy decides what a NaN step does.
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
