"""Entrypoint of a precompile job: `python -m hlat.training.precompile --config <path or s3 uri of config.json>`.

It builds the training step's graphs once into the run's compile-cache/, so no training job compiles from scratch.
Rules:
- it runs on training's instances and process count, because the graphs depend on them.
- it rehearses the training loop itself (`Trainer.fit`) for precompile.steps steps (HLAT's: 4).
- metrics and checkpoints go to throwaway folders: the run's history stays training's, the weights are dropped.
- CPU/CUDA save torch.compile's artifacts and Inductor kernels; eager runs record that nothing compiles.
- trn1 runs under neuron_parallel_compile: graphs are extracted, values invalid, nothing acted on.
- XLA:CPU packs torch-xla's persistent cache for training jobs with the same key.
docs/stages.md ("precompile") tells the whole story.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hlat.core.config import HlatConfig
from hlat.core.contract import channel_location, fetch_tokenizer, job_arguments, read_job_config, reporting_failure
from hlat.core.environment import neuron_available
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training.assembly import build_model
from hlat.training.compile_cache import (
    CACHE_DIR,
    cache_key,
    human_bytes,
    key_digest,
    torch_cache_dir,
    use_inductor_cache_dir,
    write_neuron_manifest,
    write_torch_cache,
    write_xla_cache,
    xla_cache_dir,
)
from hlat.training.loop import Trainer
from hlat.training.models.job import job_config
from hlat.training.parallel.distributed import World, close_world, init_world, resolve_device_kind

NOTHING_TO_COMPILE = "training.compile is false: eager PyTorch on CPU/CUDA has no graphs to build"


def main(argv: list[str] | None = None) -> int:
    args = job_arguments("python -m hlat.training.precompile", __doc__, argv, None)
    return reporting_failure(lambda: _precompile(args.config, args.device))


def _precompile(config_uri: str, device: str | None) -> int:
    run = read_job_config(config_uri)
    cfg = run.config
    cfg = job_config(run, cfg)  # model.vocab_size follows a pretrained tokenizer, as in the training job
    cache = run.storage.child(CACHE_DIR)
    kind = resolve_device_kind(device or cfg.training.device)
    if kind == "xla":
        return _precompile_xla(run, cfg, cache)
    world = init_world(kind, cfg)
    try:
        key = cache_key(cfg, world.world_size, world.device.type)
        folder = cache.uri(torch_cache_dir(key_digest(key)))
        if not cfg.training.compile:
            if world.is_main:
                write_torch_cache(cache, key, None, steps=0, seconds=0.0, note=NOTHING_TO_COMPILE)
                print(f"precompile: nothing to compile ({NOTHING_TO_COMPILE}) -> {folder}", flush=True)
            return 0
        steps = cfg.precompile.steps
        with tempfile.TemporaryDirectory(prefix="hlat-precompile-inductor-") as inductor:
            # A fresh Inductor disk cache, set before the first compile: it ends up holding this key's kernels
            # and nothing else, and is packed next to the artifacts.
            use_inductor_cache_dir(inductor)
            torch.compiler.reset()  # every graph compiled from here on is recorded for save_cache_artifacts
            seconds = rehearse(run, cfg, world)
            saved = torch.compiler.save_cache_artifacts()
            if saved is None:
                raise RuntimeError(
                    f"torch.compile recorded no cache artifacts in {steps} steps: are Inductor's caches switched off "
                    "(TORCHINDUCTOR_FX_GRAPH_CACHE=0 or TORCHINDUCTOR_AUTOGRAD_CACHE=0 in the job's environment)?"
                )
            artifacts, _ = saved
            if world.is_main:  # the other ranks compiled the same kernels
                manifest = write_torch_cache(cache, key, artifacts, steps=steps, seconds=seconds, inductor_dir=inductor)
                kernels = (
                    f"{human_bytes(manifest['inductor_bytes'])} of Inductor cache ({manifest['inductor_files']} files)"
                    if manifest["inductor_files"]
                    else "no Inductor cache files"
                )
                print(
                    f"precompile: {steps} steps traced in {seconds:.1f} s, {human_bytes(len(artifacts))} of artifacts "
                    f"and {kernels} -> {folder}",
                    flush=True,
                )
            world.barrier()  # no rank ends the job before the cache is written
        return 0
    finally:
        close_world()


def rehearsal_config(cfg: HlatConfig) -> HlatConfig:
    """The job's config cut to precompile.steps steps that still take every path a real step can take.

    That is a health check, a checkpoint one step before the end, the last checkpoint and validation pass,
    the stop vote and every sync point's host reads. The schedule keeps the job's horizon.
    """
    steps, t = cfg.precompile.steps, cfg.training
    training = t.model_copy(
        update={
            "max_steps": steps,
            "schedule_steps": t.schedule_horizon,
            "checkpoint_every": max(steps - 1, 1),
            "eval_every": 0,  # validation once, after the last step (its own graph)
        }
    )
    burn_in = cfg.burn_in
    if burn_in.health_check_every:
        burn_in = burn_in.model_copy(update={"health_check_every": max(steps - 2, 1)})
    return cfg.model_copy(update={"training": training, "burn_in": burn_in})


def rehearse(run: Run, cfg: HlatConfig, world: World) -> float:
    """Run `Trainer.fit` on `rehearsal_config(cfg)` over the run's data, writing to throwaway folders; return
    seconds.
    """
    with throwaway_trainer(run, rehearsal_config(cfg), world) as trainer:
        start = time.perf_counter()
        code = trainer.fit()
        if code:
            raise RuntimeError(
                f"the precompile steps ended with exit code {code} (a non-finite loss or a bad collective)"
            )
        if trainer.step < trainer.cfg.training.max_steps:  # a stop (SIGTERM): the later steps' graphs are missing
            raise RuntimeError(
                f"the precompile stopped at step {trainer.step} of {trainer.cfg.training.max_steps}: not every graph "
                "a job runs was built"
            )
        return time.perf_counter() - start


REHEARSAL_CHECKPOINTS = f"{CACHE_DIR}/rehearsal-checkpoints"
"""Where the rehearsal's checkpoints go: one folder under the run that every rank sees, deleted afterwards."""


@contextmanager
def throwaway_trainer(run: Run, cfg: HlatConfig, world: World) -> Iterator[Trainer]:
    """The Trainer training would build, writing metrics to a temporary folder and checkpoints to
    REHEARSAL_CHECKPOINTS.
    """
    checkpoints = run.storage.child(REHEARSAL_CHECKPOINTS)
    if world.is_main:
        checkpoints.remove("", recursive=True)  # an earlier precompile's, cut short
    world.barrier("hlat-rehearsal-start")
    with tempfile.TemporaryDirectory(prefix="hlat-precompile-") as tmp:
        tokenizer = fetch_tokenizer(run, tmp)
        trainer = Trainer(
            cfg=cfg,
            built=build_model(cfg, world),
            run=Run.of(Storage(tmp).child("run"), cfg),
            checkpoints=checkpoints,
            world=world,
            tokenizer_model=tokenizer,
            data=channel_location(run, "data"),
        )
        trainer.metrics.resume_at(0)  # a fresh history in the scratch folder, as a job's first resume starts one
        try:
            yield trainer
        finally:
            trainer.ckpt.wait()
            trainer.loader.close()
            trainer.metrics.close()
            world.barrier("hlat-rehearsal-end")
            if world.is_main:
                checkpoints.remove("", recursive=True)


def _precompile_xla(run: Run, cfg: HlatConfig, cache: Storage) -> int:
    """The XLA device: the rehearsal's graphs, every one a job runs.

    trn1: graphs are extracted, compiled after exit into NEURON_COMPILE_CACHE_URL; the key goes to neuron/.
    XLA:CPU: torch-xla's persistent cache records each graph and is packed into xla/<digest>/.
    """
    on_neuron = neuron_available()
    if on_neuron and not os.environ.get("NEURON_COMPILE_CACHE_URL"):
        raise RuntimeError(
            "NEURON_COMPILE_CACHE_URL is not set: the compiled graphs would not reach the run's compile-cache/neuron/; "
            "set it to <run>/compile-cache/neuron (the job backends do) and run under neuron_parallel_compile"
        )
    steps = cfg.precompile.steps
    with tempfile.TemporaryDirectory(prefix="hlat-xla-cache-") as local:
        world = init_world("xla", cfg, xla_cache=None if on_neuron else (local, False))
        try:
            key = cache_key(cfg, world.world_size, "xla")
            seconds = rehearse(run, cfg, world)
            if world.is_main:
                if on_neuron:
                    write_neuron_manifest(cache, key, steps=steps, seconds=seconds)
                    where = f"graphs extracted for neuronx-cc -> {os.environ['NEURON_COMPILE_CACHE_URL']}"
                else:
                    manifest = write_xla_cache(cache, key, local, steps=steps, seconds=seconds)
                    where = (
                        f"{manifest['graphs']} compiled graphs ({human_bytes(manifest['size'])}) -> "
                        f"{cache.uri(xla_cache_dir(manifest['digest']))}"
                    )
                print(f"precompile: {steps} steps rehearsed in {seconds:.1f} s, {where}", flush=True)
            world.barrier("hlat-precompile")
        finally:
            close_world()
    return 0


if __name__ == "__main__":
    sys.exit(main())
