"""A simulated SageMaker at full scale: N hosts x 32 ranks on a virtual clock, driven by the project's real control
plane (the train stage's Supervisor as `supervisor_for` builds it, `classify`, the ledger and heartbeat, the job's
StopRule, the CheckpointIndex, `hlat status` and `hlat stop`). No sleeps, no model: each job is a timeline computed
from tests/scale/model.py (the one place for time, bandwidth and price), and what the control plane reads of it is
what SageMaker would show (DescribeTrainingJob's fields, the CloudWatch lines in time order) or what the job would
leave in run storage (committed checkpoints in the real checkpoints/ index, the stop record).

The clock: every actor (a supervisor, `hlat stop` from another terminal) runs in a thread of its own, but only one
runs at a time; an actor's `sleep` parks it until the virtual time it asked for, and the scheduler advances the
clock to the earliest of the actors' wake-ups and the jobs' own events (a step boundary that matters, a checkpoint
commit, a fault, SIGTERM, SIGKILL, a stop-rule tick). The project's `time` is replaced in infra/supervision/
(supervisor.py, lease.py, watch.py, status.py) and infra/stage_jobs.py for the duration (`patch_time`), so their
waits run on the same clock.

Modelled per host, not per rank, except where rank counts matter: every rank's exception line in the log when a
job fails (what fills the 400-line tail the supervisor classifies from), and the sockets of a gloo group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from hlat.core.contract import RECORD_TAG, FailureRecord, StopTerms, format_step_line
from hlat.core.layout import CHECKPOINT_MARKER, CHECKPOINT_META, CHECKPOINTS_DIR, CheckpointIndex, step_dir
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.infra.backends.protocol import JobSpec, JobState, Status, SubmitError
from hlat.training.stop_rule import StopRule
from tests.scale import model
from tests.scale.model import Scale

EPOCH = 1_800_000_000.0
"""The virtual clock's start (2027-01-15): any fixed time works; the project's code only compares times."""


class SupervisorKilled(Exception):
    """SIGKILL of a supervisor process: it dies where it stands (an Exception, so nothing of it runs on: the
    supervisor's `follow` stops the job only for KeyboardInterrupt and the like)."""


# -- the clock -----------------------------------------------------------------------------------------------------
class Actor:
    """A blocking program (a supervisor's loop, `hlat stop`) on the virtual clock."""

    def __init__(self, sim: Sim, name: str, body: Callable[[], Any]) -> None:
        self.sim, self.name, self.body = sim, name, body
        self.wake = sim.now
        self.go = threading.Event()
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.pending: BaseException | None = None
        """Raised in the actor at its next wake-up (Ctrl-C, SIGKILL)."""
        self.thread = threading.Thread(target=self._main, name=f"sim-{name}", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        self.go.wait()
        self.go.clear()
        try:
            self.result = self.body()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done = True
            self.sim._parked.set()

    def interrupt(self, exc: BaseException) -> None:
        """Deliver `exc` now (as a signal would): the actor wakes and raises it."""
        self.pending, self.wake = exc, self.sim.now


class Sim:
    """The virtual clock: timed events and actors, one running at a time."""

    def __init__(self, start: float = EPOCH) -> None:
        self.now = start
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.actors: list[Actor] = []
        self._current: Actor | None = None
        self._parked = threading.Event()

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (max(when, self.now), self._seq, action))

    def spawn(self, name: str, body: Callable[[], Any], at: float | None = None) -> Actor:
        actor = Actor(self, name, body)
        actor.wake = self.now if at is None else at
        self.actors.append(actor)
        return actor

    def sleep(self, seconds: float) -> None:
        """An actor's sleep: park until the clock reaches now + seconds."""
        actor = self._current
        if actor is None:
            raise RuntimeError("Sim.sleep outside an actor: events must not block")
        actor.wake = self.now + max(0.0, seconds)
        self._parked.set()
        actor.go.wait()
        actor.go.clear()
        if actor.pending is not None:
            exc, actor.pending = actor.pending, None
            raise exc

    def monotonic(self) -> float:
        return self.now

    def run(self, until: float | None = None, done: Callable[[], bool] = lambda: False) -> None:
        """Advance until every actor has ended and no event is left, `until`, or `done()`."""
        while not done():
            live = [a for a in self.actors if not a.done]
            t_event = self._events[0][0] if self._events else math.inf
            actor = min(live, key=lambda a: a.wake) if live else None
            t_actor = actor.wake if actor is not None else math.inf
            when = min(t_event, t_actor)
            if when == math.inf or (until is not None and when > until):
                if until is not None:
                    self.now = max(self.now, until)
                return
            self.now = max(self.now, when)
            if t_event <= t_actor:
                _, _, action = heapq.heappop(self._events)
                action()
            else:
                assert actor is not None
                self._current = actor
                self._parked.clear()
                actor.go.set()
                self._parked.wait()
                self._current = None


def patch_time(monkeypatch: Any, sim: Sim, wall: Callable[[], float]) -> None:
    """The project's time, where the control plane reads it, on the virtual clock: `wall` is the supervisor's
    machine's clock (time.time), the sleeps and the monotonic clock are the simulation's."""
    from hlat.infra import stage_jobs
    from hlat.infra.supervision import lease, status, supervisor, watch

    shim = SimpleNamespace(time=wall, monotonic=sim.monotonic, sleep=sim.sleep)
    for module in (supervisor, lease, watch, status, stage_jobs):
        monkeypatch.setattr(module, "time", shim)


# -- the jobs ------------------------------------------------------------------------------------------------------
@dataclass
class Failure:
    """A rank's failure: the exception it raises (type, message, module) and which host's failure file SageMaker
    reports (None: the failing rank's own host)."""

    type: str
    message: str
    rank: int = 0
    module: str | None = None
    reported_host: int | None = None
    """0-based host index whose failure file becomes FailureReason."""
    peers_lost: bool = True
    """The other hosts' ranks then fail on the collective: 'connection closed by peer' records, one per host."""


PEER_LOST = ("RuntimeError", "[gloo] Connection closed by peer [10.0.{host}.7]:41230")
"""What a rank whose peer died records (a gloo collective's error, `lost-peer` in infra/backends/protocol.py)."""


@dataclass
class Script:
    """What one job does (chosen per attempt by the scenario)."""

    startup_s: float | None = None
    starting_s: float | None = None
    downloading_s: float | None = None
    step_s: float | None = None
    """Seconds a step takes (None: the plan's)."""
    fail_at_step: int | None = None
    failure: Failure | None = None
    fail_in_startup_s: float | None = None
    """The start-up fails this long after Training begins (with `failure`)."""
    hang_at_step: int | None = None
    """The last step completed before the job hangs (no step is logged after it, nothing reaches a boundary)."""
    watchdog_s: float | None = None
    """The in-job watchdog's bound: no step for this long writes a `hang` record and ends the process."""
    watchdog_record: Callable[[int, float], str] | None = None
    """The hang record's failure-file line, given the last step and the time (the job helper's format)."""
    stop_s: float | None = None
    """How long the stop takes from the end of the step in progress to exit 0 (the stop's save and commit)."""
    stop_loses: bool = False
    """The stop's save is the in-flight async save's, lost with it (no commit) when the job is SIGKILLed."""
    refuse: SubmitError | None = None
    """CreateTrainingJob refuses this submission."""
    fail_starting: tuple[str, float] | None = None
    """(FailureReason, seconds after submission): the platform fails the job (CapacityError, InternalServerError),
    no record of the job's own."""
    legacy_record: bool = False
    """Records as the job wrote them before issue 50 (`legacy_line`): the message first, the record's fields at
    the end of 1,024 characters."""


@dataclass
class SimJob:
    spec: JobSpec
    script: Script
    scale: Scale
    submitted: float
    status: Status = Status.IN_PROGRESS
    secondary: str = "Starting"
    reason: str | None = None
    ended: float | None = None
    start_step: int | None = None
    first_step_at: float | None = None
    halted_at_step: int | None = None
    """Stepping stopped after this step (a hang, a failure, a stop)."""
    lines: list[str] = field(default_factory=list)
    logged_step: int = 0
    stop_requested_at: float | None = None
    stop_cause: str | None = None
    rule_requested: bool = False
    host_failure_files: dict[int, str] = field(default_factory=dict)
    generation: int = 0
    """Bumped when the job's course changes (a stop, a failure): pending events of an older course do nothing."""

    def _scripted(self, name: str) -> float:
        """The script's figure where it sets one, else the plan's (`Scale`)."""
        value = getattr(self.script, name)
        return float(value if value is not None else getattr(self.scale, name))

    @property
    def starting_s(self) -> float:
        return self._scripted("starting_s")

    @property
    def downloading_s(self) -> float:
        return self._scripted("downloading_s")

    @property
    def startup_s(self) -> float:
        return self._scripted("startup_s")

    @property
    def step_s(self) -> float:
        return self._scripted("step_s")

    @property
    def billed_from(self) -> float:
        return self.submitted + self.starting_s

    @property
    def training_from(self) -> float:
        return self.billed_from + self.downloading_s

    @property
    def alive(self) -> bool:
        return self.ended is None

    def step_at(self, t: float) -> int | None:
        """The newest step completed by `t` (None: none yet)."""
        if self.first_step_at is None or self.start_step is None or t < self.first_step_at:
            return None
        step = self.start_step + int((t - self.first_step_at) // self.step_s)
        if self.halted_at_step is not None:
            step = min(step, self.halted_at_step)
        return min(step, self.scale.config.training.max_steps)

    def step_time(self, step: int) -> float:
        """When `step` completes."""
        assert self.first_step_at is not None and self.start_step is not None
        return self.first_step_at + (step - self.start_step) * self.step_s


class SimSageMaker:
    """The JobBackend: CreateTrainingJob, DescribeTrainingJob, StopTrainingJob and the CloudWatch log, at N hosts."""

    kind = "sagemaker"

    def __init__(
        self,
        sim: Sim,
        scale: Scale,
        run: Run,
        script: Callable[[int], Script],
        clock: Any = None,
        legacy_secondary: bool = False,
    ) -> None:
        self.sim, self.scale, self.run = sim, scale, run
        self.clock = clock
        """Run storage's clock, which the job's StopRule reads the heartbeat's age by."""
        self.legacy_secondary = legacy_secondary
        """Report no SecondaryStatus while a job runs: what the supervisor's hang timer saw before issue 50
        (it counted from the submission, Starting and Downloading included)."""
        self.script = script
        self.jobs: dict[str, SimJob] = {}
        self.submissions = 0
        self.checkpoints = CheckpointIndex(run.storage.child(CHECKPOINTS_DIR))
        self.stops_lost = 0
        """Stops that ended in SIGKILL before their checkpoint committed."""
        self.steps_lost = 0
        """Steps trained and then lost (past the newest checkpoint when a job ended)."""
        self.rule_fired: list[tuple[str, str]] = []
        """(job, why) each time a job's stop rule requested a stop."""

    # -- JobBackend --------------------------------------------------------------------------------------------
    def submit(self, spec: JobSpec) -> None:
        self.submissions += 1
        script = self.script(spec.attempt)
        if script.refuse is not None:
            raise script.refuse
        if spec.name in self.jobs:
            raise SubmitError("ResourceInUse", f"Training job {spec.name} already exists")
        job = SimJob(spec, script, self.scale, submitted=self.sim.now)
        self.jobs[spec.name] = job
        self.sim.at(job.training_from, lambda: self._training(job))
        if script.fail_starting is not None:
            reason, after = script.fail_starting
            self._later(job, job.submitted + after, lambda: self._end(job, Status.FAILED, "Failed", reason))
        self.sim.at(job.billed_from + spec.max_runtime_s, lambda: self._max_runtime(job))

    def describe(self, name: str) -> JobState | None:
        job = self.jobs.get(name)
        if job is None:
            return None
        now = self.sim.now
        secondary = job.secondary
        if job.alive and job.status == Status.IN_PROGRESS:
            secondary = (
                "Starting" if now < job.billed_from else "Downloading" if now < job.training_from else "Training"
            )
            if self.legacy_secondary:
                secondary = None  # type: ignore[assignment]
        end = job.ended if job.ended is not None else now
        billable = max(0.0, end - job.billed_from)
        return JobState(name, job.status, job.reason, secondary, billable, job.spec.instance_count, ended_at=job.ended)

    def stop(self, name: str) -> None:
        job = self.jobs.get(name)
        if job is not None and job.alive and job.status != Status.STOPPING:
            self._sigterm(job, "Stopped")

    def logs(self, name: str, cursor: Any = None) -> tuple[list[str], Any]:
        job = self.jobs[name]
        self._log_steps(job, self.sim.now)
        start = cursor or 0
        return job.lines[start:], len(job.lines)

    def dry_run(self, spec: JobSpec) -> list[dict[str, Any]]:
        return []

    # -- the job's course -----------------------------------------------------------------------------------
    def _log_steps(self, job: SimJob, until: float) -> None:
        """The trainer's progress lines (`core.contract.format_step_line`) for the steps done by `until`, one per
        training.log_every."""
        newest = job.step_at(until)
        if newest is None:
            return
        every = self.scale.config.training.log_every
        tps = self.scale.config.tokens_per_step / job.step_s
        first = max(job.logged_step + 1, (job.start_step or 0) + 1)
        for step in range(first + (-first) % every, newest + 1, every):
            job.lines.append(format_step_line(step, 2.1, 0.3, 1.5e-4, tps))
        job.logged_step = max(job.logged_step, newest)

    def _later(self, job: SimJob, when: float, action: Callable[[], None]) -> None:
        generation = job.generation

        def run() -> None:
            if job.alive and job.generation == generation:
                action()

        self.sim.at(when, run)

    def _training(self, job: SimJob) -> None:
        """SecondaryStatus Training: the container's start-up, then the first step (or a start-up failure)."""
        if not job.alive or job.status == Status.STOPPING:
            return
        if job.script.fail_in_startup_s is not None and job.script.fail_in_startup_s < job.startup_s:
            self._later(job, job.training_from + job.script.fail_in_startup_s, lambda: self._fail(job, None))
            return
        self._later(job, job.training_from + job.startup_s, lambda: self._first_step(job))

    def _first_step(self, job: SimJob) -> None:
        job.start_step = self.checkpoints.latest_step() or 0
        job.first_step_at = self.sim.now
        job.logged_step = job.start_step
        s = job.script
        if s.fail_at_step is not None and s.fail_at_step > job.start_step:
            job.halted_at_step = s.fail_at_step
            self._later(job, job.step_time(s.fail_at_step), lambda: self._fail(job, s.fail_at_step))
        if s.hang_at_step is not None and s.hang_at_step >= job.start_step:
            job.halted_at_step = s.hang_at_step
            if s.watchdog_s is not None:
                hung_from = job.step_time(s.hang_at_step) if s.hang_at_step > job.start_step else self.sim.now
                self._later(job, hung_from + s.watchdog_s, lambda: self._watchdog(job))
        self._next_checkpoint(job)
        self._target(job)
        self._start_rule(job)

    def _next_checkpoint(self, job: SimJob) -> None:
        """The checkpoints ahead: each saved (async) after its step and committed save_s later."""
        assert job.start_step is not None
        every = self.scale.checkpoint_every
        self._schedule_after(job, job.start_step // every * every)

    def _schedule_after(self, job: SimJob, committed: int) -> None:
        every = self.scale.checkpoint_every
        step = committed + every
        if step >= self.scale.config.training.max_steps:
            return
        if job.halted_at_step is not None and step > job.halted_at_step:
            return

        def commit() -> None:
            self._commit(step)
            self._schedule_after(job, step)

        self._later(job, job.step_time(step) + self.scale.save_s, commit)

    def _target(self, job: SimJob) -> None:
        target = self.scale.config.training.max_steps
        if job.halted_at_step is not None and job.halted_at_step < target:
            return
        assert job.start_step is not None
        if job.start_step >= target:
            self._later(job, self.sim.now, lambda: self._end(job, Status.COMPLETED, "Completed"))
            return

        def done() -> None:
            self._commit(target)
            self._end(job, Status.COMPLETED, "Completed")

        self._later(job, job.step_time(target) + self.scale.save_s, done)

    def _commit(self, step: int) -> None:
        """Rank 0's commit into the run's real checkpoints/ (meta.json, then COMMITTED with its sha256), and
        retention of training.keep_checkpoints."""
        ckpt = self.run.storage.child(CHECKPOINTS_DIR)
        meta = (json.dumps({"step": step, "files": {}, "world_size": self.scale.ranks}) + "\n").encode()
        ckpt.write_bytes(f"{step_dir(step)}/{CHECKPOINT_META}", meta)
        marker = {"step": step, "meta_sha256": hashlib.sha256(meta).hexdigest()}
        ckpt.write_bytes(f"{step_dir(step)}/{CHECKPOINT_MARKER}", json.dumps(marker).encode())
        keep = self.scale.config.training.keep_checkpoints
        for old in self.checkpoints.all_steps()[:-keep]:
            ckpt.fs.rm(ckpt.path(step_dir(old)), recursive=True)

    # -- the stop rule, inside the job (the real StopRule, on the host's clock) ------------------------------
    def _start_rule(self, job: SimJob) -> None:
        terms = StopTerms.from_environment(job.spec.environment)
        if not terms.any:
            return
        scale = self.scale

        def request(why: str) -> None:
            # Only a flag: the loop acts on it at its next step boundary (none comes to a hung job).
            job.rule_requested = True
            self.rule_fired.append((job.spec.name, why))
            self._stop_at_boundary(job)

        first: list[float] = []
        if self.legacy_secondary and terms.submitted_at is not None:
            # The old rule: the submission (the supervisor machine's clock) was the job's first beat.
            first.append(terms.submitted_at)

        def clock() -> float:
            return first.pop() if first else self.sim.now

        rule = StopRule(
            terms, request, lambda: 1.25 * (scale.step_s + scale.save_s), self.run, clock=clock,
            storage_clock=self.clock,
        )  # fmt: skip
        job.rule = rule  # type: ignore[attr-defined]
        every = rule.read_every or 60.0

        def tick() -> None:
            if rule.check(self.sim.now) is None and job.alive:
                self._later(job, self.sim.now + every, tick)

        self._later(job, self.sim.now, tick)

    def _stop_at_boundary(self, job: SimJob) -> None:
        """A stop the job itself asked for (the stop rule): the next step boundary, a synchronous save and commit,
        exit 0 (Completed), its stop record in the log."""
        if job.halted_at_step is not None:
            return  # hung (no boundary comes) or its course already set (a failure ahead)
        now_step = job.step_at(self.sim.now)
        step = (now_step if now_step is not None else (job.start_step or 0)) + 1
        job.halted_at_step = step
        job.generation += 1
        rule = job.rule  # type: ignore[attr-defined]

        def done() -> None:
            self._commit(step)
            job.lines.append(rule.record(step).line())
            self._end(job, Status.COMPLETED, "Completed")

        self._later(job, job.step_time(step) + self.scale.save_s, done)

    # -- SIGTERM and SIGKILL ----------------------------------------------------------------------------------
    def _max_runtime(self, job: SimJob) -> None:
        if job.alive and job.status != Status.STOPPING:
            self._sigterm(job, "MaxRuntimeExceeded")

    def _sigterm(self, job: SimJob, secondary: str) -> None:
        now = self.sim.now
        job.status, job.secondary, job.stop_requested_at = Status.STOPPING, "Stopping", now
        job.stop_cause = secondary
        job.generation += 1
        kill_at = now + model.STOP_GRACE_S
        if now < job.training_from:  # no container yet
            self._later(job, now + 1.0, lambda: self._end(job, Status.STOPPED, secondary))
            return
        stepping = job.first_step_at is not None and job.start_step is not None
        hung = job.halted_at_step is not None and (job.step_at(now) or 0) >= job.halted_at_step
        if not stepping or hung:
            # In start-up the ranks exit on the signal; a hung rank never reaches a boundary: SIGKILL.
            when = now + 5.0 if not stepping else kill_at
            self._later(job, min(when, kill_at), lambda: self._end(job, Status.STOPPED, secondary))
            return
        current = (job.step_at(now) or 0) + 1
        job.halted_at_step = current
        stop_s = job.script.stop_s if job.script.stop_s is not None else self.scale.save_s
        exit_at = job.step_time(current) + stop_s
        if exit_at <= kill_at:

            def saved() -> None:
                self._commit(current)
                self._end(job, Status.STOPPED, secondary)

            self._later(job, exit_at, saved)
        else:

            def killed() -> None:
                self.stops_lost += 1
                job.lines.append(f"[{job.spec.name}] Signal 9 (SIGKILL) received by PID 4242")
                self._end(job, Status.STOPPED, secondary)

            self._later(job, kill_at, killed)

    # -- failures ---------------------------------------------------------------------------------------------
    def _records(self, job: SimJob, step: int | None, failure: Failure) -> None:
        """The failing rank's record, then (a collective later) one 'closed by peer' record per other host, each
        host's failure file (the first record of its ranks, as `write_failure` keeps it), and every rank's
        exception line (Python's last traceback line, what each rank prints as it exits)."""
        hosts, per = self.scale.hosts, model.RANKS_PER_HOST
        failing_host = failure.rank // per
        legacy = job.script.legacy_record
        first = record(failure.type, failure.message, failure.module, step, failure.rank, failing_host, self.sim.now,
                       legacy)  # fmt: skip
        job.host_failure_files[failing_host] = first
        job.lines.append(first)
        if failure.peers_lost:
            for host in range(hosts):
                if host == failing_host:
                    continue
                kind, text = PEER_LOST
                line = record(kind, text.format(host=failing_host), None, step, host * per, host,
                              self.sim.now + model.PEER_RECORD_S, legacy)  # fmt: skip
                job.host_failure_files[host] = line
                job.lines.append(line)
            kind, text = PEER_LOST
            peer_line = f"{kind}: {text.format(host=failing_host)}"
            job.lines.append(f"{failure.type}: {' '.join(failure.message.split())}")
            job.lines.extend(peer_line for _ in range(self.scale.ranks - 1))

    def _fail(self, job: SimJob, step: int | None) -> None:
        failure = job.script.failure
        assert failure is not None
        self._log_steps(job, self.sim.now)
        self._records(job, step, failure)
        reported = failure.reported_host if failure.reported_host is not None else failure.rank // 32
        reason = model.failure_reason(job.host_failure_files[reported])
        job.generation += 1
        self._later(job, self.sim.now + model.FAILURE_SEEN_S, lambda: self._end(job, Status.FAILED, "Failed", reason))

    def _watchdog(self, job: SimJob) -> None:
        """The in-job watchdog: no step for its bound; every thread's stack in the log, a `hang` record in the
        failure file, the process ends (the job Failed)."""
        assert job.script.watchdog_record is not None and job.halted_at_step is not None
        line = job.script.watchdog_record(job.halted_at_step, self.sim.now)
        job.lines.append("watchdog: dumping every thread's stack")
        job.lines.append(line)
        job.generation += 1
        reason = model.failure_reason(line)
        self._later(job, self.sim.now + model.FAILURE_SEEN_S, lambda: self._end(job, Status.FAILED, "Failed", reason))

    def _end(self, job: SimJob, status: Status, secondary: str, reason: str | None = None) -> None:
        if not job.alive:
            return
        self._log_steps(job, self.sim.now)
        job.status, job.secondary, job.reason, job.ended = status, secondary, reason, self.sim.now
        job.generation += 1
        trained = job.step_at(self.sim.now)
        newest = self.checkpoints.latest_step() or 0
        if trained is not None and trained > newest:
            self.steps_lost += trained - newest

    # -- what a scenario reads ------------------------------------------------------------------------------
    def billed_usd(self) -> float:
        """Every job's bill so far (BillableTimeInSeconds x instances x the node price)."""
        total = 0.0
        for name in self.jobs:
            state = self.describe(name)
            assert state is not None
            total += state.billable_seconds * state.instance_count * self.scale.node_price / 3600.0
        return total

    def live(self) -> list[SimJob]:
        return [j for j in self.jobs.values() if j.alive]


def record(
    kind: str,
    message: str,
    module: str | None,
    step: int | None,
    rank: int,
    host: int,
    when: float,
    legacy: bool = False,
) -> str:
    """A rank's failure record as the job writes it (`FailureRecord.line`, with its time where records carry one);
    `legacy`: as it wrote it before issue 50."""
    fields: dict[str, Any] = {"module": module, "step": step, "rank": rank, "host": f"algo-{host + 1}"}
    if legacy:
        return legacy_line(kind, message, fields)
    if "time" in {f.name for f in dataclasses.fields(FailureRecord)}:
        fields["time"] = when
    return FailureRecord(kind, message, **fields).line()


def legacy_line(kind: str, message: str, fields: dict[str, Any], limit: int = model.FAILURE_REASON_MAX) -> str:
    """The failure record's line before issue 50 (the old rule, kept as the scenarios' "before"): `<type>:
    <message> [hlat-failure {...}]`, the message cut so that the whole line is `limit` characters, which leaves no
    room for SageMaker's "AlgorithmError: " in front of it."""
    kept = {"type": kind, **{k: v for k, v in fields.items() if v is not None}}
    tail = f" [{RECORD_TAG} {json.dumps(kept, sort_keys=True)}]"
    head = f"{kind}: {' '.join(message.split())}"
    room = limit - len(tail)
    if len(head) > room:
        head = head[: max(0, room - 3)] + "..."
    return head + tail


# -- run storage's clock -----------------------------------------------------------------------------------------
def track_writes(storage: Storage, sim: Sim) -> dict[str, float]:
    """When each object of `storage` was last written, by the true (S3's) clock: the simulation's LastModified."""
    written: dict[str, float] = {}
    real = storage.write_bytes

    def write_bytes(rel: str, data: bytes) -> None:
        real(rel, data)
        written[rel] = sim.now

    storage.write_bytes = write_bytes  # type: ignore[method-assign]
    return written


def storage_clock(storage: Storage, sim: Sim, written: dict[str, float], legacy: bool) -> Any:
    """Run storage's clock on the virtual one (core.storage.StorageClock): LastModified is the true time of the
    write. `legacy`: the rule before issue 50, the heartbeat's own `beat_at` (the supervisor machine's clock) read
    against the host's."""
    from hlat.core.storage import StorageClock

    class SimStorageClock(StorageClock):
        def modified(self, rel: str) -> float | None:
            if legacy:
                try:
                    beat = storage.read_json(rel)
                except Exception:
                    return None
                return float(beat["beat_at"]) if isinstance(beat, dict) and "beat_at" in beat else None
            return written.get(rel)

        def now(self) -> float:
            return sim.now

    return SimStorageClock(storage)


def legacy_control_plane(monkeypatch: Any) -> dict[str, Any]:
    """The control plane before issue 50, where a fix has no switch: the old rule put back for the scenario's
    "before" form. Returns the Supervisor fields that turn the rest off."""
    from hlat.infra.backends.protocol import Action, Decision, FailureClass, classify
    from hlat.infra.supervision import judgement, lease, status, supervisor

    def old_classify(state: JobState, stop_requested: bool = False, log_tail: str = "", **_: Any) -> Any:
        # No attribution by time (first_record), and ResourceLimitExceeded fatal (its old 'quota' row).
        if (state.failure_reason or "").startswith("ResourceLimitExceeded"):
            return Decision(Action.FATAL, "quota", state.failure_reason or "", FailureClass.FATAL)
        return classify(state, stop_requested, log_tail)

    real_reason = supervisor.classify_reason

    def old_classify_reason(reason: str, log_tail: str = "", **_: Any) -> Any:
        if reason.startswith("ResourceLimitExceeded"):
            return Decision(Action.FATAL, "quota", reason, FailureClass.FATAL)
        return real_reason(reason, log_tail)

    monkeypatch.setattr(supervisor, "classify", old_classify)
    monkeypatch.setattr(supervisor, "classify_reason", old_classify_reason)
    monkeypatch.setattr(judgement, "classify_reason", old_classify_reason)
    # No lease: any number of supervisors per run.
    for name in ("acquire", "check", "renew", "release"):
        if hasattr(lease, "SupervisorLease"):
            monkeypatch.setattr(lease.SupervisorLease, name, lambda self, *a, **k: 0)
    # `hlat stop` only stops a live job (no recorded request that the supervisor honours before a submission).
    if hasattr(status, "request_stop"):
        monkeypatch.setattr(status, "request_stop", lambda *a, **k: None)
    fields = {"max_attempts_without_progress": 10**6, "startup_timeout_s": None, "deadline": None,
              "startup_floor_s": None}  # fmt: skip
    names = {f.name for f in dataclasses.fields(supervisor.Supervisor)}
    return {k: v for k, v in fields.items() if k in names}


# -- a run at full scale -------------------------------------------------------------------------------------------
@dataclass
class World:
    """One scenario's world: the run in a tmp folder, its config at full scale, the simulated SageMaker, the clock."""

    sim: Sim
    scale: Scale
    run: Run
    backend: SimSageMaker
    skew_s: float = 0.0
    """The supervisors' machine clock minus the true time (the hosts' and S3's)."""
    legacy: dict[str, Any] | None = None
    """The "before" form: the Supervisor fields that turn the fixes off (None: the control plane as it is)."""
    clock: Any = None
    """Run storage's clock (see `storage_clock`)."""

    @property
    def storage(self) -> Storage:
        return self.run.storage

    def wall(self) -> float:
        """The supervisor's machine's clock."""
        return self.sim.now + self.skew_s

    def newest(self) -> int:
        return self.backend.checkpoints.latest_step() or 0

    def supervisor(self, **changes: Any) -> Any:
        """The train stage's supervisor as `infra.stage_jobs.supervisor_for` builds it from the run's config, on
        the simulated backend and the virtual clock; `changes` replace its fields."""
        from hlat.infra import stage_jobs

        real = stage_jobs.backend_for
        stage_jobs.backend_for = lambda run: self.backend  # type: ignore[assignment]
        try:
            sup = stage_jobs.supervisor_for(self.run, current_step=lambda: self.backend.checkpoints.latest_step())
        finally:
            stage_jobs.backend_for = real  # type: ignore[assignment]
        names = {f.name for f in dataclasses.fields(sup)}
        extra = {"storage_clock": self.clock} if "storage_clock" in names else {}
        return dataclasses.replace(
            sup, sleep=self.sim.sleep, clock=self.wall, **extra, **(self.legacy or {}), **changes
        )


def world(
    monkeypatch: Any,
    tmp_path: Any,
    preset: str,
    script: Callable[[int], Script] = lambda attempt: Script(),
    start_step: int | None = None,
    skew_s: float = 0.0,
    fixed: bool = True,
    **overrides: Any,
) -> World:
    """A run of `preset` at its own scale resumed from the checkpoint at `start_step` (default: two checkpoint
    intervals before training.max_steps), with config `overrides`."""
    from hlat.core.layout import CONFIG_FILE
    from hlat.infra.supervision import status

    scale = model.scale(preset, **overrides)
    sim = Sim()
    run = Run.at(str(tmp_path / f"{preset}-sim"), scale.config, f"{preset}-sim")
    run.storage.write_json(CONFIG_FILE, scale.config.model_dump(mode="json"))
    written = track_writes(run.storage, sim)
    clock = storage_clock(run.storage, sim, written, legacy=not fixed)
    backend = SimSageMaker(sim, scale, run, script, clock, legacy_secondary=not fixed)
    target = scale.config.training.max_steps
    backend._commit(start_step if start_step is not None else target - 2 * scale.checkpoint_every)
    w = World(sim, scale, run, backend, skew_s, None if fixed else legacy_control_plane(monkeypatch), clock)
    patch_time(monkeypatch, sim, w.wall)
    # The plan's estimate (the budget's basis, asked at every submission) is the same for one config: computed once.
    # Patched where it is looked up: the budget's module and the supervisor's maker.
    from hlat.infra import stage_jobs
    from hlat.infra.cost import budget as budget_module
    from hlat.infra.cost import estimates as estimates_module

    estimates: dict[int, tuple[Any, dict[str, Any]]] = {}
    real_estimate = estimates_module.estimate

    def estimate(config: Any) -> dict[str, Any]:
        if id(config) not in estimates:
            estimates[id(config)] = (config, real_estimate(config))
        return estimates[id(config)][1]

    monkeypatch.setattr(stage_jobs, "estimate", estimate)
    monkeypatch.setattr(budget_module, "estimate", estimate)
    monkeypatch.setattr(status, "backend_of", lambda config, run: backend)
    return w
