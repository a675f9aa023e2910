"""Keep a run's training going: submit a job, watch it, classify how it ended, relaunch from the newest checkpoint.

The same loop drives both job backends, and every stage's jobs: the short jobs' stages (prepare-data, precompile,
burn-in, evaluate: `run_job`, a Supervisor with `max_attempts`) run their one job to its end with it. Its memory is a
ledger in run storage (`jobs/<stage>-attempts.json`), written before each submission, so a supervisor that dies and
is restarted finds the job it launched (by its deterministic name) and watches it instead of launching a second one.

Each attempt ends in one of four ways (`infra.backends.protocol.classify`, by the failure's class, judged from the
job's own
failure record when it wrote one, else from SageMaker's status fields, else from words in the reason or the log):
done; resume at once (a failure of the job's own: NaN exit, a crash; or of the platform: a dead host or daemon, a
killed rank, hardware, an internal error, max runtime, a hang); resume after a growing delay (capacity, throttling,
a transient quota refusal, and a platform fault that repeats with no checkpoint gained); fatal (bad config, data,
image, access; the same failure of the job's own, by its cause, ending `job.max_repeats` attempts in a row with no
newer checkpoint committed between them; or `job.max_attempts_without_progress` attempts in a row, of any class,
committing none). Progress is a committed checkpoint: steps logged past it and lost do not count. The ending is
judged by the record of the rank that failed first, the earliest of any line of the job's log. A job that reports
Completed without the checkpoint of the last step is no 'done': it is resumed,
as 'completed without a checkpoint at step N', and stops the stage when that repeats the same way. The loop also
stops when the relaunches allowed (`job.max_restarts`) or the dollar budget (billable seconds x instance count x
node-hour price; on SageMaker 1.25 x the plan's estimate unless `job.budget_usd` says otherwise) run out, and no
attempt is recorded that the deadline or the budget left would refuse. A job that logs no new step for
`job.hang_timeout_minutes` once it reached Training, or no first step for `job.startup_timeout_minutes` after it, is
stopped and relaunched.

What it logs stays short on a long run: the progress line (step, loss, tokens/s and ETA measured over a window of
recent steps, dollars) when its status changes or, while steps advance, at most every ten polls, ending with the
attempt's average throughput; the trainer's own step lines go to the debug level.

Interrupting the supervisor itself (Ctrl-C, a cancelled flow run: anything that is not an Exception) stops the
job and records its end; a supervisor that crashes or is killed leaves the job running for the next supervisor to
re-attach to. While it watches a job the supervisor writes a heartbeat each poll (`jobs/<stage>-supervisor.json`:
when, which process on which host, which flow run): `hlat status` shows it, and a job whose supervisor has gone
silent stops itself. A job stopped by `hlat stop` (stop_requested 'user' in the ledger), or a stop request
(`jobs/<stage>-stop-request.json`) met before a submission, in a back-off or at a poll, ends the stage without a
relaunch: `StoppedByUser`. One supervisor runs a stage at a time: a lease in run storage (`SupervisorLease`), checked
before every submission and stop.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from hlat.core.contract import RECORD_TAG, FailureRecord, parse_failure_record, parse_step_line
from hlat.core.layout import clock_probe_path, heartbeat_path, lease_path, ledger_path, stop_request_path
from hlat.core.run import Run
from hlat.core.storage import StorageClock, is_transient
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
from hlat.infra.cost.catalog import job_cost

log = logging.getLogger("hlat.supervisor")
job_log = logging.getLogger("hlat.job")

LOG_TAIL_LINES = 400
"""Lines of a job's log kept for classifying its ending: torchrun's failure summary and the ranks' last words."""


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
    final: bool = False
    """The job has ended: tokens_per_s is the attempt's average, and there is no ETA."""
    startup_s: float | None = None
    """Seconds from submission to the first logged step, shown apart from the average (final line only)."""

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
            # The attempt's average is wall-clock from its first logged step to its last (checkpoints and
            # evaluations included); the start-up before the first step is shown apart.
            parts.append(f"{self.tokens_per_s:,.0f} tok/s" + (" average" if self.final else ""))
        if self.final and self.startup_s is not None:
            parts.append(f"start-up {_duration(self.startup_s)}")
        if self.eta_s is not None and not self.final:
            parts.append(f"ETA {_duration(self.eta_s)}")
        parts.append(f"${self.cost_usd:,.2f} spent")
        return ", ".join(parts)


class Throughput:
    """Tokens per second of one job, from the steps it logs as the supervisor sees them arrive.

    The trainer's own reading is one sync point's mean step time: it jumps on a step that checkpoints, evaluates
    or compiles (an ETA that followed it swung between 38 s and 56 min in one run). So the rate is the steps gained
    over a window of recent observations (at least `window_s` of them, when there are), and the attempt's average
    is the steps gained over the time between its first and last observation; the trainer's readings stand in
    only until two observations exist."""

    def __init__(self, tokens_per_step: int, window_s: float) -> None:
        self.tokens_per_step, self.window_s = tokens_per_step, window_s
        self.recent: deque[tuple[float, int]] = deque()
        self.first: tuple[float, int] | None = None
        self.readings: list[float] = []

    def observe(self, now: float, step: int, reading: float | None) -> None:
        """The newest step seen at `now` (one call per poll), with the trainer's tokens/s for it."""
        if reading:
            self.readings.append(reading)
        if self.recent and step <= self.recent[-1][1]:
            return
        self.recent.append((now, step))
        self.first = self.first or (now, step)
        # Keep one observation at or before the window's start: the rate then spans the whole window.
        while len(self.recent) > 2 and self.recent[1][0] <= now - self.window_s:
            self.recent.popleft()

    def _between(self, start: tuple[float, int] | None) -> float | None:
        if start is None or not self.recent or self.recent[-1][0] <= start[0]:
            return None
        (t0, s0), (t1, s1) = start, self.recent[-1]
        return (s1 - s0) * self.tokens_per_step / (t1 - t0)

    def rate(self) -> float | None:
        """Tokens/s over the recent window (the trainer's last reading before there is a window)."""
        rate = self._between(self.recent[0] if self.recent else None)
        return rate if rate is not None else (self.readings[-1] if self.readings else None)

    def average(self) -> float | None:
        """Tokens/s over the attempt: tokens gained over the time they took (the readings' mean as a fallback)."""
        rate = self._between(self.first)
        return rate if rate is not None else (sum(self.readings) / len(self.readings) if self.readings else None)

    def span(self) -> float | None:
        """Seconds between the first and the newest step seen (what `average` is measured over; None: no span)."""
        if self.first is None or not self.recent or self.recent[-1][0] <= self.first[0]:
            return None
        return self.recent[-1][0] - self.first[0]


class ProgressGate:
    """When the progress line goes to the log: the first, each change of status and the final one at once; a new
    step at most every `every_s`; the same line again only after `quiet_s` (a heartbeat that shows the job and
    its bill still going). The progress artifact is updated on every poll regardless."""

    def __init__(self, every_s: float, quiet_s: float) -> None:
        self.every_s, self.quiet_s = every_s, quiet_s
        self.printed_at: float | None = None
        self.shown: tuple[str, int | None] | None = None

    def due(self, p: Progress, now: float) -> bool:
        key = (p.status, p.step)
        if p.final or self.printed_at is None or self.shown is None or p.status != self.shown[0]:
            due = True
        else:
            due = now - self.printed_at >= (self.quiet_s if key == self.shown else self.every_s)
        if due:
            self.printed_at, self.shown = now, key
        return due


def _iso(seconds: float | None) -> str | None:
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
        rows = [{**asdict(a), **{k: _iso(getattr(a, k)) for k in _TIMESTAMPS}} for a in attempts]
        self.storage.write_json(self.rel, {"attempts": rows})

    def update(self, record: Attempt) -> None:
        """Replace one attempt (by number) with `record`: a stage that judged the job's outputs afterwards."""
        attempts = [record if a.attempt == record.attempt else a for a in self.load()]
        self.save(attempts)


def _no_identity() -> tuple[str | None, str | None]:
    return None, None


_identity: Callable[[], tuple[str | None, str | None]] = _no_identity


def set_identity(provider: Callable[[], tuple[str | None, str | None]]) -> None:
    """Who supervises, as the heartbeat names it: `provider()` -> (flow run id, command), e.g. the CLI's
    ('<uuid>', 'hlat pretrain') or a deployment's name. infra/ has no Prefect: the caller that has it sets this."""
    global _identity
    _identity = provider


def supervisor_identity() -> tuple[str | None, str]:
    """(flow run id or None, a short command) of this process: the provider's, else the environment's
    (a Prefect worker's flow run sets PREFECT__FLOW_RUN_ID) and this program's name."""
    try:
        flow_run_id, command = _identity()
    except Exception:  # a provider that cannot answer (no flow run context) must not stop a stage
        flow_run_id, command = None, None
    flow_run_id = flow_run_id or os.environ.get("PREFECT__FLOW_RUN_ID") or None
    return flow_run_id, command or _program()


def _program() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


class Heartbeat:
    """`jobs/<stage>-supervisor.json` in run storage, rewritten (atomically) once per poll while a supervisor
    watches the stage's job: {"beat_at": epoch seconds, "pid", "host", "flow_run_id", "command"}. A job whose
    supervisor's beat grows older than job.unsupervised_stop_minutes stops itself; `hlat status` shows it. A failed
    write is a warning (once until one succeeds again), never a reason to stop the stage."""

    def __init__(
        self,
        run: Run,
        stage: str,
        clock: Callable[[], float] = time.time,
        before: Callable[[], None] | None = None,
    ) -> None:
        self.run, self.rel, self.clock, self.before = run, heartbeat_path(stage), clock, before
        self.failing = False

    def beat(self) -> None:
        if self.before is not None:
            self.before()  # the supervisor's lease: a supervisor that lost it stops here (LeaseLost), unbeaten
        flow_run_id, command = supervisor_identity()
        body = {
            "beat_at": self.clock(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "flow_run_id": flow_run_id,
            "command": command,
        }
        try:
            self.run.storage.write_json(self.rel, body)
        except Exception as exc:
            if not self.failing:
                log.warning("could not write the supervisor heartbeat %s: %s", self.run.storage.uri(self.rel), exc)
            self.failing = True
        else:
            self.failing = False


def read_heartbeat(run: Run, stage: str) -> dict[str, Any] | None:
    """The stage's last heartbeat (None: none, or unreadable)."""
    try:
        beat = run.storage.read_json(heartbeat_path(stage))
    except Exception:
        return None
    return beat if isinstance(beat, dict) and isinstance(beat.get("beat_at"), int | float) else None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host lives (signal 0: exists, and ours or not ours to signal)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


STARTUP_FLOOR_S = 600.0
"""The start-up an attempt is taken to need, billed, when its stage has measured none (Attempt.startup_s): 10 min.
Below any start-up a trn1 cluster job has (SageMaker's Starting and Downloading, the Neuron image's pull, the
compile cache and the first graphs before the first step), so a job that could still commit a checkpoint is never
refused for it, while a budget left for minutes (a job with a 126 s MaxRuntime) no longer buys a job."""


# -- one supervisor per run and stage: a lease in run storage ---------------------------------------------------------
LEASE_POLLS = 5
"""A lease lasts this many of the run's polls past its last renewal (and at least LEASE_MIN_S): a supervisor renews it
every poll while it watches a job and through every back-off, so only one that is gone (or stuck for that long) loses
it."""
LEASE_MIN_S = 300.0


def read_lease(run: Run, stage: str) -> dict[str, Any] | None:
    """The stage's lease as stored (None: none, or unreadable)."""
    try:
        lease = run.storage.read_json(lease_path(stage)) if run.storage.exists(lease_path(stage)) else None
    except Exception:
        return None
    return lease if isinstance(lease, dict) and isinstance(lease.get("token"), int) else None


def lease_live(lease: dict[str, Any] | None, now: float) -> bool:
    """Whether a stored lease still holds at `now` (the store's time): not released, not expired, and not held by a
    process of this host that has died (it can be seen at once, without waiting out the expiry)."""
    if lease is None or lease.get("released") or float(lease.get("expires_at") or 0) <= now:
        return False
    return not (lease.get("host") == socket.gethostname() and not pid_alive(int(lease.get("pid") or 0)))


def describe_holder(lease: dict[str, Any]) -> str:
    """'hlat pretrain, pid 4242 on ip-10-0-0-5, flow run <id>, since 2026-...Z': who holds a lease."""
    who = f"{lease.get('command') or 'a supervisor'}, pid {lease.get('pid')} on {lease.get('host')}"
    if lease.get("flow_run_id"):
        who += f", flow run {lease['flow_run_id']}"
    since = _iso(lease.get("since")) if isinstance(lease.get("since"), int | float) else None
    return who + (f", since {since}" if since else "")


class SupervisorLease:
    """`jobs/<stage>-lease.json`: which supervisor may submit and stop the stage's jobs. {"token", "nonce", "pid",
    "host", "flow_run_id", "command", "since", "renewed_at", "expires_at", "released"}, times by run storage's clock
    (`now`: `StorageClock.now`, so two machines' clocks never meet).

    `acquire` takes it when there is none, it was released, or it expired (the token grows with each holder), and
    refuses (`SupervisorBusy`, naming the holder) while another holds it. The holder renews it every poll; before
    each submission and stop it checks that the stored lease is still its own (token and nonce: fencing), and a
    holder whose lease was taken over stops with `LeaseLost`, submitting and stopping nothing more. The store has no
    compare-and-swap here: two supervisors starting in the same instant both write, and the one whose write is read
    back keeps it (the other is refused on reading back), so the window is one write-and-read."""

    def __init__(self, run: Run, stage: str, now: Callable[[], float], ttl_s: float) -> None:
        self.run, self.stage, self.now, self.ttl_s = run, stage, now, ttl_s
        self.rel = lease_path(stage)
        self.mine: dict[str, Any] | None = None

    @property
    def token(self) -> int | None:
        return None if self.mine is None else int(self.mine["token"])

    def acquire(self, attempts: list[Attempt] | None = None) -> int:
        """Take the lease (its token), or raise SupervisorBusy naming its holder."""
        now = self.now()
        held = read_lease(self.run, self.stage)
        if lease_live(held, now):
            assert held is not None
            raise SupervisorBusy(self._busy(held, now), attempts or [])
        flow_run_id, command = supervisor_identity()
        token = int(held["token"]) + 1 if held else 1
        mine: dict[str, Any] = {
            "token": token, "nonce": uuid.uuid4().hex, "pid": os.getpid(),
            "host": socket.gethostname(), "flow_run_id": flow_run_id, "command": command, "since": now,
            "renewed_at": now, "expires_at": now + self.ttl_s, "released": False,
        }  # fmt: skip
        self.run.storage.write_json(self.rel, mine)
        back = read_lease(self.run, self.stage)
        if back is None or back.get("nonce") != mine["nonce"]:  # another supervisor wrote in the same instant
            raise SupervisorBusy(self._busy(back or mine, now), attempts or [])
        self.mine = mine
        if held and not held.get("released"):
            log.warning("%s: took over the supervisor lease of %s (expired)", self.stage, describe_holder(held))
        return token

    def _busy(self, held: dict[str, Any], now: float) -> str:
        left = float(held.get("expires_at") or now) - now
        return (
            f"{self.stage}: another supervisor runs this run's {self.stage} stage ({describe_holder(held)}; lease "
            f"{held.get('token')}, renewed every poll, expires {_duration(left)} after its last renewal): this one "
            "touches nothing. `hlat status` shows it; `hlat stop` stops the run; this command may run again once "
            "that one has ended"
        )

    def check(self, attempts: list[Attempt] | None = None) -> None:
        """Raise LeaseLost unless the stored lease is still this supervisor's (before any submission or stop)."""
        if self.mine is None:
            return
        try:
            held = self.run.storage.read_json(self.rel) if self.run.storage.exists(self.rel) else None
        except Exception as exc:  # storage away for a moment: only a lease read as another's is lost
            log.warning("could not read %s: %s", self.run.storage.uri(self.rel), exc)
            return
        if not isinstance(held, dict) or held.get("nonce") == self.mine["nonce"]:
            return  # ours (or removed by hand: nobody else holds it)
        other = describe_holder(held)
        raise LeaseLost(
            f"{self.stage}: this supervisor's lease {self.mine['token']} was taken over by {other} after it went "
            "silent past the lease's expiry; it submits and stops nothing more (the other one goes on with the job)",
            attempts or [],
        )

    def renew(self, attempts: list[Attempt] | None = None) -> None:
        if self.mine is None:
            return
        self.check(attempts)
        now = self.now()
        self.mine = {**self.mine, "renewed_at": now, "expires_at": now + self.ttl_s}
        self.run.storage.write_json(self.rel, self.mine)

    def release(self) -> None:
        """Give the lease up (the stage ended, or this supervisor stops): the next supervisor takes it at once."""
        if self.mine is None:
            return
        try:
            held = read_lease(self.run, self.stage)
            if held is not None and held.get("nonce") == self.mine["nonce"]:
                self.run.storage.write_json(self.rel, {**self.mine, "released": True, "expires_at": self.now()})
        except Exception as exc:  # it expires by itself
            log.warning("could not release %s: %s", self.run.storage.uri(self.rel), exc)
        self.mine = None


# -- hlat stop at any moment: a stop request in run storage -----------------------------------------------------------
def request_stop(run: Run, stage: str, requested_at: float | None = None) -> None:
    """Record that the stage must not relaunch (`hlat stop`): its supervisor checks it before every submission,
    through every back-off and at every poll, and ends the stage (StoppedByUser). Running the stage's command again
    clears it."""
    _, command = supervisor_identity()
    run.storage.write_json(
        stop_request_path(stage),
        {"requested_at": time.time() if requested_at is None else requested_at, "pid": os.getpid(),
         "host": socket.gethostname(), "command": command},
    )  # fmt: skip


def stop_requested(run: Run, stage: str) -> bool:
    """Whether a stop request stands for the stage (a read that fails counts as none: the next poll reads again)."""
    try:
        return run.storage.exists(stop_request_path(stage))
    except Exception as exc:
        log.warning("could not read %s: %s", run.storage.uri(stop_request_path(stage)), exc)
        return False


def clear_stop_request(run: Run, stage: str) -> None:
    if run.storage.exists(stop_request_path(stage)):
        run.storage.remove(stop_request_path(stage))


def ending_reason(state: JobState) -> str | None:
    """What a job's ending adds to its status: the failure reason, or a finer status (MaxRuntimeExceeded); None
    for a plain Completed or Stopped (a reason column that repeats the status says nothing)."""
    if state.failure_reason:
        return state.failure_reason
    if state.secondary_status and state.secondary_status != state.status.value:
        return state.secondary_status
    return None


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
            if decision.action == Action.RESUME and self._platform_fault_repeated(decision):
                decision = replace(decision, action=Action.BACKOFF)
            record.action, record.category = decision.action.value, decision.category
            record.failure_class = decision.failure_class.value if decision.action != Action.DONE else None
            record.cause = decision.cause if decision.action != Action.DONE else None
            repeat = self._repeated_without_progress(decision) or self._no_progress(decision)
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
                log.warning("%s (%s): relaunching in %s", decision.category, decision.reason, _duration(delay))
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

    def _no_progress(self, decision: Decision) -> str | None:
        """job.max_attempts_without_progress attempts in a row, ending in any way but done or fatal (a job's own
        failure, a platform fault, no capacity, a hang, a job that stopped itself), committed no newer checkpoint:
        the stage stops, whatever the class. A fault the platform repeats (a deterministic bug on one rank seen as a
        lost peer on the others, a hang, a quota) costs the whole cluster's start-up each time; a stop of the user's
        or a cancelled flow run ends a streak instead (it was deliberate)."""
        if decision.action not in (Action.RESUME, Action.BACKOFF):
            return None
        streak: list[Attempt] = []
        for attempt in reversed(self.attempts):
            if attempt.progressed or _category(attempt) in ("user-stop", "cancelled"):
                break
            streak.append(attempt)
        if len(streak) < self.max_attempts_without_progress:
            return None
        first, last = streak[-1], streak[0]
        causes = ", ".join(dict.fromkeys(_cause(a) for a in reversed(streak)))
        newest = f"step {last.end_step}" if last.end_step else "none"
        return (
            f"{self.stage} stopped: {len(streak)} attempts in a row committed no newer checkpoint (attempts "
            f"{first.attempt}-{last.attempt}: {causes}; newest checkpoint {newest}; job.max_attempts_without_progress="
            f"{self.max_attempts_without_progress}): {(last.reason or last.status).splitlines()[0][:300]}; fix the "
            "cause, or raise job.max_attempts_without_progress to keep relaunching"
        )

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
        """The stage's average throughput over its attempts (each from its first logged step to its last: the figure
        of the final progress line), weighted by the time each spans; None when none was measured."""
        measured = [(a.tokens_per_s, a.training_s) for a in self.attempts if a.tokens_per_s and a.training_s]
        seconds = sum(t for _, t in measured)
        return sum(r * t for r, t in measured) / seconds if seconds else None

    def startup_s(self) -> float | None:
        """Seconds the stage's attempts spent before their first logged step (re-attached ones unknown)."""
        known = [a.startup_s for a in self.attempts if a.startup_s is not None]
        return sum(known) if known else None

    def spent_usd(self) -> float:
        return sum(a.cost_usd for a in self.attempts)

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
        if self.budget_usd is not None and self.spent_usd() >= self.budget_usd:
            raise BudgetExhausted(self._budget_message(current), self.attempts)
        n = used + 1
        name = job_name(self.run_id, n, self.stage)
        # Everything that refuses a submission is asked before the attempt is recorded: a refusal leaves no
        # 'Submitting' attempt behind (`hlat status` would say running).
        self._honour_stop_request(n)
        if self.deadline is not None and self.clock() >= self.deadline:
            raise DeadlinePassed(
                f"{self.stage} stopped at step {current} of {self.target_step}: job.deadline={_iso(self.deadline)} "
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
        """Billed seconds an attempt needs to commit one checkpoint: its start-up (the longest this stage measured,
        else startup_floor_s) and one checkpoint interval at the planned step time. None: not checked."""
        if self.startup_floor_s is None:
            return None
        measured = [a.startup_s for a in self.attempts if a.startup_s]
        return (max(measured) if measured else self.startup_floor_s) + (self.checkpoint_interval_s or 0.0)

    def _check_budget_buys_a_checkpoint(self, spec: JobSpec, current: int) -> None:
        need_s = self.attempt_need_s()
        if self.budget_usd is None or need_s is None or self.price_per_hour <= 0 or self.short:
            return
        hourly = self.price_per_hour * spec.instance_count
        left = self.budget_usd - self.spent_usd()
        need = need_s / 3600 * hourly
        if left >= need:
            return
        ckpt = self.checkpoint_interval_s
        interval = f" + a checkpoint interval {_duration(ckpt)}" if ckpt else ""
        raise BudgetExhausted(
            f"{self.stage} stopped at step {current} of {self.target_step}: job.budget_usd=${self.budget_usd:,.2f} "
            f"has ${left:,.2f} left, {_duration(left / hourly * 3600)} of {spec.instance_count} x "
            f"${self.price_per_hour:,.2f}/h, and a job needs ${need:,.2f} to commit a checkpoint (start-up "
            f"{_duration(need_s - (self.checkpoint_interval_s or 0))}{interval}): nothing submitted; raise "
            "job.budget_usd to go on from the last checkpoint",
            self.attempts,
        )

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
                            f"{self.stage} stopped: job.deadline={_iso(self.deadline)} has passed; set a later "
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
            record.reason = self._hung or f"hung: no step logged for {_duration(self.hang_timeout_s or 0)}"
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
            decision = stored_self_stop(self.run, record.job_name, self.stage) or self._completed_short(record)
            record.reason = decision.reason
        return decision

    def _never_submitted(self, record: Attempt, why: str) -> None:
        """An attempt recorded but never created that will not be now: ended, so no reader takes it for running."""
        record.status, record.reason, record.ended_at = "NotSubmitted", why.splitlines()[0], self.clock()
        record.action = Action.FATAL.value
        if not self.short:
            record.end_step = record.start_step
        self._save()

    def _completed_short(self, record: Attempt) -> Decision:
        """A job that reported success without the checkpoint of the last step. It may have stopped itself (a
        SIGTERM checkpoints and exits 0), so it is resumed; the same ending job.max_repeats times with no newer
        checkpoint stops."""
        newest = self.current_step()
        found = f"step {newest}" if newest is not None else "none"
        logged = record.last_logged_step
        trained = f"the job logged step {logged}" if logged is not None else "the job logged no training step"
        reason = f"completed without a checkpoint at step {self.target_step} (newest: {found}; {trained})"
        return Decision(Action.RESUME, "completed-early", reason)

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
                        f"hung: start-up overran: no first step {_duration(self.startup_timeout_s)} after the job "
                        "reached Training (job.startup_timeout_minutes)"
                    )
                    return "hung"
                return None
            if self.hang_timeout_s and now - last_advance > self.hang_timeout_s:
                self._hung = f"hung: no step logged for {_duration(self.hang_timeout_s)} (job.hang_timeout_minutes)"
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
            if self._absorb(lines, progress, meter, now):
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
            if self.budget_usd is not None and self.spent_usd() >= self.budget_usd:
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

    def _absorb(self, lines: list[str], progress: Progress, meter: Throughput, now: float) -> bool:
        """Forward job output to our log and pick up progress; True when a new step was seen. The trainer's step
        lines go to the debug level only: the progress line sums them up (they stay in the job's own log and in
        metrics.jsonl), and a job logging every step would otherwise fill the terminal."""
        advanced, reading = False, None
        for line in lines:
            parsed = parse_step_line(line)
            if parsed is None:
                job_log.info("%s", line)
                continue
            job_log.debug("%s", line)
            advanced = advanced or parsed.step != progress.step
            progress.step = parsed.step
            progress.loss = parsed.loss
            reading = parsed.tokens_per_s
        if advanced and progress.step is not None:
            meter.observe(now, progress.step, reading)
            progress.tokens_per_s = meter.rate()
            if progress.tokens_per_s:
                progress.eta_s = (self.target_step - progress.step) * self.tokens_per_step / progress.tokens_per_s
        return advanced

    def _account(self, record: Attempt, state: JobState) -> None:
        record.billable_seconds = state.billable_seconds
        record.instance_count = state.instance_count
        record.cost_usd = job_cost(state.billable_seconds, state.instance_count, self.price_per_hour)

    def _platform_fault_repeated(self, decision: Decision) -> bool:
        """A platform fault right after another one, neither attempt getting anywhere: relaunch after a delay (the
        platform may need time: a host replaced, a service recovering), but never give up for it."""
        if decision.failure_class != FailureClass.PLATFORM or len(self.attempts) < 2:
            return False
        last, before = self.attempts[-1], self.attempts[-2]
        return not last.progressed and not before.progressed and _failure_class(before) == FailureClass.PLATFORM

    def _repeated_without_progress(self, decision: Decision) -> str | None:
        """The same failure of the job's own (the same cause: category, record type and step), ending attempt after
        attempt with no newer checkpoint committed between them, job.max_repeats times: it is deterministic (a
        resume is bitwise, so a crash at step 41 comes back at step 41), and relaunching will not help. A NaN is the
        same failure whatever its step: with bf16 stochastic rounding or training.deterministic=False the step it
        comes back at moves, so 'no newer checkpoint' alone judges it. Every class's repeats are bounded too, by
        job.max_attempts_without_progress (`_no_progress`)."""
        if decision.action != Action.RESUME or decision.failure_class != FailureClass.JOB:
            return None
        last = self.attempts[-1]
        same = [last]
        for before in reversed(self.attempts[:-1]):
            if before.end_step != last.end_step or not _same_failure(before, decision):
                break
            same.append(before)
        if len(same) < self.max_repeats:
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
            f"{self.stage} stopped: the same failure repeated with no newer checkpoint: {cause}, "
            f"{len(same)} times (attempts {first.attempt}-{last.attempt}; newest checkpoint {newest}; job.max_repeats="
            f"{self.max_repeats}): {last.reason}{hint}"
        )

    def _user_stop_message(self, record: Attempt) -> str:
        if self.short:
            return f"{self.stage} stopped by hlat stop ({record.job_name}); run the same command to run it again"
        return (
            f"{self.stage} stopped by hlat stop at step {record.end_step or 0} of {self.target_step} (its newest "
            "checkpoint); run the same command to go on from it"
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


# -- following a job ---------------------------------------------------------------------------------------------------
def follow(
    backend: JobBackend,
    record: Attempt,
    save: Callable[[], None],
    poll_seconds: float,
    sleep: Callable[[float], None],
    on_poll: Callable[[list[str], JobState | None], str | None],
    reattached: bool = False,
    heartbeat: Heartbeat | None = None,
    stored_stop: Callable[[], str | None] | None = None,
    record_end: Callable[[JobState], None] | None = None,
    may_act: Callable[[], None] | None = None,
    on_earlier: Callable[[list[str]], None] | None = None,
) -> JobState:
    """Poll a job until it ends. Each poll beats the `heartbeat`, reads the job's new log lines, describes it, and
    hands both to `on_poll` (state None: not visible yet), which may return a reason to stop the job ('budget',
    'hung'). A job seen stopping that someone else stopped (`hlat stop`: the ledger's stop_requested, read through
    `stored_stop`) takes that reason. Interrupting the caller (Ctrl-C, a cancelled flow run: anything that is not an
    Exception) stops the job too: `save` records the stop in the ledger first, and once the job is seen ending
    (within STOP_WAIT_S) `record_end` records its end and `save` keeps it, so the ledger says when it stopped. A job
    `reattached` to (started by an earlier flow run) has its earlier output skipped, said in one line: replayed under
    today's timestamps it read as if the run had started again (`on_earlier` still reads it). `may_act` is asked
    before any stop: it raises (LeaseLost) when this supervisor may no longer stop the job."""

    def stop(why: str) -> None:
        if may_act is not None:
            may_act()
        record.stop_requested = why
        save()
        log.warning("stopping %s (%s)", record.job_name, why)
        backend.stop(record.job_name)

    def adopt_stop(state: JobState | None) -> None:
        """A stop requested from elsewhere (`hlat stop` writes it to the ledger before it stops the job)."""
        stopping = state is not None and (state.terminal or state.status == Status.STOPPING)
        if stopping and stored_stop is not None and record.stop_requested is None:
            with_reason = stored_stop()
            if with_reason:
                record.stop_requested = with_reason

    cursor: Any = None
    try:
        if reattached:
            earlier, cursor = read_logs(backend, record.job_name, cursor)
            if on_earlier is not None:
                on_earlier(earlier)
            if earlier:
                log.info(
                    "%s: its %d earlier log line(s) are in the job's own log, not repeated here; following its new "
                    "output", record.job_name, len(earlier),
                )  # fmt: skip
        while True:
            if heartbeat is not None:
                heartbeat.beat()
            lines, cursor = read_logs(backend, record.job_name, cursor)
            state = describe_patiently(backend, record.job_name, poll_seconds, sleep)
            adopt_stop(state)
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
            try:
                stop("cancelled")
            except LeaseLost as lost:  # another supervisor has the job now: its stop is not this one's to send
                log.warning("not stopping %s: %s", record.job_name, lost)
                raise exc from None
            final = wait_for_end(backend, record.job_name, STOP_WAIT_S, min(poll_seconds, 0.5))
            if final is not None and final.terminal and record_end is not None:
                try:  # the ledger says when the job stopped, not when the next command happens to look
                    record_end(final)
                    save()
                except Exception as err:  # what is recorded must not hide the interruption
                    log.warning("could not record the end of %s: %s", record.job_name, err)
        raise


def end_time(state: JobState, fallback: float) -> float:
    """When the job ended, as its backend recorded it (SageMaker's TrainingEndTime, the local job's status.json:
    `JobState.ended_at` where the backend reports it), else `fallback` (the time it was seen ended)."""
    return state.ended_at if state.ended_at is not None else fallback


STOP_WAIT_S = 30.0
"""How long an interrupted stage waits for its stopped job to end (it checkpoints on SIGTERM first), so that what
the user is told next (the run's newest checkpoint) is what a re-run resumes from. A second Ctrl-C stops waiting;
a SageMaker job that takes longer goes on stopping on its own."""


def wait_for_end(backend: JobBackend, name: str, timeout: float, poll_seconds: float) -> JobState | None:
    """Poll until the job is in a terminal state or `timeout` has passed; its last state (None: unknown)."""
    deadline = time.monotonic() + timeout
    state = None
    try:
        while time.monotonic() < deadline:
            state = backend.describe(name)
            if state is not None and state.terminal:
                break
            time.sleep(poll_seconds)
    except KeyboardInterrupt:  # a second Ctrl-C: stop waiting, the job goes on stopping
        log.warning("not waiting for %s to stop", name)
    except Exception as exc:  # the API is not answering: the stop was sent, the job ends on its own
        log.warning("could not follow %s to its end: %s", name, exc)
    if state is not None and state.terminal:
        log.warning("%s %s", name, state.status.value)
    return state


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
    """New log lines, each as a terminal would leave it (see `as_displayed`); none this time when the log service
    has a transient fault."""
    try:
        lines, cursor = backend.logs(name, cursor)
        return [as_displayed(line) for line in lines], cursor
    except Exception as exc:
        if not is_transient(exc):
            raise
        log.warning("logs of %s: %s; will retry", name, exc)
        return [], cursor


def as_displayed(line: str) -> str:
    """A log line as a terminal shows it: a progress bar (tqdm's, which a library may force on even in a job whose
    output is a file) redraws itself after each carriage return, so only its last state is kept."""
    if "\r" not in line:
        return line
    drawn = [part for part in line.split("\r") if part.strip()]
    return drawn[-1].rstrip() if drawn else ""


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


def announce_resumed(record: Attempt, state: JobState | None) -> None:
    """Say what became of an unfinished attempt found in the ledger: its job is re-attached to, or, when the
    job was never created (the last supervisor stopped before its submission went through), submitted now."""
    if state is None:
        log.info("attempt %d (%s): recorded but never created; submitting it", record.attempt, record.job_name)
    else:
        log.info("re-attaching to attempt %d (%s, %s)", record.attempt, record.job_name, state.status.value)


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


def stored_stop(ledger: Ledger, attempt: int) -> str | None:
    """The stop_requested the ledger holds for `attempt` (a stop requested by another process: `hlat stop`)."""
    try:
        return next((a.stop_requested for a in ledger.load() if a.attempt == attempt), None)
    except Exception as exc:  # storage away for a moment: the next poll looks again
        log.warning("could not read %s: %s", ledger.storage.uri(ledger.rel), exc)
        return None


def stop_live_job(backend: JobBackend, run: Run, stage: str = "train") -> str | None:
    """Stop the stage's unfinished job, if any (the flow's cancellation hook); returns its name."""
    attempts = Ledger(run, stage).load()
    if not attempts or attempts[-1].ended:
        return None
    lease = read_lease(run, stage)
    try:
        now = StorageClock(run.storage, probe=clock_probe_path(stage)).now()
    except Exception:  # a store that cannot be written: judged by this machine's clock
        now = time.time()
    holder = None if lease is None else (lease.get("pid"), lease.get("host"))
    if lease_live(lease, now) and lease is not None and holder != (os.getpid(), socket.gethostname()):
        # Another supervisor (another terminal, a deployment) watches this job: a cancellation here is not its end.
        log.warning("not stopping the %s job: %s supervises it", stage, describe_holder(lease))
        return None
    record = attempts[-1]
    state = backend.describe(record.job_name)
    if state is None or state.terminal:
        return None
    record.stop_requested = "cancelled"
    Ledger(run, stage).save(attempts)
    backend.stop(record.job_name)
    return record.job_name


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
