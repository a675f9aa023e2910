"""precompile task: runs the stage's short job on the run's backend (a few training steps that fill the compile
cache), then reads the compile cache's manifest."""

from __future__ import annotations

import logging
from typing import Any

from prefect import task

from hlat.core.config import HlatConfig
from hlat.core.layout import COMPILE_LATEST
from hlat.core.storage import Storage
from hlat.infra.stage_jobs import job_shape, on_neuron, run_stage_job
from hlat.tasks.caching import CACHED_STAGE, stage_cache_key
from hlat.tasks.job_failures import job_ended_badly, log_hint
from hlat.tasks.train_tokenizer import read_tokenizer_checksum

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


def precompile_cache_key(config: HlatConfig, run_uri: str) -> str:
    """What the compiled graphs depend on: model, parallelism, precision, the precompile and Neuron settings, the
    step's shape, where the jobs run, and the run's tokenizer."""
    t = config.training
    return stage_cache_key(
        "precompile",
        run_uri,
        config.section_hash("model", "parallelism", "precision", "precompile", "neuron"),
        [t.seq_len, t.micro_batch_size, t.compile, t.device],
        job_shape(config),
        read_tokenizer_checksum(run_uri),
    )


def precompile_present(run_uri: str, result: dict[str, Any]) -> bool:
    """A cached precompile counts while its cache's latest.json is there (or it had nothing to build)."""
    return result.get("status") == "skipped" or Storage(run_uri).exists(COMPILE_LATEST)


@task(name="precompile-graphs", **CACHED_STAGE)
def precompile_graphs(config: HlatConfig, run_uri: str, run_id: str, cache_key: str) -> dict[str, Any]:
    """Run the precompile job (a few training steps: torch.compile, or neuron_parallel_compile on trn1) so the
    compiled graphs land in compile-cache/ before training starts."""
    skip = precompile_needed(config)
    if skip:
        log.info("precompile: skipped (%s)", skip)
        return {"status": "skipped", "reason": skip}
    record, state = run_stage_job(config, run_uri, run_id, "precompile")
    run = Storage(run_uri)
    if state is None or state.status.value != "Completed" or not run.exists(COMPILE_LATEST):
        raise job_ended_badly("precompile", record, run, COMPILE_LATEST, log_hint(config, run, record))
    latest: dict[str, Any] = run.read_json(COMPILE_LATEST)
    return {"status": "built", "job": record.job_name, **latest}
