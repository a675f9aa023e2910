"""Stage: precompile. Build the training step's compiled graphs before training, into the run's compile-cache/:
on trn1 a short job under neuron_parallel_compile (same image and instances as training), on CPU/CUDA a job that
saves torch.compile's artifacts. Training jobs load the cache; a stale one is reported and not used."""

from __future__ import annotations

from typing import Any

from hlat.core.run import Run
from hlat.flows.stage import not_a_command, stage_flow
from hlat.tasks.caching import run_cached
from hlat.tasks.init_from import import_weights
from hlat.tasks.precompile import precompile_cache_key, precompile_graphs, precompile_present


@stage_flow("precompile")
def precompile(run: Run) -> dict[str, Any]:
    """Precompile the training graphs of the run's model, sequence length, batch, parallelism and precision."""
    if run.config.model.init_from is not None:  # the jobs build the model its config.json describes
        import_weights(run)
    key = precompile_cache_key(run)
    result: dict[str, Any] = run_cached(precompile_graphs, lambda r: precompile_present(run, r), run=run, cache_key=key)
    print(f"precompile: {result.get('status')} ({result.get('reason') or result.get('digest', '')})")
    return result


if __name__ == "__main__":
    raise SystemExit(not_a_command(precompile.name))
