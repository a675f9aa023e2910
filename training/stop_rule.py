"""The run's stop rule, inside the training job: the job stops itself at a checkpoint when a term is breached.

Terms (`core.contract.StopTerms`): budget, deadline, and the supervisor's heartbeat.
Rules:
- a thread on rank 0 judges the terms by the clock, never the device.
- every rank stops after the same step through the stop vote, checkpoints, and exits 0.
- budget and deadline stop a margin early: 1.25 x (a step + a save), or job.stop_grace_seconds.
- the heartbeat's age is read by run storage's clock, so clock skew does not matter.
docs/jobs.md ("A job is never left alone") explains the terms.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

from hlat.core.contract import STOP_BUDGET, STOP_DEADLINE, STOP_UNSUPERVISED, StopRecord, StopTerms, current_host
from hlat.core.layout import clock_probe_path, heartbeat_path, stop_record_path
from hlat.core.run import Run
from hlat.core.storage import StorageClock

log = logging.getLogger("hlat.train")

HEARTBEAT_READ_S = 60.0
"""At most one heartbeat read this often (one small GET a minute)."""
TICK_S = 1.0
"""How often the thread looks at the clock."""


def _when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


class StopRule:
    """The terms of one job; `check` requests the stop once; `margin()` is the time the stop needs."""

    def __init__(
        self,
        terms: StopTerms,
        request_stop: Callable[[str], None],
        margin: Callable[[], float],
        run: Run | None = None,
        stage: str = "train",
        clock: Callable[[], float] = time.time,
        tick_s: float = TICK_S,
        storage_clock: StorageClock | None = None,
    ) -> None:
        self.terms, self.request_stop, self.margin, self.run = terms, request_stop, margin, run
        self.heartbeat = heartbeat_path(stage)
        self.stage, self.clock, self.tick_s = stage, clock, tick_s
        self.billed_from = terms.submitted_at if terms.submitted_at is not None else clock()
        """Where the bill is counted from."""
        self.storage_clock = storage_clock
        """How old the heartbeat is, by run storage's clock."""
        if storage_clock is None and run is not None:
            self.storage_clock = StorageClock(run.storage, probe=clock_probe_path(stage, "job"))
        self.last_beat = clock()
        """The supervisor's last beat on this host's clock; the job's start at first."""
        self.read_every: float | None = None
        if terms.unsupervised_stop_s is not None:
            self.read_every = min(HEARTBEAT_READ_S, max(tick_s, terms.unsupervised_stop_s / 4))
        self._read_at: float | None = None
        self._read_failing = False
        self.why: str | None = None
        """Why the stop was requested ('budget', 'deadline', 'unsupervised'); None: not (yet)."""
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the judgement -------------------------------------------------------------------------------------------
    def due(self, now: float) -> str | None:
        """Which term is breached at `now`, if any."""
        limit = self.terms.limit_at(self.billed_from)
        if limit is not None and now >= limit[0] - self.margin():
            return limit[1]
        timeout = self.terms.unsupervised_stop_s
        if timeout is not None and self.run is not None:
            self._read_heartbeat(now)
            if now - self.last_beat >= timeout:
                return STOP_UNSUPERVISED
        return None

    def _read_heartbeat(self, now: float) -> None:
        assert self.run is not None and self.read_every is not None
        if self._read_at is not None and now - self._read_at < self.read_every:
            return
        self._read_at = now
        assert self.storage_clock is not None
        try:
            age = self.storage_clock.age(self.heartbeat)
            if age is not None:
                self.last_beat = max(self.last_beat, now - age)
            self._read_failing = False
        except Exception as exc:  # storage away, a half-written file: the last beat read stands
            if not self._read_failing:
                log.warning("stop rule: cannot read %s (%s: %s); the last beat read stands",
                            self.run.storage.uri(self.heartbeat), type(exc).__name__, exc)  # fmt: skip
            self._read_failing = True

    def check(self, now: float | None = None) -> str | None:
        """Request the stop when a term is breached (once); return why."""
        if self.why is None:
            now = self.clock() if now is None else now
            why = self.due(now)
            if why is not None:
                self.why = why
                log.warning("stop rule: %s; stopping at the next step boundary with a checkpoint", self._cause())
                self.request_stop(why)
        return self.why

    # -- what it says ------------------------------------------------------------------------------------------
    def _cause(self) -> str:
        t = self.terms
        if self.why == STOP_BUDGET:
            assert t.budget_usd is not None
            return (
                f"the run's budget of ${t.budget_usd:,.2f} (job.budget_usd) is spent: ${t.spent_usd:,.2f} by earlier "
                f"jobs, the rest by this one at ${t.price_per_hour_usd:,.2f}/h"
            )
        if self.why == STOP_DEADLINE:
            assert t.deadline is not None
            return f"the run's deadline {_when(t.deadline)} (job.deadline) is reached"
        assert t.unsupervised_stop_s is not None
        return (
            f"no supervisor heartbeat ({self.heartbeat}) since {_when(self.last_beat)}, "
            f"{_minutes(t.unsupervised_stop_s)} ago or more (job.unsupervised_stop_minutes)"
        )

    def record(self, step: int) -> StopRecord:
        """The record of a stop at `step` (the rule must have fired)."""
        assert self.why is not None
        fix = {
            STOP_BUDGET: "raise job.budget_usd to go on",
            STOP_DEADLINE: "set a later job.deadline to go on",
            STOP_UNSUPERVISED: "run the command again to go on (raise job.unsupervised_stop_minutes to wait longer)",
        }[self.why]
        return StopRecord(self.why, step, f"{self._cause()}: stopped at step {step}, checkpointed; {fix}")

    def describe(self) -> str:
        """One line: what this job keeps to."""
        t, parts = self.terms, []
        limit = t.budget_end(self.billed_from)
        if limit is not None and t.budget_usd is not None:
            parts.append(
                f"budget ${t.budget_usd:,.2f} (${t.spent_usd:,.2f} spent before) at ${t.price_per_hour_usd:,.2f}/h "
                f"lasts until {_when(limit)}"
            )
        if t.deadline is not None:
            parts.append(f"deadline {_when(t.deadline)}")
        if t.unsupervised_stop_s is not None:
            parts.append(f"{_minutes(t.unsupervised_stop_s)} without a supervisor heartbeat")
        return "stop rule: this job stops itself at a checkpoint at the earliest of: " + "; ".join(parts)

    def save_record(self, step: int) -> StopRecord:
        """Log the record (the supervisor reads the log) and keep it in run storage."""
        record = self.record(step)
        log.warning("%s", record.line())
        if self.run is not None:
            try:
                self.run.storage.write_json(
                    stop_record_path(self.stage),
                    {
                        "why": record.why, "step": step, "message": record.message, "at": _when(self.clock()),
                        # Set by SageMaker and the local backend: which attempt this record is of.
                        "job": os.environ.get("TRAINING_JOB_NAME"), "host": current_host(),
                    },
                )  # fmt: skip
            except Exception as exc:  # the log line is what the supervisor reads: never fail the stop for this
                log.warning("stop rule: cannot write %s: %s", self.run.storage.uri(stop_record_path(self.stage)), exc)
        return record

    # -- the thread --------------------------------------------------------------------------------------------
    def start(self) -> None:
        log.info("%s", self.describe())
        self._thread = threading.Thread(target=self._run, name="hlat-stop-rule", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.tick_s):
            try:
                if self.check() is not None:
                    return
            except Exception as exc:  # a bug here must not kill training: SageMaker's max runtime still backs it up
                log.warning("stop rule: %s: %s; no longer enforced in this job", type(exc).__name__, exc)
                return

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


@contextmanager
def stop_rule(trainer: Any, run: Run, terms: StopTerms | None = None) -> Iterator[StopRule | None]:
    """Enforce the job's stop terms on rank 0 while the body trains; a stop short of max_steps leaves its record."""
    terms = StopTerms.from_environment() if terms is None else terms
    if not terms.any or not trainer.world.is_main or trainer.extracting_graphs:
        yield None
        return
    rule = StopRule(terms, trainer.request_stop, trainer.stop_margin_seconds, run)
    rule.start()
    try:
        yield rule
    finally:
        rule.close()
    # A stop at the last step is the training's end, not a stop short of it: no record, the stage is done.
    stopped_at = trainer.stopped_at
    if rule.why is not None and stopped_at is not None and stopped_at < trainer.cfg.training.max_steps:
        rule.save_record(stopped_at)
