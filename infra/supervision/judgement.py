"""How the supervisor judges a stage's attempts beyond one job's ending.

The rules: a loss-spike exit is fatal; the same failure of the job's own, repeated with no newer checkpoint, is
fatal; so are too many attempts in a row committing none; a platform fault right after another backs off."""

from __future__ import annotations

import re

from hlat.infra.backends.protocol import (
    Action,
    Decision,
    FailureClass,
    classify_reason,
)
from hlat.infra.supervision.ledger import Attempt

LOSS_SPIKES = re.compile(r"\bLossSpikes\b")
"""The type of the failure record a job stopped by training.spike_max_consecutive spikes in a row writes
(EXIT_LOSS_SPIKES; training/loop.py), and the start of the reason the local backend gives such an exit without one."""


def loss_spikes_stop(decision: Decision) -> Decision:
    """A job that exited on training.spike_max_consecutive loss spikes in a row (EXIT_LOSS_SPIKES) is not relaunched:
    the cause is deterministic (a resume is bitwise, so the same data and weights spike again), whatever
    job.max_repeats says. Fatal, with one line that says what happened and what to change; any other decision as it
    is."""
    record = decision.record
    if not (record.type == "LossSpikes" if record else LOSS_SPIKES.search(decision.reason)):
        return decision
    detail = f"{record.type}: {record.message}" if record else decision.reason
    reason = f"the run diverged, not relaunched (a deterministic cause: the same steps spike again): {detail}"
    return Decision(Action.FATAL, "loss-spikes", " ".join(reason.split()), FailureClass.FATAL, record)


def no_progress(
    attempts: list[Attempt], decision: Decision, stage: str, max_attempts_without_progress: int
) -> str | None:
    """job.max_attempts_without_progress attempts in a row, ending in any way but done or fatal (a job's own
    failure, a platform fault, no capacity, a hang, a job that stopped itself), committed no newer checkpoint:
    the stage stops, whatever the class. A fault the platform repeats (a deterministic bug on one rank seen as a
    lost peer on the others, a hang, a quota) costs the whole cluster's start-up each time; a stop of the user's
    or a cancelled flow run ends a streak instead (it was deliberate)."""
    if decision.action not in (Action.RESUME, Action.BACKOFF):
        return None
    streak: list[Attempt] = []
    for attempt in reversed(attempts):
        if attempt.progressed or _category(attempt) in ("user-stop", "cancelled"):
            break
        streak.append(attempt)
    if len(streak) < max_attempts_without_progress:
        return None
    first, last = streak[-1], streak[0]
    causes = ", ".join(dict.fromkeys(_cause(a) for a in reversed(streak)))
    newest = f"step {last.end_step}" if last.end_step else "none"
    return (
        f"{stage} stopped: {len(streak)} attempts in a row committed no newer checkpoint (attempts "
        f"{first.attempt}-{last.attempt}: {causes}; newest checkpoint {newest}; job.max_attempts_without_progress="
        f"{max_attempts_without_progress}): {(last.reason or last.status).splitlines()[0][:300]}; fix the "
        "cause, or raise job.max_attempts_without_progress to keep relaunching"
    )


def platform_fault_repeated(attempts: list[Attempt], decision: Decision) -> bool:
    """A platform fault right after another one, neither attempt getting anywhere: relaunch after a delay (the
    platform may need time: a host replaced, a service recovering), but never give up for it."""
    if decision.failure_class != FailureClass.PLATFORM or len(attempts) < 2:
        return False
    last, before = attempts[-1], attempts[-2]
    return not last.progressed and not before.progressed and _failure_class(before) == FailureClass.PLATFORM


def repeated_without_progress(attempts: list[Attempt], decision: Decision, stage: str, max_repeats: int) -> str | None:
    """The same failure of the job's own (the same cause: category, record type and step), ending attempt after
    attempt with no newer checkpoint committed between them, job.max_repeats times: it is deterministic (a
    resume is bitwise, so a crash at step 41 comes back at step 41), and relaunching will not help. A NaN is the
    same failure whatever its step: with bf16 stochastic rounding or training.deterministic=False the step it
    comes back at moves, so 'no newer checkpoint' alone judges it. Every class's repeats are bounded too, by
    job.max_attempts_without_progress (`no_progress`)."""
    if decision.action != Action.RESUME or decision.failure_class != FailureClass.JOB:
        return None
    last = attempts[-1]
    same = [last]
    for before in reversed(attempts[:-1]):
        if before.end_step != last.end_step or not _same_failure(before, decision):
            break
        same.append(before)
    if len(same) < max_repeats:
        return None
    first = same[-1]
    hint = ""
    if decision.category == "completed-early":
        hint = (
            "; the job exits successfully before its last step: its log says why (a job must write the "
            "checkpoint of training.max_steps to the run's checkpoints/)"
        )
    newest = f"step {last.end_step}" if last.end_step else "none"
    cause = decision.cause
    seen = list(dict.fromkeys(_cause(a) for a in reversed(same)))
    if len(seen) > 1:  # a NaN whose step moved
        cause = "nan: " + ", then ".join(c.removeprefix("nan: ") for c in seen)
    return (
        f"{stage} stopped: the same failure repeated with no newer checkpoint: {cause}, "
        f"{len(same)} times (attempts {first.attempt}-{last.attempt}; newest checkpoint {newest}; job.max_repeats="
        f"{max_repeats}): {last.reason}{hint}"
    )


def _same_failure(attempt: Attempt, decision: Decision) -> bool:
    """Whether an earlier attempt ended in the failure `decision` judges: the same cause, or for a NaN, any NaN."""
    if decision.category == "nan":
        return _category(attempt) == "nan"
    return _cause(attempt) == decision.cause


def _cause(attempt: Attempt) -> str:
    """The attempt's cause (older ledgers recorded none: its category stands in)."""
    return attempt.cause or _category(attempt)


def _category(attempt: Attempt) -> str:
    """The attempt's failure category (older ledgers did not record it: classified again from the reason)."""
    return attempt.category or classify_reason(attempt.reason or "").category


def _failure_class(attempt: Attempt) -> FailureClass:
    if attempt.failure_class:
        return FailureClass(attempt.failure_class)
    return classify_reason(attempt.reason or "").failure_class


def completed_short(record: Attempt, newest: int | None, target_step: int) -> Decision:
    """A job that reported success without the checkpoint of the last step. It may have stopped itself (a
    SIGTERM checkpoints and exits 0), so it is resumed; the same ending job.max_repeats times with no newer
    checkpoint stops."""
    found = f"step {newest}" if newest is not None else "none"
    logged = record.last_logged_step
    trained = f"the job logged step {logged}" if logged is not None else "the job logged no training step"
    reason = f"completed without a checkpoint at step {target_step} (newest: {found}; {trained})"
    return Decision(Action.RESUME, "completed-early", reason)
