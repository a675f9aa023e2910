"""The `hlat` command line, as users run it (subprocesses, Prefect in ephemeral mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SMALL_RUN

BIN = Path(sys.executable).parent


def hlat(*args: str, cwd: Path | None = None, **extra_env: str) -> subprocess.CompletedProcess[str]:
    # Without the test session's Prefect settings: the CLI's own defaults (no telemetry from its temporary server).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PREFECT_API") and k != "PREFECT_SERVER_ANALYTICS_ENABLED"
    }
    env.update(extra_env)
    return subprocess.run(
        [str(BIN / "hlat"), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600, check=False
    )


def test_presets_lists_key_figures() -> None:
    out = hlat("presets")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["preset", "params", "layers"]
    row = next(line for line in lines if line.startswith("hlat-70b"))
    for figure in (
        "68.98B",
        "80",
        "8192",
        "64/8",
        "4096",
        "32000",
        "1024",
        "bf16-mixed",
        "32x8",
        "256 x ml.trn1.32xlarge",
    ):
        assert figure in row


def test_config_shows_the_resolved_config_and_rejects_bad_fields() -> None:
    out = hlat("config", "--preset", "hlat-7b", "--set", "training.lr=1e-4", "--set", "job.instance_count=16")
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    assert resolved["training"]["lr"] == 1e-4 and resolved["job"]["instance_count"] == 16
    assert resolved["run_id"].startswith("hlat-7b-")
    bad = hlat("config", "--set", "training.warmup_step=10")
    assert bad.returncode == 2
    assert "training.warmup_step: unknown field 'warmup_step' in training" in bad.stderr
    assert "did you mean training.warmup_steps?" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_each_stage_runs_alone_from_the_cli(tmp_path: Path) -> None:
    sets = [arg for k, v in SMALL_RUN.items() for arg in ("--set", f"{k}={v}")]
    common = ["--preset", "tiny", "--run-id", "cli", "--storage", str(tmp_path / "runs"), *sets]
    out = hlat("run", "prepare-data", *common)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # A healthy run shows no ERROR line (the temporary server used to log a failed telemetry send, offline).
    assert "ERROR" not in out.stdout + out.stderr and "telemetry" not in out.stdout + out.stderr
    assert (tmp_path / "runs/cli/data/manifest.json").exists()
    tokenizer = hlat("run", "train-tokenizer", *common)
    assert tokenizer.returncode == 0, tokenizer.stdout[-3000:] + tokenizer.stderr[-3000:]
    assert (tmp_path / "runs/cli/tokenizer/tokenizer.model").exists()
    conflict = hlat("run", "prepare-data", *common, "--set", "training.lr=0.5")
    assert (
        conflict.returncode == 2
        and "was started with a different config (training.lr: 0.002 -> 0.5)" in conflict.stderr
    )


@pytest.mark.slow
def test_dry_run_prints_the_sagemaker_request_and_cost_and_sends_nothing(tmp_path: Path) -> None:
    """`hlat pretrain --preset hlat-7b --dry-run`: the CreateTrainingJob request, the uploads it needs, the hourly
    cost and an estimate, with AWS pointed at a closed port (a request would fail) and nothing written."""
    from tests.integration.conftest import free_port

    env_before = dict(os.environ)
    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"
    try:
        out = hlat(
            "pretrain", "--preset", "hlat-7b", "--dry-run", "--storage", "s3://my-bucket/runs",
            "--set", "job.role_arn=arn:aws:iam::123456789012:role/hlat", cwd=tmp_path,
        )  # fmt: skip
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "placeholder" not in text
    request = json.loads(text.split("sagemaker CreateTrainingJob:\n", 1)[1].split("\n\n", 1)[0])
    assert request["TrainingJobName"].endswith("-train-1")
    assert request["ResourceConfig"] == {"InstanceType": "ml.trn1.32xlarge", "InstanceCount": 64, "VolumeSizeInGB": 512}
    run_uri = f"s3://my-bucket/runs/{request['TrainingJobName'].removeprefix('hlat-').removesuffix('-train-1')}"
    assert "CheckpointConfig" not in request  # the ranks write to <run>/checkpoints/ themselves, from every host
    assert request["AlgorithmSpecification"]["ContainerEntrypoint"][:2] == [
        "python3",
        "/opt/ml/input/data/code/job_init.py",
    ]  # our init in front of the SDK's command: StopTrainingJob's SIGTERM reaches the ranks
    assert request["HyperParameters"] == {"config": f"{run_uri}/config.json"}
    assert request["Environment"]["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    assert "S3 PutObject x " in text and f"under {run_uri}/code/" in text
    assert "64 x ml.trn1.32xlarge at $24.725/node-hour = $1,582.40/hour" in text
    assert "1,799.4B tokens in " in text and "by the planner's model), about $" in text
    assert list(tmp_path.iterdir()) == []  # nothing written locally either


def test_dry_run_on_the_local_backend_shows_the_job_command(tmp_path: Path) -> None:
    out = hlat("pretrain", "--preset", "tiny", "--dry-run", "--storage", str(tmp_path / "runs"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "on the local backend" in out.stdout and "hlat.training.train" in out.stdout
    assert "$0.00/hour" in out.stdout
    assert not (tmp_path / "runs").exists()


def aws_dry_run(stage: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`hlat run STAGE --dry-run` of the 7B preset on S3 with a role: what the stage's job would send."""
    role = "job.role_arn=arn:aws:iam::123456789012:role/hlat"
    return hlat("run", stage, "--preset", "hlat-7b", "--dry-run", "--storage", "s3://my-bucket/runs", "--set", role,
                cwd=cwd)  # fmt: skip


@pytest.mark.slow
def test_dry_run_of_a_stage_job_shows_its_cost_bound(tmp_path: Path) -> None:
    out = aws_dry_run("burn-in", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dry run: burn-in of run hlat-7b-" in out.stdout and "-burn-in-1" in out.stdout
    assert "bound: the burn-in job stops by its max runtime of 1 h: at most $1,582.40" in out.stdout
    refused = hlat("run", "train-tokenizer", "--preset", "tiny", "--dry-run", cwd=tmp_path)
    assert refused.returncode == 2 and "runs in the flow's own process" in refused.stderr


@pytest.mark.slow
def test_dry_run_of_prepare_data_prices_the_job_for_the_runs_tokens(tmp_path: Path) -> None:
    out = aws_dry_run("prepare-data", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "-prepare-data-1" in out.stdout and "cost: 8 x ml.c5.4xlarge at $0.816/node-hour" in out.stdout
    # HLAT's 1.8T tokens at 4 bytes per token, 64 workers at the measured per-worker throughput.
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("estimate: prepare-data: 7.20 TB of text in")]
    assert "on 64 worker(s) (8 x ml.c5.4xlarge)" in line and "MB/s per worker" in line
    plan = hlat("plan", "--preset", "hlat-7b", cwd=tmp_path)
    assert plan.returncode == 0 and "  prepare-data: 7.20 TB of text in" in plan.stdout


@pytest.mark.slow
def test_dry_run_of_the_evaluation_job_shows_its_own_instance_image_and_cost(tmp_path: Path) -> None:
    out = aws_dry_run("evaluate", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    request = json.loads(out.stdout.split("sagemaker CreateTrainingJob:\n", 1)[1].split("\n\ncost:", 1)[0])
    assert request["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge"
    assert request["ResourceConfig"]["InstanceCount"] == 1
    assert "/pytorch-training:" in request["AlgorithmSpecification"]["TrainingImage"]
    assert "CheckpointConfig" not in request  # nothing of the run's checkpoints copied onto the instance
    assert {"Key": "hlat:stage", "Value": "evaluate"} in request["Tags"]
    assert "cost: 1 x ml.p4d.24xlarge at $37.688/node-hour" in out.stdout
    assert "at most $904.51" in out.stdout


@pytest.mark.slow
def test_a_data_source_that_cannot_be_read_fails_before_anything_starts_and_leaves_nothing(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    cases = {
        str(tmp_path / "missing.jsonl"): "does not exist; give an existing file or folder",
        "s3://My_Bucket/corpus": "is not an S3 URI; use s3://bucket/prefix",
        "some org/corpus": "is neither an existing local path nor a Hugging Face dataset name",
        "builtin:wikipedia": "unknown builtin corpus",
    }
    for source, fix in cases.items():
        for command in (("pretrain",), ("run", "prepare-data")):
            out = hlat(*command, "--storage", str(runs), "--set", f"data.source={source}")
            assert out.returncode == 2, out.stderr
            (line,) = out.stderr.splitlines()  # one line, no server started, no log file to point to
            assert line.startswith("hlat: error: data.source: ") and fix in line, line
    assert not runs.exists()  # no run folder, no config.json


@pytest.mark.slow
def test_a_failure_inside_a_flow_is_one_line_with_the_trace_in_the_log_file(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    args = ("run", "train", "--run-id", "no-data", "--storage", str(tmp_path / "runs"))
    quiet = hlat(*args, HLAT_LOG_DIR=str(logs))
    assert quiet.returncode == 1, quiet.stderr
    assert "Traceback" not in quiet.stderr, quiet.stderr
    errors = [line for line in quiet.stderr.splitlines() if line.startswith("hlat: error:")]
    assert errors == [
        f"hlat: error: {tmp_path}/runs/no-data/data/manifest.json does not exist: "
        "run the prepare-data stage for this run first"
    ]
    (log_file,) = logs.glob("*-run.log")
    assert f"hlat: the full log: {log_file}" in quiet.stderr
    text = log_file.read_text()
    assert "Traceback" in text and "StorageNotFound" in text and "Beginning flow run" in text
    assert len(quiet.stderr.splitlines()) < 20, quiet.stderr

    verbose = hlat(*args, "--verbose", HLAT_LOG_DIR=str(logs))
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def test_a_flow_module_is_not_a_command_and_names_the_one_that_runs_it() -> None:
    """The flows sit below the CLI (no import of it): `python -m hlat.flows.<stage>` says which command runs the
    stage, in one line, and runs nothing."""
    for module, command in (("train", "hlat run train"), ("train_tokenizer", "hlat run train-tokenizer"),
                            ("pretrain", "hlat pretrain")):  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-m", f"hlat.flows.{module}", "--help"], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 1 and out.stdout == "", out
        assert out.stderr.startswith(f"hlat: a flow module is not a command: run `{command} ["), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_status_and_stop_name_a_missing_run_in_one_line(tmp_path: Path) -> None:
    for command in ("status", "stop"):
        out = hlat(command, "nope", "--storage", str(tmp_path))
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.strip() == (
            f"hlat: error: no run at {tmp_path}/nope/config.json: name a run id under --storage (default ./runs) "
            "or a run folder"
        )
    assert hlat("status", "--storage", str(tmp_path)).stdout.strip() == f"no runs under {tmp_path}"
