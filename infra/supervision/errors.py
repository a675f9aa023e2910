"""The supervisor's errors: each one ends a stage, its message says why and what to change.

Every error carries the stage's attempts, as the ledger holds them."""

from __future__ import annotations

from hlat.infra.supervision.ledger import Attempt


class SupervisorError(RuntimeError):
    """The stage stops: the message says why and what to change."""

    def __init__(self, message: str, attempts: list[Attempt]) -> None:
        super().__init__(message)
        self.attempts = attempts


class JobFailed(SupervisorError):
    """A failure that relaunching would not fix."""


class RestartsExhausted(SupervisorError):
    pass


class BudgetExhausted(SupervisorError):
    pass


class NoProgress(JobFailed):
    """job.max_attempts_without_progress attempts in a row committed no newer checkpoint, whatever their class."""


class DeadlinePassed(SupervisorError):
    """job.deadline passed before the next attempt: nothing is submitted (nor recorded)."""


class StoppedByUser(SupervisorError):
    """`hlat stop` stopped the job: the stage ends (not a failure), and running the command again goes on."""


class SupervisorBusy(SupervisorError):
    """Another supervisor holds the stage's lease (`SupervisorLease`): this one refuses, touching nothing."""


class LeaseLost(SupervisorError):
    """This supervisor's lease was taken over by another one (it went silent past the lease's expiry): it neither
    relaunches nor stops the job again; the other supervisor goes on with it."""
