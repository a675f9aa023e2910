"""Stage: burn-in. Check the cluster training will use before training starts: devices, matmul throughput and
correctness on every device, all-reduce bandwidth across all ranks, write throughput to the checkpoint location.
A failing rank or node stops the DAG before training (unless burn_in.continue_on_failure)."""

from __future__ import annotations

from typing import Any

from hlat.core.run import Run
from hlat.flows.stage import not_a_command, stage_flow
from hlat.tasks.burn_in import burn_in_cache_key, burn_in_cluster, burn_in_present
from hlat.tasks.caching import run_cached


@stage_flow("burn-in")
def burn_in(run: Run) -> dict[str, Any]:
    """Burn in the instances (or local ranks) the run's training will use."""
    if not run.config.burn_in.enabled:
        print("burn-in: skipped (burn_in.enabled is false)")
        return {"status": "skipped"}
    key = burn_in_cache_key(run)
    report: dict[str, Any] = run_cached(burn_in_cluster, lambda r: burn_in_present(run, r), run=run, cache_key=key)
    print(f"burn-in: {'passed' if report.get('passed') else 'FAILED'} on {report.get('world_size')} rank(s)")
    return report


if __name__ == "__main__":
    raise SystemExit(not_a_command(burn_in.name))
