"""The stages' side of experiment tracking (tracking.backend, `training/tracking.py`): at a stage's start the run's
setting is checked and its tracked run opened (found or created once, with the config and the run's storage URI);
at its end what it produced goes there: the data and tokenizer reports as artifacts, the training summary with its
cost, the evaluation results (figures, results.json and report.md). A local training job logs the per-step metrics
itself; a SageMaker job's are logged by the train stage from metrics.jsonl as the supervisor sees them
(`MetricsMirror`, `stage_tracks_metrics`). Tracking never decides a stage: a store that fails is warned about, and
the stage goes on."""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

from prefect import task

from hlat.core.config import ConfigError, HlatConfig
from hlat.core.layout import EVAL_REPORT, METRICS_FILE
from hlat.core.run import Run
from hlat.infra.stage_jobs import job_python, stage_tracks_metrics
from hlat.training.tracking import Tracker, check_tracking, open_tracker

log = logging.getLogger("hlat.tracking")


def _with_tracker(run: Run, work: Callable[[Tracker], None]) -> None:
    tracker = open_tracker(run.config, run)
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
    """Refuse, naming the field and the fix, tracking that the training jobs could not do: local jobs in another
    interpreter (job.python, or the XLA environment) need the backend's client there. SageMaker jobs track nothing
    themselves (the stage logs their metrics: `MetricsMirror`), so they need nothing."""
    if cfg.tracking.backend == "none" or stage_tracks_metrics(cfg):
        return
    _check_job_python(cfg)


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
    check_tracking(run.config, run)
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


class MetricsMirror:
    """The train stage's logging of a job's per-step metrics into the tracked run, for jobs that do not track
    (`stage_tracks_metrics`: SageMaker's): each `poll` reads what metrics.jsonl gained since the last (a ranged read
    from the last offset; the whole file again when a resume rewrote it shorter) and logs its records, one step's lines
    merged. The tracker logs only steps past the last one its store holds, so the steps a resumed job re-trains (with
    bitwise the same values) are not logged twice. Never stops the stage: a failure is warned about once."""

    def __init__(self, run: Run) -> None:
        self.run = run
        mirrors = stage_tracks_metrics(run.config)
        self.tracker: Tracker | None = open_tracker(run.config, run) if mirrors else None
        self.offset = 0
        self._warned = False

    def poll(self) -> None:
        if self.tracker is None:
            return
        try:
            self._poll(self.tracker)
        except Exception as exc:  # tracking never decides the stage
            if not self._warned:
                self._warned = True
                log.warning("tracking: could not read %s for the tracked run: %s", METRICS_FILE, exc)

    def _poll(self, tracker: Tracker) -> None:
        store = self.run.storage
        if not store.exists(METRICS_FILE):
            return
        size = store.size(METRICS_FILE)
        if size < self.offset:  # rewritten shorter: a resume cut it back to its checkpoint
            self.offset = 0
        if size == self.offset:
            return
        data = store.read_range(METRICS_FILE, self.offset, size)
        whole = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self.offset += whole
        by_step: dict[int, dict[str, Any]] = {}
        for line in data[:whole].decode("utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                by_step.setdefault(record.pop("step"), {}).update(record)
        tracker.log_records(sorted(by_step.items()))

    def close(self) -> None:
        self.poll()
        if self.tracker is not None:
            self.tracker.close()
