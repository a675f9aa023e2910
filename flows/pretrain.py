"""The parent flow `hlat`: one run id, the stages chained in DAG order, each skipped when cached."""

from __future__ import annotations

import logging
from typing import Any, cast
from uuid import UUID

from prefect import flow
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

from hlat.flows.burn_in import burn_in
from hlat.flows.evaluate import evaluate
from hlat.flows.params import OVERRIDES, PRESET, RUN_ID, STORAGE, OptionalText, Overrides, PresetName
from hlat.flows.precompile import precompile
from hlat.flows.prepare_data import prepare_data
from hlat.flows.stage import merged_overrides, run_name, stages_of, start_run, stop_jobs_on_cancel
from hlat.flows.train import train
from hlat.flows.train_tokenizer import train_tokenizer
from hlat.tasks.caching import artifact_key

STAGES = ("prepare-data", "train-tokenizer", "precompile", "burn-in", "train", "evaluate")


class _Progress:
    """The DAG's place for the terminal ("stage k of 6: <name>") and for the parent run's page (one progress
    artifact, updated in place). Failing to publish never stops the run."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.artifact: UUID | None = None

    def stage(self, done: int, name: str | None = None) -> None:
        if name is not None:
            get_run_logger().info("stage %d of %d: %s", done + 1, len(STAGES), name)
        what = f"{done} of {len(STAGES)} stages done" + (f"; running {name}" if name else "")
        try:
            if self.artifact is None:
                key = artifact_key("pretrain-progress", self.run_id)
                made = create_progress_artifact(100 * done / len(STAGES), key=key, description=what)
                self.artifact = cast(UUID, made)  # sync_compatible: a UUID when called from sync code
            else:
                update_progress_artifact(self.artifact, 100 * done / len(STAGES), description=what)
        except Exception as exc:
            logging.getLogger("hlat.pretrain").warning("could not update the progress artifact: %s", exc)


def _after(previous: Any, stage_flow: Any, **params: Any) -> Any:
    """Run the next stage with the previous stage's result as its `wait_for`. The stages read their inputs from the
    run's storage, not from each other's return values; Prefect finds the subflow run that returned `previous` and
    records the edge, so the parent run's graph draws the chain prepare-data -> ... -> evaluate."""
    return stage_flow(**params, wait_for=[previous])


@flow(name="hlat", flow_run_name=run_name, log_prints=True, on_cancellation=[stop_jobs_on_cancel])
def hlat(
    preset: PresetName = PRESET,
    run_id: OptionalText = RUN_ID,
    storage: OptionalText = STORAGE,
    overrides: Overrides = OVERRIDES,
) -> dict[str, Any]:
    """Pretrain an HLAT-style model: prepare-data -> train-tokenizer -> precompile -> burn-in -> train -> evaluate.
    A failed burn-in stops the DAG before training."""
    # The run is started once, here; each stage reads its config.json (stages_of). The stages' parameters are the
    # record of what built the run, shown on their pages and used when one is re-run alone.
    changes = merged_overrides(overrides)  # the deployment's under the run's
    config, run = start_run(preset, changes, run_id, storage)
    stage: dict[str, Any] = {
        "preset": preset,
        "overrides": changes,
        # A copy of the run id, not the open-run task's own string: Prefect links a value to the task that returned
        # it by identity, and drew an edge from open-run to every stage (the chain read as a fan). The chain's
        # edges are the stages' wait_for (`_after`).
        "run_id": "".join(run.run_id),
        "storage": config.storage.root,
    }
    progress = _Progress(run.run_id)
    with stages_of(run, config):
        progress.stage(0, STAGES[0])
        data = prepare_data(**stage)
        progress.stage(1, STAGES[1])
        tokenizer = _after(data, train_tokenizer, **stage)
        progress.stage(2, STAGES[2])
        graphs = _after(tokenizer, precompile, **stage)
        progress.stage(3, STAGES[3])
        health: dict[str, Any] = _after(graphs, burn_in, **stage)
        progress.stage(4, STAGES[4])
        training = _after(health, train, **stage)
        progress.stage(5, STAGES[5])
        scores: dict[str, Any] = _after(training, evaluate, **stage)
    progress.stage(6)
    print(f"hlat: run {run.run_id} done -> {run.uri}")
    return {
        "run_id": run.run_id,
        "run_uri": run.uri,
        "data": data.model_dump(mode="json"),
        "tokenizer": tokenizer,
        "precompile": graphs,
        "burn_in": {k: health.get(k) for k in ("status", "passed", "world_size", "failures") if k in health},
        "train": training,
        "evaluate": {k: scores.get(k) for k in ("step", "perplexity", "lm_eval", "files")},
    }


if __name__ == "__main__":
    import sys

    from hlat.cli import main

    sys.exit(main(["pretrain", *sys.argv[1:]]))
