"""Stage: burn-in. Check the cluster training will use before training starts: devices, matmul throughput and
correctness on every device, all-reduce bandwidth across all ranks, write throughput to the checkpoint location.
A failing rank or node stops the DAG before training (unless burn_in.continue_on_failure)."""

from __future__ import annotations

from typing import Any

from hlat.core.config import HlatConfig
from hlat.flows.stage import stage_flow
from hlat.infra.runs import Run
from hlat.tasks.burn_in import burn_in_cache_key, burn_in_cluster, burn_in_present
from hlat.tasks.caching import run_cached


@stage_flow("burn-in")
def burn_in(config: HlatConfig, run: Run) -> dict[str, Any]:
    """Burn in the instances (or local ranks) the run's training will use."""
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
    from hlat.cli import run_stage_module

    run_stage_module(burn_in.name)
