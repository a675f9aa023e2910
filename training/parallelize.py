"""Parallelism applied to a built model, in a fixed order driven by the validated parallel degrees.

Order: tensor parallel → activation checkpointing → compile → data-parallel wrapping. Tensor and pipeline
parallelism exist on trn1 only (neuronx-distributed, see `training/neuron.py`); on CPU and CUDA data
parallelism is DistributedDataParallel over gloo or nccl. On XLA there is no DDP and no torch.compile (XLA
compiles the whole step): the loop averages the gradients itself (`reduce_gradients`, one all-reduce per
optimizer step, inside the step's graph), and activation checkpointing uses torch-xla's checkpoint. The
returned module is what the loop calls; the model passed in keeps the parameters, so its state dict is the same
whatever was applied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.config import ConfigError, HlatConfig
from training.distributed import World
from training.neuron import apply_tensor_parallel, require_neuron

log = logging.getLogger("hlat.train")


def _recompute_in_backward(module: nn.Module, on_xla: bool) -> None:
    """Make module's forward recompute its activations in backward (its parameters and names unchanged)."""
    forward: Callable[..., Any] = module.forward
    if on_xla:
        from training import xla

        # torch-xla's checkpoint is the re-entrant kind only, and takes positional inputs (as the model passes them).
        recompute, reentrant = xla.checkpoint_function(), True
    else:
        recompute, reentrant = checkpoint, False

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: no backward, nothing to recompute
            return forward(*args, **kwargs)
        return recompute(forward, *args, use_reentrant=reentrant, **kwargs)

    module.forward = checkpointed


def parallelize(model: nn.Module, cfg: HlatConfig, world: World) -> nn.Module:
    p = cfg.parallelism
    # 1. Tensor parallel: Neuron only (neuronx-distributed's layers); a clear error elsewhere.
    if p.tensor > 1 or p.pipeline > 1:
        if world.device.type != "xla":
            require_neuron()
            raise ConfigError(
                f"parallelism.tensor={p.tensor}, parallelism.pipeline={p.pipeline} run on XLA devices only; "
                "on CPU and CUDA set both to 1 (data parallelism takes every device)"
            )
        apply_tensor_parallel(model, cfg)
    # 2. Activation checkpointing: 'selective' recomputes the attention sub-layer, 'full' the whole block.
    if p.activation_checkpointing != "none":
        for block in model.layers:  # type: ignore[union-attr]
            _recompute_in_backward(block.attn if p.activation_checkpointing == "selective" else block, world.on_xla)
    # 3. Compile.
    runner: nn.Module = model
    if cfg.training.compile and world.on_xla:
        log.warning("training.compile is ignored on XLA: XLA compiles the whole training step itself")
    elif cfg.training.compile:
        runner = torch.compile(model)  # type: ignore[assignment]
    # 4. Data parallel (on XLA: reduce_gradients, called by the loop).
    if world.world_size > 1 and not world.on_xla:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [world.local_rank] if world.device.type == "cuda" else None
        runner = DistributedDataParallel(runner, device_ids=device_ids)
    return runner


def reduce_gradients(model: nn.Module, world: World) -> None:
    """On XLA, average the gradients over the data-parallel processes (DDP does it on CPU and CUDA); call once per
    optimizer step, after the last backward."""
    if world.on_xla and world.world_size > 1:
        from training import xla

        xla.reduce_gradients(model.parameters(), world.world_size)
