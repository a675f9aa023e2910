"""Stage: train. Launch the training entrypoint on the run's data and tokenizer; relaunch from the newest
checkpoint until done or job.max_restarts runs out. (The SageMaker and local job backends generalise this.)"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.common import resolve, run_name
from tasks.common import run_cached, stage_cache_key
from tasks.tokenizer import read_data_checksum, read_tokenizer_checksum
from tasks.train import latest_checkpoint, publish_training_report, train_model


@flow(name="train", flow_run_name=run_name, log_prints=True)
def train(
    preset: str = "tiny",
    overrides: dict[str, Any] | None = None,
    run_id: str | None = None,
    storage: str | None = None,
) -> dict[str, Any]:
    """Train the run's model from its prepared data and tokenizer."""
    config, run = resolve(preset, overrides, run_id, storage)
    key = stage_cache_key(
        "train", run.uri, config.fingerprint(), read_data_checksum(run.uri), read_tokenizer_checksum(run.uri)
    )
    summary: dict[str, Any] = run_cached(
        train_model.with_options(retries=config.job.max_restarts, retry_delay_seconds=2),
        lambda _: latest_checkpoint(run.uri) == config.training.max_steps,
        run_uri=run.uri,
        processes=config.world_size,
        cache_key=key,
    )
    publish_training_report(summary, run.run_id)
    print(f"train: step {summary.get('final_step')}, loss {summary.get('loss')}, val_loss {summary.get('val_loss')}")
    return summary


if __name__ == "__main__":
    import sys

    from flows.cli import main

    sys.exit(main(["run", "train", *sys.argv[1:]]))
