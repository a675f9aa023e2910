"""A stage's accounts over its attempts: dollars spent, throughput, start-up, and what the budget still buys.

Every figure is summed from the ledger's attempts. The budget refuses a job it cannot pay to its first checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from hlat.infra.backends.protocol import JobState
from hlat.infra.cost.catalog import job_cost
from hlat.infra.supervision.ledger import Attempt
from hlat.infra.supervision.progress import duration

STARTUP_FLOOR_S = 600.0
"""The start-up an attempt is taken to need, billed, when its stage has measured none (Attempt.startup_s): 10 min.
Below any start-up a trn1 cluster job has (SageMaker's Starting and Downloading, the Neuron image's pull, the
compile cache and the first graphs before the first step), so a job that could still commit a checkpoint is never
refused for it, while a budget left for minutes (a job with a 126 s MaxRuntime) no longer buys a job."""


def dollars_spent(attempts: list[Attempt]) -> float:
    return sum(a.cost_usd for a in attempts)


def mean_tokens_per_s(attempts: list[Attempt]) -> float | None:
    """The stage's average throughput over its attempts (each from its first logged step to its last: the figure
    of the final progress line), weighted by the time each spans; None when none was measured."""
    measured = [(a.tokens_per_s, a.training_s) for a in attempts if a.tokens_per_s and a.training_s]
    seconds = sum(t for _, t in measured)
    return sum(r * t for r, t in measured) / seconds if seconds else None


def startup_total_s(attempts: list[Attempt]) -> float | None:
    """Seconds the stage's attempts spent before their first logged step (re-attached ones unknown)."""
    known = [a.startup_s for a in attempts if a.startup_s is not None]
    return sum(known) if known else None


def account(record: Attempt, state: JobState, price_per_hour: float) -> None:
    """The attempt's bill so far, from its job's billable seconds and instance count."""
    record.billable_seconds = state.billable_seconds
    record.instance_count = state.instance_count
    record.cost_usd = job_cost(state.billable_seconds, state.instance_count, price_per_hour)


@dataclass(frozen=True)
class Budget:
    """A stage's dollar budget (job.budget_usd; None: no bound), judged over its attempts."""

    stage: str
    target_step: int
    budget_usd: float | None
    price_per_hour: float
    startup_floor_s: float | None
    """The billed seconds of a start-up, when the stage has measured none (None: not checked before submitting)."""
    checkpoint_interval_s: float | None
    """Seconds from the first step to the first checkpoint at the planned step time (None: no plan)."""

    def spent(self, attempts: list[Attempt]) -> bool:
        return self.budget_usd is not None and dollars_spent(attempts) >= self.budget_usd

    def spent_message(self, step: int | None, attempts: list[Attempt]) -> str:
        return (
            f"{self.stage} stopped at step {step or 0} of {self.target_step}: the budget job.budget_usd="
            f"${self.budget_usd:,.2f} is spent (${dollars_spent(attempts):,.2f} over {len(attempts)} job(s)); "
            "raise job.budget_usd to go on from the last checkpoint"
        )

    def attempt_need_s(self, attempts: list[Attempt]) -> float | None:
        """Billed seconds an attempt needs to commit one checkpoint: its start-up (the longest this stage measured,
        else startup_floor_s) and one checkpoint interval at the planned step time. None: not checked."""
        if self.startup_floor_s is None:
            return None
        measured = [a.startup_s for a in attempts if a.startup_s]
        return (max(measured) if measured else self.startup_floor_s) + (self.checkpoint_interval_s or 0.0)

    def refusal(self, attempts: list[Attempt], instance_count: int, current: int) -> str | None:
        """Why the budget left cannot buy a job of `instance_count` instances its first checkpoint (None: it can)."""
        need_s = self.attempt_need_s(attempts)
        if self.budget_usd is None or need_s is None or self.price_per_hour <= 0:
            return None
        hourly = self.price_per_hour * instance_count
        left = self.budget_usd - dollars_spent(attempts)
        need = need_s / 3600 * hourly
        if left >= need:
            return None
        ckpt = self.checkpoint_interval_s
        interval = f" + a checkpoint interval {duration(ckpt)}" if ckpt else ""
        return (
            f"{self.stage} stopped at step {current} of {self.target_step}: job.budget_usd=${self.budget_usd:,.2f} "
            f"has ${left:,.2f} left, {duration(left / hourly * 3600)} of {instance_count} x "
            f"${self.price_per_hour:,.2f}/h, and a job needs ${need:,.2f} to commit a checkpoint (start-up "
            f"{duration(need_s - (ckpt or 0))}{interval}): nothing submitted; raise "
            "job.budget_usd to go on from the last checkpoint"
        )
