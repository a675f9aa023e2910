"""Loss-spike skipping (training.spike_skip): a step whose loss or gradient norm spikes is not applied.

A step spikes when a value is over spike_zscore deviations above the trailing spike_window's mean. The rule follows
OLMo-core's skip-step optimizer; docs/training.md ("Loss spikes") gives the differences. State is fixed-shape device
tensors updated with `torch.where`: no host read, one XLA graph either way. The host reads counters at sync points and
saves them in checkpoints, so a resumed run judges the same. The state is the same on every rank and is saved once."""

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
    """A run's trailing window and spike counters, on `device`.

    `judge` decides a step before its update; `record` counts it and moves the window. A caller that learns the norm
    only after the update judges on the loss and passes the norm to `record`."""

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
        """The step where max_consecutive spikes were first reached, and that run's first step (0: never)."""

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
        """Count 1-based step `step`; its values enter the window unless it spiked or is not finite. Tensors are
        replaced, never changed in place, so a staged checkpoint stays intact."""
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
        """Restore a saved state; one with another window size starts an empty window (counters go on)."""
        kept = self._STATE if int(state["window"]) == self.window else tuple(n for n in self._STATE if n != "history")
        for name in kept:
            current = getattr(self, name)
            setattr(self, name, state[name].to(device=self.device, dtype=current.dtype))
        if "history" not in kept:
            self.filled = torch.zeros_like(self.filled)
            self.position = torch.zeros_like(self.position)


# -- on the host, from what a sync point read ----------------------------------------------------------------
def describe_spike(seen: dict[str, Any], zscore: float) -> str:
    """'loss spike skipped (loss 9.1 vs window mean 3.2 +/- 0.1)' for the newest spike in `seen`."""
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
