"""Keep a run's training going: submit a job, watch it, classify how it ended, relaunch from the newest checkpoint.

The same loop drives both job backends. Its memory is a ledger in run storage (`jobs/<stage>-attempts.json`),
written before each submission, so a supervisor that dies and is restarted finds the job it launched (by its
deterministic name) and watches it instead of launching a second one.

Each attempt ends in one of four ways (`infra.jobs.classify`): done; resume at once (killed, NaN exit, hardware,
internal error, max runtime); resume after a growing delay (capacity, throttling); fatal (bad config, access,
quota, or the same failure twice in a row with no step gained). The loop also stops when the relaunches allowed
(`job.max_restarts`) or the dollar budget (billable seconds x instance count x node-hour price) run out. A job that
logs no new step for `job.hang_timeout_minutes` is stopped and relaunched.

Interrupting the supervisor itself (Ctrl-C, a cancelled flow run: anything that is not an Exception) stops the
job; a supervisor that crashes or is killed leaves the job running for the next supervisor to re-attach to.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from infra.catalog import job_cost
from infra.jobs import (
    Action,
    Decision,
    JobBackend,
    JobSpec,
    JobState,
    Status,
    SubmitError,
    classify,
    classify_reason,
    job_name,
)
from infra.storage import Storage, is_transient

log = logging.getLogger("hlat.supervisor")
job_log = logging.getLogger("hlat.job")

# The trainer's progress line: "step 120 loss 5.4321 grad_norm 0.812 lr 1.99e-03 45000 tok/s".
PROGRESS_LINE = re.compile(
    r"\bstep (?P<step>\d+) loss (?P<loss>\S+) grad_norm (?P<grad_norm>\S+) lr (?P<lr>\S+) (?P<tps>[\d.]+) tok/s"
)


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
    ended_at: float | None = None
    stop_requested: str | None = None
    """Why we stopped it ('cancelled', 'budget', 'hung'), when we did."""
    last_logged_step: int | None = None
    """The newest step the job logged (it may not have reached a checkpoint)."""

    @property
    def steps_gained(self) -> int:
        return max(0, (self.end_step or self.start_step) - self.start_step)

    @property
    def progressed(self) -> bool:
        """Gained a checkpoint, or at least trained past its starting step."""
        return self.steps_gained > 0 or (self.last_logged_step or 0) > self.start_step

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    def row(self) -> dict[str, Any]:
        """A row of the attempts table artifact."""
        return {
            "attempt": self.attempt,
            "job": self.job_name,
            "status": self.status,
            "reason": (self.reason or "")[:200],
            "action": self.action or "",
            "steps gained": self.steps_gained,
            "cost ($)": round(self.cost_usd, 2),
        }


@dataclass
class Progress:
    """What the stage reports while a job runs."""

    attempt: int
    job_name: str
    status: str
    step: int | None = None
    target_step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    cost_usd: float = 0.0

    @property
    def fraction(self) -> float:
        return min(1.0, (self.step or 0) / self.target_step) if self.target_step else 0.0

    def line(self) -> str:
        parts = [f"attempt {self.attempt} {self.job_name} {self.status}"]
        if self.step is not None:
            parts.append(f"step {self.step}/{self.target_step}")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        if self.eta_s is not None:
            parts.append(f"ETA {_duration(self.eta_s)}")
        parts.append(f"${self.cost_usd:,.2f} spent")
        return ", ".join(parts)


class Ledger:
    """The attempts of one stage of a run, in run storage; rewritten whole (atomically) on each change."""

    def __init__(self, run: Storage, stage: str) -> None:
        self.storage, self.rel = run, f"jobs/{stage}-attempts.json"

    def load(self) -> list[Attempt]:
        if not self.storage.exists(self.rel):
            return []
        return [Attempt(**a) for a in self.storage.read_json(self.rel)["attempts"]]

    def save(self, attempts: list[Attempt]) -> None:
        self.storage.write_json(self.rel, {"attempts": [asdict(a) for a in attempts]})


@dataclass
class Supervisor:
    backend: JobBackend
    run: Storage
    run_id: str
    make_spec: Callable[[int, str], JobSpec]
    """(attempt, job name) -> the job to submit."""
    current_step: Callable[[], int | None]
    """The newest complete checkpoint's step (None: none)."""
    target_step: int
    tokens_per_step: int
    stage: str = "train"
    max_restarts: int = 100
    budget_usd: float | None = None
    price_per_hour: float = 0.0
    poll_seconds: float = 60.0
    hang_timeout_s: float | None = 3600.0
    backoff_seconds: list[float] = field(default_factory=lambda: [60.0, 300.0, 900.0, 1800.0])
    on_progress: Callable[[Progress], None] = lambda p: None
    on_attempts: Callable[[list[Attempt]], None] = lambda a: None
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.run, self.stage)
        self.attempts: list[Attempt] = []

    # -- the loop ------------------------------------------------------------------------------------------
    def run_to_completion(self) -> list[Attempt]:
        """Relaunch until the newest checkpoint reaches target_step; raise SupervisorError when stopping short."""
        self.attempts = self.ledger.load()
        backoffs = 0
        while True:
            current = self._latest_step()
            if current >= self.target_step:
                log.info("%s: step %d of %d reached", self.stage, current, self.target_step)
                return self.attempts
            record = self._next_attempt(current)
            decision = self._run_attempt(record)
            record.action = decision.action.value
            self._save()
            level = logging.INFO if decision.action == Action.DONE else logging.WARNING
            log.log(
                level,
                "attempt %d (%s) ended: %s -> %s",
                record.attempt,
                record.job_name,
                record.reason,
                decision.action,
            )
            if decision.action == Action.DONE:
                if self._latest_step() >= self.target_step:
                    return self.attempts
                # Completed without reaching the target (e.g. stopped itself after SIGTERM): carry on.
                decision = Decision(Action.RESUME, "completed-early", "the job ended before the last step")
            if decision.action == Action.FATAL:
                raise JobFailed(f"{self.stage} stopped: {decision.reason}", self.attempts)
            repeat = self._repeated_without_progress(decision)
            if repeat:
                raise JobFailed(repeat, self.attempts)
            if decision.action == Action.BACKOFF:
                delay = self.backoff_seconds[min(backoffs, len(self.backoff_seconds) - 1)]
                backoffs += 1
                log.warning("%s (%s): relaunching in %s", decision.category, decision.reason, _duration(delay))
                self.sleep(delay)
            else:
                backoffs = 0

    def _latest_step(self) -> int:
        return self.current_step() or 0

    def spent_usd(self) -> float:
        return sum(a.cost_usd for a in self.attempts)

    def _next_attempt(self, current: int) -> Attempt:
        """The attempt to watch: an unfinished one from the ledger (re-attach), or a new one (after the checks)."""
        if self.attempts and not self.attempts[-1].ended:
            record = self.attempts[-1]
            log.info("re-attaching to attempt %d (%s)", record.attempt, record.job_name)
            return record
        used = len(self.attempts)
        if used > self.max_restarts:
            last = self.attempts[-1]
            raise RestartsExhausted(
                f"{self.stage} stopped at step {current} of {self.target_step}: all {self.max_restarts} relaunches "
                f"allowed by job.max_restarts are used (last failure: {last.reason}); raise job.max_restarts to go on",
                self.attempts,
            )
        if self.budget_usd is not None and self.spent_usd() >= self.budget_usd:
            raise BudgetExhausted(self._budget_message(current), self.attempts)
        n = used + 1
        record = Attempt(attempt=n, job_name=job_name(self.run_id, n, self.stage), start_step=current)
        record.submitted_at = self.clock()
        self.attempts.append(record)
        self._save()  # before submitting: a restarted supervisor then looks for this job by name
        return record

    def _run_attempt(self, record: Attempt) -> Decision:
        state = self._describe(record.job_name)
        if state is None:
            spec = self.make_spec(record.attempt, record.job_name)
            record.instance_count = spec.instance_count
            try:
                self.backend.submit(spec)
            except SubmitError as exc:
                record.status, record.reason, record.ended_at = "NotSubmitted", str(exc), self.clock()
                record.end_step = record.start_step
                return classify_reason(str(exc))
            log.info("submitted %s (%s x %d)", record.job_name, spec.instance_type, spec.instance_count)
            record.status = Status.IN_PROGRESS.value
            self._save()
        final = self._watch(record)
        record.status = final.status.value
        record.reason = final.failure_reason or final.secondary_status or final.status.value
        record.end_step = self._latest_step()
        record.ended_at = self.clock()
        self._account(record, final)
        if record.stop_requested == "budget":
            self._save()
            raise BudgetExhausted(self._budget_message(record.end_step), self.attempts)
        if record.stop_requested == "hung":
            record.reason = f"hung: no step logged for {_duration(self.hang_timeout_s or 0)}"
            return Decision(Action.RESUME, "hung", record.reason)
        if record.stop_requested == "cancelled" and final.status != Status.COMPLETED:
            # Stopped when an earlier supervisor was cancelled (a cancellation in this one re-raises in _watch):
            # the run is being started again, so go on from the last checkpoint.
            record.reason = "stopped when an earlier flow run was cancelled"
            return Decision(Action.RESUME, "cancelled", record.reason)
        return classify(final)

    def _watch(self, record: Attempt) -> JobState:
        """Follow the job until it ends, streaming its progress; stop it when hung or over budget."""
        progress = Progress(record.attempt, record.job_name, "InProgress", target_step=self.target_step)
        last_advance = self.clock()

        def on_poll(lines: list[str], state: JobState | None) -> str | None:
            nonlocal last_advance
            if self._absorb(lines, progress):
                last_advance = self.clock()
                record.last_logged_step = progress.step
            if state is None:
                return None
            self._account(record, state)
            progress.status = state.secondary_status or state.status.value
            progress.cost_usd = self.spent_usd()
            self.on_progress(progress)
            log.info("%s", progress.line())
            if self.budget_usd is not None and self.spent_usd() >= self.budget_usd:
                return "budget"
            if self.hang_timeout_s and self.clock() - last_advance > self.hang_timeout_s:
                return "hung"
            return None

        return follow(self.backend, record, self._save, self.poll_seconds, self.sleep, on_poll)

    def _absorb(self, lines: list[str], progress: Progress) -> bool:
        """Forward job output to our log and pick up progress; True when a new step was seen."""
        advanced = False
        for line in lines:
            job_log.info("%s", line)
            match = PROGRESS_LINE.search(line)
            if not match:
                continue
            step = int(match["step"])
            advanced = advanced or step != progress.step
            progress.step = step
            progress.loss = _float(match["loss"])
            progress.tokens_per_s = _float(match["tps"])
            if progress.tokens_per_s:
                progress.eta_s = (self.target_step - step) * self.tokens_per_step / progress.tokens_per_s
        return advanced

    def _account(self, record: Attempt, state: JobState) -> None:
        record.billable_seconds = state.billable_seconds
        record.instance_count = state.instance_count
        record.cost_usd = job_cost(state.billable_seconds, state.instance_count, self.price_per_hour)

    def _repeated_without_progress(self, decision: Decision) -> str | None:
        """The same failure twice in a row with no step gained by either attempt: relaunching will not help."""
        if decision.action != Action.RESUME or len(self.attempts) < 2:
            return None
        last, before = self.attempts[-1], self.attempts[-2]
        if last.progressed or before.progressed:
            return None
        if classify_reason(before.reason or "").category != classify_reason(last.reason or "").category:
            return None
        return (
            f"{self.stage} stopped: the same failure repeated with no step gained "
            f"(attempts {before.attempt} and {last.attempt}, both at step {last.start_step}): {last.reason}"
        )

    def _budget_message(self, step: int | None) -> str:
        return (
            f"{self.stage} stopped at step {step or 0} of {self.target_step}: the budget job.budget_usd="
            f"${self.budget_usd:,.2f} is spent (${self.spent_usd():,.2f} over {len(self.attempts)} job(s)); "
            "raise job.budget_usd to go on from the last checkpoint"
        )

    def _save(self) -> None:
        self.ledger.save(self.attempts)
        self.on_attempts(self.attempts)

    def _describe(self, name: str) -> JobState | None:
        return describe_patiently(self.backend, name, self.poll_seconds, self.sleep)


# -- following a job: shared by the train stage's supervisor and the short stage jobs ---------------------------
def follow(
    backend: JobBackend,
    record: Attempt,
    save: Callable[[], None],
    poll_seconds: float,
    sleep: Callable[[float], None],
    on_poll: Callable[[list[str], JobState | None], str | None],
) -> JobState:
    """Poll a job until it ends. Each poll reads its new log lines, describes it, and hands both to `on_poll`
    (state None: not visible yet), which may return a reason to stop the job ('budget', 'hung'). Interrupting
    the caller (Ctrl-C, a cancelled flow run: anything that is not an Exception) stops the job too; `save` records
    the stop in the ledger first."""

    def stop(why: str) -> None:
        record.stop_requested = why
        save()
        log.warning("stopping %s (%s)", record.job_name, why)
        backend.stop(record.job_name)

    cursor: Any = None
    try:
        while True:
            lines, cursor = read_logs(backend, record.job_name, cursor)
            state = describe_patiently(backend, record.job_name, poll_seconds, sleep)
            if state is not None and state.terminal:
                more, cursor = read_logs(backend, record.job_name, cursor)
                on_poll(lines + more, state)
                return state
            why = on_poll(lines, state)
            if why and record.stop_requested is None:
                stop(why)
            sleep(poll_seconds)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # the job must not outlive an interrupted supervisor
            log.warning("interrupted (%s)", type(exc).__name__)
            stop("cancelled")
        raise


def describe_patiently(
    backend: JobBackend, name: str, poll_seconds: float, sleep: Callable[[float], None]
) -> JobState | None:
    """describe, riding out throttling and dropped connections with a doubling delay (up to 16 polls)."""
    delay = poll_seconds
    while True:
        try:
            return backend.describe(name)
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning("describe %s: %s; retrying in %s", name, exc, _duration(delay))
            sleep(delay)
            delay = min(delay * 2, 16 * poll_seconds)


def read_logs(backend: JobBackend, name: str, cursor: Any) -> tuple[list[str], Any]:
    """New log lines; none this time when the log service has a transient fault."""
    try:
        return backend.logs(name, cursor)
    except Exception as exc:
        if not is_transient(exc):
            raise
        log.warning("logs of %s: %s; will retry", name, exc)
        return [], cursor


def _forward(lines: list[str], state: JobState | None) -> None:
    for line in lines:
        job_log.info("%s", line)


def run_job(
    backend: JobBackend,
    run: Storage,
    run_id: str,
    stage: str,
    make_spec: Callable[[int, str], JobSpec],
    poll_seconds: float,
    max_attempts: int = 3,
    backoff_seconds: list[float] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.time,
) -> tuple[Attempt, JobState | None]:
    """Run a short job to its end (precompile, burn-in): the same naming, ledger, re-attach, log streaming and
    stop-on-interrupt as training, relaunching only on failures classified resume or back-off, up to
    `max_attempts` jobs. Returns the last attempt and its final state (None: the submission was refused); the
    caller reads the job's outputs to judge it."""
    ledger = Ledger(run, stage)
    attempts = ledger.load()
    delays = backoff_seconds or [poll_seconds]
    tries = 0
    while True:
        if attempts and not attempts[-1].ended:
            record = attempts[-1]
            log.info("re-attaching to %s", record.job_name)
        else:
            n = len(attempts) + 1
            record = Attempt(attempt=n, job_name=job_name(run_id, n, stage), submitted_at=clock())
            attempts.append(record)
            ledger.save(attempts)
        tries += 1
        state = describe_patiently(backend, record.job_name, poll_seconds, sleep)
        if state is None:
            spec = make_spec(record.attempt, record.job_name)
            try:
                backend.submit(spec)
            except SubmitError as exc:
                record.status, record.reason, record.ended_at = "NotSubmitted", str(exc), clock()
                ledger.save(attempts)
                decision = classify_reason(str(exc))
                if decision.action == Action.FATAL or tries >= max_attempts:
                    return record, None
                sleep(delays[min(tries - 1, len(delays) - 1)])
                continue
            record.status = Status.IN_PROGRESS.value
            ledger.save(attempts)
        state = follow(backend, record, lambda: ledger.save(attempts), poll_seconds, sleep, _forward)
        record.status = state.status.value
        record.reason = state.failure_reason or state.secondary_status or state.status.value
        record.billable_seconds, record.instance_count = state.billable_seconds, state.instance_count
        record.ended_at = clock()
        decision = classify(state)
        record.action = decision.action.value
        ledger.save(attempts)
        if decision.action in (Action.DONE, Action.FATAL) or tries >= max_attempts:
            return record, state
        log.warning("%s job %s: %s; relaunching", stage, record.job_name, record.reason)
        sleep(delays[min(tries - 1, len(delays) - 1)] if decision.action == Action.BACKOFF else poll_seconds)


def stop_live_job(backend: JobBackend, run: Storage, stage: str = "train") -> str | None:
    """Stop the stage's unfinished job, if any (the flow's cancellation hook); returns its name."""
    attempts = Ledger(run, stage).load()
    if not attempts or attempts[-1].ended:
        return None
    record = attempts[-1]
    state = backend.describe(record.job_name)
    if state is None or state.terminal:
        return None
    record.stop_requested = "cancelled"
    Ledger(run, stage).save(attempts)
    backend.stop(record.job_name)
    return record.job_name


def _float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
