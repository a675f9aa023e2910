"""One real Prefect deployment for the end-to-end tests: `prefect server start` on 127.0.0.1 (UI on) with its own
PREFECT_HOME, every deployment of deployments/prefect.yaml registered by `hlat deploy`, and a process worker
started by `hlat worker`. Each process is started here in a session of its own and stopped here by its PID
(SIGINT, then SIGKILL after a grace period); teardown fails if anything it started is still alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pytest

from tests.integration.conftest import free_port
from tests.jobs import default_sigint

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PREFECT, HLAT = str(BIN / "prefect"), str(BIN / "hlat")
FAKE_AWS = {
    # Registered only (nothing runs them here): the AWS deployments need their placeholders filled in.
    "HLAT_S3_ROOT": "s3://hlat-e2e-bucket/runs",
}


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


def session_members(sid: int) -> list[int]:
    """Live processes of the session `sid` (a process started with start_new_session and its descendants)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            found.append(int(entry.name))
    return found


class Started:
    """A process started for the tests, in its own session, stopped by PID."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log: IO[bytes] = log.open("wb")
        self.proc = subprocess.Popen(
            args,
            env=env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=default_sigint,  # prefect's server and worker stop cleanly on SIGINT
        )
        self.pid = self.proc.pid

    def stop(self, grace: float) -> list[int]:
        """SIGINT, SIGKILL after `grace` s; then SIGKILL whatever of its session is left and return those PIDs."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        leftovers = session_members(self.pid)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        return leftovers


@pytest.fixture(scope="module")
def prefect_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real Prefect server with its UI on 127.0.0.1 and its own PREFECT_HOME; yields the env that reaches it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HLAT_"))}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_UI_URL=f"http://127.0.0.1:{port}",
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_WORKER_PREFETCH_SECONDS="1",
        **FAKE_AWS,
    )
    server = Started([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, home / "server.log")
    try:
        wait_healthy(env["PREFECT_API_URL"], server.proc)
        yield env
    finally:
        leftovers = server.stop(grace=20)
        assert not leftovers, f"prefect server left processes {leftovers} behind"


def prefect(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_ok(env, [PREFECT, "--no-prompt", *args], timeout)


def run_ok(env: dict[str, str], args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"{' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def deployed(prefect_env: dict[str, str]) -> str:
    """`hlat deploy`: the work pool created and every deployment of deployments/prefect.yaml registered."""
    return run_ok(prefect_env, [HLAT, "deploy"], timeout=600).stdout


@pytest.fixture(scope="module")
def worker(prefect_env: dict[str, str], deployed: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    """`hlat worker`: a process worker on the pool `hlat`, one flow run at a time."""
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    started = Started([HLAT, "worker", "--limit", "1"], prefect_env, log)
    try:
        wait_until(lambda: "started" in log.read_text() or started.proc.poll() is not None, 120, "the worker")
        assert started.proc.poll() is None, log.read_text()[-3000:]
        yield started
    finally:
        leftovers = started.stop(grace=30)
        assert not leftovers, f"the worker left processes {leftovers} behind"


@contextmanager
def api(env: dict[str, str]) -> Iterator[Any]:
    """A sync Prefect client on the test server."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        yield client


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.5)
