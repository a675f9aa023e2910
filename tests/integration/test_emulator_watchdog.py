"""A hung job ends itself on the SageMaker emulator with no supervisor alive: 2 emulated hosts, rank 1 (on algo-2)
blocks for good once step 3 is launched (HLAT_FAULT_HANG_AT_STEP), rank 0 then waits in step 4's gradient
all-reduce for it. Nothing in the job is a stop: only the in-job watchdog (training/watchdog.py, job.watchdog=8 s)
ends it, with a HangDetected failure record as the job's FailureReason and every thread's stack in its log. The job
is submitted through the local backend directly: no supervisor runs, none relaunches it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hlat.core.contract import EXIT_HUNG, parse_failure_record
from hlat.infra.backends.local import LocalBackend
from hlat.infra.backends.local_daemon import job_processes
from hlat.infra.backends.protocol import Status
from tests.integration.test_local_jobs import log_text, spec_for, wait, wait_for_line
from tests.jobs import make_run, require_emulator

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_multi_host_job_at_a_time")]

require_emulator()

BOUND_S = 8.0
HANG = "fault: rank 1 hangs in step 3"


def test_a_rank_that_hangs_ends_the_job_through_the_watchdog_with_its_stacks_and_no_supervisor(
    prepared: Path, tmp_path: Path
) -> None:
    run = make_run(
        prepared, tmp_path, "hang", eval_every=0, max_steps=100_000, checkpoint_every=1000, log_every=1,
        micro_batch_size=1, global_batch_size=2,
        **{"job.instance_count": 2, "job.processes_per_node": 1, "job.watchdog": BOUND_S},
    )  # fmt: skip
    backend = LocalBackend(str(run / "jobs"), stop_grace_seconds=5)
    spec = spec_for(run, instance_count=2, environment={"HLAT_FAULT_HANG_AT_STEP": "3:1"})
    backend.submit(spec)
    wait_for_line(backend, spec.name, HANG, timeout=180)
    hung_at = time.monotonic()
    state = wait(backend, spec.name, timeout=90)
    seconds = time.monotonic() - hung_at
    log = log_text(backend, spec.name)
    assert state.status == Status.FAILED, log[-4000:]
    # The bound, the watchdog's tick (a tenth of it), the other host killed 5 s after the first failed, polls.
    assert seconds < BOUND_S + 1 + 5 + 10, (seconds, log[-4000:])
    record = parse_failure_record(state.failure_reason)
    assert record is not None and record.type == "HangDetected", state.failure_reason
    assert record.message.startswith("no step for ") and "(bound 8 s, job.watchdog)" in record.message, record
    assert record.step in (2, 3), record
    assert f"exit {EXIT_HUNG}" in log, log[-4000:]
    # Every thread's stack, in the job's log: the hung rank's shows where it blocks.
    assert "every thread's stack follows" in log and "Current thread 0x" in log, log[-4000:]
    assert "in hang_at_step" in log and "Thread 0x" in log, log[-4000:]
    # No step after the hang, no stop, nothing left running.
    assert "step 4 loss" not in log and "checkpointing step" not in log
    assert job_processes(backend.job_dir(spec.name)) == []
    print(f"\nrank 1 hung in step 3: the job ended Failed {seconds:.1f} s later: {state.failure_reason[:200]}")
