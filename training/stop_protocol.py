"""The stop protocol: how a training job stops at a step boundary with a checkpoint and exits 0.

A stop is asked by SIGTERM (SageMaker, before it stops a job) or by the stop rule's thread (`request`). The ranks
agree on the step to stop after through the stop vote (`training/stop_vote.py`), with no collective at the step
boundaries. On the agreed step every rank saves that step synchronously, superseding an async save in flight.
The checkpoint must fit SageMaker's grace (`job.stop_grace_seconds`); rank 0 logs whether it is expected to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hlat.core.config import HlatConfig
from hlat.core.layout import CHECKPOINT_META
from hlat.core.stop_timeline import grace_seconds, stop_timeline
from hlat.core.storage import Storage
from hlat.training.callbacks import Callback, SyncPoint
from hlat.training.checkpoint import CheckpointManager, step_dir
from hlat.training.parallel.distributed import World
from hlat.training.stop_vote import StopVote
from hlat.training.watchdog import Progress

log = logging.getLogger("hlat.train")

STOP_MARGIN = 1.25
"""A requested stop's margin over the measured step and save (`StopProtocol.margin_seconds`)."""


@dataclass
class SaveTimes:
    """How long this job's saves took, as the Trainer times them: what a stop expects its own save to take."""

    last: tuple[int, float] | None = None
    """(step, seconds) of the last save timed to its end."""
    in_flight: tuple[int, float] | None = None
    """(step, perf_counter at its start) of the last async save, until a stop waits for it."""
    async_started: list[tuple[int, float]] = field(default_factory=list)
    """(step, time.time() at its start) of the last two async saves."""

    def began(self, step: int, began: float, async_save: bool) -> None:
        """A save of `step` began at perf_counter `began`: an async one is timed at a stop, a synchronous one now."""
        if async_save:
            self.in_flight = (step, began)
            self.async_started = [*self.async_started[-1:], (step, time.time())]
        else:
            self.last = (step, time.perf_counter() - began)


class StopProtocol(Callback):
    """The stop request, the vote and the stop's checkpoint, on every rank (module docstring)."""

    def __init__(
        self,
        cfg: HlatConfig,
        world: World,
        ckpt: CheckpointManager,
        checkpoints: Storage,
        save: Callable[[int], None],
        saves: SaveTimes,
        progress: Progress,
        extracting_graphs: bool,
    ) -> None:
        self.cfg, self.world, self.ckpt, self.checkpoints = cfg, world, ckpt, checkpoints
        self.save, self.saves, self.progress, self.extracting_graphs = save, saves, progress, extracting_graphs
        self.requested = False
        self.why: str | None = None  # why this rank requested the stop, when not on SIGTERM (request)
        self.vote: StopVote | None = None  # the stop agreed with the other ranks, while fit runs
        self.stopped_at: int | None = None  # the step a stop checkpointed
        self.step_seconds: float | None = None  # the mean step time measured at the last sync point
        self.sigterm_at: float | None = None  # time.monotonic() of this process's first SIGTERM

    # -- asking --------------------------------------------------------------------------------------------
    def request(self, why: str) -> None:
        """Stop at the next step boundary as on SIGTERM (a checkpoint, exit 0), for `why` (the stop rule's reason,
        from its thread: the vote's threads tell the other ranks)."""
        if not self.requested:
            self.why = why
            self.requested = True
        if self.vote is not None:
            self.vote.request()

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """The process's SIGTERM handler while fit runs."""
        if self.sigterm_at is None:
            self.sigterm_at = time.monotonic()
        self.requested = True
        if self.vote is not None:
            self.vote.request()  # an Event: safe in a signal handler

    def margin_seconds(self) -> float:
        """How long before a hard limit a stop must be asked for: STOP_MARGIN x (a step + a save) as measured here,
        job.stop_grace_seconds until a synchronous save has been timed (an async save's length is known at a stop)."""
        if self.saves.last is None or self.step_seconds is None:
            return self.cfg.job.stop_grace_seconds
        return STOP_MARGIN * (self.step_seconds + self.saves.last[1])

    # -- the hooks -----------------------------------------------------------------------------------------
    def on_fit_start(self, step: int) -> None:
        t, world = self.cfg.training, self.world
        self.vote = StopVote(
            world.rank, world.world_size, t.max_steps, passed=step,
            connect=world.connect_store if world.world_size > 1 else None,
        )  # fmt: skip
        self.vote.start()
        if self.requested:  # asked before the loop (the stop rule's thread, a SIGTERM during resume)
            self.vote.request()

    def on_step_end(self, step: int) -> bool:
        # Local numbers only: the stop step is agreed by the vote's threads.
        assert self.vote is not None
        return self.vote.at_boundary(step)

    def on_sync(self, point: SyncPoint) -> int | None:
        self.step_seconds = point.seconds
        return None

    def on_stop(self, point: SyncPoint) -> None:
        """No evaluation or health check: the grace is for the checkpoint."""
        self.progress.beat(point.step, "stop")
        self.stop(point.step, point.seconds)

    def on_fit_end(self) -> None:
        if self.vote is not None:
            self.vote.close()

    # -- the stop ------------------------------------------------------------------------------------------
    def stop(self, step: int, step_seconds: float) -> None:
        """Every rank, once the vote passed after `step`: supersede an async save still in flight
        (`CheckpointManager.supersede`: cut at its next part, never committed; waiting for it could take the grace,
        core/stop_timeline.py), then save this step synchronously (committed before the process exits). Under graph
        extraction there is nothing real to save: the stop ends the rehearsal at this step."""
        if self.extracting_graphs:
            log.warning("SIGTERM while extracting graphs: stopping at step %d, no checkpoint", step)
            return
        grace = grace_seconds(self.cfg)
        # A stop voted for this rank by another is the SIGTERM every rank gets, or the stop rule's (rank 0 says why).
        log.warning("%s: checkpointing step %d and exiting", self.why or "SIGTERM", step)
        if self.world.is_main:
            self.log_stop_budget(step, grace, step_seconds)
        saves = self.saves
        if saves.in_flight is not None:
            saving, began = saves.in_flight
            saves.in_flight = None
            if saving == step:  # this very step's save is in flight: it is the stop's checkpoint
                self.ckpt.wait()
                log.warning("stop: step %d saved (its async save finished) in %.1f s; exiting 0", saving,
                            time.perf_counter() - began)  # fmt: skip
                self.stopped_at = step
                return
            cut_from = time.perf_counter()
            # Every rank supersedes alike (each reaches this stop at the same step), so rank 0 never waits to commit
            # files the others stopped writing.
            superseded = self.ckpt.supersede()
            if superseded is not None:
                log.info(
                    "stop: the async save of step %d was in flight %.1f s: superseded (cut in %.1f s), not committed",
                    superseded, cut_from - began, time.perf_counter() - cut_from,
                )  # fmt: skip
        began = time.perf_counter()
        self.save(step)
        self.ckpt.wait()  # an async manager's save, made synchronous: this rank's files are written (rank 0: committed)
        saves.last = (step, time.perf_counter() - began)
        saves.in_flight = None
        after = f", {time.monotonic() - self.sigterm_at:.1f} s after this rank's SIGTERM" if self.sigterm_at else ""
        log.warning("stop: step %d saved in %.1f s%s (grace %.0f s); exiting 0", step, saves.last[1], after, grace)
        self.stopped_at = step

    def log_stop_budget(self, step: int, grace: float, step_seconds: float) -> None:
        """One line: the stop's timeline from SIGTERM (`core.stop_timeline`, as the dry run prints it) from what this
        job measured: the time since this rank's SIGTERM (else a whole step), an async save in flight (superseded:
        at most one part), the last save's time (else the modelled staging, writes and commit), and whether the
        checkpoint is expected to fit."""
        saves = self.saves
        since = time.monotonic() - self.sigterm_at if self.sigterm_at is not None else None
        if saves.last is None:
            saves.last = self._async_save_seconds()
        save = saves.last[1] if saves.last is not None else None
        left = None
        if saves.in_flight is not None and save is not None:
            # What is left of the async save still running, if it takes as long as the last one did.
            left = max(0.0, save - (time.perf_counter() - saves.in_flight[1]))
        timeline = stop_timeline(
            self.cfg, step_seconds, since_sigterm=since, save_seconds=save,
            in_flight=saves.in_flight is not None, in_flight_left_s=left, grace=grace,
        )  # fmt: skip
        measured = f"step {step_seconds:.1f} s"
        sigterm = f", SIGTERM {since:.1f} s ago" if since is not None else ", no SIGTERM here (the worst case counted)"
        measured += sigterm
        last = saves.last
        measured += f", last save {last[1]:.1f} s (step {last[0]})" if last else ", no save timed yet"
        line = f"stop at step {step}: {timeline.line().removeprefix('stop: ')}; measured: {measured}"
        if timeline.fits():
            log.info("%s", line)
        else:
            log.warning("%s: SIGKILL may come first", line)

    def _async_save_seconds(self) -> tuple[int, float] | None:
        """(step, seconds) of this job's newest committed async save, from its start here to the commit time rank 0
        wrote in its meta.json (to the second, so rounded up): one small read, at a stop only. None when there is
        none (or its meta.json cannot be read)."""
        for step, began in reversed(self.saves.async_started):
            try:
                meta = self.checkpoints.read_json(f"{step_dir(step)}/{CHECKPOINT_META}")
                committed = datetime.fromisoformat(meta["time"])
            except Exception:  # not committed yet, pruned, unreadable: the one before, or nothing
                continue
            return step, max(0.0, committed.timestamp() - began) + 1.0
        return None
