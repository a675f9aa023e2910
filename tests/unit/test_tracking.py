"""Experiment tracking's parts on a real MLflow SQLite store: what a record logs, one run found again and each step
logged once across reopenings, a failing store warned about once, MetricsLog's hand-over (at flushes; the kept
history the store lacks at a resume); and SageMaker's MlflowConfig in the CreateTrainingJob request, checked
against botocore's service model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from botocore.validate import validate_parameters

from hlat.core.config import ConfigError, HlatConfig, TrackingConfig
from hlat.core.layout import TRACKING_RECORD
from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.infra.backends.sagemaker import SageMakerBackend
from hlat.infra.backends.sagemaker_request import config_request, mlflow_config, tracking_environment
from hlat.infra.backends.sagemaker_validation import validate_request
from hlat.training.metrics import MetricsLog
from hlat.training.tracking import (
    LOGGED_TAG,
    MlflowTracker,
    _whole_steps,
    flat_config,
    numeric,
    open_tracker,
    wandb_run_id,
)
from tests.unit.test_sagemaker_jobs import make_job, make_spec, no_network, plain_client

__all__ = ["no_network"]  # its autouse fixture: nothing here connects anywhere but the local store

ARN = "arn:aws:sagemaker:us-west-2:123456789012:mlflow-tracking-server/team"


def mlflow_cfg(run_id: str = "r1") -> object:
    return load_config("tiny", {"tracking.backend": "mlflow"}, run_id=run_id)


def test_a_record_logs_its_finite_numbers_and_the_config_flattens() -> None:
    values = {"loss": 2.5, "skipped": True, "spikes_skipped": 3, "note": "x", "val_loss": None, "bad": float("nan")}
    assert numeric(values) == {"loss": 2.5, "skipped": 1.0, "spikes_skipped": 3.0}
    params = flat_config(load_config("tiny", {"training.max_steps": 7}, run_id="r"))
    assert params["training.max_steps"] == "7" and params["model.arch"] == "llama"
    assert all(len(v) <= 6000 for v in params.values())
    assert wandb_run_id("tiny-a/b:c") == "tiny-a-b-c"


def test_chunks_never_split_a_step() -> None:
    records = [(s, {f"k{i}": 1.0 for i in range(400)}) for s in (1, 1, 2, 3, 3, 3)]
    chunks = list(_whole_steps(records, 1000))
    assert [[s for s, _ in c] for c in chunks] == [[1, 1, 2], [3, 3, 3]]


def test_one_mlflow_run_found_again_and_each_step_logged_once(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    run = Run.at(str(tmp_path / "r1"))
    cfg = mlflow_cfg()
    first = open_tracker(cfg, run)  # type: ignore[arg-type]
    assert isinstance(first, MlflowTracker) and first.logged_step == -1
    first.log_records([(1, {"loss": 3.0}), (2, {"loss": 2.0}), (2, {"val_loss": 2.5})])
    first.close()
    record = json.loads((tmp_path / "r1" / TRACKING_RECORD).read_text())

    (tmp_path / "r1" / TRACKING_RECORD).unlink()  # found again by its tag, without the record
    again = open_tracker(cfg, run)  # type: ignore[arg-type]
    assert isinstance(again, MlflowTracker) and again.run_id == record["run_id"] and again.logged_step == 2
    again.log_records([(1, {"loss": 3.0}), (2, {"loss": 2.0}), (3, {"loss": 1.0})])  # 1 and 2 already there
    again.close()

    client = MlflowClient(tracking_uri=record["tracking_uri"])
    assert [(m.step, m.value) for m in client.get_metric_history(record["run_id"], "loss")] == [
        (1, 3.0), (2, 2.0), (3, 1.0)
    ]  # fmt: skip
    assert [m.step for m in client.get_metric_history(record["run_id"], "val_loss")] == [2]
    assert client.get_run(record["run_id"]).data.tags[LOGGED_TAG] == "3"
    assert len(client.search_runs([client.get_experiment_by_name("hlat").experiment_id])) == 1


def test_a_failing_store_is_warned_about_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tracker = open_tracker(mlflow_cfg(), Run.at(str(tmp_path / "r1")))  # type: ignore[arg-type]
    assert tracker is not None
    (tmp_path / "r1" / "tracking" / "mlflow.db").write_bytes(b"not a database")  # the store breaks under it
    with caplog.at_level(logging.WARNING, "hlat.tracking"):
        for step in range(1, 4):
            tracker.log_records([(step, {"loss": 1.0})])
        tracker.log_json("data.json", {"rows": 1})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "metrics.jsonl" in warnings[0].getMessage() and tracker.broken


def test_metrics_log_hands_its_records_over_at_flushes_and_what_the_store_lacks_at_resume(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    run = Run.at(str(tmp_path / "r1"))
    cfg = mlflow_cfg()
    log = MetricsLog(run, enabled=True)
    tracker = open_tracker(cfg, run)  # type: ignore[arg-type]
    log.attach(tracker)
    log.resume_at(0)
    for step in (1, 2, 3):
        log.record(step, {"loss": float(step)})
    assert tracker is not None and tracker.logged_step == -1  # nothing before a flush
    log.flush()
    assert tracker.logged_step == 3
    log.record(4, {"loss": 4.0})  # never flushed: the job dies
    tracker.close()

    # The store lost nothing of 1-3; a store that missed them (a W&B attempt killed before it wrote) gets them here.
    other = Run.at(str(tmp_path / "r2"))
    (tmp_path / "r2").mkdir()
    (tmp_path / "r2" / "metrics.jsonl").write_text((tmp_path / "r1" / "metrics.jsonl").read_text())
    fresh = MetricsLog(other, enabled=True)
    tracker2 = open_tracker(mlflow_cfg("r2"), other)  # type: ignore[arg-type]
    fresh.attach(tracker2)
    fresh.resume_at(2)  # the checkpoint: lines 1-2 kept and logged now, 3 and 4 come again from training
    assert tracker2 is not None and tracker2.logged_step == 2
    tracker2.close()
    record = json.loads((tmp_path / "r2" / TRACKING_RECORD).read_text())
    history = MlflowClient(tracking_uri=record["tracking_uri"]).get_metric_history(record["run_id"], "loss")
    assert [m.step for m in history] == [1, 2]


def test_sagemaker_request_carries_mlflow_config_valid_for_the_service_model(tmp_path: Path) -> None:
    tracking = TrackingConfig(backend="mlflow", mlflow_tracking_server_arn=ARN, experiment="hlat-7b")
    spec = make_spec(environment={"NEURON_COMPILE_CACHE_URL": "s3://b/c", **tracking_environment(tracking)})
    expected = {"MlflowResourceArn": ARN, "MlflowExperimentName": "hlat-7b", "MlflowRunName": spec.run_id}
    assert mlflow_config(spec) == expected
    model = plain_client("sagemaker").meta.service_model
    shape = model.operation_model("CreateTrainingJob").input_shape
    partial = config_request(spec, make_job())
    assert partial["MlflowConfig"] == expected
    create = next(r for r in SageMakerBackend(make_job()).dry_run(spec) if r["operation"] == "CreateTrainingJob")
    params = create["params"]
    assert params["MlflowConfig"] == expected
    validate_parameters(params, shape)
    validate_request(params)
    assert params["Environment"]["MLFLOW_TRACKING_URI"] == ARN  # the sagemaker-mlflow plugin resolves the ARN

    # The train stage's job gets those variables from the run's config (the other stages' jobs do not).
    from hlat.infra.stage_jobs import job_environment

    settings = {"tracking.backend": "mlflow", "tracking.mlflow_tracking_server_arn": ARN}
    run = Run.at("s3://b/runs/r", load_config("tiny", settings))
    assert job_environment(run, "train")["MLFLOW_TRACKING_URI"] == ARN
    assert "MLFLOW_TRACKING_URI" not in job_environment(run, "evaluate")

    # Without a tracking server, no MlflowConfig.
    assert tracking_environment(TrackingConfig(backend="mlflow")) == {}
    assert "MlflowConfig" not in config_request(make_spec(), make_job())
    with pytest.raises(ConfigError, match="mlflow_tracking_server_arn"):
        load_config("tiny", {"tracking.mlflow_tracking_server_arn": "arn:aws:s3:::bucket"})


def sagemaker_config(run_id: str = "r", **tracking: object) -> HlatConfig:
    overrides = {"job.backend": "sagemaker", "job.instance_type": "ml.trn1.32xlarge",
                 "job.role_arn": "arn:aws:iam::123456789012:role/hlat"}  # fmt: skip
    return load_config("tiny", {**overrides, **{f"tracking.{k}": v for k, v in tracking.items()}}, run_id=run_id)


@pytest.mark.slow  # MLflow's SQLite store: about 5 s to create
def test_sagemaker_jobs_track_nothing_themselves_the_train_stage_logs_their_metrics(tmp_path: Path) -> None:
    """The Neuron images cannot install MLflow's client beside their pins and SageMaker shows a job's environment
    (no W&B key there): the train stage reads metrics.jsonl as it grows and logs each step once (MetricsMirror), and
    the job is told not to track (HLAT_TRACKED_BY_STAGE)."""
    from mlflow.tracking import MlflowClient

    from hlat.infra.stage_jobs import job_environment
    from hlat.tasks.tracking import MetricsMirror, check_job_tracking

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = sagemaker_config(backend="mlflow", mlflow_tracking_uri=store)
    check_job_tracking(cfg)  # nothing needed of the jobs
    check_job_tracking(sagemaker_config(backend="wandb"))  # the key stays with the flow, not in the job
    run = Run.at(str(tmp_path / "r"), cfg)
    assert job_environment(run, "train")["HLAT_TRACKED_BY_STAGE"] == "1"
    assert "HLAT_TRACKED_BY_STAGE" not in job_environment(Run.at(str(tmp_path / "l"), mlflow_cfg("l")), "train")

    metrics = tmp_path / "r" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)

    def lines(steps: range, partial: bool = False) -> str:
        text = "".join(json.dumps({"step": k, "loss": 10.0 - k, "lr": 0.1}) + "\n" for k in steps)
        text += json.dumps({"step": 4, "val_loss": 6.5}) + "\n" if 4 in steps else ""
        return text + ('{"step": 99, "lo' if partial else "")

    mirror = MetricsMirror(run)
    metrics.write_text(lines(range(1, 5), partial=True))  # a line still being written waits
    mirror.poll()
    metrics.write_text(lines(range(1, 3)))  # a relaunch resumed from step 2: the file rewritten shorter
    mirror.poll()
    metrics.write_text(lines(range(1, 7)))  # steps 3 and 4 again (bitwise the same values), then 5 and 6
    mirror.close()
    record = json.loads((tmp_path / "r" / TRACKING_RECORD).read_text())
    client = MlflowClient(tracking_uri=record["tracking_uri"])
    assert [(m.step, m.value) for m in client.get_metric_history(record["run_id"], "loss")] == [
        (k, 10.0 - k) for k in range(1, 7)
    ]
    assert [(m.step, m.value) for m in client.get_metric_history(record["run_id"], "val_loss")] == [(4, 6.5)]


def test_local_jobs_in_an_interpreter_without_the_client_are_refused() -> None:
    import shutil
    import sys

    from hlat.tasks.tracking import check_job_tracking

    def cfg(python: str) -> object:
        return load_config("tiny", {"tracking.backend": "mlflow", "job.python": python}, run_id="r")

    check_job_tracking(cfg(sys.executable))  # type: ignore[arg-type]
    bare = shutil.which("python3", path="/usr/bin:/usr/local/bin")
    if bare is None or bare == sys.executable:
        pytest.skip("no interpreter without mlflow on this machine")
    with pytest.raises(ConfigError, match=r"has no mlflow; install it there"):
        check_job_tracking(cfg(bare))  # type: ignore[arg-type]
