"""`hlat deploy` and `hlat worker` before they reach a server: which deployments, which placeholders they need,
and the one-line errors (the registration itself runs against a real server in tests/e2e)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.deploy import PREFECT_FILE, deploy_env, load_deployments, missing_env, select
from training.config import ConfigError

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
    assert missing_env(deployments, default_pull, {}) == [
        "HLAT_GIT_BRANCH",
        "HLAT_GIT_REPOSITORY",
        "HLAT_PROJECT_DIR",
        "HLAT_S3_ROOT",
    ]
    env = deploy_env({"HLAT_S3_ROOT": "s3://b/p", "HLAT_GIT_REPOSITORY": "https://x/y.git", "HLAT_GIT_BRANCH": "m"})
    assert env["HLAT_PROJECT_DIR"] == str(PREFECT_FILE.parents[1])
    assert missing_env(deployments, default_pull, env) == []


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
