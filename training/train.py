"""Entrypoint of a training job: `python -m hlat.training.train --config <path or s3 uri of config.json>`.

Run under torchrun for several processes; SageMaker's Torchrun driver runs it by path
(`torchrun ... training/train.py --config <uri>`), hence the sys.path set-up below. The run's folder is the
config's folder: data/ and tokenizer/ are read from it (or from the job's input channels), metrics.jsonl is
written to it, checkpoints go to its checkpoints/ (or, inside a job, to the local checkpoint folder the backend
syncs with the run's checkpoint prefix). Compiled graphs come from its compile-cache/ when the precompile stage
left ones matching this job (`training/compile_cache.py`). A failure's reason is written where the backend
reports it from.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script path: make the project's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tempfile

from hlat.core.contract import (
    EXIT_NAN,
    channel_location,
    checkpoint_location,
    fetch_tokenizer,
    job_arguments,
    read_job_config,
    reporting_failure,
    tensorboard_location,
    write_failure,
)
from hlat.core.environment import neuron_available
from hlat.training.compile_cache import load_torch_cache, use_node_local_neuron_cache
from hlat.training.distributed import close_world, init_world
from hlat.training.faults import checkpoint_storage
from hlat.training.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    args = job_arguments("python -m hlat.training.train", __doc__, argv, None)
    code = reporting_failure(lambda: _train(args.config, args.device))
    if code == EXIT_NAN:
        write_failure("NonFiniteLoss: the loss became NaN or inf; relaunch from the last checkpoint")
    return code


def _train(config_uri: str, device: str | None) -> int:
    run, cfg = read_job_config(config_uri)
    world = init_world(device or cfg.training.device, cfg)
    try:
        if neuron_available():
            use_node_local_neuron_cache(world)  # before anything compiles: one copy per node, read locally
        with tempfile.TemporaryDirectory(prefix="hlat-train-") as tmp:
            tokenizer = fetch_tokenizer(run, tmp)
            trainer = Trainer(
                cfg=cfg,
                run=run,
                checkpoints=checkpoint_storage(checkpoint_location(run)),
                world=world,
                tokenizer_model=tokenizer,
                tensorboard_dir=tensorboard_location(run),
                data=channel_location(run, "data"),
            )
            # Before the first compiled step: the precompile stage's graphs and kernels, when they match this job
            # (it may point TORCHINDUCTOR_CACHE_DIR at a copy of the kernels: nothing has compiled yet).
            cache = load_torch_cache(run, cfg, world.world_size, world.device.type, log_status=world.is_main)
            trainer.first_step_metrics.update(cache.metrics())
            trainer.resume()
            return trainer.fit()
    finally:
        close_world()


if __name__ == "__main__":
    sys.exit(main())
