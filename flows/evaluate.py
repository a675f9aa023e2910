"""Stage: evaluate. Perplexity and bits per byte on the held-out split, lm-eval-harness tasks on the checkpoint
exported to Hugging Face, and a report (eval/results.json, eval/report.md, loss and gradient-norm plots) with
published baseline rows. Any committed checkpoint of the run: the newest by default, or `step`."""

from __future__ import annotations

from typing import Any

from hlat.core.config import HlatConfig
from hlat.core.layout import CheckpointError, locate_checkpoint
from hlat.flows.params import STEP, OptionalStep
from hlat.flows.stage import stage_flow
from hlat.infra.runs import Run
from hlat.tasks.caching import run_cached
from hlat.tasks.evaluate import (
    check_task_names,
    evaluate_checkpoint,
    evaluation_cache_key,
    evaluation_present,
    evaluation_summary,
    write_eval_report,
)


@stage_flow("evaluate")
def evaluate(config: HlatConfig, run: Run, step: OptionalStep = STEP) -> dict[str, Any]:
    """Evaluate a checkpoint of the run (default: the newest) and write its report."""
    check_task_names(config)  # a typo fails here, in seconds, not in a job after the model is loaded
    try:
        step = locate_checkpoint(f"{run.uri}/checkpoints", step).step
    except CheckpointError as exc:
        raise CheckpointError(f"evaluate: run {run.run_id}: {exc} (run the train stage first)") from None
    key = evaluation_cache_key(config, run.uri, step)
    results: dict[str, Any] = run_cached(
        evaluate_checkpoint,
        lambda _: evaluation_present(run.uri, step),
        config=config,
        run_uri=run.uri,
        run_id=run.run_id,
        step=step,
        cache_key=key,
    )
    files = write_eval_report(results, run.uri, run.run_id)
    print(f"evaluate: step {step}: {evaluation_summary(results)}; report {files.get('report.md')}")
    return {**results, "files": files}


if __name__ == "__main__":
    from hlat.cli import run_stage_module

    run_stage_module(evaluate.name)
