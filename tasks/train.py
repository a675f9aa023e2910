"""train tasks: supervise the run's training jobs until the last step, publish progress, attempts and summary."""

from __future__ import annotations

import json
import logging
from typing import Any, cast
from uuid import UUID

from prefect import task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate

from hlat.core.layout import CHECKPOINTS_DIR, METRICS_FILE, CheckpointIndex
from hlat.core.storage import Storage
from hlat.infra.runs import Run
from hlat.infra.stage_jobs import supervisor_for
from hlat.infra.supervisor import Attempt, Progress
from hlat.tasks.caching import CACHED_STAGE, artifact_key, stage_cache_key

log = logging.getLogger("hlat.train")


def latest_checkpoint(run: Storage) -> int | None:
    """The step of the run's newest committed checkpoint (None: none yet)."""
    return CheckpointIndex(run.child(CHECKPOINTS_DIR)).latest_step()


def train_cache_key(run: Run) -> str:
    """What the trained weights depend on: the run's fingerprint, and its shards and tokenizer (the inputs
    core/stages.py names)."""
    return stage_cache_key(run, "train", run.config.fingerprint())


def training_present(run: Run) -> bool:
    """A cached training counts while the run's newest committed checkpoint is its last step."""
    return latest_checkpoint(run.storage) == run.config.training.max_steps


class _Artifacts:
    """The stage's live artifacts: a progress bar (with the progress line as its description) and the attempts
    table, each created once and then updated in place: one card per artifact in the flow run, not a new keyed
    version on every change. Failing to publish never stops training."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.progress_id: UUID | None = None
        self.attempts_id: UUID | None = None
        self.rows: list[dict[str, Any]] | None = None

    def progress(self, p: Progress) -> None:
        try:
            if self.progress_id is None:
                key = artifact_key("train-progress", self.run_id)
                made = create_progress_artifact(100 * p.fraction, key=key, description=p.line())
                self.progress_id = cast(UUID, made)  # sync_compatible: a UUID when called from sync code
            else:
                update_progress_artifact(self.progress_id, 100 * p.fraction, description=p.line())
        except Exception as exc:  # the API being away must not stop a week-long job
            log.warning("could not update the progress artifact: %s", exc)

    def attempts(self, attempts: list[Attempt]) -> None:
        rows = [a.row() for a in attempts]
        if rows == self.rows:  # the ledger is saved more often than its table changes
            return
        try:
            if self.attempts_id is None:
                made = create_table_artifact(
                    rows, key=artifact_key("train-attempts", self.run_id), description=f"training jobs of {self.run_id}"
                )
                self.attempts_id = cast(UUID, made)
            else:
                with get_client(sync_client=True) as client:  # a table's data is its rows as JSON, as created
                    client.update_artifact(self.attempts_id, ArtifactUpdate(data=json.dumps(rows)))
            self.rows = rows
        except Exception as exc:
            log.warning("could not update the attempts artifact: %s", exc)


@task(name="train-model", **CACHED_STAGE)
def train_model(run: Run, cache_key: str) -> dict[str, Any]:
    """Submit and watch training jobs, relaunching from the newest checkpoint, until training.max_steps;
    with evaluation.every_steps, evaluate intermediate checkpoints alongside."""
    from hlat.tasks.evaluate import CheckpointEvaluator

    artifacts = _Artifacts(run.run_id)
    evaluator = CheckpointEvaluator(run)

    def on_progress(p: Progress) -> None:
        artifacts.progress(p)
        evaluator.poll()

    supervisor = supervisor_for(
        run,
        current_step=lambda: latest_checkpoint(run.storage),
        on_progress=on_progress,
        on_attempts=artifacts.attempts,
    )
    attempts = supervisor.run_to_completion()
    # Only on success: a failed or interrupted stage must not wait for evaluations (a cancelled flow's hook stops
    # the evaluation job with the others).
    evaluator.close()
    summary = training_summary(run.storage)
    summary.update(jobs=len(attempts), cost_usd=round(supervisor.spent_usd(), 2))
    # The stage's throughput is the attempts' average, the final progress line's figure, not the trainer's reading
    # of its last logged step (143 against 412 tokens/s under load); the start-up before the first step apart.
    summary.pop("tokens_per_s", None)
    if (tokens_per_s := supervisor.tokens_per_s()) is not None:
        summary["tokens_per_s"] = tokens_per_s
    if (startup_s := supervisor.startup_s()) is not None:
        summary["startup_s"] = startup_s
    return summary


def training_summary(run: Storage) -> dict[str, Any]:
    """Final step, the last logged training loss, validation loss, gradient norm, learning rate, tokens/s and MFU
    (each the trainer's reading at its last logged step), read back from metrics.jsonl. The stage replaces tokens/s
    with its attempts' average where it measured one."""
    summary: dict[str, Any] = {"final_step": latest_checkpoint(run)}
    if run.exists(METRICS_FILE):
        for line in run.read_text(METRICS_FILE).splitlines():
            record = json.loads(line)
            for key in ("loss", "val_loss", "tokens_per_s", "grad_norm", "lr", "mfu"):
                if record.get(key) is not None:
                    summary[key] = record[key]
    return summary


SUMMARY_ROWS = {  # key: (label, format)
    "final_step": ("final step (newest checkpoint)", "{:,}"),
    "loss": ("training loss, last logged step", "{:.4f}"),
    "val_loss": ("validation loss, last evaluation", "{:.4f}"),
    "tokens_per_s": ("tokens/s, average from the first logged step to the last (the progress line's)", "{:,.0f}"),
    "startup_s": ("start-up before the first step (s)", "{:,.0f}"),
    "grad_norm": ("gradient norm, last logged step", "{:.3f}"),
    "lr": ("learning rate, last logged step", "{:.3g}"),
    "mfu": ("MFU, last logged step", "{:.1%}"),
    "jobs": ("training jobs", "{:,}"),
    "cost_usd": ("cost", "${:,.2f}"),
}


def summary_rows(summary: dict[str, Any]) -> list[dict[str, str]]:
    """The training report's rows: each figure labelled with what it is and rounded to what it means."""
    rows = []
    for key, value in summary.items():
        label, fmt = SUMMARY_ROWS.get(key, (key, "{}"))
        rows.append({"metric": label, "value": "" if value is None else fmt.format(value)})
    return rows


def summary_line(summary: dict[str, Any]) -> str:
    """`train: step 600, loss 4.7768, val_loss 4.8011, 1 job(s), $0.00`."""
    parts = [f"step {summary.get('final_step')}"]
    for key in ("loss", "val_loss"):
        if summary.get(key) is not None:
            parts.append(f"{key} {summary[key]:.4f}")
    if summary.get("jobs") is not None:
        parts.append(f"{summary['jobs']} job(s)")
    if summary.get("cost_usd") is not None:
        parts.append(f"${summary['cost_usd']:,.2f}")
    return "train: " + ", ".join(parts)


@task(name="publish-training-report")
def publish_training_report(summary: dict[str, Any], run_id: str) -> None:
    rows = summary_rows(summary)
    create_table_artifact(rows, key=artifact_key("training-report", run_id), description=f"train of {run_id}")
