"""The local backend's SageMaker emulator: 2 hosts x 2 processes of the tiny training, each host with its own /opt/ml
and PID 1, started from the CreateTrainingJob request by the SageMaker SDK's own scripts.

Shown here: what each host is given (as SageMaker lays it out), that today's checkpoint location (the node-local
/opt/ml/checkpoints under CheckpointConfig) cannot commit across hosts while the run's storage can, what a
relaunch copies onto each host, and that StopTrainingJob's SIGTERM reaches the trainer through our init and not
through the SDK's shell.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from hlat.core.layout import CHECKPOINT_MARKER, step_dir
from hlat.infra.backends.local import LocalBackend
from hlat.infra.backends.local_faults import FAULTS_ENV
from hlat.infra.backends.protocol import JobSpec, Status, job_name
from tests.integration.test_local_jobs import log_text, spec_for, wait, wait_for_line
from tests.jobs import make_run, require_emulator

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_multi_host_job_at_a_time")]

require_emulator()

TWO_HOSTS = {"job.instance_count": 2, "job.processes_per_node": 2, "micro_batch_size": 2}
GRACE_S = 15.0
STOP_GRACE_S = 120.0  # SageMaker's (`docker stop -t120`): the stop test may take longer than 15 s on a loaded machine
UNRELATED = "MY_DATABASE_PASS"


def two_host_run(prepared: Path, root: Path, run_id: str, **training: Any) -> Path:
    return make_run(prepared, root, run_id, eval_every=0, **TWO_HOSTS, **training)


def two_host_spec(run: Path, attempt: int = 1, **changes: Any) -> JobSpec:
    return spec_for(run, attempt, instance_count=2, processes_per_node=2, **changes)


def host_ml(backend: LocalBackend, name: str, host: str) -> Path:
    return Path(backend.job_dir(name)) / "hosts" / host / "opt" / "ml"


def received(backend: LocalBackend, name: str) -> dict[str, dict[str, int]]:
    return json.loads((Path(backend.job_dir(name)) / "hosts.json").read_text())["received_bytes"]


@pytest.fixture(scope="module")
def finished(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalBackend, Path, JobSpec]:
    """A 2-host job trained to step 6 (checkpoints at 3 and 6) on the emulator."""
    root = tmp_path_factory.mktemp("emulated")
    run = two_host_run(prepared, root, "two-hosts", max_steps=6, checkpoint_every=3)
    backend = LocalBackend(str(run / "jobs"), stop_grace_seconds=GRACE_S)
    spec = two_host_spec(run)
    # Something of this machine's that is no job's business: the SDK's environment.py logs every variable.
    os.environ[UNRELATED] = "hunter2"
    try:
        backend.submit(spec)
    finally:
        del os.environ[UNRELATED]
    state = wait(backend, spec.name)
    assert state.status == Status.COMPLETED, log_text(backend, spec.name)
    return backend, run, spec


def test_each_host_has_its_own_opt_ml_and_torchrun_is_launched_by_the_sdks_driver(
    finished: tuple[LocalBackend, Path, JobSpec],
) -> None:
    backend, run, spec = finished
    log = log_text(backend, spec.name)
    request = json.loads((Path(backend.job_dir(spec.name)) / "job.json").read_text())["request"]
    assert request["ResourceConfig"]["InstanceCount"] == 2 and "CheckpointConfig" not in request
    for rank, host in enumerate(["algo-1", "algo-2"]):
        ml = host_ml(backend, spec.name, host)
        resources = json.loads((ml / "input/config/resourceconfig.json").read_text())
        assert resources["current_host"] == host and resources["hosts"] == ["algo-1", "algo-2"]
        assert resources["network_interface_name"] == "lo"
        assert json.loads((ml / "input/config/hyperparameters.json").read_text()) == {"config": spec.config_uri}
        channels = json.loads((ml / "input/config/inputdataconfig.json").read_text())
        assert set(channels) == {"data", "tokenizer", "code", "sm_drivers"}
        assert channels["data"]["TrainingInputMode"] == "FastFile"
        # The SDK's scripts, as it uploaded them, run from this host's own channels: sm_train.sh, environment.py
        # (which wrote the SM_* variables from the files above) and the torchrun driver.
        assert (ml / "input/data/sm_drivers/sm_train.sh").is_file() and (ml / "input/sm_training.env").is_file()
        assert (ml / "input/data/code/job_init.py").is_file()
        assert f"[{host}] Executing command: torchrun --nnodes=2 --nproc_per_node=2 --master_addr=algo-1 " in log
        assert f"--master_port=7777 --node_rank={rank} hlat_job.py --config {spec.config_uri}" in log
        assert f"[{host}] SM_CURRENT_HOST={host}" in log
        # Our init is PID 1 in front of the SDK's shell
        assert "python3 /opt/ml/input/data/code/job_init.py /bin/bash -c chmod +x" in log
    assert UNRELATED not in log and "hunter2" not in log  # the container gets credentials and settings, not all
    # The four ranks trained together and rank 0 committed checkpoints whose files came from both hosts.
    meta = json.loads((run / "checkpoints" / step_dir(6) / "meta.json").read_text())
    assert meta["world_size"] == 4
    assert {f"rank-{r:05d}.pt" for r in range(4)} <= set(meta["files"])
    assert (run / "checkpoints" / step_dir(3) / CHECKPOINT_MARKER).exists()


def test_a_relaunch_copies_no_checkpoint_onto_any_host(finished: tuple[LocalBackend, Path, JobSpec]) -> None:
    """The second attempt resumes from step 6 of the run's storage: SageMaker copies nothing of the checkpoint
    history onto the hosts (no CheckpointConfig), and each rank reads only its own files."""
    backend, run, _ = finished
    config = json.loads((run / "config.json").read_text())
    config["training"].update(max_steps=8, schedule_steps=6)  # extended, under the same cosine horizon

    (run / "config.json").write_text(json.dumps(config))
    spec = two_host_spec(run, attempt=2)
    backend.submit(spec)
    state = wait(backend, spec.name)
    assert state.status == Status.COMPLETED, log_text(backend, spec.name)
    log = log_text(backend, spec.name)
    assert log.count("resumed from step 6") == 4
    per_host = received(backend, spec.name)
    assert {host: got["checkpoints"] for host, got in per_host.items()} == {"algo-1": 0, "algo-2": 0}
    # What each rank read at resume: the shared state (rank 0's host and the other alike) and its own rank file.
    reads = {int(r): int(b) for r, b in re.findall(r"rank(\d) resumed from step 6 .*\(read (\d+) bytes\)", log)}
    meta = json.loads((run / "checkpoints" / step_dir(6) / "meta.json").read_text())["files"]
    assert reads == {r: meta["train_state.pt"]["size"] + meta[f"rank-{r:05d}.pt"]["size"] for r in range(4)}
    assert (run / "checkpoints" / step_dir(8) / CHECKPOINT_MARKER).exists()


def test_todays_checkpoint_location_cannot_commit_across_hosts(prepared: Path, tmp_path: Path) -> None:
    """The defect this emulator exists to show: with CheckpointConfig and the checkpoints written to the node-local
    /opt/ml/checkpoints (what the job did before), rank 0 on algo-1 never sees the rank files of algo-2."""
    run = two_host_run(prepared, tmp_path, "node-local", max_steps=6, checkpoint_every=3, commit_timeout_s=10)
    seed = run / "checkpoints" / "earlier.txt"  # something already under the prefix: copied onto every host
    seed.parent.mkdir()
    seed.write_text("x" * 1000)
    backend = LocalBackend(str(run / "jobs"), stop_grace_seconds=GRACE_S)
    spec = two_host_spec(
        run, checkpoint_prefix="checkpoints", environment={"HLAT_CHECKPOINT_DIR": "/opt/ml/checkpoints"}
    )
    backend.submit(spec)
    state = wait(backend, spec.name)
    assert state.status == Status.FAILED
    log = log_text(backend, spec.name)
    folder = "/opt/ml/checkpoints/step-000000003"
    missing = rf"not committing {folder}: rank-00002\.pt, rank-00003\.pt(, manifest-0000[23]\.json)* missing"
    assert re.search(missing, log), log[-3000:]
    assert "by host: algo-2: ranks 2, 3" in log  # the checkpoint manager names the missing ranks' host
    assert state.failure_reason is not None and "not committing" in state.failure_reason
    # CheckpointConfig per host: the prefix copied into each host's own folder at start, each host's writes
    # uploaded to the prefix; no host ever holds another's files, and nothing was committed.
    copied = {h: got["checkpoints"] for h, got in received(backend, spec.name).items()}
    assert copied == {"algo-1": 1000, "algo-2": 1000}
    own = {"algo-1": {"rank-00000.pt", "rank-00001.pt", "train_state.pt"}, "algo-2": {"rank-00002.pt", "rank-00003.pt"}}
    for host, files in own.items():
        local = host_ml(backend, spec.name, host) / "checkpoints"
        assert (local / "earlier.txt").exists()
        assert {p.name for p in (local / step_dir(3)).iterdir() if p.suffix == ".pt"} == files
    uploaded = {p.name for p in (run / "checkpoints" / step_dir(3)).iterdir() if p.suffix == ".pt"}
    assert uploaded == own["algo-1"] | own["algo-2"]


def stop_after(backend: LocalBackend, spec: JobSpec, step: int) -> float:
    """Submit, stop once `step` is logged; the seconds from the stop to the job's end."""
    backend.submit(spec)
    wait_for_line(backend, spec.name, f"step {step} loss")
    started = time.monotonic()
    backend.stop(spec.name)
    state = wait(backend, spec.name)
    assert state.status == Status.STOPPED, log_text(backend, spec.name)
    return time.monotonic() - started


def test_a_stop_reaches_the_ranks_of_every_host_through_our_init(prepared: Path, tmp_path: Path) -> None:
    run = two_host_run(prepared, tmp_path, "stopped", max_steps=100_000, checkpoint_every=1000)
    backend = LocalBackend(str(run / "jobs"), stop_grace_seconds=STOP_GRACE_S)
    spec = two_host_spec(run)
    seconds = stop_after(backend, spec, 3)
    log = log_text(backend, spec.name)
    assert log.count("job_init: SIGTERM: stopping the job's ranks") == 2  # each host's PID 1
    stopped = {int(s) for s in re.findall(r"rank\d SIGTERM: checkpointing step (\d+) and exiting", log)}
    assert len(stopped) == 1 and log.count("SIGTERM: checkpointing step") == 4  # every rank, the same step
    step = stopped.pop()
    assert (run / "checkpoints" / step_dir(step) / CHECKPOINT_MARKER).exists()
    assert "after SIGTERM: SIGKILL" not in log and seconds < STOP_GRACE_S


def test_the_sdks_shell_as_pid_1_never_passes_the_stop_on(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without our init the SDK's `/bin/bash -c ... sm_train.sh` is PID 1: it has no SIGTERM handler, so the kernel
    drops the signal; SIGKILL ends the job after the grace period and the steps since the last checkpoint are lost."""
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"1": {"sdk_entrypoint": True}}))
    run = two_host_run(prepared, tmp_path, "sdk-shell", max_steps=100_000, checkpoint_every=1000)
    backend = LocalBackend(str(run / "jobs"), stop_grace_seconds=5)
    seconds = stop_after(backend, two_host_spec(run), 3)
    log = log_text(backend, f"{run.name}-train-1")
    assert "job_init" not in log and "SIGTERM: checkpointing" not in log
    assert "still running 5s after SIGTERM: SIGKILL" in log and seconds >= 5
    assert not (run / "checkpoints").exists()


def test_precompile_on_both_hosts_feeds_the_training_on_both_hosts(prepared: Path, tmp_path: Path) -> None:
    """torch.compile's cache, built by a precompile job of two instances into the run's compile-cache/, is read by
    the training job's ranks on both instances, as every node reads it from S3 on SageMaker."""
    run = make_run(
        prepared, tmp_path, "compiled", compile=True, max_steps=3, eval_every=0, checkpoint_every=100,
        **{"job.instance_count": 2, "job.processes_per_node": 1, "micro_batch_size": 4},
    )  # fmt: skip
    backend = LocalBackend(str(run / "jobs"), stop_grace_seconds=GRACE_S)
    spec = spec_for(
        run, name=f"{run.name}-precompile-1", instance_count=2, stage="precompile", entry="hlat.training.precompile"
    )
    backend.submit(spec)
    state = wait(backend, spec.name, timeout=600)
    assert state.status == Status.COMPLETED, log_text(backend, spec.name)
    assert "[algo-1] precompile: 4 steps traced" in log_text(backend, spec.name)  # precompile.steps
    assert (run / "compile-cache" / "latest.json").exists()
    train_spec = spec_for(run, instance_count=2)
    backend.submit(train_spec)
    state = wait(backend, train_spec.name, timeout=600)
    assert state.status == Status.COMPLETED, log_text(backend, train_spec.name)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["compile_cache"] == "hit", first


def test_the_tiny_dag_runs_on_two_emulated_hosts_and_is_cached_on_rerun(
    prefect_server: None, tmp_path: Path, small_run: dict[str, Any]
) -> None:
    """`hlat pretrain --preset tiny --set job.instance_count=2 --set job.processes_per_node=2 ...`, in process:
    burn-in and training on two emulated hosts (prepare-data and evaluation stay one-instance jobs)."""
    from hlat.flows.pretrain import hlat

    overrides = {**small_run, **{f"job.{k}": v for k, v in (("instance_count", 2), ("processes_per_node", 2))}}
    overrides["training.micro_batch_size"] = 2
    first = hlat(preset="tiny", overrides=overrides, storage=str(tmp_path))
    run = tmp_path / first["run_id"]
    jobs = run / "jobs"
    for stage in ("burn-in", "train"):
        assert (jobs / job_name(first["run_id"], 1, stage) / "hosts" / "algo-2" / "opt" / "ml").is_dir(), stage
    # Burn-in: every rank's checks, the hosts by their names, one write to the run's checkpoint store per host.
    report = json.loads((run / "burn-in" / "report.json").read_text())
    assert report["passed"] and report["world_size"] == 4 and report["hosts"] == ["algo-1", "algo-2"]
    rows = {r["rank"]: r for r in report["ranks"]}
    assert [rows[r]["host"] for r in range(4)] == ["algo-1", "algo-1", "algo-2", "algo-2"]
    assert [rows[r]["write_mbps"] is not None for r in range(4)] == [True, False, True, False]
    assert (run / "checkpoints" / step_dir(12) / CHECKPOINT_MARKER).exists()
    assert (run / "eval" / "results.json").is_file()
    listing = sorted(p.name for p in jobs.iterdir())

    second = hlat(preset="tiny", overrides=overrides, storage=str(tmp_path))
    assert second["run_id"] == first["run_id"]
    assert sorted(p.name for p in jobs.iterdir()) == listing  # no job was launched again: every stage cached
