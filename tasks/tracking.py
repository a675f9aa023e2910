"""The stages' side of experiment tracking (tracking.backend, `training/tracking.py`): at a stage's start the run's
setting is checked and its tracked run opened (found or created once, with the config and the run's storage URI);
at its end what it produced goes there: the data and tokenizer reports as artifacts, the training summary with its
cost, the evaluation results (figures, results.json and report.md). The training job logs the per-step metrics
itself. Tracking never decides a stage: a store that fails is warned about, and the stage goes on."""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

from prefect import task

from hlat.core.config import ConfigError, HlatConfig
from hlat.core.environment import NEURON_SDKS
from hlat.core.layout import EVAL_DIR
from hlat.infra.runs import Run
from hlat.infra.sagemaker_jobs import PROJECT_ROOT
from hlat.infra.stage_jobs import job_python
from hlat.training.tracking import Tracker, check_tracking, open_tracker

log = logging.getLogger("hlat.tracking")

EVAL_REPORT = f"{EVAL_DIR}/report.md"


def _with_tracker(run: Run, work: Callable[[Tracker], None]) -> None:
    tracker = open_tracker(run.config, run.storage)
    if tracker is None:
        return
    try:
        work(tracker)
    finally:
        tracker.close()


def flat_figures(values: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """`values`' numbers (nested dicts joined with '/') under `prefix`: 'eval/perplexity/val_ppl'."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            out.update(flat_figures(value, name))
        elif isinstance(value, bool | int | float):
            out[name] = value
    return out


def check_job_tracking(cfg: HlatConfig) -> None:
    """Refuse, naming the field and the fix, tracking that the training jobs could not do. Local jobs in another
    interpreter (job.python, or the XLA environment) need the backend's client there. SageMaker jobs: W&B would need
    its API key in the job's environment, which the job's description shows; MLflow needs the jobs' requirements
    file (deployments/job-requirements-<neuron.sdk>.txt, what the instances install on the Neuron image) to hold
    MLflow's client (and, for a tracking server ARN, the sagemaker-mlflow plugin)."""
    t = cfg.tracking
    if t.backend == "none":
        return
    if cfg.job.backend == "local":
        _check_job_python(cfg)
        return
    if t.backend == "wandb":
        raise ConfigError(
            "tracking.backend=wandb with job.backend=sagemaker: the jobs would need WANDB_API_KEY in their "
            "environment, which SageMaker shows in the job's description; use tracking.backend=mlflow with "
            "tracking.mlflow_tracking_server_arn (the job's role signs its requests) or tracking.backend=none"
        )
    name = NEURON_SDKS[cfg.neuron.sdk].job_requirements
    text = (PROJECT_ROOT / "deployments" / name).read_text()
    present = {re.split(r"[=<>~!\[; ]", line.strip(), maxsplit=1)[0].lower() for line in text.splitlines()}
    needed = {"mlflow-skinny": {"mlflow", "mlflow-skinny"}}
    if t.mlflow_tracking_server_arn:
        needed["sagemaker-mlflow"] = {"sagemaker-mlflow"}
    missing = sorted(package for package, names in needed.items() if not names & present)
    if missing:
        raise ConfigError(
            f"tracking.backend=mlflow with job.backend=sagemaker: the training jobs install deployments/{name}, which "
            f"lacks {', '.join(missing)}, so they could not log (pip cannot install mlflow-skinny beside the Neuron "
            "image's pinned tensorboard 2.6.0: tests/integration/test_job_requirements.py); set tracking.backend=none "
            "for SageMaker runs (metrics.jsonl and TensorBoard stay their record)"
        )


def _check_job_python(cfg: HlatConfig) -> None:
    python = job_python(cfg, "train")
    if python is None:  # the flow's own interpreter: this one, which has them (pyproject's dependencies)
        return
    module = "mlflow" if cfg.tracking.backend == "mlflow" else "wandb"
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    if not found:
        raise ConfigError(
            f"tracking.backend={cfg.tracking.backend}: the local training jobs run in {python}, which has no {module}; "
            f"install it there (`{python} -m pip install -c constraints.txt {module}`) or set tracking.backend=none"
        )


@task(name="start-tracking")
def start_tracking(run: Run) -> None:
    """Refuse a tracking setting the run cannot use (naming the fix), then open the run's tracked run (found or
    created, recorded in <run>/tracking/tracking.json) with its config and storage URI. Nothing with backend none."""
    if run.config.tracking.backend == "none":
        return
    check_tracking(run.config, run.storage)
    check_job_tracking(run.config)
    _with_tracker(run, lambda t: t.log_config(run.config))


@task(name="track-data-report")
def track_data_report(run: Run, report: Mapping[str, Any]) -> None:
    """prepare-data's report as the artifact reports/data.json."""
    if run.config.tracking.backend != "none":
        _with_tracker(run, lambda t: t.log_json("data.json", dict(report)))


@task(name="track-tokenizer-report")
def track_tokenizer_report(run: Run, report: Mapping[str, Any]) -> None:
    """train-tokenizer's report as the artifact reports/tokenizer.json."""
    if run.config.tracking.backend != "none":
        _with_tracker(run, lambda t: t.log_json("tokenizer.json", dict(report)))


@task(name="track-training")
def track_training(run: Run, summary: Mapping[str, Any]) -> None:
    """The training summary (steps, final loss, jobs, cost) as figures under train/ and reports/training.json."""
    if run.config.tracking.backend == "none":
        return

    def work(t: Tracker) -> None:
        t.log_summary(flat_figures(summary, "train"))
        t.log_json("training.json", dict(summary))

    _with_tracker(run, work)


@task(name="track-evaluation")
def track_evaluation(run: Run, results: Mapping[str, Any]) -> None:
    """The evaluation's figures under eval/, its results as reports/evaluation.json and eval/report.md."""
    if run.config.tracking.backend == "none":
        return

    def work(t: Tracker) -> None:
        t.log_summary(flat_figures(results, "eval"))
        t.log_json("evaluation.json", dict(results))
        if run.storage.exists(EVAL_REPORT):
            t.log_text("report.md", run.storage.read_text(EVAL_REPORT))

    _with_tracker(run, work)
