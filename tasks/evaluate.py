"""evaluate tasks: run the evaluation job of one checkpoint, then write and publish the report.

The job (`training/evaluate.py`, one process on `evaluation.instance_type`) writes
`eval/step-NNNNNNNNN/results.json`; the report task copies the newest to `eval/results.json` and writes
`eval/report.md` with the loss and gradient-norm curves beside it (`infra/reports/eval_report.py`), plus Prefect
artifacts;
a metric under its `alerts.eval_floors` floor emits an alert event (tasks/alerts.py).
Intermediate evaluations (`evaluation.every_steps`) run the same job from the train stage while training goes on.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from hlat.core.config import OFFLINE_TASK_PREFIX, HlatConfig
from hlat.core.layout import (
    AVERAGED_DIR,
    CHECKPOINT_MARKER,
    CHECKPOINTS_DIR,
    EVAL_DIR,
    EVAL_REPORT,
    EVAL_RESULTS,
    EVAL_RESULTS_FILE,
    CheckpointIndex,
    eval_results_path,
    step_dir,
)
from hlat.core.run import Run
from hlat.infra.reports.eval_report import (
    choose_metric,
    embed_images,
    evaluation_history,
    load_baselines,
    write_report,
)
from hlat.infra.stage_jobs import run_stage_job
from hlat.infra.supervision.errors import JobFailed
from hlat.tasks.alerts import RunEvents, alert_eval_floors
from hlat.tasks.caching import CACHED_STAGE, TRANSIENT_RETRIES, artifact_key, stage_cache_key

log = logging.getLogger("hlat.evaluate")


@task(name="checkpoint-marker", **TRANSIENT_RETRIES)
def checkpoint_marker(run: Run, step: int, averaged: bool = False) -> str:
    """The checkpoint's commit marker (step and meta.json's sha256): changes whenever the checkpoint does."""
    folder = run.storage.child(AVERAGED_DIR if averaged else CHECKPOINTS_DIR)
    return folder.read_text(f"{step_dir(step)}/{CHECKPOINT_MARKER}")


def evaluation_cache_key(run: Run, step: int, averaged: bool = False) -> str:
    """What an evaluation depends on: the checkpoint (its step and commit marker; `hlat average`'s, under
    averaged/, apart) and the evaluation settings."""
    marker = checkpoint_marker(run, step, averaged)
    which = [AVERAGED_DIR] if averaged else []
    return stage_cache_key(run, "evaluate", step, *which, marker, run.config.evaluation.model_dump(mode="json"))


def evaluation_present(run: Run, step: int, averaged: bool = False) -> bool:
    return run.storage.exists(eval_results_path(step, averaged))


def check_task_names(config: HlatConfig) -> None:
    """Fail on an unknown lm-eval task name before a job is launched (lm-eval indexes its task YAML offline)."""
    standard = [t for t in config.evaluation.tasks if not t.startswith(OFFLINE_TASK_PREFIX)]
    if standard:
        from hlat.training.evaluation.lm_harness import check_tasks

        check_tasks(standard, None)


def run_evaluation_job(run: Run, step: int, averaged: bool = False) -> dict[str, Any]:
    """Run the evaluation job of checkpoint `step` (`averaged`: of `hlat average`'s step-N) to its end; its
    results.json."""
    record, state = run_stage_job(run, "evaluate", step, {"from": AVERAGED_DIR} if averaged else None)
    out = run.storage
    path = eval_results_path(step, averaged)
    if state is None or state.status.value != "Completed" or not out.exists(path):
        # A job that reports success without its results is named as such, with the missing file's path.
        ended = record.ending if record.status != "Completed" else f"Completed but wrote no {out.uri(path)}"
        raise JobFailed(f"evaluate: job {record.job_name} ended {ended}", [record])
    results: dict[str, Any] = out.read_json(path)
    return results


@task(name="evaluate-checkpoint", **CACHED_STAGE)
def evaluation_of(run: Run, step: int, cache_key: str, averaged: bool = False) -> dict[str, Any]:
    """Perplexity and lm-eval tasks of checkpoint `step` (`averaged`: `hlat average`'s), in an evaluation job on the
    run's backend (the job's program is training/evaluate.py)."""
    return run_evaluation_job(run, step, averaged)


@task(name="write-eval-report", **TRANSIENT_RETRIES)
def write_eval_report(results: dict[str, Any], run: Run) -> dict[str, str]:
    """eval/results.json (this evaluation), eval/report.md and its plots; the report as a Prefect artifact."""
    out = run.storage
    files = write_report(run, results, load_baselines())
    # Written last: eval/results.json present means the report beside it is this evaluation's.
    out.write_json(EVAL_RESULTS, results)
    files[EVAL_RESULTS_FILE] = out.uri(EVAL_RESULTS)
    publish_eval_report(run, results, run.run_id)
    alert_eval_floors(run, results.get("step"), results)
    return files


def publish_eval_report(run: Run, results: dict[str, Any], run_id: str) -> None:
    try:
        # The UI shows the artifact on its own page: the charts travel inside it (report.md links the files).
        report = embed_images(run.storage.read_text(EVAL_REPORT), run.storage.child(EVAL_DIR))
        note = f"\n\nFull-size charts and files: `{run.storage.uri(EVAL_DIR)}/`"
        create_markdown_artifact(report + note, key=artifact_key("eval-report", run_id))
        rows = [{"metric": k, "value": _rounded(v)} for k, v in (results.get("perplexity") or {}).items()]
        for name, result in ((results.get("lm_eval") or {}).get("tasks") or {}).items():
            rows += [{"metric": f"{name} {m}", "value": _rounded(v)} for m, v in result.get("metrics", {}).items()]
        if rows:
            create_table_artifact(rows, key=artifact_key("eval-scores", run_id), description=f"evaluate of {run_id}")
    except Exception as exc:  # publishing never decides the stage
        log.warning("could not publish the evaluation artifacts: %s", exc)


class CheckpointEvaluator:
    """Evaluates intermediate checkpoints while training runs (`evaluation.every_steps`): each time the train
    stage reports progress, every newly committed checkpoint whose step is a multiple of every_steps is queued, and
    a background thread evaluates the queue in step order, one evaluation job at a time; training is never
    paused. `close()` looks once more (checkpoints committed just before the job ended) and waits for the queue.
    A failed evaluation is logged, not raised: it must not stop training. A queued checkpoint is pinned
    (checkpoints/pins/, CheckpointIndex.pin) so the trainer's retention keeps it until its evaluation has ended,
    successfully or not."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.every = run.config.evaluation.every_steps
        self._checkpoints = CheckpointIndex(run.stage(CHECKPOINTS_DIR))
        self._seen = {int(row["step"]) for row in evaluation_history(run) if row.get("step") is not None}
        # Pins left by an earlier train stage's evaluator that died before evaluating them: this one re-queues
        # (and re-pins) what it still has to evaluate, so the stale pins would only keep checkpoints forever.
        try:
            for step in self._checkpoints.pinned_steps():
                self._checkpoints.unpin(step)
        except Exception as exc:
            log.warning("could not clear the stale pins under %s: %s", self._checkpoints.storage.uri(), exc)
        self._pending: list[int] = []
        self._events = RunEvents(run.run_id, run.uri)  # made here: the worker thread has no flow run context
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None  # set while the worker runs; the worker clears it on exit

    def poll(self) -> None:
        """Queue the committed checkpoints not evaluated yet; start the worker if none runs."""
        if not self.every:
            return
        new = [s for s in self._checkpoints.committed_steps() if s % self.every == 0 and s not in self._seen]
        for step in new:  # before it is queued: retention may run at the trainer's next commit
            self._pin(step)
        with self._lock:
            self._seen.update(new)
            self._pending = sorted(self._pending + new)
            if self._pending and self._thread is None:
                self._thread = threading.Thread(target=self._work, name="evaluate-checkpoints", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._thread = None  # under the lock: a poll after this starts a new worker
                    return
                step = self._pending.pop(0)
            try:
                results = run_evaluation_job(self.run, step)
                log.info("intermediate evaluation of step %d: %s", step, evaluation_summary(results))
                alert_eval_floors(self.run, step, results, self._events)
            except Exception as exc:
                log.warning("intermediate evaluation of step %d failed: %s", step, exc)
            finally:
                self._unpin(step)

    def _pin(self, step: int) -> None:
        try:
            self._checkpoints.pin(step, why=f"queued for evaluation by run {self.run.run_id}")
        except Exception as exc:  # evaluation goes on; only retention may now take the checkpoint first
            log.warning("could not pin checkpoint step %d for its evaluation: %s", step, exc)

    def _unpin(self, step: int) -> None:
        try:
            self._checkpoints.unpin(step)
        except Exception as exc:  # a stale pin keeps one checkpoint too many, nothing worse
            log.warning("could not unpin checkpoint step %d after its evaluation: %s", step, exc)

    def close(self) -> None:
        self.poll()
        worker = self._thread
        if worker is not None:
            worker.join()  # it exits only with the queue empty, and nothing queues after this


def _rounded(value: Any) -> Any:
    """A score as the table shows it: four significant digits (266.6, 2.638, 0.2617); anything else as it is."""
    return float(f"{value:.4g}") if isinstance(value, float) else value


def evaluation_summary(results: dict[str, Any]) -> str:
    """`perplexity 266.55, 2.638 bits/byte, hellaswag acc_norm 0.262`: the scores, rounded."""
    ppl = results.get("perplexity") or {}
    parts = []
    if ppl:  # perplexity is None when exp(nll) overflowed (JSON has no inf)
        value = ppl.get("perplexity")
        parts.append(f"perplexity {value:,.2f}" if isinstance(value, int | float) else "perplexity overflowed")
        if isinstance(ppl.get("bits_per_byte"), int | float):
            parts[-1] += f", {ppl['bits_per_byte']:.3f} bits/byte"
    for name, result in ((results.get("lm_eval") or {}).get("tasks") or {}).items():
        metrics = result.get("metrics") or {}
        metric = choose_metric(metrics)
        if metric:
            parts.append(f"{name} {metric} {metrics[metric]:.3f}")
    return ", ".join(parts) or "no scores"
