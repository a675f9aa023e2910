"""The README's command blocks, pasted: every ```bash block of "Running flows" and of "Deployments and the Prefect
UI" runs as written, line by line under `set -e`, and must succeed.

They run in a copy of the project's files (so `./runs`, `./hf-demo` and the deployments' working directory are the
copy's, not the checkout's), with this environment's `hlat`, `prefect` and `python` first on PATH. "Running flows"
runs against the session's test server; "Deployments" starts its own server as the block says, on a free port in
place of 4200, with its own PREFECT_HOME. The environment is the user's: no Prefect or hlat variable of the test
session (telemetry stays on, as on a fresh machine; offline, its reports fail in the server's log). What a block
starts in the background (the server, the worker) is stopped afterwards, and nothing it started may be left
running.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, session_members
from tests.integration.conftest import free_port

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def bash_blocks(heading: str) -> list[str]:
    """The ```bash blocks of the README section `## heading` (up to the next `## ` heading)."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert blocks, f"no bash block under '## {heading}'"
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
    assert proc.returncode == 0, f"a README line failed (exit {proc.returncode}):\n{out[-6000:]}"
    return out


def stop_session(sid: int, grace: float = 30) -> list[int]:
    """SIGTERM what a block left running (its session), then SIGKILL what is left after `grace` s."""
    import time

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
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HLAT_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def test_running_flows_block_works_as_written(prefect_server: None, tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    project = project_copy(tmp_path / "hlat")
    env = user_env(PREFECT_API_URL=str(PREFECT_API_URL.value()), HLAT_LOG_DIR=str(tmp_path / "logs"))
    started: list[int] = []
    try:
        out = "".join(paste(b, project, env, timeout=1500, started=started) for b in bash_blocks("Running flows"))
    finally:
        left = [pid for sid in started for pid in stop_session(sid)]
    assert not left, f"the block left processes {left} behind"
    assert "Traceback" not in out, out[-6000:]
    runs = project / "runs"
    assert (runs / "demo" / "eval" / "report.md").is_file() and (project / "hf-demo" / "config.json").is_file()
    assert (runs / "demo" / "checkpoints" / "step-000000800").is_dir()  # the extended run
    assert (runs / "demo" / "compare" / "lr3e-3" / "compare.md").is_file()


def test_deployments_block_works_as_written(tmp_path: Path) -> None:
    project = project_copy(tmp_path / "hlat")
    port = free_port()
    env = user_env(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_SERVER_API_PORT=str(port),
        HLAT_PROJECT_DIR=str(project),  # `hlat` is this environment's: point its deployments at the copy
        HLAT_LOG_DIR=str(tmp_path / "logs"),
    )
    (block,) = bash_blocks("Deployments and the Prefect UI")
    block = block.replace("127.0.0.1:4200", f"127.0.0.1:{port}")
    started: list[int] = []
    try:
        out = paste(block, project, env, timeout=1500, started=started)
    finally:
        left = stop_session(started[0]) if started else []  # the server and the worker the block left running
    assert not left, f"the block left processes {left} behind"
    assert "Traceback" not in out, out[-6000:]
    assert out.count("Flow run finished successfully in 'Completed'") == 3, out[-6000:]
    run = project / "runs" / "demo-ui"
    assert (run / "checkpoints" / "step-000000800").is_dir() and (run / "eval" / "report.md").is_file()
