"""The parent flow `hlat`: one run id, the stages chained in DAG order, each skipped when cached."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.common import resolve, run_name
from flows.prepare_data import prepare_data
from flows.train import stop_job_on_cancel, train
from flows.train_tokenizer import train_tokenizer


@flow(name="hlat", flow_run_name=run_name, log_prints=True, on_cancellation=[stop_job_on_cancel])
def hlat(
    preset: str = "tiny",
    overrides: dict[str, Any] | None = None,
    run_id: str | None = None,
    storage: str | None = None,
) -> dict[str, Any]:
    """Pretrain an HLAT-style model: prepare-data -> train-tokenizer -> train (later stages join as they land)."""
    config, run = resolve(preset, overrides, run_id, storage)
    root = config.storage.root
    data = prepare_data(preset=preset, overrides=overrides, run_id=run.run_id, storage=root)
    tokenizer = train_tokenizer(preset=preset, overrides=overrides, run_id=run.run_id, storage=root)
    training = train(preset=preset, overrides=overrides, run_id=run.run_id, storage=root)
    print(f"hlat: run {run.run_id} done -> {run.uri}")
    return {
        "run_id": run.run_id,
        "run_uri": run.uri,
        "data": data.model_dump(mode="json"),
        "tokenizer": tokenizer,
        "train": training,
    }


if __name__ == "__main__":
    import sys

    from flows.cli import main

    sys.exit(main(["pretrain", *sys.argv[1:]]))
