"""The parent flow `hlat`: one run id, the stages chained in DAG order, each skipped when cached."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.burn_in import burn_in
from flows.common import resolve, run_name, stop_jobs_on_cancel
from flows.evaluate import evaluate
from flows.params import OVERRIDES, PRESET, RUN_ID, STORAGE, Overrides, PresetName
from flows.precompile import precompile
from flows.prepare_data import prepare_data
from flows.train import train
from flows.train_tokenizer import train_tokenizer


@flow(name="hlat", flow_run_name=run_name, log_prints=True, on_cancellation=[stop_jobs_on_cancel])
def hlat(
    preset: PresetName = PRESET,
    run_id: str | None = RUN_ID,
    storage: str | None = STORAGE,
    overrides: Overrides = OVERRIDES,
) -> dict[str, Any]:
    """Pretrain an HLAT-style model: prepare-data -> train-tokenizer -> precompile -> burn-in -> train -> evaluate.
    A failed burn-in stops the DAG before training."""
    config, run = resolve(preset, overrides, run_id, storage)
    stage: dict[str, Any] = {
        "preset": preset,
        "overrides": overrides,
        "run_id": run.run_id,
        "storage": config.storage.root,
    }
    data = prepare_data(**stage)
    tokenizer = train_tokenizer(**stage)
    graphs = precompile(**stage)
    health = burn_in(**stage)
    training = train(**stage)
    scores = evaluate(**stage)
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

    from flows.cli import main

    sys.exit(main(["pretrain", *sys.argv[1:]]))
