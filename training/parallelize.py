"""Parallelism of a job's model, in a fixed order driven by the validated parallel degrees.

Order: tensor parallel → activation checkpointing → compile → data-parallel wrapping.
1. Tensor (and sequence) parallelism is part of the model's construction: `model_layers` gives the Transformer
   neuronx-distributed's parallel layers when the model is split (`training/neuron.py`; NxD's groups were formed
   by `init_world`), dense layers otherwise.
2. Activation checkpointing: 'selective' recomputes the attention sub-layer, 'full' the whole block (torch-xla's
   checkpoint on XLA).
3. torch.compile on CPU and CUDA, one transformer block at a time (`compile_blocks`; XLA compiles the whole step
   itself).
4. Data parallelism: DistributedDataParallel over gloo or nccl on CPU and CUDA. When the model is split, NxD's
   optimizer reduces the gradients over the data-parallel group (never over TP peers); on XLA without NxD the loop
   averages them itself (`reduce_gradients`, one all-reduce per optimizer step, inside the step's graph).
The returned module is what the loop calls; the model passed in keeps the parameters, so its state dict is the
same whatever was applied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hlat.core.config import HlatConfig
from hlat.training.distributed import World
from hlat.training.model import DenseLayers, Layers

log = logging.getLogger("hlat.train")


def _recompute_in_backward(module: nn.Module, on_xla: bool) -> None:
    """Make module's forward recompute its activations in backward (its parameters and names unchanged)."""
    forward: Callable[..., Any] = module.forward
    if on_xla:
        from hlat.training import xla

        # torch-xla's checkpoint is the re-entrant kind only, and takes positional inputs (as the model passes them).
        recompute, reentrant = xla.checkpoint_function(), True
    else:
        recompute, reentrant = checkpoint, False

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: no backward, nothing to recompute
            return forward(*args, **kwargs)
        return recompute(forward, *args, use_reentrant=reentrant, **kwargs)

    module.forward = checkpointed


def model_layers(cfg: HlatConfig, world: World) -> Layers:
    """1. The model's layer factory: NxD's tensor-parallel layers when the model is split, dense ones otherwise."""
    if world.nxd is not None and world.tp_size > 1:
        from hlat.training.neuron import NxdLayers

        return NxdLayers(cfg)
    return DenseLayers()


def compile_blocks(model: nn.Module) -> None:
    """torch.compile every transformer block in place (`nn.Module.compile`: names and state dict unchanged).

    The blocks run one code path, so Dynamo traces one graph (forward and backward) that every block reuses: the
    compile time of one block, not of the whole depth, and the compiled code fuses the norms, the rotary embedding
    and SwiGLU's elementwise work around the matrix multiplies. The embedding and the output head stay eager. On
    CUDA, document masks become FlexAttention block masks, fused inside the compiled block (SDPA with a dense
    (B, 1, T, T) mask has no flash kernel)."""
    for block in model.layers:  # type: ignore[union-attr]
        block.compile()
    if next(model.parameters()).device.type == "cuda":
        model.flex_document_mask = True  # type: ignore[assignment]


def parallelize(model: nn.Module, cfg: HlatConfig, world: World) -> nn.Module:
    p = cfg.parallelism
    # 1. Tensor parallelism: built into the model (model_layers).
    # 2. Activation checkpointing: 'selective' recomputes the attention sub-layer, 'full' the whole block.
    if p.activation_checkpointing != "none":
        for block in model.layers:  # type: ignore[union-attr]
            _recompute_in_backward(block.attn if p.activation_checkpointing == "selective" else block, world.on_xla)
    # 3. Compile.
    runner: nn.Module = model
    if cfg.training.compile and world.on_xla:
        log.warning("training.compile is ignored on XLA: XLA compiles the whole training step itself")
    elif cfg.training.compile:
        compile_blocks(model)
    # 4. Data parallel (NxD's optimizer when the model is split; on XLA: reduce_gradients, called by the loop).
    if world.world_size > 1 and not world.on_xla and world.nxd is None:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [world.local_rank] if world.device.type == "cuda" else None
        runner = DistributedDataParallel(runner, device_ids=device_ids)
    return runner


def reduce_gradients(model: nn.Module, world: World) -> None:
    """On XLA, average the gradients over the data-parallel processes (DDP does it on CPU and CUDA); call once per
    optimizer step, after the last backward."""
    if world.on_xla and world.world_size > 1 and world.nxd is None:
        from hlat.training import xla

        xla.reduce_gradients(model.parameters(), world.world_size)
