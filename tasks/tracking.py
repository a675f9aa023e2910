"""The stages' side of experiment tracking (tracking.backend, `training/tracking.py`): at a stage's start the run's
setting is checked and its tracked run opened (found or created once, with the config and the run's storage URI);
at its end what it produced goes there: the data and tokenizer reports as artifacts, the training summary with its
cost, the evaluation results (figures, results.json and report.md). The training job logs the per-step metrics
itself. Tracking never decides a stage: a store that fails is warned about, and the stage goes on."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from prefect import task

from hlat.core.layout import EVAL_DIR
from hlat.infra.runs import Run
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


@task(name="start-tracking")
def start_tracking(run: Run) -> None:
    """Refuse a tracking setting the run cannot use (naming the fix), then open the run's tracked run (found or
    created, recorded in <run>/tracking/tracking.json) with its config and storage URI. Nothing with backend none."""
    if run.config.tracking.backend == "none":
        return
    check_tracking(run.config, run.storage)
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
