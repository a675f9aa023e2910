"""Loss-spike skipping (training.spike_skip): a step whose loss or gradient norm spikes is not applied, decided on
the device.

The rule follows OLMo-core's skip-step optimizer (allenai/OLMo-core, src/olmo_core/optim/skip_step_optimizer.py): a
step spikes when its loss, or its gradient norm, is more than training.spike_zscore standard deviations (unbiased, over
the window) from the mean of the trailing training.spike_window steps. It differs in three ways: only a rise counts (a
sudden drop of the loss is no reason to drop an update; OLMo-core takes the absolute z-score); no step is judged before
the window is full (OLMo-core starts at max(20, window / 2) steps); and a spiking step's values do not enter the window,
so a spike does not inflate the mean and spread that judge the steps after it (OLMo-core appends every step's). A
non-finite step's values stay out too (training.nan_policy handles those); every other step's replace the oldest.

Everything lives on the device as fixed-shape tensors (a ring buffer of the last `window` losses and norms, integer
counters) and every update is a `torch.where`, so a spiking step and a normal one run the same ops: no host read, no
data-dependent Python branch, the same XLA graph. The host reads the counters at the loop's sync points only
(`tensors`, in the sync point's one transfer) and writes them in each checkpoint (`state_dict`), so a resumed run
judges every later step exactly as an uninterrupted one. The loss is the step's mean over every rank and the norm is
the global one, so the state is the same on every rank: it is saved once, with the shared state.

Counters are int32 (under XLA_USE_BF16 a float32 counter would be BF16 on the device); the window itself is float32,
BF16 on the device under Neuron 2.24's XLA_USE_BF16 (a spike of several sigmas stands well above BF16's rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

LOSS, GRAD_NORM = 0, 1
"""Rows of the window: the step's loss, its gradient norm."""
SPIKE_FIELDS = ("loss", "loss_mean", "loss_std", "grad_norm", "grad_norm_mean", "grad_norm_std")
"""What `SpikeDetector.newest` holds of the newest spiking step, in this order (the log line's figures)."""


@dataclass(frozen=True)
class Verdict:
    """A step judged by `SpikeDetector.judge` (device tensors): whether it spiked, its values and the window's."""

    spike: torch.Tensor
    """Bool, 0-dim: the step's update is to be skipped."""
    values: torch.Tensor
    """(2,): the step's loss and gradient norm (0 where the norm was not known yet)."""
    mean: torch.Tensor
    std: torch.Tensor


class SpikeDetector:
    """The trailing window and the spike counters of a run, on `device` (see the module docstring).

    `judge` decides a step before its update; `record` then counts it and moves the window on. A caller that knows
    the gradient norm only after the update (NxD's optimizer clips inside step()) judges on the loss alone and
    passes the norm to `record`, which keeps it in the window all the same."""

    def __init__(self, window: int, zscore: float, max_consecutive: int, device: torch.device) -> None:
        if window < 2:
            raise ValueError(f"a spike window needs at least 2 steps, got {window}")
        self.window, self.zscore, self.max_consecutive = window, zscore, max_consecutive
        self.device = device

        def counter() -> torch.Tensor:
            return torch.zeros((), dtype=torch.int32, device=device)

        self._slots = torch.arange(window, dtype=torch.int32, device=device)
        self.history = torch.zeros((2, window), dtype=torch.float32, device=device)
        self.filled, self.position = counter(), counter()
        self.consecutive, self.run_start = counter(), counter()
        self.skipped = counter()
        """Steps skipped as spikes so far in the run."""
        self.newest_step = counter()
        self.newest = torch.zeros(len(SPIKE_FIELDS), dtype=torch.float32, device=device)
        """The newest spiking step's figures (SPIKE_FIELDS)."""
        self.tripped_at, self.tripped_from = counter(), counter()
        """The step at which max_consecutive spikes in a row were first reached, and the first step of that run
        (0: not reached)."""

    # -- on the device, every step ------------------------------------------------------------------------
    def judge(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> Verdict:
        """Whether this step spikes, from its loss and (when given) its gradient norm; changes nothing."""
        loss = loss.detach().float().reshape(())
        norm = torch.zeros_like(loss) if grad_norm is None else grad_norm.detach().float().reshape(())
        values = torch.stack([loss, norm])
        std, mean = torch.std_mean(self.history, dim=1)
        above = (values - mean) > self.zscore * std
        spike = above[LOSS] if grad_norm is None else above[LOSS] | above[GRAD_NORM]
        # A non-finite step is never a spike (nan_policy decides what it does), and never enters the window.
        judged = (self.filled >= self.window) & torch.isfinite(values).all()
        return Verdict(spike=spike & judged, values=values, mean=mean, std=std)

    def record(self, step: torch.Tensor, verdict: Verdict, grad_norm: torch.Tensor | None = None) -> None:
        """Count step `step` (a device int32, 1-based) as judged; enter its values into the window unless it spiked
        or is not finite. `grad_norm`: the norm when `judge` did not have it (it joins the window, not the verdict).
        Every tensor is replaced, none changed in place: a checkpoint staging the previous ones keeps them intact."""
        values = verdict.values
        if grad_norm is not None:
            values = torch.stack([values[LOSS], grad_norm.detach().float().reshape(())])
        spike = verdict.spike
        accept = ~spike & torch.isfinite(values).all()
        write = (self._slots == self.position) & accept
        self.history = torch.where(write, values[:, None], self.history)
        following = self.position + 1
        self.position = torch.where(accept, torch.where(following >= self.window, 0, following), self.position)
        self.filled = torch.where(accept & (self.filled < self.window), self.filled + 1, self.filled)
        self.run_start = torch.where(spike & (self.consecutive == 0), step, self.run_start)
        self.consecutive = torch.where(spike, self.consecutive + 1, 0)
        self.skipped = self.skipped + spike.int()
        self.newest_step = torch.where(spike, step, self.newest_step)
        figures = torch.stack(
            [values[LOSS], verdict.mean[LOSS], verdict.std[LOSS], values[GRAD_NORM], verdict.mean[GRAD_NORM],
             verdict.std[GRAD_NORM]]
        )  # fmt: skip
        self.newest = torch.where(spike, figures, self.newest)
        trips = (self.tripped_at == 0) & (self.consecutive >= self.max_consecutive)
        self.tripped_from = torch.where(trips, self.run_start, self.tripped_from)
        self.tripped_at = torch.where(trips, step, self.tripped_at)

    # -- what the host reads at a sync point, and what a checkpoint holds ---------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """The counters the loop reads at a sync point (in its one transfer)."""
        return {
            "spikes_skipped": self.skipped,
            "spike_step": self.newest_step,
            "spike_figures": self.newest,
            "spikes_tripped_at": self.tripped_at,
            "spikes_tripped_from": self.tripped_from,
        }

    _STATE = ("history", "filled", "position", "consecutive", "run_start", "skipped", "newest_step", "newest",
              "tripped_at", "tripped_from")  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The whole state, as device tensors (the checkpoint's staging moves them to the host with the rest)."""
        return {"window": self.window, **{name: getattr(self, name) for name in self._STATE}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state. One saved with another window size cannot continue: the window starts empty (the
        counters go on), as a first run's does."""
        kept = self._STATE if int(state["window"]) == self.window else tuple(n for n in self._STATE if n != "history")
        for name in kept:
            current = getattr(self, name)
            setattr(self, name, state[name].to(device=self.device, dtype=current.dtype))
        if "history" not in kept:
            self.filled = torch.zeros_like(self.filled)
            self.position = torch.zeros_like(self.position)


# -- on the host, from what a sync point read ----------------------------------------------------------------
def describe_spike(seen: dict[str, Any], zscore: float) -> str:
    """'loss spike skipped (loss 9.1 vs window mean 3.2 +/- 0.1)' for the newest spiking step in `seen` (the host
    copy of `SpikeDetector.tensors`): the loss's figures, the gradient norm's, or both, whichever spiked."""
    f = dict(zip(SPIKE_FIELDS, (float(x) for x in seen["spike_figures"]), strict=True))
    parts = []
    if f["loss"] - f["loss_mean"] > zscore * f["loss_std"]:
        parts.append(("loss", f"loss {f['loss']:.4g} vs window mean {f['loss_mean']:.4g} +/- {f['loss_std']:.2g}"))
    if f["grad_norm"] - f["grad_norm_mean"] > zscore * f["grad_norm_std"]:
        parts.append(
            (
                "grad-norm",
                f"grad norm {f['grad_norm']:.4g} vs window mean {f['grad_norm_mean']:.4g} +/- {f['grad_norm_std']:.2g}",
            )
        )
    if not parts:  # rounding on the way to the host: say what was read
        parts.append(("loss", f"loss {f['loss']:.4g} vs window mean {f['loss_mean']:.4g} +/- {f['loss_std']:.2g}"))
    kinds = " and ".join(kind for kind, _ in parts)
    return f"{kinds} spike skipped ({'; '.join(text for _, text in parts)})"


def spikes_reason(seen: dict[str, Any], max_consecutive: int, zscore: float) -> str:
    """The failure reason of a run stopped by max_consecutive spikes in a row (`LossSpikes: ...`)."""
    first, last = int(seen["spikes_tripped_from"]), int(seen["spikes_tripped_at"])
    return (
        f"LossSpikes: steps {first}-{last} spiked {last - first + 1} in a row (training.spike_max_consecutive="
        f"{max_consecutive}, training.spike_zscore={zscore:g}), the newest at step {int(seen['spike_step'])}: "
        f"{describe_spike(seen, zscore)}; no update of theirs was applied. The run diverged (the same data and "
        "weights spike again on a relaunch): resume from an earlier checkpoint with a lower training.lr, or raise "
        "training.spike_zscore or training.spike_max_consecutive"
    )
