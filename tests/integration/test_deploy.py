"""`hlat deploy` and `hlat worker`: which deployments, which placeholders they need, the one-line errors, work
pools of another type and a worker stopped by SIGTERM, against the Prefect test server (the registration itself
runs against a real server in tests/e2e)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hlat.core.config import ConfigError
from hlat.deploy import (
    IMAGE_CODE_DIR,
    PREFECT_FILE,
    PROJECT_ROOT,
    DeployError,
    code_source,
    default_selection,
    deploy,
    deploy_env,
    ensure_pool,
    load_deployments,
    missing_env,
    runs_from_checkout,
    select,
)

BIN = Path(sys.executable).parent


def hlat(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HLAT_"))}
    base["PREFECT_HOME"] = env.pop("PREFECT_HOME")
    return subprocess.run(
        [str(BIN / "hlat"), *args], capture_output=True, text=True, env={**base, **env}, timeout=120, check=False
    )


def test_the_file_has_the_pretrain_presets_and_every_stage_for_tiny_and_7b() -> None:
    deployments, _ = load_deployments()
    names = [d["name"] for d in deployments]
    assert [n for n in names if n.startswith("pretrain-")] == [
        "pretrain-tiny",
        "pretrain-7b",
        "pretrain-70b",
        "pretrain-pythia-6.9b",
        "pretrain-neox-20b",
    ]
    stages = ("prepare-data", "train-tokenizer", "precompile", "burn-in", "train", "evaluate")
    assert {f"{s}-{size}" for s in stages for size in ("tiny", "7b")} <= set(names)
    assert {d["work_pool"]["name"] for d in deployments} == {"hlat"}
    # The UI lists deployments A-Z: each stage says where it stands in the DAG (its description and a tag).
    by_name = {d["name"]: d for d in deployments}
    for k, stage in enumerate(stages, 1):
        for size in ("tiny", "7b"):
            dep = by_name[f"{stage}-{size}"]
            assert dep["description"].startswith(f"Stage {k} of 6 (") and f"stage-{k}" in dep["tags"], dep["name"]
    for dep in deployments:  # every entrypoint exists and is a flow
        file, func = dep["entrypoint"].split(":")
        assert f"def {func}(" in (PREFECT_FILE.parents[1] / file).read_text()


def test_select_by_name_or_flow_slash_name_globs() -> None:
    deployments, _ = load_deployments()
    assert [d["name"] for d in select(deployments, ["hlat/pretrain-*"])][:2] == ["pretrain-tiny", "pretrain-7b"]
    assert len(select(deployments, ["*-tiny"])) == 7
    assert select(deployments, []) == deployments
    with pytest.raises(ConfigError, match=r"no deployment matches.*pretrain-tiny"):
        select(deployments, ["pretrain-13b"])


def test_placeholders_needed_depend_on_what_is_deployed() -> None:
    deployments, default_pull = load_deployments()
    tiny = select(deployments, ["*-tiny"])
    assert missing_env(tiny, default_pull, {}) == ["HLAT_PROJECT_DIR"]
    assert missing_env(deployments, default_pull, {}) == ["HLAT_CODE_DIR", "HLAT_PROJECT_DIR", "HLAT_S3_ROOT"]
    env = deploy_env({"HLAT_S3_ROOT": "s3://b/p"})
    assert env["HLAT_PROJECT_DIR"] == str(PREFECT_FILE.parents[1])
    assert missing_env(deployments, default_pull, env) == []


def test_the_aws_deployments_run_the_worker_images_code_or_this_checkout_never_a_git_remote() -> None:
    """On an ecs or kubernetes pool the AWS deployments run the code baked into the worker image (a private
    repository, or a clone whose `origin` is a local path, works: nothing is cloned); on a process pool, this
    checkout. `prefect deploy` fills the placeholder in from the environment `deploy_env` makes (tests/e2e and
    test_account_template.py read it back)."""
    deployments, default_pull = load_deployments()
    seven = next(d for d in deployments if d["name"] == "pretrain-7b")
    assert code_source(seven, default_pull) == "image" and not runs_from_checkout(seven, default_pull)
    step = "prefect.deployments.steps.set_working_directory"
    assert seven["pull"] == [{step: {"directory": "{{ $HLAT_CODE_DIR }}"}}]
    for pool_type, folder in (("ecs", IMAGE_CODE_DIR), ("kubernetes", IMAGE_CODE_DIR), ("process", str(PROJECT_ROOT))):
        assert deploy_env({}, pool_type=pool_type)["HLAT_CODE_DIR"] == folder, pool_type
    names = {name for d in deployments for step in d.get("pull", default_pull) for name in step}
    assert not any("git" in n for n in names), names
    # A caller's own choice stands (a checkout at another path on the worker's host, say).
    assert deploy_env({"HLAT_CODE_DIR": "/srv/hlat"}, pool_type="ecs")["HLAT_CODE_DIR"] == "/srv/hlat"


def test_deploy_names_each_missing_variable_and_what_it_is_for(tmp_path: Path) -> None:
    out = hlat("deploy", PREFECT_HOME=str(tmp_path), PREFECT_API_URL="http://127.0.0.1:9/api")
    assert out.returncode == 2, out.stderr
    assert "HLAT_S3_ROOT: the s3://bucket/prefix that holds AWS runs" in out.stderr
    assert "hlat deploy --name '*-tiny'" in out.stderr and "Traceback" not in out.stderr


def test_deploy_and_worker_refuse_an_ephemeral_api(tmp_path: Path) -> None:
    for command in (["deploy", "--name", "*-tiny"], ["worker"]):
        out = hlat(*command, PREFECT_HOME=str(tmp_path))
        assert out.returncode == 2, out.stderr
        assert "PREFECT_API_URL is not set" in out.stderr and "prefect server start" in out.stderr


def test_without_names_an_ecs_or_kubernetes_pool_gets_only_the_deployments_that_bring_their_code() -> None:
    deployments, default_pull = load_deployments()
    local = [d["name"] for d in deployments if runs_from_checkout(d, default_pull)]
    assert local == [d["name"] for d in select(deployments, ["*-tiny"])]
    assert default_selection(deployments, default_pull, "process") == (deployments, [])
    for pool_type in ("ecs", "kubernetes"):
        chosen, skipped = default_selection(deployments, default_pull, pool_type)
        assert [d["name"] for d in skipped] == local
        assert len(chosen) == 10 and all(not runs_from_checkout(d, default_pull) for d in chosen)
    # Any fetching step counts as remote, a working directory in the image as the image; a shell step or a
    # working directory elsewhere runs from the checkout.
    assert code_source({"pull": [{"prefect_aws.deployments.steps.pull_from_s3": {}}]}, []) == "remote"
    assert code_source({"pull": [{"prefect.deployments.steps.git_clone": {}}]}, []) == "remote"
    assert runs_from_checkout({"pull": [{"prefect.deployments.steps.run_shell_script": {}}]}, [])
    in_image = {"prefect.deployments.steps.set_working_directory": {"directory": IMAGE_CODE_DIR}}
    assert code_source({"pull": [in_image]}, []) == "image"
    elsewhere = {"prefect.deployments.steps.set_working_directory": {"directory": "/home/me/hlat"}}
    assert code_source({"pull": [elsewhere]}, []) == "checkout"


# -- against the Prefect test server ------------------------------------------------------------------------
@pytest.fixture
def api(prefect_server: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The test server's API URL, also in the environment (the `prefect` subprocesses read it there), and the
    placeholders of the AWS deployments set."""
    from prefect.settings import PREFECT_API_URL

    url = str(PREFECT_API_URL.value())
    monkeypatch.setenv("PREFECT_API_URL", url)
    monkeypatch.setenv("HLAT_S3_ROOT", "s3://hlat-test-bucket/runs")
    yield url


def prefect_file_on_pool(tmp_path: Path, pool: str) -> Path:
    """The project's prefect.yaml with its work pool renamed (the test server is shared by the session)."""
    text = PREFECT_FILE.read_text()
    old = "      name: hlat\n      work_queue_name: default"
    assert old in text
    path = tmp_path / "prefect.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.replace(old, f"      name: {pool}\n      work_queue_name: default"))
    return path


@pytest.mark.slow
def test_a_pool_of_another_type_is_an_error_that_names_the_fix(api: str, tmp_path: Path) -> None:
    pool = f"hlat-{uuid.uuid4().hex[:8]}"
    env = deploy_env()
    assert ensure_pool(pool, "process", env) == "created (type process)"
    assert ensure_pool(pool, "process", env) == "exists (type process)"
    with pytest.raises(DeployError) as err:
        deploy(
            ["pretrain-7b"], pool_type="ecs", prefect_file=prefect_file_on_pool(tmp_path, pool), allow_open_server=True
        )
    message = str(err.value)
    assert f"work pool {pool!r} exists with type process, not ecs" in message
    assert "use --type process" in message and f"`prefect work-pool delete {pool}`" in message
    # The CLI prints it as one line (`hlat worker` checks its pool the same way, before starting anything).
    out = hlat("worker", "--pool", pool, "--type", "ecs", PREFECT_HOME=str(tmp_path), PREFECT_API_URL=api)
    assert out.returncode == 1, out.stderr
    assert f"hlat: error: work pool {pool!r} exists with type process, not ecs" in out.stderr
    assert "Traceback" not in out.stderr and "started" not in out.stdout
    # Without --type, the existing pool is taken as it is.
    assert ensure_pool(pool, None, env) == "exists (type process)"


@pytest.mark.slow
def test_deploy_to_an_ecs_pool_leaves_out_the_local_deployments_and_says_so(
    api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hlat.deploy

    pool = f"hlat-{uuid.uuid4().hex[:8]}"
    assert ensure_pool(pool, "ecs", deploy_env()) == "created (type ecs)"
    calls: list[list[str]] = []

    def run(cmd: list[str], env: dict[str, str]) -> int:
        calls.append(cmd)  # `prefect deploy` itself is tested in tests/e2e
        return 0

    monkeypatch.setattr(hlat.deploy, "run_prefect_deploy", run)
    # (The session's server is open: test_account_template.py shows it refused without --allow-open-server.)
    assert deploy([], pool_type="ecs", prefect_file=prefect_file_on_pool(tmp_path, pool), allow_open_server=True) == 0
    out = capsys.readouterr().out
    assert f"work pool {pool!r}: exists (type ecs)" in out
    assert "skipping 7 deployment(s) that run from this checkout, which ecs workers cannot reach" in out
    assert "pretrain-tiny, prepare-data-tiny" in out and "deploy them anyway with --name" in out
    (cmd,) = [c for c in calls if "deploy" in c]
    names = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--name"]
    assert "--all" not in cmd and len(names) == 10 and "pretrain-7b" in names and "train-tiny" not in names
    # Without --type, the existing pool's type decides the same way.
    calls.clear()
    assert deploy([], prefect_file=prefect_file_on_pool(tmp_path, pool), allow_open_server=True) == 0
    assert "skipping 7 deployment(s)" in capsys.readouterr().out


@pytest.mark.slow
def test_worker_stops_promptly_on_sigterm_even_with_sigint_ignored(api: str, tmp_path: Path) -> None:
    """A worker started in the background by a script (`hlat worker &`) inherits SIGINT ignored; Prefect's worker
    stops on SIGTERM by sending itself SIGINT, so it ignored SIGTERM until it was killed."""
    pool = f"hlat-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HLAT_"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_API_URL=api, PREFECT_WORKER_QUERY_SECONDS="1")
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "hlat"), "worker", "--pool", pool],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
    try:
        deadline = time.monotonic() + 120
        while "started" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the worker did not start in 120 s"
            time.sleep(0.3)
        time.sleep(1.5)  # polling
        assert proc.poll() is None, log.read_text()[-3000:]
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"hlat worker still running 15 s after SIGTERM:\n{log.read_text()[-3000:]}")
        assert time.monotonic() - sent < 15
        assert "stopped" in log.read_text(), log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_deploy_and_worker_wait_for_a_server_that_is_still_starting() -> None:
    """`prefect server start --background` returns some 20 s before its API answers: the next README line waits."""
    import http.server
    import threading

    from hlat.deploy import wait_for_api
    from tests.integration.conftest import free_port

    port = free_port()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the stdlib's name
            self.send_response(200 if self.path == "/api/health" else 404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    threading.Timer(2.0, server.serve_forever).start()  # bound now, answering only in 2 s
    try:
        started = time.monotonic()
        wait_for_api(f"http://127.0.0.1:{port}/api", timeout=30)
        assert 1.5 < time.monotonic() - started < 15
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(DeployError, match=r"cannot reach the Prefect API at http://127\.0\.0\.1:9/api"):
        wait_for_api("http://127.0.0.1:9/api", timeout=1)


def test_prefects_worker_advice_after_every_deployment_is_left_out_once_said_by_hlat() -> None:
    from hlat.deploy import without_worker_hints

    block = [
        "Deployment 'hlat/pretrain-tiny' successfully created with id 'abc'.\n",
        "\n",
        "To execute flow runs from these deployments, start a worker in a separate terminal that pulls work\n",
        "from the 'hlat' work pool:\n",
        "\n",
        "        $ prefect worker start --pool 'hlat'\n",
        "\n",
        "To schedule a run for this deployment, use the following command:\n",
        "        $ prefect deployment run 'hlat/pretrain-tiny'\n",
    ]
    kept = list(without_worker_hints(block * 7))
    assert not [line for line in kept if "worker" in line]
    assert sum("successfully created" in line for line in kept) == 7
    assert sum("prefect deployment run" in line for line in kept) == 7
