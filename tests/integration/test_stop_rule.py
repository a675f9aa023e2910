"""A training job nobody watches stops itself: real tiny jobs on the local backend, submitted as the train stage
submits them (`job_spec`, the stop terms in their environment) with no supervisor polling them, run out of budget,
reach the run's deadline or lose their supervisor's heartbeat, and stop at a checkpoint with exit 0 and a record
saying why, which `classify` turns into a deliberate stop; a relaunch resumes from that checkpoint."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from hlat.core.config import HlatConfig
from hlat.core.contract import (
    STOP_BUDGET,
    STOP_DEADLINE,
    STOP_UNSUPERVISED,
    StopRecord,
    parse_stop_record,
    read_job_config,
)
from hlat.core.layout import heartbeat_path, stop_record_path
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.infra.backends.local import LocalBackend
from hlat.infra.backends.protocol import Action, FailureClass, JobState, Status, classify, stored_self_stop
from hlat.infra.cost.catalog import job_cost
from hlat.infra.stage_jobs import job_spec
from hlat.training.faults import STEP_SECONDS
from hlat.training.stop_rule import _when
from tests.integration.test_local_jobs import jobs, latest_checkpoint, log_text, wait, wait_for_line
from tests.jobs import make_run

__all__ = ["jobs"]  # the fixture

# A tiny job of many paced steps (a checkpoint every 5): it ends only when something stops it.
LONG = {"max_steps": 100_000, "checkpoint_every": 5, "eval_every": 0, "log_every": 1}
PACE = "0.2"  # seconds per step: a few steps a second, so a stop lands mid-run


def beat(run: Storage, at: float) -> None:
    """The supervisor's heartbeat, as infra/supervision/lease.py writes it."""
    heartbeat = {"beat_at": at, "pid": 4242, "host": "gone", "flow_run_id": None, "command": "hlat pretrain"}
    run.write_json(heartbeat_path("train"), heartbeat)


def submit(jobs: LocalBackend, config: HlatConfig, run: Path, attempt: int, spent_usd: float = 0.0) -> str:
    spec = job_spec(Run.at(str(run), config, run.name), attempt, spent_usd=spent_usd, submitted_at=time.time())
    jobs.submit(spec)
    return spec.name


def stopped_itself(jobs: LocalBackend, name: str, run: Path, why: str) -> tuple[JobState, StopRecord]:
    """The job ended Completed (exit 0) with a stop record for `why`, at the run's newest checkpoint."""
    state = wait(jobs, name)
    text = log_text(jobs, name)
    assert state.status == Status.COMPLETED, text
    record = parse_stop_record(text)
    assert record is not None and record.why == why, text
    assert latest_checkpoint(run) == record.step and record.step >= 1
    assert Storage(str(run)).read_json(stop_record_path("train"))["why"] == why
    stored = stored_self_stop(Run.at(str(run)), name)  # what a supervisor that missed the log reads
    assert stored is not None and stored.category == why
    return state, record


@pytest.mark.slow
def test_a_job_past_its_budget_with_no_supervisor_stops_itself_and_a_relaunch_resumes(
    prepared: Path, tmp_path: Path, jobs: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$30 at $3,600/h: 30 s of the job's bill from its submission, less the stop's margin (job.stop_grace_seconds,
    20 s, while the async saves are not timed), so it stops after 10 s or its first step, whichever comes later;
    the platform's own max runtime would stop it 20 s after the budget ran out. (A loaded 2-core machine may take
    15 s to start a job.)"""
    overrides = {"job.budget_usd": 30, "job.price_per_hour_usd": 3600, "job.stop_grace_seconds": 20}
    run = make_run(prepared, tmp_path, "budget", **LONG, **overrides)
    config = read_job_config(str(run / "config.json")).config
    monkeypatch.setenv(STEP_SECONDS, PACE)
    beat(Storage(str(run)), time.time())  # one heartbeat, never another
    first = submit(jobs, config, run, 1)
    state, record = stopped_itself(jobs, first, run, STOP_BUDGET)
    assert record.message.endswith(f"stopped at step {record.step}, checkpointed; raise job.budget_usd to go on")
    decision = classify(state, log_tail=log_text(jobs, first))
    assert (decision.action, decision.failure_class, decision.category) == (Action.FATAL, FailureClass.FATAL, "budget")
    assert "job.budget_usd" in decision.reason

    # Relaunched with a deadline instead (and what the first job cost as spent): it resumes from that checkpoint
    # and stops at the deadline, past it.
    spent = job_cost(state.billable_seconds, 1, 3600)
    later = config.model_copy(
        update={"job": config.job.model_copy(update={"budget_usd": None, "deadline": _deadline(30)})}
    )
    second = submit(jobs, later, run, 2, spent_usd=spent)
    _, again = stopped_itself(jobs, second, run, STOP_DEADLINE)
    assert f"resumed from step {record.step} of" in log_text(jobs, second)
    assert again.step > record.step
    assert "set a later job.deadline to go on" in again.message
    assert classify(wait(jobs, second), log_tail=log_text(jobs, second)).category == "deadline"


def _deadline(seconds: float) -> datetime:
    return datetime.fromtimestamp(time.time() + seconds, UTC)


@pytest.mark.slow
def test_a_job_whose_supervisor_went_silent_stops_itself(
    prepared: Path, tmp_path: Path, jobs: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor beats each second while the job trains, then dies: the job stops 6 s after the last beat
    (job.unsupervised_stop_minutes=0.1), and its record names that beat."""
    run = make_run(prepared, tmp_path, "orphan", **LONG, **{"job.unsupervised_stop_minutes": 0.1})
    config = read_job_config(str(run / "config.json")).config
    monkeypatch.setenv(STEP_SECONDS, PACE)
    storage = Storage(str(run))
    beat(storage, time.time() - 86_400)  # an earlier supervisor's, long dead: the submission is newer
    dead = threading.Event()
    last: list[float] = []

    def supervise() -> None:
        while not dead.wait(1.0):
            last.append(time.time())
            beat(storage, last[-1])

    supervisor = threading.Thread(target=supervise, daemon=True)
    name = submit(jobs, config, run, 1)
    supervisor.start()
    try:
        wait_for_line(jobs, name, "step 40 loss")  # 8 s of steps, over the 6 s timeout: no stop while it beats
        assert parse_stop_record(log_text(jobs, name)) is None
    finally:
        dead.set()
        supervisor.join()
    state, record = stopped_itself(jobs, name, run, STOP_UNSUPERVISED)
    assert f"since {_when(last[-1])}" in record.message, record.message
    assert "job.unsupervised_stop_minutes" in record.message
    decision = classify(state, log_tail=log_text(jobs, name))
    assert (decision.action, decision.failure_class) == (Action.RESUME, FailureClass.PLATFORM)
