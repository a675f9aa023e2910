"""The parent flow `hlat`: one run id, the stages chained in DAG order, each skipped when cached."""

from __future__ import annotations

import importlib
import logging
from typing import Any, cast
from uuid import UUID

from prefect import Flow, flow
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger
from pydantic import BaseModel

from hlat.core.stages import Stage, stages
from hlat.flows.params import OVERRIDES, PRESET, RUN_ID, STORAGE, OptionalText, Overrides, PresetName
from hlat.flows.stage import merged_overrides, run_name, stages_of, start_run, stop_jobs_on_cancel
from hlat.tasks.caching import artifact_key


def stage_flow_of(stage: Stage) -> Flow[..., Any]:
    """The Prefect flow of a stage: `flows/<module>.py`'s function of the same name."""
    flow_fn: Flow[..., Any] = getattr(importlib.import_module(f"hlat.flows.{stage.module}"), stage.module)
    return flow_fn


def chain() -> list[tuple[Stage, Flow[..., Any]]]:
    """The parent's DAG: each row of the table (core/stages.py) with its flow, in order."""
    return [(row, stage_flow_of(row)) for row in stages()]


class _Progress:
    """The DAG's place for the terminal ("stage k of 6: <name>") and for the parent run's page (one progress
    artifact, updated in place). Failing to publish never stops the run."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.artifact: UUID | None = None

    def stage(self, done: int, name: str | None = None) -> None:
        if name is not None:
            get_run_logger().info("stage %d of %d: %s", done + 1, len(stages()), name)
        what = f"{done} of {len(stages())} stages done" + (f"; running {name}" if name else "")
        try:
            if self.artifact is None:
                key = artifact_key("pretrain-progress", self.run_id)
                made = create_progress_artifact(100 * done / len(stages()), key=key, description=what)
                self.artifact = cast(UUID, made)  # sync_compatible: a UUID when called from sync code
            else:
                update_progress_artifact(self.artifact, 100 * done / len(stages()), description=what)
        except Exception as exc:
            logging.getLogger("hlat.pretrain").warning("could not update the progress artifact: %s", exc)


def _plain(result: Any) -> Any:
    """A stage's result as the parent returns it: JSON-like (a pydantic report as its dump)."""
    return result.model_dump(mode="json") if isinstance(result, BaseModel) else result


@flow(name="hlat", flow_run_name=run_name, log_prints=True, on_cancellation=[stop_jobs_on_cancel])
def hlat(
    preset: PresetName = PRESET,
    run_id: OptionalText = RUN_ID,
    storage: OptionalText = STORAGE,
    overrides: Overrides = OVERRIDES,
) -> dict[str, Any]:
    """Pretrain an HLAT-style model: prepare-data -> train-tokenizer -> precompile -> burn-in -> train -> evaluate
    (core/stages.py). A failed stage stops the DAG: a failed burn-in stops it before training."""
    # The run is started once, here, and handed to each stage (stages_of). The stages' parameters are the record of
    # what built the run, shown on their pages and used when one is re-run alone.
    changes = merged_overrides(overrides)  # the deployment's under the run's
    run = start_run(preset, changes, run_id, storage)
    params: dict[str, Any] = {
        "preset": preset,
        "overrides": changes,
        # A copy of the run id, not the open-run task's own string: Prefect links a value to the task that returned
        # it by identity, and drew an edge from open-run to every stage (the chain read as a fan).
        "run_id": "".join(run.run_id),
        "storage": run.config.storage.root,
    }
    progress = _Progress(run.run_id)
    results: dict[str, Any] = {"run_id": run.run_id, "run_uri": run.uri}
    previous: Any = None
    with stages_of(run):
        for done, (stage, stage_flow) in enumerate(chain()):
            progress.stage(done, stage.name)
            # The previous stage's result as this one's `wait_for`: the stages read their inputs from the run's
            # storage, not from each other's return values; Prefect finds the subflow run that returned `previous`
            # and records the edge, so the parent run's graph draws the chain prepare-data -> ... -> evaluate.
            wait_for = [previous] if previous is not None else None
            previous = stage_flow(**params, wait_for=wait_for)
            results[stage.name] = _plain(previous)
    progress.stage(len(stages()))
    print(f"hlat: run {run.run_id} done -> {run.uri}")
    return results


if __name__ == "__main__":
    from hlat.flows.stage import not_a_command

    raise SystemExit(not_a_command(hlat.name))
