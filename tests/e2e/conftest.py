"""One real Prefect deployment for the end-to-end tests, the one docs/deployments.md's block makes: that block,
pasted as written into a shell in a copy of the project, starts `prefect server start` on 127.0.0.1 (UI on) with its
own PREFECT_HOME, registers the tiny deployments with `hlat deploy`, starts a process worker with `hlat worker` and
runs the tiny DAG through it. The tests of tests/e2e/test_deployments.py check that block's run and drive that
server and worker further (every deployment registered, a run cancelled, a stage started from the UI). What the
block left running is stopped by its session id at teardown (SIGTERM, then SIGKILL after a grace period), and
teardown fails if anything is still alive.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PREFECT, HLAT = str(BIN / "prefect"), str(BIN / "hlat")
FAKE_AWS = {
    # Registered only (nothing runs them here): the AWS deployments need their placeholders filled in.
    "HLAT_S3_ROOT": "s3://hlat-e2e-bucket/runs",
}


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


def bash_blocks(page: Path, heading: str) -> list[str]:
    """The ```bash blocks of the section `## heading` of a Markdown page (up to the next `## ` heading)."""
    text = page.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert blocks, f"no bash block under '## {heading}' in {page.name}"
    return blocks


def project_copy(dest: Path) -> Path:
    """The project's tracked files (as a clean clone has them), without environments or runs."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest


def paste(block: str, cwd: Path, env: dict[str, str], timeout: float, started: list[int] | None = None) -> str:
    """Run a block as a user pasting it would (bash, stopping at the first failing line) and return its output.
    The block's session id goes into `started`, for the caller to stop what it left running in the background.
    Output goes through a file: a background job keeps a pipe open after the block ends."""
    log = cwd.parent / f"block-{len(list(cwd.parent.glob('block-*.log')))}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            ["bash", "-c", "set -eo pipefail\nset -x\n" + block],
            cwd=cwd,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if started is not None:
            started.append(proc.pid)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log.read_text()
    assert proc.returncode == 0, f"a line of the block failed (exit {proc.returncode}):\n{out[-6000:]}"
    return out


def stop_session(sid: int, grace: float = 30) -> list[int]:
    """SIGTERM what a block left running (its session), then SIGKILL what is left after `grace` s."""
    for pid in session_members(sid):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = session_members(sid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: no Prefect or hlat variable of the test session (telemetry stays on, as
    on a fresh machine; offline, its reports fail in the server's log), this environment's `hlat`, `prefect` and
    `python` first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HLAT_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


@dataclass(frozen=True)
class DeploymentsBlock:
    """The block of docs/deployments.md, run: its project copy, its output, and the environment that reaches the
    server it left running (PREFECT_API_URL, PREFECT_UI_URL), on which its worker serves the pool `hlat`."""

    project: Path
    out: str
    env: dict[str, str]

    @property
    def run(self) -> Path:
        """The run the block trains (`run_id=demo-ui`, the deployments' storage `./runs`)."""
        return self.project / "runs" / "demo-ui"


@pytest.fixture(scope="module")
def deployments_block(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeploymentsBlock]:
    """The ```bash block of docs/deployments.md's "Deployments and the Prefect UI", pasted as written in a copy of the
    project (so `./runs` and the deployments' working directory are the copy's; `HLAT_PROJECT_DIR` points this
    environment's `hlat` at it), on a free port in place of 4200 and with its own PREFECT_HOME. It starts a server,
    deploys the tiny deployments, starts a worker and runs the tiny DAG, then a longer train and its evaluation,
    through that worker. The server and the worker it leaves running serve this module's other tests (one tiny DAG
    for the block and the end-to-end checks); they are stopped at teardown, and nothing may be left running."""
    root = tmp_path_factory.mktemp("deployments-block")
    project = project_copy(root / "hlat")
    port = free_port()
    env = user_env(
        PREFECT_HOME=str(root / "prefect-home"),
        PREFECT_SERVER_API_PORT=str(port),
        HLAT_PROJECT_DIR=str(project),  # `hlat` is this environment's: point its deployments at the copy
        HLAT_LOG_DIR=str(root / "logs"),
    )
    (block,) = bash_blocks(ROOT / "docs" / "deployments.md", "Deployments and the Prefect UI")
    assert "127.0.0.1:4200" in block
    block = block.replace("127.0.0.1:4200", f"127.0.0.1:{port}")
    started: list[int] = []
    try:
        out = paste(block, project, env, timeout=1500, started=started)
        url = f"http://127.0.0.1:{port}"
        yield DeploymentsBlock(project, out, {**env, "PREFECT_API_URL": f"{url}/api", "PREFECT_UI_URL": url})
    finally:
        left = stop_session(started[0]) if started else []  # the server and the worker the block left running
        assert not left, f"the block left processes {left} behind"


@pytest.fixture(scope="module")
def prefect_env(deployments_block: DeploymentsBlock) -> dict[str, str]:
    """The environment that reaches the block's server and its UI."""
    return deployments_block.env


def prefect(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_ok(env, [PREFECT, "--no-prompt", *args], timeout)


def run_ok(env: dict[str, str], args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"{' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def deployed(prefect_env: dict[str, str]) -> str:
    """`hlat deploy` on the block's server: every deployment of deployments/prefect.yaml registered (the block
    registered the tiny ones and created the pool)."""
    return run_ok({**prefect_env, **FAKE_AWS}, [HLAT, "deploy"], timeout=600).stdout


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
