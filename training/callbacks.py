"""The training loop's side concerns, as callbacks the Trainer calls at named hook points.

A callback overrides the hooks it needs; the others do nothing. The Trainer calls its callbacks in list order
(`Trainer.callbacks`): StopProtocol, NanPolicy, SpikePolicy (with training.spike_skip), FirstStepMetrics,
MetricsLogging. So at a sync point the NaN and spike verdicts come before anything is recorded, and a stop's
checkpoint comes after the step's record.

The hook points, in the order a fit meets them:
- `on_resume(state)`: a checkpoint's shared state was loaded (before fit).
- `on_fit_start(step)`: before the first step; `step` is the step fit starts from.
- `on_step_end(step)`: every step boundary, on every rank. Host numbers only. True asks for a stop after `step`.
- `sync_tensors()`: device tensors the next sync point reads, in its one transfer.
- `on_sync(point)`: at a sync point, with what it read. An exit code ends the job there, before any checkpoint.
- `on_stop(point)`: the stop was agreed after this step; fit then returns 0.
- `on_checkpoint(state)`: a checkpoint's shared state is being assembled; add to it.
- `on_fit_end()`: fit returns or raises; before the last save is waited for and the metrics are closed.

No hook may read the device: only `on_sync` sees device values, read once by the Trainer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hlat.core.config import HlatConfig
from hlat.core.contract import EXIT_LOSS_SPIKES, EXIT_NAN, format_step_line, write_failure
from hlat.training.devices import memory_gb, peak_flops
from hlat.training.metrics import MetricsLog
from hlat.training.parallel.distributed import World
from hlat.training.spikes import SpikeDetector, describe_spike, spikes_reason

log = logging.getLogger("hlat.train")


@dataclass
class SyncPoint:
    """A sync point: the step just done, what the host read of the device, and the step's record being built."""

    step: int
    first: bool
    """The first step of this fit."""
    seen: dict[str, Any]
    """Host copies of the step's loss, norm and finite flag, the step tally and every `sync_tensors`."""
    values: dict[str, Any]
    """The step's record (metrics.jsonl); callbacks add to it."""
    seconds: float
    """The mean step time since the previous sync point."""
    logged: bool
    """Whether the step is recorded: training.log_every, the last step, the first of this fit."""


class Callback:
    """A side concern of the loop. Every hook is a no-op here (module docstring: when each is called)."""

    def on_resume(self, state: dict[str, Any]) -> None:
        return None

    def on_fit_start(self, step: int) -> None:
        return None

    def on_step_end(self, step: int) -> bool:
        return False

    def sync_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def on_sync(self, point: SyncPoint) -> int | None:
        return None

    def on_stop(self, point: SyncPoint) -> None:
        return None

    def on_checkpoint(self, state: dict[str, Any]) -> None:
        return None

    def on_fit_end(self) -> None:
        return None


class NanPolicy(Callback):
    """training.nan_policy, on the host. `exit`: a non-finite step ends the job (EXIT_NAN) so it relaunches from
    the last checkpoint; no checkpoint is saved before this check. `skip`: the step was not applied (decided on the
    device) and is logged."""

    def __init__(self, policy: str, extracting_graphs: bool) -> None:
        self.policy, self.extracting_graphs = policy, extracting_graphs
        self.seen = 0  # non-finite steps logged so far in this fit

    def on_fit_start(self, step: int) -> None:
        self.seen = 0

    def on_sync(self, point: SyncPoint) -> int | None:
        seen = point.seen
        nonfinite = int(seen["nonfinite"])
        if nonfinite > self.seen and not self.extracting_graphs:
            where = f"loss is {float(seen['first_loss'])} at step {int(seen['first_step'])}"
            if self.policy == "exit":
                log.error("%s: exiting so the job restarts from the last checkpoint", where)
                return EXIT_NAN
            log.warning("%s: %d step(s) skipped so far (training.nan_policy=skip)", where, nonfinite)
            self.seen = nonfinite
        if not bool(seen["finite"]):
            point.values["skipped"] = True
        return None


class SpikePolicy(Callback):
    """training.spike_skip, on the host: the detector's state in checkpoints, the log of skipped steps, and the
    end of the job (EXIT_LOSS_SPIKES) after training.spike_max_consecutive spikes in a row. The skip itself is
    decided on the device, in the step (`detector`, `masked_step`)."""

    def __init__(self, detector: SpikeDetector, max_consecutive: int, zscore: float, extracting_graphs: bool) -> None:
        self.detector = detector
        self.max_consecutive, self.zscore, self.extracting_graphs = max_consecutive, zscore, extracting_graphs
        self.restored = 0  # skipped before this job, as its checkpoint says (a host number: no device read)
        self.seen = 0  # skipped and logged so far

    def on_resume(self, state: dict[str, Any]) -> None:
        if "spikes" in state:
            self.detector.load_state_dict(state["spikes"])
            self.restored = int(state["spikes"]["skipped"])
        else:
            log.info("training.spike_skip: the checkpoint holds no spike window (saved with it off): it starts empty")

    def on_fit_start(self, step: int) -> None:
        self.seen = self.restored  # only the spikes of this job are logged

    def sync_tensors(self) -> dict[str, torch.Tensor]:
        return self.detector.tensors()

    def on_sync(self, point: SyncPoint) -> int | None:
        seen = point.seen
        if not self.extracting_graphs:
            if int(seen["spikes_tripped_at"]):  # before any hook: no checkpoint holds those steps
                reason = spikes_reason(seen, self.max_consecutive, self.zscore)
                log.error("%s", reason)
                write_failure(reason)
                return EXIT_LOSS_SPIKES
            if int(seen["spikes_skipped"]) > self.seen:
                self.seen = int(seen["spikes_skipped"])
                log.warning(
                    "step %d: %s; %d skipped so far (training.spike_skip)",
                    int(seen["spike_step"]), describe_spike(seen, self.zscore), self.seen,
                )  # fmt: skip
        point.values["spikes_skipped"] = int(seen["spikes_skipped"])
        if int(seen["spike_step"]) == point.step:
            point.values["skipped"] = True
        return None

    def on_checkpoint(self, state: dict[str, Any]) -> None:
        # Device tensors: staged to the host with the rest of the state. The loss and the norm it judges are the
        # same on every rank, so the state is shared.
        state["spikes"] = self.detector.state_dict()


class FirstStepMetrics(Callback):
    """The first step's record gets the time to first step (build, compile or load the compile cache, resume, one
    step) and `metrics`, which the job program fills (e.g. the compile cache's status). Recorded whatever
    training.log_every says: it is what precompilation saves a job."""

    def __init__(self, built_at: float, metrics: dict[str, Any]) -> None:
        self.built_at, self.metrics = built_at, metrics

    def on_sync(self, point: SyncPoint) -> int | None:
        if point.first:
            point.values["first_step_seconds"] = time.perf_counter() - self.built_at
            point.values.update(self.metrics)
        return None


class MetricsLogging(Callback):
    """A logged step's record: metrics.jsonl, TensorBoard and the tracked run (`MetricsLog`), and the step line
    (`core.contract.format_step_line`) that the supervisor reads progress, ETA and throughput from."""

    def __init__(
        self,
        cfg: HlatConfig,
        world: World,
        metrics: MetricsLog,
        lr: Callable[[], float | torch.Tensor],
        source_tokens: Callable[[], dict[str, int]],
        extracting_graphs: bool,
    ) -> None:
        self.cfg, self.world, self.metrics = cfg, world, metrics
        self.lr, self.source_tokens, self.extracting_graphs = lr, source_tokens, extracting_graphs
        self.flops_per_token = cfg.model.flops_per_token(cfg.training.seq_len)
        self.peak = peak_flops(world.device)

    def on_sync(self, point: SyncPoint) -> int | None:
        if point.logged:
            self.record(point.step, point.values, point.seconds)
        return None

    def record(self, step: int, stats: dict[str, Any], seconds: float) -> None:
        """Record a step's values; `seconds` is the mean step time since the previous sync point."""
        tokens = self.cfg.tokens_per_step
        tokens_per_s = tokens / seconds if seconds > 0 else float("nan")
        values: dict[str, Any] = {
            **stats,
            "lr": self.lr(),
            "tokens_per_s": tokens_per_s,
            "step_seconds": seconds,
            "tokens": step * tokens,
            "memory_gb": memory_gb(self.world.device),
        }
        if self.peak:
            values["mfu"] = tokens_per_s * self.flops_per_token / (self.peak * self.world.world_size)
        values.update(self.source_tokens())
        self.metrics.record(step, values)
        if self.world.is_main and self.extracting_graphs:
            log.info("step %d traced (extracting graphs: its values are invalid)", step)
        elif self.world.is_main:
            # The step-line contract: the supervisor reads progress, ETA and throughput from it.
            log.info("%s", format_step_line(step, stats["loss"], stats["grad_norm"], values["lr"], tokens_per_s))
