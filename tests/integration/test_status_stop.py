"""`hlat status` and `hlat stop` from another process, after the command that started the run has died (SIGHUP of
its terminal's session, SIGKILL), on the local backend and on the SageMaker emulator; and what an interrupted run
records: the attempt's end at the stop, its flow run Cancelled, no ERROR line. (The same on the SageMaker emulator:
tests/integration/test_status_stop_emulator.py, among the emulator's files.) Real processes throughout: `hlat run
train` in a session of its own (`setsid`, as a terminal starts it), its job daemon, the training processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hlat.core.layout import heartbeat_path
from hlat.core.run import Run
from hlat.infra.backends.local import LocalBackend
from hlat.infra.supervision.ledger import Ledger
from tests.conftest import SMALL_DATA
from tests.jobs import as_from_a_terminal, make_run, processes_mentioning, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TWO_HOSTS = {"job.instance_count": 2, "job.processes_per_node": 2, "training.micro_batch_size": 2}
TRAINING = {"max_steps": 5000, "checkpoint_every": 4, "keep_checkpoints": 2, "eval_every": 0, "log_every": 1}


def overrides(**extra: Any) -> dict[str, Any]:
    return {**SMALL_DATA, **{f"training.{k}": v for k, v in TRAINING.items()}, "job.poll_seconds": 0.5, **extra}


def new_run(prepared: Path, tmp_path: Path, run_id: str, **extra: Any) -> Path:
    """A run over the prepared data and tokenizer, with the config the CLI is then given (`overrides`)."""
    return make_run(prepared, tmp_path, run_id, **{k: v for k, v in overrides(**extra).items() if k not in SMALL_DATA})


def sets(**extra: Any) -> list[str]:
    return [arg for k, v in overrides(**extra).items() for arg in ("--set", f"{k}={json.dumps(v)}")]


def env_for(tmp_path: Path, api_url: str | None = None) -> dict[str, str]:
    """A user's terminal: the temporary server (no PREFECT_API_URL) or the given API; the test's own log folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), HLAT_LOG_DIR=str(tmp_path / "logs"), OMP_NUM_THREADS="1")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def start_train(
    tmp_path: Path, run_id: str, run: Path, api_url: str | None = None, **extra: Any
) -> tuple[subprocess.Popen[bytes], str]:
    """`hlat run train` in a session of its own, once its job has logged a few steps; (process, job name)."""
    output = (tmp_path / f"{run_id}.out").open("wb")
    flow = subprocess.Popen(
        [str(BIN / "hlat"), "run", "train", "--run-id", run_id, "--storage", str(tmp_path), *sets(**extra)],
        cwd=ROOT,
        env=env_for(tmp_path, api_url),
        stdout=output,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # setsid: its own session and process group, as a terminal's shell starts it
        preexec_fn=as_from_a_terminal,
    )
    ledger = Ledger(Run.at(str(run)), "train")
    wait_for(lambda: any(a.status == "InProgress" for a in ledger.load()), 180, "the job to start")
    name = ledger.load()[0].job_name
    backend = LocalBackend(str(run / "jobs"))
    wait_for(lambda: any(" step 5 loss" in line for line in backend.logs(name)[0]), 180, "a few steps")
    return flow, name


def hlat(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "hlat"), *args, "--storage", str(tmp_path)],
        cwd=ROOT, env=env_for(tmp_path), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def dead_cli_then_status_and_stop(tmp_path: Path, run: Path, run_id: str, sig: signal.Signals, **extra: Any) -> None:
    flow, name = start_train(tmp_path, run_id, run, **extra)
    beat = json.loads((run / heartbeat_path("train")).read_text())
    assert beat["pid"] == flow.pid and beat["host"] == socket.gethostname() and beat["command"] == "hlat run train"
    assert time.time() - beat["beat_at"] < 30 and beat["flow_run_id"]
    live = hlat(tmp_path, "status", run_id)
    assert live.returncode == 0, live.stderr
    assert f"hlat run train, pid {flow.pid} on {socket.gethostname()}" in live.stdout, live.stdout

    os.killpg(flow.pid, sig)  # the terminal closes (SIGHUP to its session's group), or the command is killed
    flow.wait(timeout=60)
    backend = LocalBackend(str(run / "jobs"))
    state = backend.describe(name)
    assert state is not None and not state.terminal  # the job trains on alone

    status = hlat(tmp_path, "status", run_id)
    assert status.returncode == 0, status.stderr
    text = status.stdout
    assert f"job {name} (attempt 1): Training, step " in text and "so far" in text, text
    assert "supervised by: nobody for " in text, text
    assert "train            running" in text and "prepare-data     done" in text, text
    assert len(text.splitlines()) <= 10 and not any(c in text for c in ("e-0", "e+0")), text
    listed = hlat(tmp_path, "status")
    assert listed.returncode == 0 and f"{run_id}, step " in listed.stdout and name in listed.stdout, listed.stdout

    sent = time.time()
    stop = hlat(tmp_path, "stop", run_id)
    assert stop.returncode == 0, stop.stderr
    state = backend.describe(name)
    assert state is not None and state.status == "Stopped"
    from hlat.tasks.train import latest_checkpoint

    step = latest_checkpoint(Run.at(str(run)))
    assert step is not None and step >= 5
    assert f"hlat: {name} (train) ended Stopped" in stop.stdout, stop.stdout
    assert f"the run's newest checkpoint is step {step:,}; run the same command to go on from it" in stop.stdout
    (attempt,) = Ledger(Run.at(str(run)), "train").load()
    assert attempt.stop_requested == "user" and attempt.status == "Stopped" and attempt.end_step == step
    assert attempt.ended_at is not None and sent - 1 <= attempt.ended_at <= time.time()
    assert attempt.billable_seconds > 0 and attempt.action == "resume"
    assert processes_mentioning(str(run)) == []
    after = hlat(tmp_path, "status", run_id)
    assert "stopped by hlat stop" in after.stdout and "supervised by" not in after.stdout, after.stdout


def test_a_killed_command_leaves_its_job_to_status_and_stop_from_another_process(
    prepared: Path, tmp_path: Path
) -> None:
    run = new_run(prepared, tmp_path, "alone")
    dead_cli_then_status_and_stop(tmp_path, run, "alone", signal.SIGKILL)


def test_hlat_stop_ends_the_stage_of_a_live_supervisor_without_a_relaunch(prepared: Path, tmp_path: Path) -> None:
    """`hlat stop` while `hlat run train` still watches its job: the job checkpoints and the command ends, saying how
    to go on, instead of relaunching the job it did not stop itself."""
    run = new_run(prepared, tmp_path, "watched")
    flow, _ = start_train(tmp_path, "watched", run)
    stop = hlat(tmp_path, "stop", "watched")
    assert stop.returncode == 0, stop.stderr
    code = flow.wait(timeout=120)
    out = (tmp_path / "watched.out").read_text()
    (line,) = [line for line in out.splitlines() if line.startswith("hlat: stopped:")]
    assert code == 0 and "train stopped by hlat stop at step " in line and "run the same command to go on" in line
    assert "ERROR" not in out, out[-3000:]  # a deliberate stop: its runs end Cancelled, not Failed
    (attempt,) = Ledger(Run.at(str(run)), "train").load()  # no second job
    assert attempt.stop_requested == "user" and attempt.status == "Stopped" and attempt.ended_at is not None
    assert attempt.reason == "stopped by hlat stop" and attempt.action == "resume"
    assert processes_mentioning(str(run)) == []


def test_ctrl_c_records_the_end_and_cancels_the_flow_run_without_an_error_line(
    prepared: Path, tmp_path: Path, prefect_server: None
) -> None:
    """Ctrl-C: the ledger records the stopped job's end then (it kept 'InProgress' until the next command), and the
    flow and task runs end Cancelled with no 'Crash detected!' ERROR lines (there were three)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL

    run = new_run(prepared, tmp_path, "interrupted-c2")
    flow, _ = start_train(tmp_path, "interrupted-c2", run, api_url=str(PREFECT_API_URL.value()))
    beat = json.loads((run / heartbeat_path("train")).read_text())
    os.killpg(flow.pid, signal.SIGINT)
    code = flow.wait(timeout=120)
    ended = time.time()
    out = (tmp_path / "interrupted-c2.out").read_text()
    assert code == 130, out[-3000:]
    assert "ERROR" not in out and "Crash detected" not in out and "Crashed" not in out, out[-3000:]
    (attempt,) = Ledger(Run.at(str(run)), "train").load()
    assert attempt.status == "Stopped" and attempt.stop_requested == "cancelled" and attempt.action == "resume"
    assert attempt.ended_at is not None and attempt.ended_at <= ended and attempt.billable_seconds > 0
    assert attempt.end_step is not None and attempt.end_step >= 5
    flows = FlowRunFilter(name=FlowRunFilterName(any_=["train/interrupted-c2"]))
    with get_client(sync_client=True) as client:
        (flow_run,) = client.read_flow_runs(flow_run_filter=flows)
        tasks = client.read_task_runs(flow_run_filter=flows)
    assert flow_run.state is not None and flow_run.state.type == StateType.CANCELLED, flow_run.state
    assert str(flow_run.id) == beat["flow_run_id"]
    states = {t.name.rsplit("-", 1)[0]: t.state.type for t in tasks if t.state is not None}
    assert states.get("train-model") == StateType.CANCELLED, states
    assert processes_mentioning(str(run)) == []


def test_hlat_stop_during_a_back_off_prevents_the_next_job(prepared: Path, tmp_path: Path) -> None:
    """The first job, on the SageMaker emulator's two hosts, finds no capacity; its supervisor backs off for 10
    minutes. `hlat stop` then, with no job running, says the stage will not relaunch, and the supervising command
    ends within a poll, submitting nothing more."""
    run = new_run(prepared, tmp_path, "backing-off", **TWO_HOSTS)
    env = {**env_for(tmp_path), "HLAT_LOCAL_FAULTS": json.dumps({"1": {"fail": "CapacityError: none", "after_s": 0}})}
    output = (tmp_path / "backing-off.out").open("wb")
    flow = subprocess.Popen(
        [str(BIN / "hlat"), "run", "train", "--run-id", "backing-off", "--storage", str(tmp_path),
         *sets(**TWO_HOSTS, **{"job.backoff_seconds": [600]})],
        cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    ledger = Ledger(Run.at(str(run)), "train")
    wait_for(lambda: [a.action for a in ledger.load()] == ["backoff"], 180, "the first job's capacity failure")
    lease = json.loads((run / "jobs" / "train-lease.json").read_text())
    assert lease["pid"] == flow.pid and not lease["released"]
    status = hlat(tmp_path, "status", "backing-off")
    assert "train            between attempts" in status.stdout and f"pid {flow.pid}" in status.stdout, status.stdout
    stop = hlat(tmp_path, "stop", "backing-off")
    assert stop.returncode == 0, stop.stderr
    assert "no train job is running" in stop.stdout and "the stage will not relaunch" in stop.stdout, stop.stdout
    assert "nothing to stop" not in stop.stdout
    code = flow.wait(timeout=120)
    out = (tmp_path / "backing-off.out").read_text()
    (line,) = [line for line in out.splitlines() if line.startswith("hlat: stopped:")]
    assert code == 0 and "stopped by hlat stop between attempts" in line, out[-3000:]
    assert [a.attempt for a in ledger.load()] == [1]  # no second job
    assert processes_mentioning(str(run)) == []
