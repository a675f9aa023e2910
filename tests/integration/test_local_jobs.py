"""The local job backend for real: detached supervisors running the tiny training under the SageMaker contract,
with injected kills, hangs and capacity errors, max runtime, a crashed host, and re-attaching to a running job."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.storage import Storage
from hlat.infra.backends.local import DAEMON_DIED, LocalBackend
from hlat.infra.backends.local_daemon import CheckpointMirror, failure_reason
from hlat.infra.backends.local_faults import FAULTS_ENV
from hlat.infra.backends.protocol import Action, JobSpec, JobState, Status, SubmitError, classify
from hlat.training.checkpoint import CheckpointManager
from tests.jobs import make_run

pytestmark = pytest.mark.slow

CAPACITY = "CapacityError: Unable to provision requested ML compute capacity"
LONG = {"max_steps": 100_000, "checkpoint_every": 5, "eval_every": 0}
TIMEOUT = 180.0  # seconds for a tiny job to get somewhere: generous, for a loaded 2-core machine


def spec_for(run: Path, attempt: int = 1, max_runtime_s: int = 600, **changes: object) -> JobSpec:
    fields: dict[str, object] = {
        "name": f"{run.name}-train-{attempt}",
        "run_id": run.name,
        "attempt": attempt,
        "run_uri": str(run),
        "config_uri": str(run / "config.json"),
        "instance_type": "local",
        "instance_count": 1,
        "processes_per_node": 1,
        "max_runtime_s": max_runtime_s,
        **changes,
    }
    return JobSpec(**fields)  # type: ignore[arg-type]


def wait(backend: LocalBackend, name: str, timeout: float = TIMEOUT, poll: float = 0.2) -> JobState:
    """Poll until the job ends. The bill only grows, to the end (a budget stop relies on it), except for a host that
    crashed: it is billed up to its last sign of life, which may be before the last poll."""
    deadline, billed = time.monotonic() + timeout, 0.0
    while time.monotonic() < deadline:
        state = backend.describe(name)
        assert state is not None
        crashed = state.terminal and DAEMON_DIED in (state.failure_reason or "")
        assert crashed or state.billable_seconds >= billed, f"bill fell: {billed} s, then {state.billable_seconds} s"
        billed = state.billable_seconds
        if state.terminal:
            return state
        time.sleep(poll)
    raise AssertionError(f"{name} still {backend.describe(name)} after {timeout}s:\n{log_text(backend, name)}")


def wait_for_line(backend: LocalBackend, name: str, text: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log_text(backend, name):
            return
        state = backend.describe(name)
        assert state is not None and not state.terminal, f"{state}:\n{log_text(backend, name)}"
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in the log of {name} after {timeout}s:\n{log_text(backend, name)}")


def log_text(backend: LocalBackend, name: str) -> str:
    path = Path(backend.job_dir(name)) / "output.log"
    return path.read_text(errors="replace") if path.exists() else ""


def processes_of(job_dir: str) -> list[int]:
    """Live processes (zombies excluded) whose command line or environment names the job folder."""
    needle = job_dir.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if (
                needle in Path(f"/proc/{entry}/cmdline").read_bytes()
                or needle in Path(f"/proc/{entry}/environ").read_bytes()
            ):
                found.append(int(entry))
        except (OSError, IndexError):
            continue
    return found


def supervisor_pid(backend: LocalBackend, name: str) -> int:
    return int(json.loads((Path(backend.job_dir(name)) / "daemon.json").read_text())["pid"])


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[LocalBackend]:
    """A backend over a fresh jobs folder; whatever a test leaves running is killed afterwards."""
    backend = LocalBackend(str(tmp_path / "jobs"), stop_grace_seconds=20)
    yield backend
    for job in (tmp_path / "jobs").glob("*") if (tmp_path / "jobs").exists() else []:
        for pid in processes_of(str(job)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def latest_checkpoint(run: Path) -> int | None:
    return CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1).latest_step()


def test_a_job_completes_with_its_checkpoints_in_the_run_and_logs_read_once(
    prepared: Path, tmp_path: Path, jobs: LocalBackend
) -> None:
    run = make_run(prepared, tmp_path, "done", max_steps=12, checkpoint_every=5, eval_every=0)
    spec = spec_for(run)
    jobs.submit(spec)
    lines: list[str] = []
    cursor = None
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        state = jobs.describe(spec.name)
        assert state is not None and state.status in (Status.IN_PROGRESS, Status.COMPLETED), state
        new, cursor = jobs.logs(spec.name, cursor)
        lines += new
        if state.terminal:
            break
        time.sleep(0.05)
    lines += jobs.logs(spec.name, cursor)[0]
    assert state is not None and state.status == Status.COMPLETED and state.secondary_status == "Completed", log_text(
        jobs, spec.name
    )
    assert state.billable_seconds > 0 and state.instance_count == 1
    assert lines == log_text(jobs, spec.name).splitlines()  # every line once, in order
    assert any("step 12 loss" in line for line in lines)

    job = Path(jobs.job_dir(spec.name))
    assert (job / "opt/ml/input/data/tokenizer").resolve() == (run / "tokenizer").resolve()
    assert not (job / "opt/ml/checkpoints").exists()  # no CheckpointConfig: the training writes to the run itself
    assert latest_checkpoint(run) == 12
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000000010", "step-000000012"]
    assert any((run / "tensorboard").iterdir())  # a local run gets TensorBoard events in its own folder
    assert classify(state).action == Action.DONE


def test_a_run_on_s3_gets_its_channels_downloaded_and_writes_its_checkpoints_there(
    prepared: Path, tmp_path: Path, jobs: LocalBackend, s3_env: Any
) -> None:
    local = make_run(prepared, tmp_path, "on-s3", max_steps=6, checkpoint_every=3, eval_every=0)
    run = Storage(f"{s3_env.url}/on-s3")
    for path in sorted(local.rglob("*")):
        if path.is_file():
            run.put_file(str(path), path.relative_to(local).as_posix())
    spec = spec_for(local, run_uri=run.url, config_uri=run.uri("config.json"))
    jobs.submit(spec)
    state = wait(jobs, spec.name)
    assert state.status == Status.COMPLETED, log_text(jobs, spec.name)
    tokenizer = Path(jobs.job_dir(spec.name)) / "opt/ml/input/data/tokenizer"
    assert not tokenizer.is_symlink() and (tokenizer / "tokenizer.model").is_file()  # File mode: a copy
    assert CheckpointManager(run.child("checkpoints"), keep_last=1).latest_step() == 6


def test_a_capacity_fault_fails_before_launching(
    prepared: Path, tmp_path: Path, jobs: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = make_run(prepared, tmp_path, "capacity", max_steps=12)
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"1": {"fail": CAPACITY, "after_s": 0.5}}))
    spec = spec_for(run)
    jobs.submit(spec)
    state = wait(jobs, spec.name, timeout=30)
    assert state.status == Status.FAILED and state.failure_reason == CAPACITY
    assert state.billable_seconds >= 0.5
    assert classify(state).action == Action.BACKOFF
    assert "launching" not in log_text(jobs, spec.name)
    assert not (Path(jobs.job_dir(spec.name)) / "opt").exists() and not (run / "checkpoints").exists()

    # The next attempt has no fault; submitting a name twice is refused, like SageMaker's ResourceInUse.
    with pytest.raises(SubmitError) as refused:
        jobs.submit(spec)
    assert refused.value.code == "ResourceInUse"
    with pytest.raises(SubmitError, match="ValidationException"):
        jobs.submit(spec_for(run, name="not/a/name"))
    monkeypatch.setenv(FAULTS_ENV, "{not json")
    with pytest.raises(ValueError, match=FAULTS_ENV):
        jobs.submit(spec_for(run, attempt=2))


def test_a_killed_job_leaves_complete_checkpoints_and_the_next_attempt_resumes(
    prepared: Path, tmp_path: Path, jobs: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = make_run(prepared, tmp_path, "killed", max_steps=40, checkpoint_every=2, eval_every=0, keep_checkpoints=2)
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"1": {"kill_at_step": 30}}))
    first = spec_for(run, attempt=1)
    jobs.submit(first)
    state = wait(jobs, first.name)
    assert state.status == Status.FAILED, log_text(jobs, first.name)
    assert state.failure_reason == "AlgorithmError: training process killed by signal SIGKILL (exit code 137)"
    assert classify(state).action == Action.RESUME
    assert processes_of(jobs.job_dir(first.name)) == []
    resumed_from = latest_checkpoint(run)  # complete, though the mirror may have been mid-checkpoint
    assert resumed_from is not None and resumed_from <= 40

    second = spec_for(run, attempt=2)
    jobs.submit(second)
    state = wait(jobs, second.name)
    assert state.status == Status.COMPLETED, log_text(jobs, second.name)
    assert f"resumed from step {resumed_from}" in log_text(jobs, second.name)
    assert latest_checkpoint(run) == 40


def test_a_nan_exit_is_classified_for_a_resume(prepared: Path, tmp_path: Path, jobs: LocalBackend) -> None:
    run = make_run(prepared, tmp_path, "nan", max_steps=12, checkpoint_every=5, eval_every=0)
    spec = spec_for(run, environment={"HLAT_FAULT_NAN_AT_STEP": "3"})
    jobs.submit(spec)
    state = wait(jobs, spec.name)
    assert state.status == Status.FAILED and state.failure_reason is not None, log_text(jobs, spec.name)
    assert state.failure_reason.startswith("AlgorithmError: ")
    assert classify(state).category == "nan", state.failure_reason


def test_a_hung_job_is_stopped_and_leaves_no_process(
    prepared: Path, tmp_path: Path, jobs: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = make_run(prepared, tmp_path, "hang", **LONG)
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"1": {"hang_at_step": 7}}))
    spec = spec_for(run)
    jobs.submit(spec)
    wait_for_line(jobs, spec.name, "fault: SIGSTOP")
    logged = len(log_text(jobs, spec.name))
    time.sleep(1.0)  # hung: nothing more is logged, and the job is still running as far as anyone can tell
    assert len(log_text(jobs, spec.name)) == logged
    state = jobs.describe(spec.name)
    assert state is not None and state.status == Status.IN_PROGRESS and state.secondary_status == "Training"

    jobs.stop(spec.name)
    state = jobs.describe(spec.name)
    assert state is not None and state.status in (Status.STOPPING, Status.STOPPED)
    state = wait(jobs, spec.name)
    assert state.status == Status.STOPPED and state.secondary_status == "Stopped", log_text(jobs, spec.name)
    assert classify(state, stop_requested=True).action == Action.FATAL
    assert processes_of(jobs.job_dir(spec.name)) == []
    # SIGCONT then SIGTERM: the training saved the step it had reached, and the mirror uploaded it.
    assert "SIGTERM: checkpointing step" in log_text(jobs, spec.name)
    step = latest_checkpoint(run)
    assert step is not None and step >= 7
    jobs.stop(spec.name)  # stopping an ended job is not an error


def test_max_runtime_stops_the_job(prepared: Path, tmp_path: Path, jobs: LocalBackend) -> None:
    run = make_run(prepared, tmp_path, "timeout", **LONG)
    spec = spec_for(run, max_runtime_s=6)
    jobs.submit(spec)
    state = wait(jobs, spec.name)
    assert state.status == Status.STOPPED and state.secondary_status == "MaxRuntimeExceeded", log_text(jobs, spec.name)
    assert state.billable_seconds >= 6
    assert classify(state).action == Action.RESUME
    assert processes_of(jobs.job_dir(spec.name)) == []


def test_a_restarted_flow_reattaches_and_a_dead_supervisor_fails_the_job(
    prepared: Path, tmp_path: Path, jobs: LocalBackend
) -> None:
    run = make_run(prepared, tmp_path, "reattach", **LONG)
    spec = spec_for(run)
    submitter = LocalBackend(jobs.jobs_dir)
    submitter.submit(spec)
    del submitter  # the flow that submitted the job is gone
    wait_for_line(jobs, spec.name, "step 3 loss")
    state = jobs.describe(spec.name)
    assert state is not None and state.status == Status.IN_PROGRESS and state.secondary_status == "Training"
    assert any("step 3 loss" in line for line in jobs.logs(spec.name)[0])

    os.kill(supervisor_pid(jobs, spec.name), signal.SIGKILL)  # the host "crashes"
    deadline = time.monotonic() + 10
    while (state := jobs.describe(spec.name)) is not None and not state.terminal and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state is not None and state.status == Status.FAILED
    assert state.failure_reason == "InternalServerError: the job's daemon process died"
    assert classify(state).action == Action.RESUME
    assert processes_of(jobs.job_dir(spec.name)) == []  # the training went down with its "host"
    jobs.stop(spec.name)  # no supervisor to signal: not an error


def test_dry_run_touches_nothing(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path / "jobs"))
    spec = spec_for(tmp_path / "run", processes_per_node=2, environment={"HLAT_RUN_ID": "run"})
    [request] = backend.dry_run(spec)
    assert not (tmp_path / "jobs").exists()
    job_dir = str(tmp_path / "jobs" / spec.name)
    assert request["backend"] == "local" and request["job_dir"] == job_dir
    assert request["command"][1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert request["command"][-4:] == ["-m", "hlat.training.train", "--config", str(tmp_path / "run" / "config.json")]
    env = request["environment"]
    assert "HLAT_CHECKPOINT_DIR" not in env  # checkpoints go to the run's checkpoints/, as outside a job
    synced = backend.dry_run(spec_for(tmp_path / "run", checkpoint_prefix="checkpoints"))[0]["environment"]
    assert synced["HLAT_CHECKPOINT_DIR"] == f"{job_dir}/opt/ml/checkpoints"  # CheckpointConfig's folder, if asked
    assert env["SM_CHANNEL_DATA"] == f"{job_dir}/opt/ml/input/data/data"
    assert env["HLAT_FAILURE_FILE"] == f"{job_dir}/opt/ml/output/failure"
    assert env["SM_HOSTS"] == '["algo-1"]' and env["TRAINING_JOB_NAME"] == spec.name
    assert env["HLAT_RUN_ID"] == "run"


def test_failure_reasons_follow_sagemaker() -> None:
    assert failure_reason(1, "NonFiniteLoss: loss is nan at step 8\n", []) == (
        "AlgorithmError: NonFiniteLoss: loss is nan at step 8"
    )
    assert "NonFiniteLoss" in failure_reason(3, None, [])
    assert failure_reason(-15, None, []).endswith("killed by signal SIGTERM (exit code 143)")
    assert failure_reason(137, None, []).endswith("killed by signal SIGKILL (exit code 137)")
    assert failure_reason(2, None, ["Traceback", "ValueError: bad"]) == (
        "AlgorithmError: ExecuteUserScriptError: exit code 2\nTraceback\nValueError: bad"
    )


class RecordingStorage(Storage):
    """Storage that notes every upload and removal, in order."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls: list[str] = []

    def put_file(self, local_path: str, rel: str) -> None:
        self.calls.append(f"put {rel}")
        super().put_file(local_path, rel)

    def remove(self, rel: str, recursive: bool = False) -> None:
        self.calls.append(f"remove {rel}")
        super().remove(rel, recursive)


def test_the_mirror_writes_markers_last_and_deletes_them_first(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", RecordingStorage(str(tmp_path / "remote"))
    remote.write_text("step-000000001/train_state.pt", "one")
    remote.write_text("step-000000001/COMMITTED", "{}")
    mirror = CheckpointMirror(str(local), remote)
    assert mirror.download() == 2 and (local / "step-000000001/train_state.pt").read_text() == "one"
    mirror.sync()
    assert remote.calls == []  # what was downloaded is in sync

    (local / "step-000000002").mkdir()
    for name in ("COMMITTED", "meta.json", "train_state.pt"):
        (local / "step-000000002" / name).write_text(name)
    (local / "step-000000001/train_state.pt").write_text("one, saved again")  # a re-save of step 1
    mirror.sync()
    # Step 1's old marker goes before its new file arrives; the markers come last.
    assert remote.calls == [
        "remove step-000000001/COMMITTED",
        "put step-000000001/train_state.pt",
        "put step-000000002/meta.json",
        "put step-000000002/train_state.pt",
        "put step-000000001/COMMITTED",
        "put step-000000002/COMMITTED",
    ]
    assert remote.read_text("step-000000001/train_state.pt") == "one, saved again"

    remote.calls.clear()
    for path in sorted((local / "step-000000001").iterdir()):
        path.unlink()
    (local / "step-000000001").rmdir()
    mirror.sync()
    assert remote.calls[0] == "remove step-000000001/COMMITTED"
    assert remote.list() == ["step-000000002"]  # no empty folder left behind


def test_the_mirror_carries_every_shard_of_a_sharded_checkpoint(tmp_path: Path) -> None:
    """TP 2 x DP 2: two shard files and four rank files in the job's folder reach the URI, and a manager reading
    the URI loads every shard (what a resumed job and the exporter read)."""
    local, remote = tmp_path / "local", Storage(str(tmp_path / "remote"))
    mirror = CheckpointMirror(str(local), remote)
    mirror.download()
    shards = ["tp00-pp00", "tp01-pp00"]
    ranks = [
        CheckpointManager(
            Storage(str(local)), keep_last=2, rank=r, world_size=4, shard=shards[r % 2], shard_writer=r < 2,
            shards=shards, commit_timeout_s=5,
        )
        for r in range(4)
    ]  # fmt: skip
    for rank in (3, 2, 1, 0):  # rank 0, which commits, last: every other file is there by then
        shared = {"model": {"w": torch.full((2,), float(rank))}} if rank < 2 else None
        ranks[rank].save(7, shared, {"loader": {"offset": rank}})
    mirror.sync()
    reader = CheckpointManager(remote, keep_last=2)
    assert reader.latest_step() == 7
    assert reader.shard_names(7) == shards
    loaded = reader.load_shards(7)
    assert [float(loaded[s]["model"]["w"][0]) for s in shards] == [0.0, 1.0]
    resumed = CheckpointManager(remote, keep_last=2, rank=3, world_size=4, shard="tp01-pp00", shards=shards)
    shared, mine = resumed.load(7)
    assert float(shared["model"]["w"][0]) == 1.0 and mine["loader"]["offset"] == 3


def test_two_ranks_under_torchrun_are_stopped_together(
    prepared: Path, tmp_path: Path, jobs: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun starts each rank in a session of its own: the job still reaches, hangs and stops all of them."""
    run = make_run(prepared, tmp_path, "ranks", **LONG, **{"job.processes_per_node": 2})
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"1": {"hang_at_step": 4}}))
    spec = spec_for(run, processes_per_node=2)
    jobs.submit(spec)
    wait_for_line(jobs, spec.name, "fault: SIGSTOP")
    jobs.stop(spec.name)
    state = wait(jobs, spec.name)
    assert state.status == Status.STOPPED, log_text(jobs, spec.name)
    assert processes_of(jobs.job_dir(spec.name)) == []
    assert "rank0 SIGTERM: checkpointing step" in log_text(jobs, spec.name)
    assert "rank1 SIGTERM: checkpointing step" in log_text(jobs, spec.name)
    step = latest_checkpoint(run)
    assert step is not None and step >= 4
