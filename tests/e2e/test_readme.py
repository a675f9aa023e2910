"""The README's command blocks, pasted: every ```bash block of "Running flows" runs as written, line by line under
`set -e`, and must succeed. (docs/deployments.md's block runs in tests/e2e/test_deployments.py, whose tests share
the server, worker and tiny DAG it leaves running.)

They run in a copy of the project's files (so `./runs` and `./hf-demo` are the copy's, not the checkout's), with
this environment's `hlat`, `prefect` and `python` first on PATH, against the session's test server. The environment
is the user's: no Prefect or hlat variable of the test session. What a block starts in the background is stopped
afterwards, and nothing it started may be left running.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, bash_blocks, paste, project_copy, stop_session, user_env

pytestmark = pytest.mark.slow


def test_running_flows_block_works_as_written(prefect_server: None, tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    project = project_copy(tmp_path / "hlat")
    env = user_env(PREFECT_API_URL=str(PREFECT_API_URL.value()), HLAT_LOG_DIR=str(tmp_path / "logs"))
    started: list[int] = []
    try:
        blocks = bash_blocks(ROOT / "README.md", "Running flows")
        out = "".join(paste(b, project, env, timeout=1500, started=started) for b in blocks)
    finally:
        left = [pid for sid in started for pid in stop_session(sid)]
    assert not left, f"the block left processes {left} behind"
    assert "Traceback" not in out, out[-6000:]
    runs = project / "runs"
    assert (runs / "demo" / "eval" / "report.md").is_file() and (project / "hf-demo" / "config.json").is_file()
    assert (runs / "demo" / "checkpoints" / "step-000000800").is_dir()  # the extended run
    assert (runs / "demo" / "compare" / "lr3e-3" / "compare.md").is_file()
