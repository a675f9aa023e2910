"""Experiment tracking with real stores: a tiny training job killed twice (each time while saving a checkpoint, after
its metrics were flushed to the tracker) and resumed logs into ONE tracked run, every step's metrics once and equal
to metrics.jsonl, with its config, storage URI and the stages' reports: an MLflow SQLite store (the default store of
a local run) and W&B in offline mode (its files read back). A store that does not answer never stops training."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from hlat.core.config import ConfigError
from hlat.core.layout import TRACKING_RECORD
from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training.tracking import (
    LOGGED_TAG,
    RUN_TAG,
    check_tracking,
    wandb_key,
    wandb_offline_history,
    wandb_records,
    wandb_run_files,
    wandb_run_id,
)
from tests.jobs import make_run, metrics, train

STEPS = 12
RUN = {"max_steps": STEPS, "checkpoint_every": 4, "keep_checkpoints": 2, "eval_every": 6, "log_every": 1,
       "warmup_steps": 2}  # fmt: skip
SECRET = "wandb-key-0123456789abcdef-never-logged"
SEEDED = {
    "WANDB_API_KEY": SECRET,
    "HF_TOKEN": "hf_seeded0123456789abcdefNEVERLOGGED",
    "MLFLOW_TRACKING_USERNAME": "seeded-mlflow-user-never-logged",
    "MLFLOW_TRACKING_PASSWORD": "seeded-mlflow-password-never-logged",
    "PREFECT_API_KEY": "pnu_seeded0123456789abcdefneverlogged",
}


def killed_twice_and_resumed(run: Path) -> list[str]:
    """Killed while saving step 4's checkpoint (no checkpoint yet: steps 1-4 are trained again), then while saving
    step 8's (resumed from 4: steps 5-8 again), then to the end. Each time the tracker had logged through the
    step being saved. Returns the three jobs' output (their logs)."""
    outs = []
    for step in (4, 8):
        code, out = train(run, {"HLAT_FAULT_KILL_BEFORE_COMMIT": str(step)})
        assert code == -9 and "tracking (" not in out, out[-3000:]  # (no tracker warning: the store answered)
        outs.append(out)
    code, out = train(run)
    assert code == 0 and "tracking (" not in out, out[-3000:]
    return [*outs, out]


def wandb_offline_history_of(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The history rows of one attempt's .wandb file (what each attempt wrote, for a failure's message)."""
    rows = [r.history for r in wandb_records(path) if r.WhichOneof("record_type") == "history"]
    return [(int(json.loads(i.value_json)), {}) for h in rows for i in h.item if wandb_key(i) == "_step"]


def per_step(run: Path, key: str) -> dict[int, float]:
    """metrics.jsonl's `key` per step (the final history: a resumed job keeps one line per step)."""
    return {r["step"]: r[key] for r in metrics(run) if r.get(key) is not None}


@pytest.mark.slow  # three training jobs
def test_mlflow_one_run_every_step_once_with_config_and_reports(prepared: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    run = make_run(prepared, tmp_path, "tracked", **RUN, **{"tracking.backend": "mlflow"})
    killed_twice_and_resumed(run)

    record = json.loads((run / TRACKING_RECORD).read_text())
    assert record["tracking_uri"] == f"sqlite:///{run.resolve() / 'tracking' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=record["tracking_uri"])
    experiment = client.get_experiment_by_name("hlat")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [record["run_id"]]
    tracked = runs[0]
    assert tracked.data.tags[RUN_TAG] == "tracked" and tracked.data.tags[LOGGED_TAG] == str(STEPS)
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "val_loss"):
        history = client.get_metric_history(tracked.info.run_id, key)
        steps = [m.step for m in history]
        assert sorted(steps) == sorted(set(steps)), f"{key}: a step logged twice: {sorted(steps)}"
        expected = per_step(run, key)
        assert set(steps) == set(expected), key
        if key in ("loss", "grad_norm", "lr", "val_loss"):  # bitwise the same values (timings differ per attempt)
            assert {m.step: m.value for m in history} == pytest.approx(expected, rel=1e-12), key
    assert len(client.get_metric_history(tracked.info.run_id, "loss")) == STEPS
    params = tracked.data.params
    assert params["training.max_steps"] == str(STEPS) and params["tracking.backend"] == "mlflow"
    assert tracked.data.tags["hlat.storage"] == str(run)

    track_stages(run)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    files = {a.path for a in client.list_artifacts(record["run_id"], "reports")}
    assert files == {f"reports/{name}" for name in REPORTS}
    latest = runs[0].data.metrics
    assert latest["train/cost_usd"] == 0.0 and latest["eval/perplexity/val_ppl"] == 42.0
    assert all(SECRET not in p.read_text(errors="ignore") for p in (run / "tracking").rglob("*.json"))


REPORTS = ("data.json", "tokenizer.json", "training.json", "evaluation.json", "report.md")


def track_stages(run: Path) -> None:
    """The stages' ends, from the flows' tasks: the data and tokenizer reports, the training summary with its cost,
    the evaluation's results and report.md."""
    from hlat.core.run import load_stored_config
    from hlat.tasks.tracking import track_data_report, track_evaluation, track_tokenizer_report, track_training

    stored = Run.at(str(run), load_stored_config(Storage(str(run))))
    track_data_report.fn(stored, {"rows_read": 300, "rows_kept": 290})
    track_tokenizer_report.fn(stored, {"vocab_size": 512, "bytes_per_token": 3.9})
    track_training.fn(stored, {"step": STEPS, "loss": 5.5, "cost_usd": 0.0, "jobs": 3})
    (run / "eval").mkdir(exist_ok=True)
    (run / "eval" / "report.md").write_text("# Evaluation\n\nperplexity 42\n")
    track_evaluation.fn(stored, {"step": STEPS, "perplexity": {"val_ppl": 42.0, "val_loss": 3.7}})


@pytest.mark.slow  # three training jobs
def test_wandb_offline_one_run_every_step_once_no_secret(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 51: every secret a flow run or job may hold, seeded where it would come from (the ECS task's secrets,
    # resolved into the environment): none reaches config.json, a checkpoint, the tracked run or a log.
    for variable, value in SEEDED.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("WANDB_SILENT", "true")
    overrides = {"tracking.backend": "wandb", "tracking.wandb_mode": "offline", "tracking.experiment": "hlat-test"}
    run = make_run(prepared, tmp_path, "tracked-wb", **RUN, **overrides)
    logs = killed_twice_and_resumed(run)

    record = json.loads((run / TRACKING_RECORD).read_text())
    assert record["id"] == wandb_run_id("tracked-wb") == "tracked-wb"
    folder = run / "tracking"
    files = wandb_run_files(folder, record["id"])
    assert len(files) == 3  # one per attempt, all the same W&B run id (`wandb sync` resumes one run from them)
    rows = wandb_offline_history(folder, record["id"])
    steps = [step for step, _ in rows]
    per_file = {f.parent.name: [s for s, _ in wandb_offline_history_of(f)] for f in files}
    assert steps == sorted(set(steps)) and set(steps) == set(range(1, STEPS + 1)), per_file
    losses = {step: values["loss"] for step, values in rows if "loss" in values}
    assert losses == pytest.approx(per_step(run, "loss"), rel=1e-12)
    assert {s: v["val_loss"] for s, v in rows if "val_loss" in v} == pytest.approx(per_step(run, "val_loss"))
    configs = [r.config for path in files for r in wandb_records(path) if r.WhichOneof("record_type") == "config"]
    keys = {wandb_key(item): json.loads(item.value_json) for c in configs for item in c.update}
    assert keys["training.max_steps"] == str(STEPS) and keys["hlat.storage"] == str(run)

    track_stages(run)
    runs = {r.run.run_id for path in wandb_run_files(folder, record["id"]) for r in wandb_records(path)
            if r.WhichOneof("record_type") == "run"}  # fmt: skip
    assert runs == {"tracked-wb"}
    saved = {p.relative_to(p.parents[2]).as_posix() for p in folder.glob("wandb/offline-run-*/files/reports/*")}
    assert saved == {f"files/reports/{name}" for name in REPORTS}
    summary = {
        wandb_key(item): json.loads(item.value_json)
        for path in wandb_run_files(folder, record["id"])
        for r in wandb_records(path)
        if r.WhichOneof("record_type") == "summary"
        for item in r.summary.update
    }
    assert summary["train/cost_usd"] == 0.0 and summary["eval/perplexity/val_ppl"] == 42.0
    files = [p for p in run.rglob("*") if p.is_file()]
    assert {"config.json", "metrics.jsonl"} <= {p.name for p in files}
    assert any(p.parts[-3] == "checkpoints" for p in files if len(p.parts) > 3)  # the final checkpoint's files
    for variable, value in SEEDED.items():
        leaked = [p for p in files if value.encode() in p.read_bytes()]
        assert not leaked, (variable, leaked)
        assert not [out for out in logs if value in out], variable


def test_a_store_that_does_not_answer_never_stops_training(prepared: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing answers there
    overrides = {"tracking.backend": "mlflow", "tracking.mlflow_tracking_uri": f"http://127.0.0.1:{port}"}
    run = make_run(prepared, tmp_path, "untracked", max_steps=3, checkpoint_every=3, log_every=1, **overrides)
    env = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    code, out = train(run, env)
    assert code == 0, out[-3000:]
    assert out.count("tracking (mlflow)") == 1, out[-3000:]
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2, 3]


def test_settings_a_run_cannot_use_are_refused_naming_the_fix() -> None:
    cfg = load_config("tiny", {"tracking.backend": "mlflow"}, run_id="r")
    with pytest.raises(ConfigError, match=r"tracking\.mlflow_tracking_uri"):
        check_tracking(cfg, Run.at("s3://bucket/runs/r"))
    check_tracking(cfg, Run.at(os.getcwd()))
    arn = "arn:aws:sagemaker:us-west-2:123456789012:mlflow-tracking-server/team"
    check_tracking(cfg.model_copy(update={"tracking": cfg.tracking.model_copy(
        update={"mlflow_tracking_server_arn": arn})}), Run.at("s3://bucket/runs/r"))  # fmt: skip
    offline = load_config("tiny", {"tracking.backend": "wandb", "tracking.wandb_mode": "offline"}, run_id="r")
    with pytest.raises(ConfigError, match=r"tracking\.wandb_mode=online"):
        check_tracking(offline, Run.at("s3://bucket/runs/r"))


@pytest.mark.slow
def test_the_stage_flows_log_their_reports_into_the_one_run(
    prefect_server: None, tmp_path: Path, small_run: dict[str, Any]
) -> None:
    """prepare-data and train-tokenizer, as flows on the test suite's Prefect server: each stage's report lands in
    the run's one MLflow run (opened at the first stage, with the config)."""
    from mlflow.tracking import MlflowClient

    from hlat.flows.prepare_data import prepare_data
    from hlat.flows.train_tokenizer import train_tokenizer

    overrides = {**small_run, "tracking.backend": "mlflow", "tracking.experiment": "flows"}
    prepare_data(preset="tiny", overrides=overrides, run_id="staged", storage=str(tmp_path))
    train_tokenizer(preset="tiny", overrides=overrides, run_id="staged", storage=str(tmp_path))
    record = json.loads((tmp_path / "staged" / TRACKING_RECORD).read_text())
    client = MlflowClient(tracking_uri=record["tracking_uri"])
    experiment = client.get_experiment_by_name("flows")
    assert experiment is not None
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [record["run_id"]]
    assert {a.path for a in client.list_artifacts(record["run_id"], "reports")} == {
        "reports/data.json", "reports/tokenizer.json"
    }  # fmt: skip
    data = json.loads(Path(client.download_artifacts(record["run_id"], "reports/data.json", str(tmp_path))).read_text())
    assert data["rows_read"] == data["rows_kept"] + data["rows_quarantined"] == 300
    assert client.get_run(record["run_id"]).data.params["tracking.experiment"] == "flows"
