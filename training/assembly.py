"""The model a job trains, built and parallelized, with its optimizer: what the Trainer is given.

`build_model` seeds the world, builds the model with its parallelism and wraps it (DDP, FSDP2, NxD). Every rank
and every split starts from the same weights. It runs before the Trainer, so the loop holds no set-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hlat.core.config import ConfigError, HlatConfig
from hlat.core.environment import precision_by_flags
from hlat.training.model import Transformer
from hlat.training.optim import build_optimizer, optimizer_recipe, trainable_parameters
from hlat.training.parallel.distributed import World
from hlat.training.parallel.parallelize import fsdp_active, model_layers, parallelize


@dataclass
class BuiltModel:
    """The model of one rank: the module, what a step calls, the optimizer, and how they were built."""

    model: Transformer
    """The module itself: this rank's TP slices, or under FSDP2 its shards."""
    wrapped: Any
    """What a step calls: DDP, FSDP2's module, or NxD's pipeline (its `run_train`)."""
    optimizer: Any
    precision_flags: bool
    """Whether torch-xla's flags apply precision.mode (`precision_by_flags`), not the trainer."""
    fsdp: bool
    started_at: float = field(default_factory=time.perf_counter)
    """perf_counter() when the build began: the job's time to first step counts from here."""


def check_world(cfg: HlatConfig, world: World) -> None:
    """Refuse a job whose process count is not the config's."""
    if world.world_size != cfg.world_size:
        raise ConfigError(
            f"this job has {world.world_size} processes but job.instance_count x job.processes_per_node = "
            f"{cfg.world_size}; launch {cfg.world_size} processes or fix the config"
        )


def build_model(cfg: HlatConfig, world: World) -> BuiltModel:
    """Seed the world, then build this rank's model, wrap it for its parallelism and build its optimizer.

    The weights are initialised on the host from the seed. Under pipeline parallelism the model stays on the meta
    device: NxD's pipeline materialises and initialises this rank's stage only. With model.init_from the weights
    come later, from the Trainer's resume (the import, or a checkpoint): no random init. Under FSDP2 the model then
    stays on the meta device until each rank materialises its own shards.
    """
    started_at = time.perf_counter()
    check_world(cfg, world)
    world.seed(cfg.training.seed)
    staged = world.layout.pipeline > 1
    imported = cfg.model.init_from is not None
    fsdp = fsdp_active(cfg, world)
    meta = staged or (imported and fsdp)
    model = Transformer(cfg.model, device="meta" if meta else "cpu", layers=model_layers(cfg, world))
    if not meta and not imported:
        model.init_weights(cfg.training.seed)
    flags = precision_by_flags(cfg, world.on_xla)
    if cfg.precision.mode == "bf16-sr" and not flags:
        model = model.to(torch.bfloat16)  # pure BF16: weights and optimizer states (Neuron 2.24: XLA_USE_BF16)
    # Under FSDP2 the whole model never goes to the device: it is sharded on the host, then each rank moves its
    # shards (parallelize).
    model = model if staged or fsdp else model.to(world.device)
    wrapped: Any = parallelize(model, cfg, world)
    if staged:  # after activation checkpointing: the stages keep the recomputing blocks
        from hlat.training.parallel.neuron import pipeline_model

        wrapped = pipeline_model(wrapped, cfg, init=model.initialiser(cfg.training.seed))
    optimizer = _optimizer(cfg, world, model, wrapped, flags)
    return BuiltModel(model, wrapped, optimizer, flags, fsdp, started_at)


def _optimizer(cfg: HlatConfig, world: World, model: Transformer, wrapped: Any, flags: bool) -> Any:
    """AdamW as `training.optim` prescribes; when the model is split, through NxD's optimizer. It reduces the
    gradients over the data-parallel group and clips by the global norm across TP and PP (`grad_norm`)."""
    if world.nxd is None:
        return build_optimizer(model, cfg.training, cfg.precision.mode, world.device.type, flags)
    from hlat.training.parallel.neuron import parallel_optimizer

    staged = world.layout.pipeline > 1
    params = list(wrapped.local_parameters()) if staged else trainable_parameters(model)
    optimizer_class, arguments = optimizer_recipe(
        params, cfg.training, cfg.precision.mode, world.device.type, zero1=cfg.parallelism.zero1, flags=flags
    )
    return parallel_optimizer(world.nxd, optimizer_class, params, **arguments)
