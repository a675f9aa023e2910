"""Entrypoint of a precompile job: `python -m hlat.training.precompile --config <path or s3 uri of config.json>`.

Builds the training step's compiled graphs once, before training, into the run's compile-cache/ (layout and key
in `training/compile_cache.py`), so that no training job, first or relaunched, compiles from scratch. It runs on
the same instances and process count as training (under torchrun; SageMaker's Torchrun driver runs it by path,
hence the sys.path set-up below), because the graphs depend on them.

- CPU/CUDA with training.compile on: the Trainer is built exactly as training builds it (model, parallelism,
  precision, loader over the run's data and tokenizer, or the job's input channels), but with a throwaway folder
  for its metrics and checkpoints: the run's history stays training's alone. From a fresh compiler state, with
  TORCHINDUCTOR_CACHE_DIR pointed at an empty temporary folder, it runs precompile.steps training steps;
  torch.compiler.save_cache_artifacts() then holds every graph they compiled (forward and backward) and the folder
  every kernel, and rank 0 writes both (the folder as inductor.tar.gz), their manifest and latest.json. The
  weights are thrown away.
- CPU/CUDA with training.compile off: eager PyTorch compiles nothing; a manifest says so and the job succeeds.
- trn1 (torch-neuronx and torch-xla importable): the job runs under neuron_parallel_compile (the job backends
  set RUN_NEURON_PARALLEL_COMPILE=1, and SageMaker's Torchrun driver wraps torchrun in it). The steps run on the
  XLA device, where their graphs are extracted rather than executed; after this program exits the wrapper
  compiles them all in parallel into NEURON_COMPILE_CACHE_URL (the run's compile-cache/neuron/).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script path: make the project's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hlat.core.config import HlatConfig
from hlat.core.contract import channel_location, fetch_tokenizer, job_arguments, read_job_config, reporting_failure
from hlat.core.environment import neuron_available
from hlat.core.layout import CHECKPOINTS_DIR
from hlat.core.storage import Storage
from hlat.training.compile_cache import (
    CACHE_DIR,
    cache_key,
    human_bytes,
    key_digest,
    torch_cache_dir,
    use_inductor_cache_dir,
    write_neuron_manifest,
    write_torch_cache,
)
from hlat.training.distributed import World, close_world, init_world
from hlat.training.trainer import Trainer

log = logging.getLogger("hlat.precompile")

NOTHING_TO_COMPILE = "training.compile is false: eager PyTorch on CPU/CUDA has no graphs to build"


def main(argv: list[str] | None = None) -> int:
    args = job_arguments("python -m hlat.training.precompile", __doc__, argv, None)
    return reporting_failure(lambda: _precompile(args.config, args.device))


def _precompile(config_uri: str, device: str | None) -> int:
    run, cfg = read_job_config(config_uri)
    cache = run.child(CACHE_DIR)
    world = init_world(device or cfg.training.device, cfg)
    try:
        if world.on_xla:
            return _precompile_xla(run, cfg, cache, world)
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
            with throwaway_trainer(run, cfg, world) as trainer:
                torch.compiler.reset()  # every graph compiled from here on is recorded for save_cache_artifacts
                seconds = run_steps(trainer, steps)
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


@contextmanager
def throwaway_trainer(run: Storage, cfg: HlatConfig, world: World) -> Iterator[Trainer]:
    """The Trainer training would build, reading the run's data and tokenizer, writing metrics and checkpoints
    to a temporary folder that is deleted afterwards."""
    with tempfile.TemporaryDirectory(prefix="hlat-precompile-") as tmp:
        tokenizer = fetch_tokenizer(run, tmp)
        scratch = Storage(tmp)
        trainer = Trainer(
            cfg=cfg,
            run=scratch.child("run"),
            checkpoints=scratch.child(CHECKPOINTS_DIR),
            world=world,
            tokenizer_model=tokenizer,
            data=channel_location(run, "data"),
        )
        trainer.metrics.resume_at(0)  # a fresh history in the scratch folder, as a job's first resume starts one
        try:
            yield trainer
        finally:
            trainer.loader.close()
            trainer.metrics.close()


def run_steps(trainer: Trainer, steps: int) -> float:
    """Run `steps` training steps (forward, backward, optimizer: every graph a step compiles); return seconds."""
    batches = trainer.device_batches(trainer.loader, trainer.cfg.gradient_accumulation)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        stats = trainer.train_step(batches)
        trainer.step = step
        loss = float(trainer.world.to_host(stats["loss"]))  # a host read per step: here, time is not the point
        if trainer.world.is_main:
            log.info(
                "precompile: step %d of %d done at %.1f s (loss %.4f)", step, steps, time.perf_counter() - start, loss
            )  # fmt: skip
    return time.perf_counter() - start


def _precompile_xla(run: Storage, cfg: HlatConfig, cache: Storage, world: World) -> int:
    """The XLA device: run the steps, one graph each (the loop's own mark_step), and one validation pass. On trn1, under
    neuron_parallel_compile, their graphs are extracted rather than executed and compiled into
    NEURON_COMPILE_CACHE_URL after this program exits; the key goes to neuron/manifest.json.

    Only trn1 runs the Neuron part: torch-neuronx and neuronx-cc exist only there."""
    if not neuron_available():
        raise RuntimeError(
            "precompile on XLA outside trn1 (XLA:CPU) has no Neuron compiler to feed: the rehearsal's graphs are "
            "compiled by the training job itself; set precompile.enabled=false"
        )
    url = os.environ.get("NEURON_COMPILE_CACHE_URL")
    if not url:
        raise RuntimeError(
            "NEURON_COMPILE_CACHE_URL is not set: the compiled graphs would not reach the run's compile-cache/neuron/; "
            "set it to <run>/compile-cache/neuron (the job backends do) and run under neuron_parallel_compile"
        )
    key = cache_key(cfg, world.world_size, world.device.type)
    steps = cfg.precompile.steps
    with throwaway_trainer(run, cfg, world) as trainer:
        seconds = run_steps(trainer, steps)
        trainer.evaluate(steps)  # the held-out forward pass is a graph of its own (every job ends with one)
    if world.is_main:
        write_neuron_manifest(cache, key, steps=steps, seconds=seconds)
        print(f"precompile: {steps} steps traced in {seconds:.1f} s, graphs extracted for neuronx-cc -> {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
