"""A stage's attempts, one per job, kept in run storage (`jobs/<stage>-attempts.json`).

The ledger is written before each submission and rewritten whole on each change.
A restarted supervisor reads it to find the job it launched."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from hlat.core.layout import ledger_path
from hlat.core.run import Run

log = logging.getLogger("hlat.supervisor")


USER_STOP = "user"
"""stop_requested of a job stopped by `hlat stop`: a deliberate stop, never relaunched by the supervisor watching it."""


@dataclass
class Attempt:
    """One job of the run, as recorded in the ledger."""

    attempt: int
    job_name: str
    status: str = "Submitting"
    reason: str | None = None
    action: str | None = None
    start_step: int = 0
    end_step: int | None = None
    billable_seconds: float = 0.0
    instance_count: int = 1
    cost_usd: float = 0.0
    submitted_at: float = 0.0
    """Seconds since the epoch in memory; ISO 8601 UTC in the ledger."""
    ended_at: float | None = None
    stop_requested: str | None = None
    """Why it was stopped ('cancelled', 'budget', 'hung', 'target-reached'; 'user': `hlat stop`), when it was."""
    last_logged_step: int | None = None
    """The newest step the job logged (it may not have reached a checkpoint)."""
    category: str | None = None
    """How its ending was classified ('completed', 'capacity', 'completed-early'...): what a repeat is judged by."""
    failure_class: str | None = None
    """Whose fault the ending was (infra.backends.protocol.FailureClass: fatal, job, platform, capacity), None when
    done."""
    cause: str | None = None
    """What a repeat is judged by: the category, with the failure record's type and step when the job wrote one
    ('nan: NonFiniteLoss at step 41')."""
    tokens_per_s: float | None = None
    """Its average throughput: tokens gained between the first and the last step the supervisor saw (start-up
    excluded: see startup_s), the figure of its final progress line."""
    training_s: float | None = None
    """The seconds that average spans."""
    startup_s: float | None = None
    """Seconds from its submission to its first logged step (image, instances, compiles); None when re-attached."""

    @property
    def steps_gained(self) -> int:
        return max(0, (self.end_step or self.start_step) - self.start_step)

    @property
    def progressed(self) -> bool:
        """Committed a checkpoint newer than the one it started from. Steps logged past it do not count: a job that
        resumes at 30 and fails at 41 every time logs steps 31-40 each time and keeps nothing of them."""
        return self.steps_gained > 0

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    @property
    def ending(self) -> str:
        """The status, with the reason when there is one: 'Completed', 'Failed: CapacityError: ...'."""
        return f"{self.status}: {self.reason}" if self.reason else self.status

    def row(self) -> dict[str, Any]:
        """A row of the attempts table artifact."""
        reason = "" if self.reason in (None, self.status) else self.reason  # the status column already says it
        return {
            "attempt": self.attempt,
            "job": self.job_name,
            "status": self.status,
            "reason": (reason or "")[:200],
            "action": self.action or "",
            "steps checkpointed": self.steps_gained,
            "last step logged": self.last_logged_step if self.last_logged_step is not None else "",
            "cost ($)": round(self.cost_usd, 2),
        }


def iso_time(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _epoch(value: str | float | None) -> float | None:
    """A ledger timestamp: ISO 8601 (this version) or epoch seconds (ledgers written before it)."""
    if value is None or isinstance(value, int | float):
        return value
    return datetime.fromisoformat(value).timestamp()


_TIMESTAMPS = ("submitted_at", "ended_at")


class Ledger:
    """The attempts of one stage of a run, in run storage; rewritten whole (atomically) on each change.
    Timestamps are ISO 8601 UTC strings there (older ledgers' epoch seconds still read)."""

    def __init__(self, run: Run, stage: str) -> None:
        self.storage, self.rel = run.storage, ledger_path(stage)

    def load(self) -> list[Attempt]:
        if not self.storage.exists(self.rel):
            return []
        attempts = []
        for a in self.storage.read_json(self.rel)["attempts"]:
            times = {k: _epoch(a[k]) for k in _TIMESTAMPS if k in a}
            attempts.append(Attempt(**{**a, **times}))
        return attempts

    def save(self, attempts: list[Attempt]) -> None:
        rows = [{**asdict(a), **{k: iso_time(getattr(a, k)) for k in _TIMESTAMPS}} for a in attempts]
        self.storage.write_json(self.rel, {"attempts": rows})

    def update(self, record: Attempt) -> None:
        """Replace one attempt (by number) with `record`: a stage that judged the job's outputs afterwards."""
        attempts = [record if a.attempt == record.attempt else a for a in self.load()]
        self.save(attempts)


def stored_stop(ledger: Ledger, attempt: int) -> str | None:
    """The stop_requested the ledger holds for `attempt` (a stop requested by another process: `hlat stop`)."""
    try:
        return next((a.stop_requested for a in ledger.load() if a.attempt == attempt), None)
    except Exception as exc:  # storage away for a moment: the next poll looks again
        log.warning("could not read %s: %s", ledger.storage.uri(ledger.rel), exc)
        return None
