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

from hlat.core.layout import (
    CHECKPOINTS_DIR,
    DATA_DIR,
    IMPORT_RECORD,
    MANIFEST_FILE,
    METRICS_FILE,
    REPORT_FILE,
    TOKENIZER_DIR,
    CheckpointIndex,
)
from hlat.core.mixture import SourceDraw, check_repetition
from hlat.core.models.job import job_model
from hlat.core.run import Run
from hlat.core.shards import read_mixture
from hlat.core.stages import stage
from hlat.core.storage import Storage
from hlat.infra.cost.budget import budget
from hlat.infra.stage_jobs import supervisor_for
from hlat.infra.supervision.ledger import Attempt
from hlat.infra.supervision.progress import Progress
from hlat.tasks.alerts import TrainAlerts
from hlat.tasks.caching import CACHED_STAGE, artifact_key, stage_cache_key
from hlat.tasks.init_from import imported_identity
from hlat.tasks.tracking import MetricsMirror

log = logging.getLogger("hlat.train")


def latest_checkpoint(run: Run) -> int | None:
    """The step of the run's newest committed checkpoint (None: none yet)."""
    return CheckpointIndex(run.storage.child(CHECKPOINTS_DIR)).latest_step()


def train_cache_key(run: Run) -> str:
    """What the trained weights depend on: the run's fingerprint, and its shards and tokenizer (the inputs
    core/stages.py names)."""
    return stage_cache_key(run, "train", run.config.fingerprint(), *imported_identity(run))


def training_present(run: Run) -> bool:
    """A cached training counts while the stage is done: the newest checkpoint reached training.max_steps."""
    return stage("train").done(run, run.config)


def measured_source_tokens(data: Storage, tokenizer: Storage) -> dict[str, int]:
    """Each prepared source's training tokens, estimated as its train_bytes over the tokenizer report's
    bytes_per_token (measured on the run's held-out mixture, so a source whose text tokenizes unlike the mixture's
    is estimated less well). Empty when the data or the tokenizer report is not there yet."""
    if not data.exists(MANIFEST_FILE) or not tokenizer.exists(REPORT_FILE):
        return {}
    bytes_per_token = tokenizer.read_json(REPORT_FILE).get("bytes_per_token")
    if not bytes_per_token:
        return {}
    mixture, _ = read_mixture(data)
    return {s.name: round(s.train_bytes / bytes_per_token) for s in mixture.sources}


def model_changes(run: Run) -> list[str]:
    """What the training jobs' model becomes (`job_model`), in the lines each job logs too: the imported checkpoint's
    family and shape, then the pretrained tokenizer's vocabulary. ConfigError when the padded size does not divide
    over the tensor ranks or the imported embedding does not fit the tokenizer."""
    tokenizer = run.stage(TOKENIZER_DIR)
    record = run.storage.read_json(IMPORT_RECORD) if run.storage.exists(IMPORT_RECORD) else None
    pretrained = run.config.tokenizer.pretrained is not None and tokenizer.exists(REPORT_FILE)
    vocab = int(tokenizer.read_json(REPORT_FILE)["vocab_size"]) if pretrained else None
    _, lines = job_model(run.config, record["config"] if record is not None else None, vocab)
    return lines


def check_training_repetition(run: Run) -> list[SourceDraw]:
    """The tokens the run draws from each source against its measured size: ConfigError (naming the source and the
    numbers) when a source would be repeated past its max_epochs, before any training job is launched."""
    measured = measured_source_tokens(run.stage(DATA_DIR), run.stage(TOKENIZER_DIR))
    return check_repetition(run.config, measured)


def source_tokens(record: dict[str, Any]) -> dict[str, int]:
    """The `tokens/<source>` counts of a metrics record, by source name."""
    return {key.split("/", 1)[1]: int(value) for key, value in record.items() if key.startswith("tokens/")}


def mixture_line(counts: dict[str, int]) -> str:
    """`web 60.1%, code 29.8%, books 10.1%`: each source's share of the tokens counted."""
    total = sum(counts.values())
    return ", ".join(f"{name} {n / total:.1%}" for name, n in counts.items()) if total else ""


def latest_source_tokens(run: Run, tail_bytes: int = 1 << 16) -> dict[str, int]:
    """The per-source counts of the newest metrics record that has them, from the last `tail_bytes` of
    metrics.jsonl only (the file grows with the run; the progress artifact reads it at every new step)."""
    if not run.storage.exists(METRICS_FILE):
        return {}
    size = run.storage.size(METRICS_FILE)
    with run.storage.open(METRICS_FILE, "rb") as fh:
        fh.seek(max(0, size - tail_bytes))
        tail = fh.read().decode("utf-8", errors="replace").splitlines()
    for line in reversed(tail[1:] if size > tail_bytes else tail):  # the first line may be cut
        try:
            counts = source_tokens(json.loads(line))
        except ValueError:
            continue
        if counts:
            return counts
    return {}


class _Artifacts:
    """The stage's live artifacts: a progress bar (with the progress line, and each source's share of the tokens
    so far, as its description) and the attempts table, each created once and then updated in place: one card per
    artifact in the flow run, not a new keyed version on every change. Failing to publish never stops training."""

    def __init__(self, run_id: str, run: Run | None = None) -> None:
        self.run_id, self.run = run_id, run
        self.progress_id: UUID | None = None
        self.attempts_id: UUID | None = None
        self.rows: list[dict[str, Any]] | None = None
        self.mix: tuple[int | None, str] = (None, "")  # (step, line) of the last per-source shares read

    def description(self, p: Progress) -> str:
        """The progress line, then the sources' shares of the tokens (data rank 0's counts), read again only when
        a new step was logged."""
        if self.run is not None and (p.step != self.mix[0] or p.final):
            try:
                self.mix = (p.step, mixture_line(latest_source_tokens(self.run)))
            except Exception as exc:  # a metrics file being rewritten must not stop the progress bar
                log.debug("could not read the per-source tokens: %s", exc)
        return f"{p.line()}; sources: {self.mix[1]}" if self.mix[1] else p.line()

    def progress(self, p: Progress) -> None:
        try:
            description = self.description(p)
            if self.progress_id is None:
                key = artifact_key("train-progress", self.run_id)
                made = create_progress_artifact(100 * p.fraction, key=key, description=description)
                self.progress_id = cast(UUID, made)  # sync_compatible: a UUID when called from sync code
            else:
                update_progress_artifact(self.progress_id, 100 * p.fraction, description=description)
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

    # A source the run would repeat past its max_epochs fails the stage here, before any job is submitted.
    check_training_repetition(run)
    for change in model_changes(run):
        log.info("train: %s", change)
    artifacts = _Artifacts(run.run_id, run)
    evaluator = CheckpointEvaluator(run)
    alerts = TrainAlerts(run, budget(run.config).usd)
    mirror = MetricsMirror(run)  # a SageMaker job's metrics into the tracked run (its job tracks nothing itself)

    def on_progress(p: Progress) -> None:
        artifacts.progress(p)
        alerts.progress(p)
        mirror.poll()
        evaluator.poll()

    def on_attempts(attempts: list[Attempt]) -> None:
        artifacts.attempts(attempts)
        alerts.attempts(attempts)

    supervisor = supervisor_for(
        run,
        current_step=lambda: latest_checkpoint(run),
        on_progress=on_progress,
        on_attempts=on_attempts,
    )
    alerts.started(latest_checkpoint(run), run.config.training.max_steps)
    try:
        attempts = supervisor.run_to_completion()
    except BaseException as exc:  # the stage stops watching: a stalled-training alert would say nothing new
        alerts.ended(type(exc).__name__)
        raise
    finally:
        mirror.close()  # what the last attempt flushed
    alerts.ended("done")
    # Only on success: a failed or interrupted stage must not wait for evaluations (a cancelled flow's hook stops
    # the evaluation job with the others).
    evaluator.close()
    summary = training_summary(run)
    summary.update(jobs=len(attempts), cost_usd=round(supervisor.spent_usd(), 2))
    # The stage's throughput is the attempts' average, the final progress line's figure, not the trainer's reading
    # of its last logged step (143 against 412 tokens/s under load); the start-up before the first step apart.
    summary.pop("tokens_per_s", None)
    if (tokens_per_s := supervisor.tokens_per_s()) is not None:
        summary["tokens_per_s"] = tokens_per_s
    if (startup_s := supervisor.startup_s()) is not None:
        summary["startup_s"] = startup_s
    return summary


def training_summary(run: Run) -> dict[str, Any]:
    """Final step, the last logged training loss, validation loss, gradient norm, learning rate, tokens/s and MFU
    (each the trainer's reading at its last logged step), and each source's tokens at the last record that counts
    them (`tokens/<source>`, data rank 0's, with `data_degree`), read back from metrics.jsonl. The stage replaces
    tokens/s with its attempts' average where it measured one."""
    summary: dict[str, Any] = {"final_step": latest_checkpoint(run)}
    sources: dict[str, Any] = {}
    if run.storage.exists(METRICS_FILE):
        for line in run.storage.read_text(METRICS_FILE).splitlines():
            record = json.loads(line)
            for key in ("loss", "val_loss", "tokens_per_s", "grad_norm", "lr", "mfu"):
                if record.get(key) is not None:
                    summary[key] = record[key]
            if counts := source_tokens(record):
                sources = {f"tokens/{name}": n for name, n in counts.items()}
                sources["data_degree"] = record.get("data_degree", 1)
    return {**summary, **sources}


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
    """The training report's rows: each figure labelled with what it is and rounded to what it means; each source's
    tokens with its share of them (data rank 0's counts: every data rank mixes its own documents by the same rule,
    so the run's shares are the same and its tokens about data_degree times these)."""
    counts = source_tokens(summary)
    total = sum(counts.values())
    degree = summary.get("data_degree", 1)
    rank = "data rank 0" if degree == 1 else f"data rank 0 of {degree}"
    rows = []
    for key, value in summary.items():
        if key == "data_degree":
            continue
        if key.startswith("tokens/"):
            name = key.split("/", 1)[1]
            share = f" ({value / total:.1%})" if total else ""
            rows.append({"metric": f"tokens from source {name} ({rank})", "value": f"{value:,}{share}"})
            continue
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
