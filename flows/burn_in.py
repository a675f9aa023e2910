"""Stage: burn-in. Check the cluster training will use before training starts: devices, matmul throughput and
correctness on every device, all-reduce bandwidth across all ranks, write throughput to the checkpoint location.
A failing rank or node stops the DAG before training (unless burn_in.continue_on_failure)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from hlat.flows.params import OVERRIDES, PRESET, RUN_ID, STORAGE, OptionalText, Overrides, PresetName
from hlat.flows.stage import resolve, run_name, stop_jobs_on_cancel
from hlat.tasks.burn_in import burn_in_cache_key, burn_in_cluster, burn_in_present
from hlat.tasks.caching import run_cached


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
    report: dict[str, Any] = run_cached(
        burn_in_cluster,
        lambda r: burn_in_present(run.uri, r),
        config=config,
        run_uri=run.uri,
        run_id=run.run_id,
        cache_key=burn_in_cache_key(config, run.uri),
    )
    print(f"burn-in: {'passed' if report.get('passed') else 'FAILED'} on {report.get('world_size')} rank(s)")
    return report


if __name__ == "__main__":
    import sys

    from hlat.cli import main

    sys.exit(main(["run", "burn-in", *sys.argv[1:]]))
