"""Entrypoint of a training job: `python -m hlat.training.train --config <path or s3 uri of config.json>`.

Run under torchrun for several processes; on SageMaker the Torchrun driver starts it through the job's entry script
(`torchrun ... hlat_job.py --config <uri>`, infra/backends/job_entry.py). The run's folder is the
config's folder: data/ and tokenizer/ are read from it (or from the job's input channels), metrics.jsonl is
written to it, checkpoints go to its checkpoints/ (or, inside a job, to the local checkpoint folder the backend
syncs with the run's checkpoint prefix). The job stops itself, checkpointed, when the run's budget or deadline runs
out or its supervisor goes silent (`training/stop_rule.py`), and ends itself when it hangs (`training/watchdog.py`, on
every rank from the start: no step progress for longer than its bound dumps every thread's stack, records
`HangDetected` and exits EXIT_HUNG). Compiled graphs come from its compile-cache/ when the
precompile stage left ones matching this job (`training/compile_cache.py`). A failure's reason is written where
the backend reports it from. With tracking.backend set, rank 0 logs the config and every step's metrics into the
run's one tracked run, resumed by every attempt (`training/tracking.py`).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

from hlat.core.config import HlatConfig
from hlat.core.contract import (
    EXIT_NAN,
    TRACKED_BY_STAGE_ENV,
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
from hlat.core.run import Run
from hlat.training import xla
from hlat.training.assembly import build_model
from hlat.training.compile_cache import (
    NeuronGraphSharing,
    fetch_xla_cache,
    load_torch_cache,
    use_node_local_neuron_cache,
)
from hlat.training.hooks import hooks
from hlat.training.loop import Trainer, extracting_graphs
from hlat.training.models.job import job_config
from hlat.training.parallel.distributed import close_world, init_world, resolve_device_kind
from hlat.training.stop_rule import stop_rule
from hlat.training.tracking import open_tracker
from hlat.training.watchdog import Progress, start_watchdog

log = logging.getLogger("hlat.train")


def main(argv: list[str] | None = None) -> int:
    args = job_arguments("python -m hlat.training.train", __doc__, argv, None)
    code = reporting_failure(lambda: _train(args.config, args.device))
    if code == EXIT_NAN:
        write_failure("NonFiniteLoss: the loss became NaN or inf; relaunch from the last checkpoint")
    return code


def _train(config_uri: str, device: str | None) -> int:
    run = read_job_config(config_uri)
    cfg = run.config
    # From here: a start-up that hangs (a store, a group that never forms, a compile cache read) is bounded too.
    progress = Progress()
    watchdog = start_watchdog(progress, cfg.job.watchdog, extracting_graphs())
    try:
        return _train_watched(run, cfg, device, progress)
    finally:
        if watchdog is not None:
            watchdog.close()


def _train_watched(run: Run, cfg: HlatConfig, device: str | None, progress: Progress) -> int:
    cfg = job_config(run, cfg)  # model.vocab_size follows a pretrained tokenizer
    kind = resolve_device_kind(device or cfg.training.device)
    xla_cache = None
    if kind == "xla" and not neuron_available():
        # XLA:CPU: precompile's torch-xla persistent cache, given to torch-xla before anything compiles. (On trn1
        # the Neuron cache plays this part: neuron_parallel_compile's, copied node-locally below.)
        xla_cache = fetch_xla_cache(
            run, cfg, int(os.environ.get("WORLD_SIZE", "1")), log_status=os.environ.get("RANK", "0") == "0"
        )
    # On trn1 the Neuron cache (neuron_parallel_compile's) is copied to each node's disk before the process group
    # exists, whose init all-reduce and rendezvous compile graphs too: one copy per node, read locally.
    neuron_cache = use_node_local_neuron_cache() if neuron_available() else None
    # Local rank 0 of each node shares the graphs this node compiles on a miss with later jobs: while the job runs
    # and once more when it ends, however it ends.
    with NeuronGraphSharing(neuron_cache):
        try:
            world = init_world(
                kind, cfg, xla_cache=(xla_cache.kernels_dir, True) if xla_cache and xla_cache.kernels_dir else None
            )
            with tempfile.TemporaryDirectory(prefix="hlat-train-") as tmp:
                tokenizer = fetch_tokenizer(run, tmp)
                trainer = Trainer(
                    cfg=cfg,
                    built=build_model(cfg, world),
                    run=run,
                    checkpoints=hooks().checkpoint_storage(checkpoint_location(run)),
                    world=world,
                    tokenizer_model=tokenizer,
                    tensorboard_dir=tensorboard_location(run),
                    data=channel_location(run, "data"),
                    progress=progress,
                )
                # Before the first compiled step: the precompile stage's graphs and kernels, when they match this job
                # (it may point TORCHINDUCTOR_CACHE_DIR at a copy of the kernels: nothing has compiled yet).
                cache = xla_cache or load_torch_cache(run, cfg, world.world_size, world.device.type, world.is_main)
                trainer.first_step_metrics.update(cache.metrics())
                # Rank 0's: the run's tracked run, resumed (it logs only the steps its store does not hold yet).
                tracker = None
                if world.is_main and not trainer.extracting_graphs and not os.environ.get(TRACKED_BY_STAGE_ENV):
                    tracker = open_tracker(cfg, run)
                if tracker is not None:
                    tracker.log_config(cfg)
                    trainer.metrics.attach(tracker)
                try:
                    # The run's budget, deadline and supervision: the job stops itself at a checkpoint when one runs
                    # out.
                    with stop_rule(trainer, run):
                        trainer.resume()
                        code = trainer.fit()
                finally:
                    if tracker is not None:
                        tracker.close()
                if world.on_xla and world.is_main:
                    counts = xla.counters()
                    log.info(
                        "xla: this job compiled %d graph(s) and loaded %d from the persistent compile cache",
                        counts["compilations"], counts["persistent_cache_hits"],
                    )  # fmt: skip
                return code
        finally:
            close_world()


if __name__ == "__main__":
    sys.exit(main())
