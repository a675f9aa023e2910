"""Parallelism applied to a built model, in a fixed order driven by the validated parallel degrees.

Order: tensor parallel → activation checkpointing → compile → data-parallel wrapping. Tensor and pipeline
parallelism exist on trn1 only (neuronx-distributed, see `training/neuron.py`); on CPU and CUDA data
parallelism is DistributedDataParallel over gloo or nccl. The returned module is what the loop calls; the
model passed in keeps the parameters, so its state dict is the same whatever was applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.config import ConfigError, HlatConfig
from training.distributed import World
from training.neuron import apply_tensor_parallel, require_neuron


def _recompute_in_backward(module: nn.Module) -> None:
    """Make module's forward recompute its activations in backward (its parameters and names unchanged)."""
    forward: Callable[..., Any] = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

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
            _recompute_in_backward(block.attn if p.activation_checkpointing == "selective" else block)
    # 3. Compile.
    runner: nn.Module = model
    if cfg.training.compile:
        runner = torch.compile(model)  # type: ignore[assignment]
    # 4. Data parallel.
    if world.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [world.local_rank] if world.device.type == "cuda" else None
        runner = DistributedDataParallel(runner, device_ids=device_ids)
    return runner
