"""train tasks: run the training job (relaunched from its last checkpoint when resumable), publish its summary."""

from __future__ import annotations

import json
from typing import Any

from prefect import Task, task
from prefect.artifacts import create_table_artifact
from prefect.client.schemas.objects import State, TaskRun

from infra.local_train import TrainingFailed, run_training
from infra.storage import Storage
from tasks.common import artifact_key, cache_key_param, is_transient
from training.checkpoint import CheckpointManager
from training.metrics import METRICS_FILE


def retry_resumable(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Relaunch when the job can resume from its checkpoint (killed, NaN exit) or the fault was transient."""
    try:
        state.result()
    except TrainingFailed as exc:
        return exc.exit.resumable
    except Exception as exc:
        return is_transient(exc)
    return False


def latest_checkpoint(run_uri: str) -> int | None:
    return CheckpointManager(Storage(run_uri).child("checkpoints"), keep_last=1).latest_step()


@task(name="train-model", cache_key_fn=cache_key_param, persist_result=True, retry_condition_fn=retry_resumable)
def train_model(run_uri: str, processes: int, cache_key: str) -> dict[str, Any]:
    """Run `training.train` on the run until max_steps; each retry resumes from the newest checkpoint."""
    run_training(f"{run_uri}/config.json", processes)
    return training_summary(run_uri)


def training_summary(run_uri: str) -> dict[str, Any]:
    """Final step, last training loss and validation loss, tokens/s, read back from metrics.jsonl."""
    run = Storage(run_uri)
    summary: dict[str, Any] = {"final_step": latest_checkpoint(run_uri)}
    if run.exists(METRICS_FILE):
        for line in run.read_text(METRICS_FILE).splitlines():
            record = json.loads(line)
            for key in ("loss", "val_loss", "tokens_per_s", "grad_norm", "lr", "mfu"):
                if record.get(key) is not None:
                    summary[key] = record[key]
    return summary


@task(name="publish-training-report")
def publish_training_report(summary: dict[str, Any], run_id: str) -> None:
    rows = [{"metric": k, "value": v} for k, v in summary.items()]
    create_table_artifact(rows, key=artifact_key("training-report", run_id), description=f"train of {run_id}")
