"""Stage: evaluate. Perplexity and bits per byte on the held-out split, lm-eval-harness tasks on the checkpoint
exported to Hugging Face, and a report (eval/results.json, eval/report.md, loss and gradient-norm plots) with
published baseline rows. Any committed checkpoint of the run: the newest by default, or `step`; with `averaged`,
`hlat average`'s (the mean of the last K checkpoints' weights, under averaged/), its results in
eval/averaged-step-N/."""

from __future__ import annotations

from typing import Any

from hlat.core.layout import AVERAGED_DIR, CHECKPOINTS_DIR, CheckpointError, locate_checkpoint
from hlat.core.run import Run
from hlat.flows.params import AVERAGED, STEP, OptionalStep
from hlat.flows.stage import not_a_command, stage_flow
from hlat.tasks.caching import run_cached
from hlat.tasks.evaluate import (
    check_task_names,
    evaluation_cache_key,
    evaluation_of,
    evaluation_present,
    evaluation_summary,
    write_eval_report,
)
from hlat.tasks.tracking import track_evaluation


@stage_flow("evaluate")
def evaluate(run: Run, step: OptionalStep = STEP, averaged: bool = AVERAGED) -> dict[str, Any]:
    """Evaluate a checkpoint of the run (default: the newest; `averaged`: `hlat average`'s) and write its report."""
    check_task_names(run.config)  # a typo fails here, in seconds, not in a job after the model is loaded
    folder = AVERAGED_DIR if averaged else CHECKPOINTS_DIR
    try:
        step = locate_checkpoint(f"{run.uri}/{folder}", step).step
    except CheckpointError as exc:
        first = "hlat average RUN --last K" if averaged else "the train stage"
        raise CheckpointError(f"evaluate: run {run.run_id}: {exc} (run {first} first)") from None
    key = evaluation_cache_key(run, step, averaged)
    results: dict[str, Any] = run_cached(
        evaluation_of,
        lambda _: evaluation_present(run, step, averaged),
        run=run,
        step=step,
        cache_key=key,
        averaged=averaged,
    )
    files = write_eval_report(results, run)
    track_evaluation(run, results)
    which = f"averaged step {step}" if averaged else f"step {step}"
    print(f"evaluate: {which}: {evaluation_summary(results)}; report {files.get('report.md')}")
    return {**results, "files": files}


if __name__ == "__main__":
    raise SystemExit(not_a_command(evaluate.name))
