"""Stage: train. Supervise training jobs on the configured backend (local processes or SageMaker), relaunching
from the newest checkpoint until training.max_steps, the relaunch budget or the dollar budget runs out.
Cancelling the flow run stops the job; a flow process that dies leaves it running, and the next run of this
flow re-attaches to it."""

from __future__ import annotations

from typing import Any

from hlat.core.run import Run
from hlat.flows.stage import not_a_command, stage_flow
from hlat.tasks.caching import run_cached
from hlat.tasks.init_from import import_weights
from hlat.tasks.plan import plan_parallelism
from hlat.tasks.tracking import start_tracking, track_training
from hlat.tasks.train import publish_training_report, summary_line, train_cache_key, train_model, training_present


@stage_flow("train")
def train(run: Run) -> dict[str, Any]:
    """Train the run's model from its prepared data and tokenizer."""
    start_tracking(run)  # the run's tracked run, which every training job resumes: checked before any job
    plan_parallelism(run)  # advice: warns on a slow configured layout, never stops the stage
    if run.config.model.init_from is not None:  # before the cache key: it holds the imported weights' hash
        import_weights(run)
    key = train_cache_key(run)
    summary: dict[str, Any] = run_cached(train_model, lambda _: training_present(run), run=run, cache_key=key)
    publish_training_report(summary, run.run_id)
    track_training(run, summary)
    print(summary_line(summary))
    return summary


if __name__ == "__main__":
    raise SystemExit(not_a_command(train.name))
