"""precompile task: runs the stage's short job on the run's backend (a few training steps that fill the compile
cache), then reads the compile cache's manifest."""

from __future__ import annotations

import logging
from typing import Any

from prefect import task

from hlat.core.config import HlatConfig
from hlat.core.layout import COMPILE_LATEST
from hlat.core.run import Run
from hlat.core.stages import stage
from hlat.infra.stage_jobs import job_shape, on_neuron, run_stage_job
from hlat.tasks.caching import CACHED_STAGE, stage_cache_key
from hlat.tasks.init_from import imported_identity
from hlat.tasks.job_failures import job_ended_badly

log = logging.getLogger("hlat.jobs")


def precompile_needed(config: HlatConfig) -> str | None:
    """Why the precompile stage has nothing to do, or None when it has work."""
    if not config.precompile.enabled:
        return "precompile.enabled is false"
    if on_neuron(config) or config.training.device == "xla":  # XLA:CPU: torch-xla's persistent compile cache
        return None
    if not config.training.compile:
        return "training.compile is off: eager PyTorch on CPU/CUDA has no graphs to build"
    return None


def precompile_cache_key(run: Run) -> str:
    """What the compiled graphs depend on: model, parallelism, precision, the precompile and Neuron settings, the
    step's shape, where the jobs run, and the run's tokenizer (an input in core/stages.py)."""
    config = run.config
    t = config.training
    return stage_cache_key(
        run,
        "precompile",
        config.section_hash("model", "parallelism", "precision", "precompile", "neuron"),
        [t.seq_len, t.micro_batch_size, t.compile, t.device],
        job_shape(config),
        *imported_identity(run),  # the imported checkpoint decides the model's shape (its config.json)
    )


def precompile_present(run: Run, result: dict[str, Any]) -> bool:
    """A cached precompile counts while its cache's latest.json is there (or it had nothing to build)."""
    return result.get("status") == "skipped" or stage("precompile").done(run, run.config)


@task(name="precompile-graphs", **CACHED_STAGE)
def precompile_graphs(run: Run, cache_key: str) -> dict[str, Any]:
    """Run the precompile job (a few training steps: torch.compile, or neuron_parallel_compile on trn1) so the
    compiled graphs land in compile-cache/ before training starts."""
    skip = precompile_needed(run.config)
    if skip:
        log.info("precompile: skipped (%s)", skip)
        return {"status": "skipped", "reason": skip}
    record, state = run_stage_job(run, "precompile")
    out = run.storage
    if state is None or state.status.value != "Completed" or not out.exists(COMPILE_LATEST):
        raise job_ended_badly(run, "precompile", record, COMPILE_LATEST)
    latest: dict[str, Any] = out.read_json(COMPILE_LATEST)
    return {"status": "built", "job": record.job_name, **latest}
