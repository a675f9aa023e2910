"""A ledger written after the fact records when the job ended as its backend recorded it, not when its writer saw
the end: SageMaker's TrainingEndTime, the local job's status.json."""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import boto3

from hlat.core.config import JobConfig
from hlat.infra.backends.local import LocalBackend
from hlat.infra.backends.local_daemon import process_start
from hlat.infra.backends.protocol import JobState, Status
from hlat.infra.backends.sagemaker import SageMakerBackend
from hlat.infra.supervision.watch import end_time


def test_the_backends_end_time_wins_over_the_readers_clock() -> None:
    assert end_time(JobState("j", Status.STOPPED, ended_at=1000.0), fallback=5000.0) == 1000.0
    assert end_time(JobState("j", Status.STOPPED), fallback=5000.0) == 5000.0


def test_sagemaker_reports_its_training_end_time_once_the_job_has_ended() -> None:
    job = JobConfig(backend="sagemaker", instance_type="ml.trn1.32xlarge", region="us-west-2")
    backend = SageMakerBackend(job, boto3.Session(region_name="us-west-2", aws_access_key_id="x",
                                                  aws_secret_access_key="x"))  # fmt: skip
    start, end = datetime(2026, 11, 28, 1, 0, tzinfo=UTC), datetime(2026, 11, 28, 2, 30, tzinfo=UTC)
    desc = {"TrainingJobName": "j", "TrainingJobStatus": "Stopped", "TrainingStartTime": start, "TrainingEndTime": end,
            "ResourceConfig": {"InstanceCount": 4}}  # fmt: skip
    assert backend._state(desc).ended_at == end.timestamp()
    assert backend._state({**desc, "TrainingJobStatus": "Stopping"}).ended_at is None


def test_the_local_backend_reports_the_end_its_job_recorded(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path))
    job_dir = Path(backend.job_dir("j"))
    job_dir.mkdir(parents=True)
    status = {"status": "Stopped", "failure_reason": None, "secondary_status": "Stopped", "started": 100.0,
              "ended": 160.5}  # fmt: skip
    (job_dir / "status.json").write_text(json.dumps(status))
    os.utime(job_dir / "status.json", (150.0, 150.0))  # written before the end it records: the record wins
    state = backend._final_state("j", 1)
    assert state is not None and state.ended_at == 160.5 and state.billable_seconds == 60.5


def test_the_bill_never_falls_when_the_job_ends_between_two_reads(tmp_path: Path) -> None:
    """The daemon reads its clock for the end, then writes status.json; a describe in between sees the job running
    and bills it up to its own, later, clock. The final bill must not be less (it was: 21.539409 s, then
    21.539324 s, in test_local_jobs under load)."""
    backend = LocalBackend(str(tmp_path))
    job_dir = Path(backend.job_dir("j"))
    job_dir.mkdir(parents=True)
    supervisor = subprocess.Popen(["sleep", "60"])
    try:
        started = time.time() - 5
        record = {"pid": supervisor.pid, "process_start": process_start(supervisor.pid), "started": started}
        (job_dir / "daemon.json").write_text(json.dumps(record))
        running = backend.describe("j")
        assert running is not None and running.status == Status.IN_PROGRESS
    finally:
        supervisor.kill()
        supervisor.wait()
    ended = started + running.billable_seconds - 0.05  # the daemon's clock, read just before that describe
    status = {"status": "Completed", "failure_reason": None, "secondary_status": "Completed", "started": started,
              "ended": ended}  # fmt: skip
    (job_dir / "status.json").write_text(json.dumps(status))
    final = backend.describe("j")
    assert final is not None and final.status == Status.COMPLETED
    assert final.billable_seconds >= running.billable_seconds, (running.billable_seconds, final.billable_seconds)
