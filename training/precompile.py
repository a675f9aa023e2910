"""Entrypoint of a precompile job: `python -m hlat.training.precompile --config <path or s3 uri of config.json>`.

Builds the training step's compiled graphs once, before training, into the run's compile-cache/ (layout and key
in `training/compile_cache.py`), so that no training job, first or relaunched, compiles from scratch. It runs on
the same instances and process count as training (under torchrun; SageMaker's Torchrun driver starts it through
the job's entry script, infra/job_entry.py), because the graphs depend on them.

Every path runs the training loop itself (`Trainer.fit`, `rehearse`) on the job's config cut to precompile.steps
steps (`rehearsal_config`; HLAT's compile run: 4 steps with a checkpoint at step 3): the steps, the sync points'
host reads and stop vote, a periodic health check, a checkpoint, the last step's checkpoint and validation pass.
The Trainer is built exactly as training builds it (model, parallelism, precision, loader over the run's data and
tokenizer, or the job's input channels), with a throwaway folder for its metrics and one under the run's
compile-cache/ for its checkpoints (every rank's, deleted afterwards): the run's history stays training's alone,
and the weights are thrown away.

- CPU/CUDA with training.compile on: from a fresh compiler state, with TORCHINDUCTOR_CACHE_DIR pointed at an
  empty temporary folder; torch.compiler.save_cache_artifacts() then holds every graph the rehearsal compiled
  (forward and backward, training and validation) and the folder every kernel, and rank 0 writes both (the folder
  as inductor.tar.gz), their manifest and latest.json.
- CPU/CUDA with training.compile off: eager PyTorch compiles nothing; a manifest says so and the job succeeds.
- trn1 (torch-neuronx and torch-xla importable): the job runs under neuron_parallel_compile (the job backends
  set RUN_NEURON_PARALLEL_COMPILE=1, and SageMaker's Torchrun driver wraps torchrun in it). The steps run on the
  XLA device, where their graphs are extracted rather than executed; after this program exits the wrapper
  compiles them all in parallel into NEURON_COMPILE_CACHE_URL (the run's compile-cache/neuron/). The wrapper sets
  NEURON_EXTRACT_GRAPHS_ONLY, and every value the rehearsal reads back is invalid: the Trainer (`loop.py`,
  `extracting_graphs`) then traces every step, hook and host read and acts on none of them (no health verdict, no
  NaN exit, no checkpoint, metrics or failure file), as HLAT's scripts do at compile time.
- XLA:CPU (the local rehearsal of trn1): torch-xla's persistent compilation cache records every graph the
  rehearsal compiles, and the job packs it into compile-cache/xla/<digest>/; a training job with the same key
  loads it before anything compiles (`training/train.py`) and compiles no graph of its own.
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
from hlat.training.data.tokenizer import job_config
from hlat.training.loop import Trainer
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
    """The job's config, cut to precompile.steps steps that still take every path a job's step can take (HLAT's
    compile run: 4 steps, a checkpoint at step 3): a periodic health check (when the job runs them) before the
    checkpoint, the checkpoint one step before the end, the last step's checkpoint and validation pass, the stop
    vote and the host reads of every sync point. The learning-rate schedule keeps the job's horizon."""
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
    """Run the training loop itself (`Trainer.fit`) on `rehearsal_config(cfg)`, over the run's data, writing its
    metrics and checkpoints to a throwaway folder; return the seconds it took."""
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
"""Where the rehearsal's checkpoints go: under the run, so that every rank of every host writes into one folder
and rank 0 can commit them (a folder of each process's own would never see the others' files); deleted after."""


@contextmanager
def throwaway_trainer(run: Run, cfg: HlatConfig, world: World) -> Iterator[Trainer]:
    """The Trainer training would build, reading the run's data and tokenizer, writing metrics to a temporary
    folder and checkpoints to REHEARSAL_CHECKPOINTS, both deleted afterwards."""
    checkpoints = run.storage.child(REHEARSAL_CHECKPOINTS)
    if world.is_main:
        checkpoints.remove("", recursive=True)  # an earlier precompile's, cut short
    world.barrier("hlat-rehearsal-start")
    with tempfile.TemporaryDirectory(prefix="hlat-precompile-") as tmp:
        tokenizer = fetch_tokenizer(run, tmp)
        trainer = Trainer(
            cfg=cfg,
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

    - trn1, under neuron_parallel_compile: the graphs are extracted rather than executed and compiled into
      NEURON_COMPILE_CACHE_URL after this program exits; the key goes to neuron/manifest.json.
    - XLA:CPU (the local rehearsal): torch-xla's persistent cache (`xr.initialize_cache`) in a fresh folder
      records every compiled graph; it is packed into xla/<digest>/, where training jobs with the same key load
      it and compile nothing.
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
