"""A stop fits SageMaker's grace: on two emulated SageMaker hosts, StopTrainingJob's SIGTERM (then SIGKILL after
job.stop_grace_seconds = 120 s, as SageMaker's `docker stop -t120`) sent at random moments, inside a step, inside an
async save and inside a checkpoint write, always ends with the checkpoint of the step in progress (or the next)
committed and every rank exiting 0: job status Stopped, no SIGKILL, well before the grace. The steps are slowed to
about 10 s (HLAT_FAULT_STEP_SECONDS, a big model's step) and each checkpoint file's write by 2 s
(HLAT_FAULT_SAVE_SECONDS), with training.log_every=1 only so that the test sees where the job is. Each stop's
relaunch resumes from the stop's checkpoint.

CI runs 2 stops (`HLAT_STOP_EVENTS`); the long version is the same test with more:
`HLAT_STOP_EVENTS=10 .venv/bin/python -m pytest -n 0 -s tests/chaos/test_stop_grace.py` (it prints each stop's
moment, the step it stopped at and the seconds from SIGTERM to the end)."""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest

from hlat.core.layout import CHECKPOINT_MARKER, step_dir
from hlat.core.storage import Storage
from hlat.infra.backends.local import LocalBackend
from hlat.infra.backends.protocol import Status
from hlat.training.checkpoint import CheckpointManager
from tests.integration.test_local_jobs import log_text, spec_for, wait
from tests.jobs import make_run, require_emulator

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_multi_host_job_at_a_time")]

require_emulator()

EVENTS = int(os.environ.get("HLAT_STOP_EVENTS", "2"))
GRACE_S = 120.0  # SageMaker's
STEP_S = 10.0
SAVE_FILE_S = 2.0  # rank 0 writes two files (train_state.pt, its rank file): an async save runs about 4 s
CHECKPOINT_EVERY = 2
# The first two are what CI's two stops cover.
KINDS = ("checkpoint write", "step", "async save")
STEP_LINE = re.compile(r"\bstep (\d+) loss ")


def moment(kind: str, step: int, rng: random.Random) -> float | None:
    """Seconds after the line of `step` to stop at, for a stop of `kind`; None: this step does not serve (the
    checkpoint hook runs right after the line of a step that is a multiple of CHECKPOINT_EVERY)."""
    saves = step % CHECKPOINT_EVERY == 0
    if kind == "async save":  # the background save just begun: staging, its first file
        return rng.uniform(0.1, 1.0) if saves else None
    if kind == "checkpoint write":  # inside the slowed writes of the save
        return rng.uniform(1.5, 2 * SAVE_FILE_S - 0.3) if saves else None
    # inside a step with no save in flight (a save ends about 4 s into the step after its own)
    return rng.uniform(2 * SAVE_FILE_S + 1, STEP_S - 0.5) if saves else rng.uniform(0.5, STEP_S - 0.5)


def steps_logged(log: str) -> list[int]:
    return [int(s) for s in STEP_LINE.findall(log)]


def test_stops_at_random_moments_commit_the_step_in_progress_and_exit_zero_within_the_grace(
    prepared: Path, tmp_path: Path
) -> None:
    run = make_run(
        prepared, tmp_path, "stops", max_steps=100_000, checkpoint_every=CHECKPOINT_EVERY, log_every=1,
        eval_every=0, async_checkpoint=True, micro_batch_size=4,
        **{"job.instance_count": 2, "job.processes_per_node": 1, "job.stop_grace_seconds": GRACE_S},
    )  # fmt: skip
    backend = LocalBackend(str(run / "jobs"), stop_grace_seconds=GRACE_S)
    environment = {"HLAT_FAULT_STEP_SECONDS": str(STEP_S), "HLAT_FAULT_SAVE_SECONDS": str(SAVE_FILE_S)}
    rng = random.Random(20261127)
    plan = [KINDS[i % len(KINDS)] for i in range(EVENTS)]
    checkpoints = CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1)
    resumed_at = 0
    table = []
    for attempt, kind in enumerate(plan, start=1):
        spec = spec_for(run, attempt, instance_count=2, processes_per_node=1, environment=environment)
        backend.submit(spec)
        # The first line of this attempt whose step serves this kind of stop; then the moment inside it.
        deadline = time.monotonic() + 300
        while True:
            assert time.monotonic() < deadline, log_text(backend, spec.name)[-3000:]
            state = backend.describe(spec.name)
            assert state is not None and not state.terminal, log_text(backend, spec.name)[-3000:]
            seen = [s for s in steps_logged(log_text(backend, spec.name)) if s > resumed_at]
            offset = moment(kind, seen[-1], rng) if seen else None
            if offset is not None:
                break
            time.sleep(0.05)
        line_step = seen[-1]
        time.sleep(offset)
        stopped_at = time.monotonic()
        backend.stop(spec.name)
        state = wait(backend, spec.name, timeout=GRACE_S + 60)
        seconds = time.monotonic() - stopped_at
        log = log_text(backend, spec.name)
        status = json.loads((Path(backend.job_dir(spec.name)) / "status.json").read_text())
        assert state.status == Status.STOPPED and status["exit_code"] == 0, log[-3000:]
        assert "after SIGTERM: SIGKILL" not in log, log[-3000:]
        if attempt > 1:
            assert log.count(f"resumed from step {resumed_at} ") == 2, log[-3000:]
        stopped = {int(s) for s in re.findall(r"SIGTERM: checkpointing step (\d+) and exiting", log)}
        assert len(stopped) == 1 and log.count("SIGTERM: checkpointing step") == 2, log[-3000:]  # both ranks
        step = stopped.pop()
        # The step in progress when the stop came (its line not yet logged), or the next.
        assert line_step + 1 <= step <= line_step + 2, (kind, line_step, step)
        assert (run / "checkpoints" / step_dir(step) / CHECKPOINT_MARKER).exists()
        assert checkpoints.latest_step() == step
        assert "the checkpoint is NOT expected to fit" not in log
        own = [float(s) for s in re.findall(r"saved in [\d.]+ s, ([\d.]+) s after this rank's SIGTERM", log)]
        assert len(own) == 2, log[-3000:]
        # Well inside the grace: the rest of a step, the async save in flight, the stop's own save.
        assert seconds < 2 * STEP_S + 4 * SAVE_FILE_S + 15 < GRACE_S / 2, (kind, seconds)
        table.append((attempt, kind, f"{offset:.1f} s after step {line_step}'s line", step, max(own), seconds))
        resumed_at = step
    print("\n| stop | moment | when | stopped at step | SIGTERM to the ranks' exit (s) | stop to Stopped (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for attempt, kind, when, step, own_s, seconds in table:
        print(f"| {attempt} | {kind} | {when} | {step} | {own_s:.1f} | {seconds:.1f} |")
