"""Failures judged from their causes on the SageMaker emulator (2 hosts): a rank SIGKILLed before its first step
writes no failure record, SageMaker's FailureReason is the SDK driver's CalledProcessError, and torchrun's own
account of the signal in the log says what happened. Three jobs in a row killed that way are each relaunched (a
platform fault, backed off when it repeats) and the fourth trains to the end: job.max_attempts_without_progress is 4
here, since with its default of 3 the stage stops after the third attempt that gained nothing, whatever the class
(tests/unit/test_supervisor_control.py, and tests/scale's scenario 2 at 256 hosts)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from hlat.core.presets import load_config
from hlat.core.storage import Storage
from hlat.infra.backends.local_daemon import job_processes
from hlat.infra.backends.protocol import job_name
from hlat.training.checkpoint import CheckpointManager
from tests.conftest import SMALL_DATA
from tests.jobs import environ_of, make_run, require_emulator

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_multi_host_job_at_a_time")]

require_emulator()

TRAINING = {"max_steps": 3, "checkpoint_every": 3, "eval_every": 0, "micro_batch_size": 2}
JOB = {
    "job.instance_count": 2, "job.processes_per_node": 1, "job.poll_seconds": 0.5, "job.backoff_seconds": [1, 2],
    "job.max_attempts_without_progress": 4,
}  # fmt: skip


def kill_first_rank(job_dir: str, timeout: float = 180) -> float:
    """SIGKILL the first rank that appears in the job (torchrun has just started it: it is still importing torch,
    long before its first step); the seconds it took to appear."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        ranks = [p for p in job_processes(job_dir) if "LOCAL_RANK" in environ_of(p)]
        if ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(ranks[0], signal.SIGKILL)
                return time.monotonic() - started
        time.sleep(0.05)
    raise TimeoutError(f"no rank appeared in {job_dir}")


def test_a_rank_killed_before_its_first_step_in_three_jobs_in_a_row_is_retried_each_time(
    prepared: Path, tmp_path: Path
) -> None:
    from hlat.core.run import Run
    from hlat.infra.stage_jobs import jobs_dir, supervisor_for

    run_id = "killed-early"
    run = make_run(prepared, tmp_path, run_id, **TRAINING, **JOB)
    config = load_config(
        "tiny", {**SMALL_DATA, **{f"training.{k}": v for k, v in TRAINING.items()}, **JOB}, run_id=run_id,
        storage=str(tmp_path),
    )  # fmt: skip

    def latest() -> int | None:
        return CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1).latest_step()

    stage_run = Run.at(str(run), config, run_id)
    sup = supervisor_for(stage_run, current_step=latest)
    killed: list[float] = []

    def killer() -> None:
        for attempt in (1, 2, 3):
            killed.append(kill_first_rank(os.path.join(jobs_dir(stage_run), job_name(run_id, attempt))))

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    attempts = sup.run_to_completion()
    thread.join(timeout=5)
    assert len(killed) == 3, killed
    assert [a.failure_class for a in attempts] == ["platform", "platform", "platform", None], [
        (a.category, a.reason) for a in attempts
    ]
    assert [a.category for a in attempts[:3]] == ["killed"] * 3, [a.reason for a in attempts]
    assert [a.action for a in attempts] == ["resume", "backoff", "backoff", "done"]
    assert latest() == TRAINING["max_steps"]
