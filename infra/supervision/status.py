"""`hlat status` and `hlat stop`: where a run stands, read from its storage, its job ledgers and its job backend;
and stopping its live job at a checkpoint from any terminal.

Everything here is read from what the run leaves behind, so it works from another terminal, another host, or after
the command that started the run has died: each stage's outputs (core/layout.py), its ledger
(`jobs/<stage>-attempts.json`), the supervisor's heartbeat (`jobs/<stage>-supervisor.json`), the newest line of
metrics.jsonl, and the backend named in the run's config.json (`describe`, `stop`). No Prefect: the CLI activates
an AWS credentials block first when the run names one.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hlat.core.config import HlatConfig
from hlat.core.layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    CheckpointIndex,
    clock_probe_path,
)
from hlat.core.run import Run
from hlat.core.stages import TRAINING, job_stages, stages
from hlat.core.stages import stage as row_of
from hlat.core.storage import Storage, StorageClock
from hlat.infra.backends.protocol import Action, FailureClass, JobBackend, JobState
from hlat.infra.cost.catalog import job_cost, price_per_hour
from hlat.infra.supervision.lease import (
    describe_holder,
    lease_live,
    pid_alive,
    read_heartbeat,
    read_lease,
    request_stop,
)
from hlat.infra.supervision.ledger import USER_STOP, Attempt, Ledger
from hlat.infra.supervision.progress import duration
from hlat.infra.supervision.watch import end_time

STALE_POLLS = 3
"""A heartbeat older than this many of the run's polls (and at least STALE_MIN_S) means nobody supervises."""
STALE_MIN_S = 60.0
STOP_WAIT_S = 600.0
"""How long `hlat stop` waits for the job to end (it checkpoints first); Ctrl-C stops waiting, not the stop."""


class StatusError(ValueError):
    """A run that cannot be found or read: one line naming it and the fix."""


def locate(run: str, storage: str | None = None) -> Storage:
    """The run `run` names: a run id under `storage` (default ./runs), or a run folder or s3:// URI itself."""
    candidates = []
    if storage is not None or not ("/" in run or run.startswith(".")):
        candidates.append(Storage(storage or "./runs").child(run))
    if storage is None and ("/" in run or run.startswith(".")):
        candidates.append(Storage(run.rstrip("/")))
    for candidate in candidates:
        if candidate.exists(CONFIG_FILE):
            return candidate
    where = candidates[0].uri(CONFIG_FILE)
    raise StatusError(f"no run at {where}: name a run id under --storage (default ./runs) or a run folder")


def backend_of(config: HlatConfig, run: Run) -> JobBackend:
    """The backend the run's jobs run on (config.json's job.backend), as its stages made it."""
    from hlat.infra.stage_jobs import backend_for

    return backend_for(run.with_config(config))


def stage_price(config: HlatConfig, name: str) -> float:
    """The node-hour price of the stage's instances (its row's `runs_on`, as in its job spec)."""
    where = row_of(name).runs_on or TRAINING
    return price_per_hour(where.instance_type(config), where.own_price(config))


def attempt_cost(config: HlatConfig, stage: str, attempt: Attempt, state: JobState | None = None) -> float:
    """Dollars of one attempt: the ledger's figure, or its billable seconds (the live ones when given) priced."""
    if state is not None:
        return job_cost(state.billable_seconds, state.instance_count, stage_price(config, stage))
    if attempt.cost_usd:
        return attempt.cost_usd
    return job_cost(attempt.billable_seconds, attempt.instance_count, stage_price(config, stage))


@dataclass
class LiveJob:
    stage: str
    attempt: Attempt
    state: JobState | None
    """The backend's view now (None: not created yet, or gone)."""
    heartbeat: dict[str, Any] | None
    supervised: bool
    beat_age_s: float | None


@dataclass
class RunStatus:
    run_id: str
    uri: str
    config: HlatConfig
    stages: list[tuple[str, str]] = field(default_factory=list)
    """(stage, what it stands at): 'done', 'not started', 'running', 'failed: ...', 'stopped at step N ...'."""
    live: list[LiveJob] = field(default_factory=list)
    leases: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """(stage, lease) of each stage whose supervisor holds a live lease (`jobs/<stage>-lease.json`)."""
    spent_usd: float = 0.0
    step: int | None = None
    loss: float | None = None


def _last_metrics(run: Run) -> dict[str, Any] | None:
    """The newest training record of metrics.jsonl (None: none yet)."""
    if not run.storage.exists(METRICS_FILE):
        return None
    for line in reversed(run.storage.read_text(METRICS_FILE).splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being appended
            continue
        if record.get("loss") is not None:
            return dict(record)
    return None


def _ended(attempt: Attempt) -> str:
    """What an ended attempt's stage stands at: stopped (by whom) or failed (why)."""
    if attempt.stop_requested == USER_STOP:
        return "stopped by hlat stop"
    if attempt.stop_requested == "cancelled":
        return "stopped (interrupted)"
    if attempt.stop_requested in ("budget", "hung"):
        return f"stopped ({attempt.stop_requested})"
    if attempt.status in ("Failed", "NotSubmitted"):
        reason = (attempt.reason or attempt.status).splitlines()[0]
        return f"failed: {reason[:100]}"
    return attempt.status.lower()


def store_now(run: Run, clock: Callable[[], float] = time.time) -> float:
    """Run storage's time now (what leases are stamped with); this machine's clock where the store cannot be
    written (a read-only view of the run)."""
    try:
        return StorageClock(run.storage, probe=clock_probe_path()).now()
    except Exception:
        return clock()


def run_status(run: Run, clock: Callable[[], float] = time.time) -> RunStatus:
    config = run.config
    run_id = run.storage.url.rstrip("/").rsplit("/", 1)[-1]
    status = RunStatus(run_id=run_id, uri=run.storage.url, config=config)
    newest = CheckpointIndex(run.storage.child(CHECKPOINTS_DIR)).latest_step()
    metrics = _last_metrics(run)
    if metrics is not None:
        status.step, status.loss = int(metrics["step"]), float(metrics["loss"])
    backend: JobBackend | None = None
    for row in stages():
        stage, runs_jobs = row.name, row.runs_on is not None
        attempts = Ledger(run, stage).load() if runs_jobs else []
        status.spent_usd += sum(attempt_cost(config, stage, a) for a in attempts if a.ended)
        live = attempts[-1] if attempts and not attempts[-1].ended else None
        lease = read_lease(run, stage) if runs_jobs else None
        held = lease is not None and lease_live(lease, store_now(run, clock))
        if held and lease is not None:
            status.leases.append((stage, lease))
        if live is not None:
            backend = backend or backend_of(config, run)
            state = backend.describe(live.job_name)
            if state is not None:
                status.spent_usd += attempt_cost(config, stage, live, state)
            status.live.append(_live(run, config, stage, live, state, clock()))
            if state is None:
                stood = "submitting" if held else "recorded, never created (the same command submits it)"
            else:
                stood = "running" if not state.terminal else f"ended {state.status.value} (unrecorded)"
        elif held:
            stood = "between attempts (its supervisor is backing off or about to submit)"
        elif row.done(run, config):
            stood = "done"
        elif attempts:
            stood = _ended(attempts[-1])
        else:
            stood = "not started"
        if row.trains and stood != "done" and newest is not None:
            stood += f", checkpoint step {newest:,} of {config.training.max_steps:,}"
        status.stages.append((stage, stood))
    return status


def _live(run: Run, config: HlatConfig, stage: str, attempt: Attempt, state: JobState | None, now: float) -> LiveJob:
    beat = read_heartbeat(run, stage)
    age = None if beat is None else max(0.0, now - float(beat["beat_at"]))
    stale_after = max(STALE_POLLS * config.job.poll_seconds, STALE_MIN_S)
    supervised = beat is not None and age is not None and age <= stale_after
    if supervised and beat is not None and beat.get("host") == socket.gethostname():
        supervised = pid_alive(int(beat.get("pid") or 0))  # a dead process on this host: nobody, at once
    return LiveJob(stage, attempt, state, beat, supervised, age)


def render(status: RunStatus) -> str:
    """A few lines: the run, each stage, the live job(s) with step, loss, cost and supervisor."""
    c = status.config
    lines = [f"run {status.run_id} ({status.uri}), {c.job.backend} backend, ${status.spent_usd:,.2f} spent"]
    width = max(len(s) for s, _ in status.stages)
    lines += [f"  {stage.ljust(width)}  {stood}" for stage, stood in status.stages]
    for live in status.live:
        what = live.state.secondary_status or live.state.status.value if live.state else "not created yet"
        job = f"job {live.attempt.job_name} (attempt {live.attempt.attempt}): {what}"
        if row_of(live.stage).trains and status.step is not None:
            job += f", step {status.step:,} of {c.training.max_steps:,}"
            if status.loss is not None:
                job += f", loss {status.loss:.4f}"
        if live.state is not None:
            job += f", ${attempt_cost(c, live.stage, live.attempt, live.state):,.2f} so far"
        lines.append(f"  {job}")
        lines.append(f"  supervised by: {_supervisor(live)}")
    for stage, lease in status.leases:
        lines.append(f"  {stage} lease {lease.get('token')}: held by {describe_holder(lease)}")
    return "\n".join(lines)


def _supervisor(live: LiveJob) -> str:
    beat, age = live.heartbeat, live.beat_age_s
    if beat is None or age is None:
        return "nobody (no heartbeat recorded); `hlat stop` stops the job, the same command re-attaches to it"
    who = f"{beat.get('command') or 'a supervisor'}, pid {beat.get('pid')} on {beat.get('host')}"
    if beat.get("flow_run_id"):
        who += f", flow run {beat['flow_run_id']}"
    if live.supervised:
        return f"{who}, last beat {duration(age)} ago"
    return f"nobody for {duration(age)} (last: {who}); `hlat stop` stops the job, the same command re-attaches to it"


def list_runs(root: Storage) -> str:
    """One line per run under the storage root: its id, where training stands, what runs now."""
    lines = []
    for name in sorted(root.list()):
        run = Run.of(root.child(name))
        if not run.storage.exists(CONFIG_FILE):
            continue
        try:
            lines.append(_one_line(run, name))
        except Exception as exc:  # one unreadable run must not hide the others
            lines.append(f"{name}: unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    return "\n".join(lines) if lines else f"no runs under {root.url}"


def _one_line(run: Run, name: str) -> str:
    config = run.config
    newest = CheckpointIndex(run.storage.child(CHECKPOINTS_DIR)).latest_step()
    parts = [name, f"step {newest or 0:,} of {config.training.max_steps:,}"]
    for job_stage in job_stages():
        attempts = Ledger(run, job_stage).load()
        if attempts and not attempts[-1].ended:
            parts.append(f"{job_stage} job {attempts[-1].job_name} unfinished")
    last = stages()[-1]
    if last.done(run, config):
        parts.append(f"{last.name} done")
    return ", ".join(parts)


# -- hlat stop ------------------------------------------------------------------------------------------------
@dataclass
class Stopped:
    stage: str
    job_name: str | None
    state: JobState | None
    """Its final state (None: not seen ending within the wait)."""
    step: int | None
    """The run's newest checkpoint afterwards."""
    note: str | None = None
    """What the stop did where no job was there to stop (a supervisor backing off, a job being submitted)."""


def stop_run(
    run: Run,
    wait_s: float = STOP_WAIT_S,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.time,
    say: Callable[[str], None] = lambda text: None,
) -> list[Stopped]:
    """Stop the run's live jobs at a checkpoint: stop_requested 'user' in each ledger first (a supervisor still
    watching then ends its stage instead of relaunching), the backend's stop (SIGTERM; SageMaker StopTrainingJob),
    then wait up to `wait_s` for each to end (a KeyboardInterrupt stops waiting, the jobs go on stopping) and record
    its end in the ledger when no supervisor did."""
    config = run.config
    backend = backend_of(config, run)
    asked: list[tuple[str, Attempt]] = []
    pending: list[Stopped] = []
    now = store_now(run, clock)
    for stage in job_stages():
        ledger = Ledger(run, stage)
        attempts = ledger.load()
        lease = read_lease(run, stage)
        held = lease_live(lease, now)
        unfinished = bool(attempts) and not attempts[-1].ended
        if not unfinished and not held:
            continue
        # First the request (before any stop): a supervisor checks it before each submission, through each
        # back-off and at each poll, so the stage ends whatever moment this finds it in.
        request_stop(run, stage, now)
        holder = f"its supervisor ({describe_holder(lease)})" if held and lease else "no supervisor"
        if not unfinished:
            note = f"no {stage} job is running; {holder} will not submit another: the stage will not relaunch"
            pending.append(Stopped(stage, None, None, None, note))
            continue
        record = attempts[-1]
        state = backend.describe(record.job_name)
        if state is None:  # recorded, not created (yet)
            if held:
                note = f"{record.job_name} ({stage}) is being submitted: {holder} stops it once it exists"
            else:
                note = f"{record.job_name} ({stage}) was recorded but never created: nothing runs"
            pending.append(Stopped(stage, record.job_name, None, None, note))
            continue
        if record.stop_requested is None:
            record.stop_requested = USER_STOP
            ledger.save(attempts)
        if not state.terminal:
            backend.stop(record.job_name)
            say(f"stopping {record.job_name} ({stage}); it saves a checkpoint first")
        asked.append((stage, record))
    results = []
    deadline = time.monotonic() + wait_s
    waiting = True
    for stage, record in asked:
        final: JobState | None = None
        try:
            while waiting:
                final = backend.describe(record.job_name)
                if final is None or final.terminal or time.monotonic() > deadline:
                    break
                time.sleep(poll_s)
        except KeyboardInterrupt:
            waiting = False
            say("not waiting: the job goes on stopping; `hlat status` shows when it has")
        if final is not None and final.terminal:
            _record_stop(run, config, stage, record, final, clock())
        results.append(Stopped(stage, record.job_name, final if final and final.terminal else None, None))
    results += pending
    step = CheckpointIndex(run.storage.child(CHECKPOINTS_DIR)).latest_step()
    for r in results:
        r.step = step
    return results


def _record_stop(run: Run, config: HlatConfig, stage: str, record: Attempt, final: JobState, now: float) -> None:
    """The stopped job's end in its ledger, unless its supervisor recorded it already (it was watching)."""
    ledger = Ledger(run, stage)
    attempts = ledger.load()
    mine = next((a for a in attempts if a.attempt == record.attempt), None)
    if mine is None or mine.ended:
        return
    mine.status = final.status.value
    mine.ended_at = end_time(final, now)
    mine.billable_seconds, mine.instance_count = final.billable_seconds, final.instance_count
    mine.cost_usd = attempt_cost(config, stage, mine, final)
    if row_of(stage).trains:
        mine.end_step = CheckpointIndex(run.storage.child(CHECKPOINTS_DIR)).latest_step() or mine.start_step
    if mine.stop_requested == USER_STOP and final.status.value != "Completed":
        mine.reason = "stopped by hlat stop"
        mine.action, mine.category, mine.cause = Action.RESUME.value, "user-stop", "user-stop"
        mine.failure_class = FailureClass.PLATFORM.value
    ledger.save(attempts)


def stop_summary(results: list[Stopped], run_id: str) -> str:
    if not results:
        return f"hlat: nothing to stop: no job of run {run_id} is running"
    lines = []
    for r in results:
        if r.note is not None:
            lines.append(f"hlat: {r.note}")
            continue
        ended = f"ended {r.state.status.value}" if r.state else "is still stopping (`hlat status` shows when it ends)"
        lines.append(f"hlat: {r.job_name} ({r.stage}) {ended}")
    saved = f"the run's newest checkpoint is step {r.step:,}" if r.step is not None else "no checkpoint yet"
    lines.append(f"hlat: {saved}; run the same command to go on from it")
    return "\n".join(lines)
