"""Keep a stage's jobs going: submit one, watch it, judge how it ended, relaunch from the newest checkpoint.

One loop drives every stage's jobs on both backends; the short jobs' stages use `run_job`. Its memory is the
ledger; its rules and their story are in docs/jobs.md ("Supervision", "When a job fails")."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hlat.core.contract import RECORD_TAG, FailureRecord, parse_failure_record, parse_step_line
from hlat.core.layout import clock_probe_path
from hlat.core.run import Run
from hlat.core.storage import StorageClock
from hlat.infra.backends.protocol import (
    Action,
    Decision,
    FailureClass,
    JobBackend,
    JobSpec,
    JobState,
    Status,
    SubmitError,
    classify,
    classify_reason,
    first_failure,
    job_name,
    stored_self_stop,
)
from hlat.infra.supervision.accounts import Budget, account, dollars_spent, mean_tokens_per_s, startup_total_s
from hlat.infra.supervision.errors import (
    BudgetExhausted,
    DeadlinePassed,
    JobFailed,
    LeaseLost,
    NoProgress,
    RestartsExhausted,
    StoppedByUser,
    SupervisorError,
)
from hlat.infra.supervision.judgement import (
    completed_short,
    loss_spikes_stop,
    no_progress,
    platform_fault_repeated,
    repeated_without_progress,
)
from hlat.infra.supervision.lease import (
    LEASE_MIN_S,
    LEASE_POLLS,
    Heartbeat,
    SupervisorLease,
    clear_stop_request,
    stop_requested,
)
from hlat.infra.supervision.ledger import USER_STOP, Attempt, Ledger, iso_time, stored_stop
from hlat.infra.supervision.progress import Progress, ProgressGate, Throughput, absorb, duration
from hlat.infra.supervision.watch import announce_resumed, describe_patiently, end_time, ending_reason, follow

log = logging.getLogger("hlat.supervisor")
job_log = logging.getLogger("hlat.job")


LOG_TAIL_LINES = 400
"""Lines of a job's log kept for classifying its ending: torchrun's failure summary and the ranks' last words."""


@dataclass
class Supervisor:
    backend: JobBackend
    run: Run
    run_id: str
    make_spec: Callable[[int, str], JobSpec]
    """(attempt, job name) -> the job to submit."""
    current_step: Callable[[], int | None]
    """The newest complete checkpoint's step (None: none)."""
    target_step: int
    tokens_per_step: int
    stage: str = "train"
    max_restarts: int = 100
    max_repeats: int = 2
    """How many times the same failure of the job's own may end an attempt with no newer checkpoint committed
    between them before the stage stops (job.max_repeats)."""
    budget_usd: float | None = None
    price_per_hour: float = 0.0
    poll_seconds: float = 60.0
    hang_timeout_s: float | None = 3600.0
    backoff_seconds: list[float] = field(default_factory=lambda: [60.0, 300.0, 900.0, 1800.0])
    on_progress: Callable[[Progress], None] = lambda p: None
    on_attempts: Callable[[list[Attempt]], None] = lambda a: None
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.time
    progress_every_s: float | None = None
    """Fewest seconds between two progress lines in the log while steps advance (None: 10 polls); an unchanged
    line is repeated only after six times that."""
    rate_window_s: float | None = None
    """The span of recent steps that tokens/s and the ETA are measured over (None: 30 polls). Longer is smoother
    and slower to follow a real change of pace."""
    max_attempts: int | None = None
    """A short job's stage (prepare-data, precompile, burn-in, evaluate: `run_job`): its job runs to its own end,
    relaunched only when that ending is classified resume or back-off, up to this many jobs in one call; the caller
    judges the last one by its outputs. None: the train stage, relaunched until target_step's checkpoint."""
    max_attempts_without_progress: int = 3
    """Attempts in a row that may commit no newer checkpoint, whatever their class (job, platform, capacity), before
    the stage stops (job.max_attempts_without_progress)."""
    startup_timeout_s: float | None = 7200.0
    """Longest from the job reaching SageMaker's Training status to its first logged step (job.startup_timeout_minutes;
    None: no bound): past it the job is stopped as hung (its start-up overran)."""
    deadline: float | None = None
    """job.deadline in epoch seconds (None: none): no attempt is recorded or submitted past it."""
    startup_floor_s: float | None = None
    """The billed seconds of a start-up, when the stage has measured none (STARTUP_FLOOR_S from the train stage); None:
    the budget is not checked for what an attempt needs before it is submitted."""
    checkpoint_interval_s: float | None = None
    """Seconds from the first step to the first checkpoint at the planned step time (training.checkpoint_every x the
    plan's step time); None: no plan (the start-up alone is what an attempt must be able to buy)."""
    storage_clock: StorageClock | None = None
    """Run storage's clock (the lease's times); None: the run's own (`StorageClock`). A simulation passes its own."""

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.run, self.stage)
        if self.storage_clock is None:
            self.storage_clock = StorageClock(self.run.storage, probe=clock_probe_path(self.stage))
        ttl = max(LEASE_POLLS * self.poll_seconds, LEASE_MIN_S)
        self.lease = SupervisorLease(self.run, self.stage, self.storage_clock.now, ttl)
        self._renewed_at: float | None = None
        self.heartbeat = Heartbeat(self.run, self.stage, self.clock, before=self._renew_lease)
        self.attempts: list[Attempt] = []
        self.resumed = False
        """The attempt being run came unfinished from the ledger (a restarted supervisor)."""
        self.log_tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        """The last lines of the watched job's log: a failure record another host wrote, torchrun's account of a
        signal (what `classify` reads when the FailureReason holds no record)."""
        self.final: JobState | None = None
        """The last attempt's final state (None: its submission was refused)."""
        self.first_record: FailureRecord | None = None
        """The earliest failure record seen in any line of the watched job's log (by its time): at 8,192 ranks
        the rank that failed first logs long before the tail's last 400 lines."""
        self._spec: JobSpec | None = None
        """The spec built for the attempt just recorded (built before recording it: a refusal records nothing)."""
        self._hung: str | None = None
        """Why the watched job was judged hung (the reason of its 'hung' stop)."""

    @property
    def short(self) -> bool:
        """A short job's stage (see `max_attempts`): no checkpoints to reach, its job's own end is the goal."""
        return self.max_attempts is not None

    # -- the loop ------------------------------------------------------------------------------------------
    def run_to_completion(self) -> list[Attempt]:
        """Relaunch until the newest checkpoint reaches target_step; raise SupervisorError when stopping short. A
        short job's stage (`max_attempts`) returns once its job ended done or fatal, or its attempts are used: the
        last attempt is its job, `final` that job's final state. Holds the stage's lease throughout (a second
        supervisor is refused: SupervisorBusy); a stop request standing from before (`hlat stop`) is cleared: running
        the command again goes on."""
        self.attempts = self.ledger.load()
        self.lease.acquire(self.attempts)
        self._renewed_at = self.clock()
        try:
            clear_stop_request(self.run, self.stage)
            return self._loop()
        finally:
            self.lease.release()

    def _loop(self) -> list[Attempt]:
        backoffs = tries = 0
        while True:
            current = self._latest_step()
            if not self.short and current >= self.target_step:
                log.info("%s: step %d of %d reached", self.stage, current, self.target_step)
                self._end_the_unfinished()
                return self.attempts
            record = self._next_attempt(current)
            tries += 1
            decision = self._run_attempt(record)
            if self.short:
                record.action, record.category = decision.action.value, decision.category
                self._save()
                if decision.action in (Action.DONE, Action.FATAL) or tries >= (self.max_attempts or 1):
                    return self.attempts
                if self.final is not None:
                    log.warning("%s job %s ended %s; relaunching", self.stage, record.job_name, record.ending)
                delays = self.backoff_seconds or [self.poll_seconds]
                backoff = self.final is None or decision.action == Action.BACKOFF
                self._pause(delays[min(tries - 1, len(delays) - 1)] if backoff else self.poll_seconds)
                continue
            if decision.action == Action.RESUME and platform_fault_repeated(self.attempts, decision):
                decision = replace(decision, action=Action.BACKOFF)
            record.action, record.category = decision.action.value, decision.category
            record.failure_class = decision.failure_class.value if decision.action != Action.DONE else None
            record.cause = decision.cause if decision.action != Action.DONE else None
            repeat = repeated_without_progress(self.attempts, decision, self.stage, self.max_repeats) or no_progress(
                self.attempts, decision, self.stage, self.max_attempts_without_progress
            )
            if repeat:
                record.action = Action.FATAL.value
            self._save()
            level = logging.INFO if decision.action == Action.DONE else logging.WARNING
            log.log(
                level, "attempt %d (%s) ended %s -> %s", record.attempt, record.job_name, record.ending, record.action
            )
            if decision.action == Action.DONE:
                return self.attempts
            if decision.action == Action.FATAL:
                raise JobFailed(f"{self.stage} stopped: {decision.reason}", self.attempts)
            if repeat:
                kind = JobFailed if repeat.startswith(f"{self.stage} stopped: the same failure") else NoProgress
                raise kind(repeat, self.attempts)
            if record.progressed:
                backoffs = 0  # a delay grows only over attempts that got nowhere
            if decision.action == Action.BACKOFF:
                delay = self.backoff_seconds[min(backoffs, len(self.backoff_seconds) - 1)]
                backoffs += 1
                log.warning("%s (%s): relaunching in %s", decision.category, decision.reason, duration(delay))
                self._pause(delay)

    def _pause(self, seconds: float, between_attempts: bool = True) -> None:
        """Sleep `seconds` in poll-sized parts, renewing the lease after each; between attempts (a back-off) a stop
        request (`hlat stop`) ends the stage at once: StoppedByUser, the next job never submitted."""
        left = seconds
        while left > 0:
            part = min(left, self.poll_seconds)
            self.sleep(part)
            left -= part
            self._renew_lease()
            if between_attempts:
                self._honour_stop_request()

    def _renew_lease(self) -> None:
        """Renew the lease when a fifth of its life has passed since the last renewal (this host's clock measures
        only that interval); raises LeaseLost when it was taken over."""
        now = self.clock()
        if self._renewed_at is None or now - self._renewed_at >= self.lease.ttl_s / 5:
            try:
                self.lease.renew(self.attempts)
            except LeaseLost:
                raise
            except Exception as exc:  # storage away: the next poll renews (the lease outlives five polls)
                log.warning("could not renew %s: %s", self.run.storage.uri(self.lease.rel), exc)
                return
            self._renewed_at = now

    def _honour_stop_request(self, next_attempt: int | None = None) -> None:
        """End the stage when `hlat stop` recorded a stop request: before a submission, or during a back-off."""
        if not stop_requested(self.run, self.stage):
            return
        newest = self._latest_step()
        what = f"before attempt {next_attempt}" if next_attempt else "between attempts"
        where = (
            "run the same command to run it again"
            if self.short
            else f"at step {newest} of {self.target_step} (its newest checkpoint); run the same command to go on"
        )
        log.warning("%s: hlat stop requested %s: no job is submitted", self.stage, what)
        raise StoppedByUser(f"{self.stage} stopped by hlat stop {what} (no job was running) {where}", self.attempts)

    def _latest_step(self) -> int:
        return self.current_step() or 0

    def _end_the_unfinished(self) -> None:
        """The target's checkpoint is committed while the ledger's last job has not ended: an earlier supervisor
        died as that job finished. It has nothing left to do, but it may still be running (its ranks leaving, or
        torchrun waiting out its exit barrier for a rank that died: minutes, billed). No job outlives the stage:
        stop it if it runs, follow it to its end and record it."""
        if not self.attempts or self.attempts[-1].ended:
            return
        record = self.attempts[-1]
        state = self._describe(record.job_name)
        if state is None:  # recorded, never created: nothing runs
            record.status, record.ended_at = "NotSubmitted", self.clock()
        else:
            if not state.terminal:
                announce_resumed(record, state)
                record.stop_requested = "target-reached"
                self._save()
                log.info("%s: stopping %s: the checkpoint of step %d is committed", self.stage, record.job_name,
                         self.target_step)  # fmt: skip
                self.backend.stop(record.job_name)
                state = self._watch(record, reattached=True)
            self._record_end(record, state)
        record.action = Action.DONE.value
        self._save()

    def _record_end(self, record: Attempt, final: JobState) -> None:
        """What an attempt's ledger entry holds once its job has ended."""
        record.status = final.status.value
        record.reason = ending_reason(final)
        if not self.short:
            record.end_step = self._latest_step()
        record.ended_at = end_time(final, self.clock())
        self._account(record, final)

    def _record_interrupted(self, record: Attempt, final: JobState) -> None:
        """The end of a job this supervisor stopped as it was interrupted: resumed by the next command."""
        self._record_end(record, final)
        if self.short:
            record.reason = record.reason or "stopped when its flow run was interrupted"
            record.action, record.category = Action.RESUME.value, "cancelled"
        elif final.status != Status.COMPLETED:
            record.reason = "stopped when its flow run was interrupted"
            record.action, record.category, record.cause = Action.RESUME.value, "cancelled", "cancelled"
            record.failure_class = FailureClass.PLATFORM.value

    def tokens_per_s(self) -> float | None:
        """The stage's average throughput over its attempts, weighted by the time each spans (None: none measured)."""
        return mean_tokens_per_s(self.attempts)

    def startup_s(self) -> float | None:
        """Seconds the stage's attempts spent before their first logged step (re-attached ones unknown)."""
        return startup_total_s(self.attempts)

    def spent_usd(self) -> float:
        return dollars_spent(self.attempts)

    @property
    def budget(self) -> Budget:
        """The budget's rules over this stage's settings as they stand."""
        return Budget(self.stage, self.target_step, self.budget_usd, self.price_per_hour, self.startup_floor_s,
                      self.checkpoint_interval_s)  # fmt: skip

    def _next_attempt(self, current: int) -> Attempt:
        """The attempt to watch: an unfinished one from the ledger (re-attach), or a new one (after the checks)."""
        self.resumed = bool(self.attempts) and not self.attempts[-1].ended
        if self.resumed:
            return self.attempts[-1]
        used = len(self.attempts)
        if used > self.max_restarts:
            last = self.attempts[-1]
            raise RestartsExhausted(
                f"{self.stage} stopped at step {current} of {self.target_step}: all {self.max_restarts} relaunches "
                f"allowed by job.max_restarts are used (last failure: {last.reason}); raise job.max_restarts to go on",
                self.attempts,
            )
        if self.budget.spent(self.attempts):
            raise BudgetExhausted(self._budget_message(current), self.attempts)
        n = used + 1
        name = job_name(self.run_id, n, self.stage)
        # Everything that refuses a submission is asked before the attempt is recorded: a refusal leaves no
        # 'Submitting' attempt behind (`hlat status` would say running).
        self._honour_stop_request(n)
        if self.deadline is not None and self.clock() >= self.deadline:
            raise DeadlinePassed(
                f"{self.stage} stopped at step {current} of {self.target_step}: job.deadline={iso_time(self.deadline)} "
                "has passed; set a later job.deadline to go on from the last checkpoint",
                self.attempts,
            )
        spec = self.make_spec(n, name)  # may refuse too (ConfigError: a deadline past, a budget spent)
        self._check_budget_buys_a_checkpoint(spec, current)
        self.lease.check(self.attempts)
        record = Attempt(attempt=n, job_name=name, start_step=current, instance_count=spec.instance_count)
        record.submitted_at = self.clock()
        self.attempts.append(record)
        self._spec = spec
        self._save()  # before submitting: a restarted supervisor then looks for this job by name
        return record

    def attempt_need_s(self) -> float | None:
        """Billed seconds an attempt needs to commit one checkpoint (`Budget.attempt_need_s`; None: not checked)."""
        return self.budget.attempt_need_s(self.attempts)

    def _check_budget_buys_a_checkpoint(self, spec: JobSpec, current: int) -> None:
        refusal = None if self.short else self.budget.refusal(self.attempts, spec.instance_count, current)
        if refusal:
            raise BudgetExhausted(refusal, self.attempts)

    def _run_attempt(self, record: Attempt) -> Decision:
        state = self._describe(record.job_name)
        if self.resumed:
            announce_resumed(record, state)
        if state is None:
            spec = self._spec if self._spec is not None and self._spec.name == record.job_name else None
            self._spec = None
            try:
                if spec is None:  # recorded by an earlier supervisor, never created: checked as a new one is
                    self._honour_stop_request(record.attempt)
                    if self.deadline is not None and self.clock() >= self.deadline:
                        raise DeadlinePassed(
                            f"{self.stage} stopped: job.deadline={iso_time(self.deadline)} has passed; set a later "
                            "job.deadline to go on from the last checkpoint",
                            self.attempts,
                        )
                    spec = self.make_spec(record.attempt, record.job_name)
                self.lease.check(self.attempts)
            except SupervisorError as exc:
                if isinstance(exc, LeaseLost):
                    raise
                self._never_submitted(record, str(exc))
                raise
            except Exception as exc:  # the spec refused (ConfigError: a deadline past, a budget spent)
                self._never_submitted(record, str(exc))
                raise
            record.instance_count = spec.instance_count
            try:
                self.backend.submit(spec)
            except SubmitError as exc:
                record.status, record.reason, record.ended_at = "NotSubmitted", str(exc), self.clock()
                if not self.short:
                    record.end_step = record.start_step
                self.final = None
                return classify_reason(str(exc))
            log.info("submitted %s (%s x %d)", record.job_name, spec.instance_type, spec.instance_count)
            record.status = Status.IN_PROGRESS.value
            self._save()
        stopped_before = record.stop_requested
        final = self._watch(record, reattached=state is not None)
        self.final = final
        self._record_end(record, final)
        if record.stop_requested == USER_STOP and stopped_before != USER_STOP:
            # `hlat stop` while this supervisor watched: a deliberate stop, not a failure to relaunch.
            record.reason = "stopped by hlat stop"
            record.action, record.category = Action.RESUME.value, "user-stop"
            if not self.short:
                record.cause, record.failure_class = "user-stop", FailureClass.PLATFORM.value
            self._save()
            raise StoppedByUser(self._user_stop_message(record), self.attempts)
        if self.short:  # its own ending, judged by the caller from its outputs
            return classify(final, log_tail="\n".join(self.log_tail), first_record=self.first_record)
        if record.stop_requested == USER_STOP:
            # Stopped by `hlat stop` while no supervisor watched (this one re-attached): running again goes on.
            record.reason = "stopped by hlat stop"
            return Decision(Action.RESUME, "user-stop", record.reason, FailureClass.PLATFORM)
        if record.stop_requested == "budget":
            self._save()
            raise BudgetExhausted(self._budget_message(record.end_step), self.attempts)
        if record.stop_requested == "hung":
            record.reason = self._hung or f"hung: no step logged for {duration(self.hang_timeout_s or 0)}"
            return Decision(Action.RESUME, "hung", record.reason, FailureClass.PLATFORM)
        if record.stop_requested == "cancelled" and final.status != Status.COMPLETED:
            # Stopped when an earlier supervisor was cancelled (a cancellation in this one re-raises in _watch):
            # the run is being started again, so go on from the last checkpoint.
            record.reason = "stopped when an earlier flow run was cancelled"
            return Decision(Action.RESUME, "cancelled", record.reason, FailureClass.PLATFORM)
        decision = loss_spikes_stop(classify(final, log_tail="\n".join(self.log_tail), first_record=self.first_record))
        if decision.action == Action.DONE and (record.end_step or 0) < self.target_step:
            # A job that stopped itself (budget, deadline, no supervisor) says so in its log and in a stop record in
            # run storage: the record is what a supervisor re-attaching after the job ended (its log skipped) reads.
            decision = stored_self_stop(self.run, record.job_name, self.stage) or completed_short(
                record, self.current_step(), self.target_step
            )
            record.reason = decision.reason
        return decision

    def _never_submitted(self, record: Attempt, why: str) -> None:
        """An attempt recorded but never created that will not be now: ended, so no reader takes it for running."""
        record.status, record.reason, record.ended_at = "NotSubmitted", why.splitlines()[0], self.clock()
        record.action = Action.FATAL.value
        if not self.short:
            record.end_step = record.start_step
        self._save()

    def _watch(self, record: Attempt, reattached: bool = False) -> JobState:
        """Follow the job until it ends, streaming its progress; stop it when hung, over budget, or asked to by a
        stop request (`hlat stop` while its job was being created). The hang timer starts when the job reaches
        SageMaker's Training status (a backend that reports no secondary status: when the watch starts); before its
        first logged step only the start-up bound (startup_timeout_s, from Training) applies, since the start-up in
        the container (the compile cache, the process groups, the first graphs) is no step and may outlast it."""
        progress = Progress(record.attempt, record.job_name, "InProgress", target_step=self.target_step)
        every = self.progress_every_s or 10 * self.poll_seconds
        gate = ProgressGate(every, 6 * every)
        meter = Throughput(self.tokens_per_step, self.rate_window_s or 30 * self.poll_seconds)
        last_advance = self.clock()
        training_since: float | None = None
        phases = stepped = False
        self.log_tail.clear()
        self.first_record, self._hung = None, None

        def earlier(lines: list[str]) -> None:
            """A re-attached job's output from before: its records, and whether it had begun its steps."""
            nonlocal stepped
            self._scan_records(lines)
            stepped = stepped or any(parse_step_line(line) for line in lines)

        def hung(now: float) -> str | None:
            if phases and training_since is None:
                return None  # Starting, Downloading: SageMaker's own phases, which end by its own errors
            if phases and not stepped and training_since is not None:
                if self.startup_timeout_s and now - training_since > self.startup_timeout_s:
                    self._hung = (
                        f"hung: start-up overran: no first step {duration(self.startup_timeout_s)} after the job "
                        "reached Training (job.startup_timeout_minutes)"
                    )
                    return "hung"
                return None
            if self.hang_timeout_s and now - last_advance > self.hang_timeout_s:
                self._hung = f"hung: no step logged for {duration(self.hang_timeout_s)} (job.hang_timeout_minutes)"
                return "hung"
            return None

        def measured() -> None:
            """The attempt's throughput in its record: the final progress line's figure, start-up apart."""
            record.tokens_per_s, record.training_s = meter.average(), meter.span()
            if not reattached and meter.first is not None and record.submitted_at:
                record.startup_s = max(0.0, meter.first[0] - record.submitted_at)

        def on_poll(lines: list[str], state: JobState | None) -> str | None:
            nonlocal last_advance, training_since, phases, stepped
            self.log_tail.extend(lines)
            self._scan_records(lines)
            if state is not None and not state.terminal and stop_requested(self.run, self.stage):
                return USER_STOP  # `hlat stop` as its job was being created: it never saw the job
            if self.short:  # its log forwarded whole; no steps, no progress line, no budget or hang to watch
                for line in lines:
                    job_log.info("%s", line)
                return None
            now = self.clock()
            if absorb(lines, progress, meter, now, self.tokens_per_step):
                last_advance, stepped = now, True
                record.last_logged_step = progress.step
            if state is None:
                return None
            phases = phases or state.secondary_status is not None
            if state.secondary_status == "Training" and training_since is None:
                training_since = now
                if not stepped:
                    last_advance = now  # the hang timer starts at Training, not at the submission
            self._account(record, state)
            progress.status = state.secondary_status or state.status.value
            progress.cost_usd = self.spent_usd()
            if state.terminal:
                measured()
                progress.final, progress.tokens_per_s, progress.startup_s = True, meter.average(), record.startup_s
            self.on_progress(progress)
            if gate.due(progress, now):
                log.info("%s", progress.line())
            if self.budget.spent(self.attempts):
                return "budget"
            return hung(self.clock())

        def record_end(final: JobState) -> None:
            measured()
            self._record_interrupted(record, final)

        return follow(
            self.backend, record, self._save, self.poll_seconds,
            lambda seconds: self._pause(seconds, between_attempts=False), on_poll, reattached,
            heartbeat=self.heartbeat, stored_stop=lambda: stored_stop(self.ledger, record.attempt),
            record_end=record_end, may_act=lambda: self.lease.check(self.attempts), on_earlier=earlier,
        )  # fmt: skip

    def _scan_records(self, lines: list[str]) -> None:
        """Keep the earliest failure record of any line (see `first_record`)."""
        for line in lines:
            if RECORD_TAG in line and (found := parse_failure_record(line)) is not None:
                self.first_record = first_failure([self.first_record, found]) if self.first_record else found

    def _account(self, record: Attempt, state: JobState) -> None:
        account(record, state, self.price_per_hour)

    def _user_stop_message(self, record: Attempt) -> str:
        if self.short:
            return f"{self.stage} stopped by hlat stop ({record.job_name}); run the same command to run it again"
        return (
            f"{self.stage} stopped by hlat stop at step {record.end_step or 0} of {self.target_step} (its newest "
            "checkpoint); run the same command to go on from it"
        )

    def _budget_message(self, step: int | None) -> str:
        return self.budget.spent_message(step, self.attempts)

    def _save(self) -> None:
        self.ledger.save(self.attempts)
        self.on_attempts(self.attempts)

    def _describe(self, name: str) -> JobState | None:
        return describe_patiently(self.backend, name, self.poll_seconds, self.sleep)


def run_job(
    backend: JobBackend,
    run: Run,
    run_id: str,
    stage: str,
    make_spec: Callable[[int, str], JobSpec],
    poll_seconds: float,
    max_attempts: int = 3,
    backoff_seconds: list[float] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.time,
) -> tuple[Attempt, JobState | None]:
    """Run a short job to its end (prepare-data, precompile, burn-in, evaluate) with the train stage's loop
    (`Supervisor` with `max_attempts`): the same naming, ledger, heartbeat, re-attach, log streaming and
    stop-on-interrupt, relaunching only on failures classified resume or back-off, up to `max_attempts` jobs.
    Returns the last attempt and its final state (None: the submission was refused); the caller reads the job's
    outputs to judge it."""
    supervisor = Supervisor(
        backend=backend,
        run=run,
        run_id=run_id,
        make_spec=make_spec,
        current_step=lambda: None,
        target_step=0,
        tokens_per_step=0,
        stage=stage,
        poll_seconds=poll_seconds,
        hang_timeout_s=None,
        backoff_seconds=backoff_seconds or [poll_seconds],
        sleep=sleep,
        clock=clock,
        max_attempts=max_attempts,
    )
    attempts = supervisor.run_to_completion()
    return attempts[-1], supervisor.final
