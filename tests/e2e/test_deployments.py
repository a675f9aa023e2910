"""Deployments for real: a `prefect server` and a process worker started here, flows run through them.

This is how users drive the pipeline from the Prefect UI: `prefect deploy` from deployments/prefect.yaml,
then `prefect deployment run <flow>/<deployment>` picked up by a worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SMALL_DATA, SMALL_RUN
from tests.integration.conftest import free_port
from tests.jobs import default_sigint, make_run, processes_mentioning

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"prefect server at {url} did not answer /health in {timeout} s")


def interrupt(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGINT, then SIGKILL after `grace` seconds."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def prefect_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real `prefect server start` on 127.0.0.1 with its own PREFECT_HOME; yields the env to reach it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_WORKER_PREFETCH_SECONDS="1",
        HLAT_PROJECT_DIR=str(ROOT),
    )
    log = (home / "server.log").open("wb")
    server = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=log,
        preexec_fn=default_sigint,  # it stops on SIGINT
    )
    try:
        wait_healthy(env["PREFECT_API_URL"], server)
        yield env
    finally:
        interrupt(server, grace=20)
        log.close()


def prefect(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [PREFECT, "--no-prompt", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def run_states(api_url: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Flow-run names with their states, and task-run (name, state) oldest first, read from the server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import TaskRunSort
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(limit=50)
        task_runs = client.read_task_runs(sort=TaskRunSort.EXPECTED_START_TIME_ASC, limit=200)
    flows = [(r.name, r.state.name if r.state else "?") for r in flow_runs]
    return flows, [(t.name, t.state.name if t.state else "?") for t in task_runs]


@pytest.fixture(scope="module")
def deployed(prefect_env: dict[str, str]) -> str:
    """Work pools created and every deployment of deployments/prefect.yaml registered; the deploy output."""
    prefect(prefect_env, "work-pool", "create", "hlat-local", "--type", "process")
    prefect(prefect_env, "work-pool", "create", "hlat-aws", "--type", "process")  # registered only: nothing runs on it
    return prefect(prefect_env, "deploy", "--all", "--prefect-file", "deployments/prefect.yaml").stdout


@pytest.fixture
def worker(prefect_env: dict[str, str], deployed: str, tmp_path: Path) -> Iterator[None]:
    """A process worker on the local pool, stopped (SIGINT) at the end of the test."""
    log = (tmp_path / "worker.log").open("wb")
    proc = subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", "hlat-local", "--limit", "1"],
        env=prefect_env,
        cwd=ROOT,
        stdout=log,
        stderr=log,
        preexec_fn=default_sigint,  # a worker stops on SIGINT
    )
    try:
        yield
    finally:
        interrupt(proc, grace=30)
        log.close()


def test_deploy_then_run_the_dag_and_a_stage_through_a_worker(
    prefect_env: dict[str, str], deployed: str, worker: None, tmp_path: Path
) -> None:
    env = prefect_env
    for name in (
        "hlat/pretrain-tiny",
        "precompile/precompile-tiny",
        "burn-in/burn-in-tiny",
        "train/train-tiny",
        "evaluate/evaluate-tiny",
        "hlat/pretrain-7b",
        "burn-in/burn-in-7b",
        "train/train-7b",
        "hlat/pretrain-70b",
    ):
        assert name in deployed
    storage = str(tmp_path / "runs")
    params = ["--param", f"storage={storage}", "--param", "run_id=e2e", "--param", f"overrides={json.dumps(SMALL_RUN)}"]
    prefect(env, "deployment", "run", "hlat/pretrain-tiny", *params, "--watch", "--watch-timeout", "400", timeout=450)
    run = tmp_path / "runs" / "e2e"
    assert (run / "data/manifest.json").is_file() and (run / "tokenizer/tokenizer.model").is_file()
    assert (run / "checkpoints/step-000000012/COMMITTED").is_file()
    assert json.loads((run / "eval/results.json").read_text())["step"] == 12 and (run / "eval/report.md").is_file()
    model = (run / "tokenizer/tokenizer.model").read_bytes()

    # A stage re-run alone from its own deployment finds its work cached and leaves the outputs as they were.
    prefect(env, "deployment", "run", "train-tokenizer/train-tokenizer-tiny", *params, "--watch", timeout=300)
    assert (run / "tokenizer/tokenizer.model").read_bytes() == model
    flows, tasks = run_states(env["PREFECT_API_URL"])
    assert sorted(name for name, _ in flows) == [
        "burn-in/e2e",
        "evaluate/e2e",
        "hlat/e2e",
        "precompile/e2e",
        "prepare-data/e2e",
        "train-tokenizer/e2e",
        "train-tokenizer/e2e",
        "train/e2e",
    ]
    assert {state for _, state in flows} == {"Completed"}
    assert [state for name, state in tasks if name.startswith("fit-tokenizer")] == ["Completed", "Cached"]


def test_cancelling_a_train_run_stops_its_job(
    prefect_env: dict[str, str], worker: None, prepared: Path, tmp_path: Path
) -> None:
    """Cancel from the API (as from the UI) while the job trains: the job is stopped, no process is left."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from infra.local_jobs import LocalBackend
    from infra.storage import Storage
    from infra.supervisor import Ledger

    training = {"max_steps": 5000, "checkpoint_every": 50, "eval_every": 0, "log_every": 1}
    run = make_run(prepared, tmp_path / "runs", "cancel", **training)
    overrides = {**SMALL_DATA, **{f"training.{k}": v for k, v in training.items()}}
    params = ["--param", f"storage={tmp_path / 'runs'}", "--param", "run_id=cancel"]
    out = prefect(
        prefect_env, "deployment", "run", "train/train-tiny", *params, "--param", f"overrides={json.dumps(overrides)}"
    )
    match = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout)
    assert match, out.stdout
    flow_run_id = match[1]
    ledger, backend = Ledger(Storage(str(run)), "train"), LocalBackend(str(run / "jobs"))

    def training_steps() -> bool:
        attempts = ledger.load()
        return bool(attempts) and any(" step 3 loss" in line for line in backend.logs(attempts[0].job_name)[0])

    wait_until(training_steps, 240, "the job to train a few steps")
    name = ledger.load()[0].job_name
    prefect(prefect_env, "flow-run", "cancel", flow_run_id)

    def flow_state() -> str:
        with temporary_settings({PREFECT_API_URL: prefect_env["PREFECT_API_URL"]}), get_client(sync_client=True) as c:
            state = c.read_flow_run(flow_run_id).state
        return state.name if state else "?"

    wait_until(lambda: flow_state() == "Cancelled", 120, "the flow run to be cancelled")
    wait_until(lambda: (s := backend.describe(name)) is not None and s.terminal, 120, "the job to stop")
    state = backend.describe(name)
    assert state is not None and state.status.value == "Stopped"
    assert processes_mentioning(str(run)) == []


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.5)
