"""Stage: burn-in. Check the cluster training will use before training starts: devices, matmul throughput and
correctness on every device, all-reduce bandwidth across all ranks, write throughput to the checkpoint location.
A failing rank or node stops the DAG before training (unless burn_in.continue_on_failure)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.common import resolve, run_name, stop_jobs_on_cancel
from flows.params import OVERRIDES, PRESET, RUN_ID, STORAGE, OptionalText, Overrides, PresetName
from infra.backends import job_shape
from infra.storage import Storage
from tasks.common import run_cached, stage_cache_key
from tasks.jobs import BURN_IN_REPORT, burn_in_cluster


@flow(name="burn-in", flow_run_name=run_name, log_prints=True, on_cancellation=[stop_jobs_on_cancel])
def burn_in(
    preset: PresetName = PRESET,
    run_id: OptionalText = RUN_ID,
    storage: OptionalText = STORAGE,
    overrides: Overrides = OVERRIDES,
) -> dict[str, Any]:
    """Burn in the instances (or local ranks) the run's training will use."""
    config, run = resolve(preset, overrides, run_id, storage)
    if not config.burn_in.enabled:
        print("burn-in: skipped (burn_in.enabled is false)")
        return {"status": "skipped"}
    key = stage_cache_key(
        "burn-in",
        run.uri,
        config.section_hash("burn_in", "precision"),
        job_shape(config),
    )
    report: dict[str, Any] = run_cached(
        burn_in_cluster,
        lambda _: Storage(run.uri).exists(BURN_IN_REPORT),
        config=config,
        run_uri=run.uri,
        run_id=run.run_id,
        cache_key=key,
    )
    print(f"burn-in: {'passed' if report.get('passed') else 'FAILED'} on {report.get('world_size')} rank(s)")
    return report


if __name__ == "__main__":
    import sys

    from flows.cli import main

    sys.exit(main(["run", "burn-in", *sys.argv[1:]]))
