"""Parallelism of a job's model, in a fixed order driven by the validated parallel degrees.

Order: tensor parallel → activation checkpointing → compile → data-parallel wrapping or FSDP2 sharding.
- Tensor and sequence parallelism are part of construction: `model_layers` picks NxD's layers or dense ones.
- 'selective' checkpointing recomputes what HLAT's scripts do: core attention and SwiGLU's silu(gate) * up.
  'full' recomputes the whole block.
- torch.compile runs per block on CPU and CUDA; XLA compiles the whole step itself.
- Data parallelism is DDP, or FSDP2 with parallelism.fsdp; NxD or `reduce_gradients` handle the rest.
The returned module is what the loop calls; the model passed in keeps the parameters and its state dict.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hlat.core.config import HlatConfig
from hlat.training.models.base import DenseLayers, Layers
from hlat.training.parallel.distributed import World

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
    if world.nxd is not None and world.layout.tensor > 1:
        from hlat.training.parallel.neuron import NxdLayers

        return NxdLayers(cfg)
    return DenseLayers()


def fsdp_active(cfg: HlatConfig, world: World) -> bool:
    """FSDP2 shards over the job's ranks: asked for, and more than one rank (one process has nothing to shard)."""
    return cfg.parallelism.fsdp and world.world_size > 1


def compile_blocks(model: nn.Module, device: torch.device | None = None, sharded: bool = False) -> None:
    """torch.compile every transformer block in place (`nn.Module.compile`: names and state dict unchanged).

    All blocks share one graph, so compile time is one block's. The embedding and output head stay eager.
    On CUDA, document masks become FlexAttention block masks: SDPA with a dense mask has no flash kernel.
    """
    for block in model.layers:  # type: ignore[union-attr]
        if sharded:
            # Under FSDP2 only the block's forward is compiled: its hooks (all-gather before, reshard after) stay
            # outside the graph, and the compiled code sees the gathered, unsharded parameters.
            block.forward = torch.compile(block.forward)
        else:
            block.compile()
    # The device the model runs on (under FSDP2 it is still on the host here: sharding moves it).
    if (device or next(model.parameters()).device).type == "cuda":
        model.flex_document_mask = True  # type: ignore[assignment]


def parallelize(model: nn.Module, cfg: HlatConfig, world: World) -> nn.Module:
    p = cfg.parallelism
    # 1. Tensor parallelism: built into the model (model_layers).
    # 2. Activation checkpointing: 'selective' recomputes the core attention and the gated activation, 'full' the
    # whole block.
    if p.activation_checkpointing != "none":
        for block in model.layers:  # type: ignore[union-attr]
            selective = p.activation_checkpointing == "selective"
            for part in (block.attn.core, block.mlp.act) if selective else (block,):
                _recompute_in_backward(part, world.on_xla)
    # 3. Compile.
    runner: nn.Module = model
    if cfg.training.compile and world.on_xla:
        log.warning("training.compile is ignored on XLA: XLA compiles the whole training step itself")
    elif cfg.training.compile:
        compile_blocks(model, world.device, sharded=fsdp_active(cfg, world))
    # 4. Data parallel (NxD's optimizer when the model is split; on XLA: reduce_gradients, called by the loop).
    if fsdp_active(cfg, world):
        shard_fully(model, cfg, world)
        return runner
    check_replica_fits(cfg, world)
    if world.world_size > 1 and not world.on_xla and world.nxd is None:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [world.local_rank] if world.device.type == "cuda" else None
        runner = DistributedDataParallel(runner, device_ids=device_ids)
    return runner


def shard_fully(model: nn.Module, cfg: HlatConfig, world: World) -> None:
    """FSDP2 over every rank: each block its own unit, then the rest as the root unit; parameters become DTensors.

    A meta-device model gets uninitialised storage for this rank's shards, to be loaded afterwards.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(world.device.type, (world.world_size,))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.precision.mode == "bf16-mixed"
        else MixedPrecisionPolicy()
    )
    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if any(p.is_meta for p in model.parameters()):
        # Built on the meta device (weights that come from elsewhere, e.g. an import: never materialised whole on a
        # host): each rank gives storage to its own shards only, and the model its RoPE tables (FSDP2's
        # meta-device initialisation: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).
        model.to_empty(device=world.device)
        model.init_rope_tables()  # type: ignore[operator]
    else:
        model.to(world.device)  # this rank's shards only


def check_replica_fits(cfg: HlatConfig, world: World) -> None:
    """On CUDA, refuse a replica whose weights, gradients and AdamW states exceed the GPU, naming the fix."""
    if world.device.type != "cuda" or world.nxd is not None:
        return
    need = cfg.model.training_state_bytes(cfg.precision.mode)
    total = torch.cuda.get_device_properties(world.device).total_memory
    if need > total:
        gib = 1024**3
        raise ValueError(
            f"the model's weights, gradients and AdamW states take {need / gib:.0f} GiB per replica, more than this "
            f"GPU's {total / gib:.0f} GiB: shard them over several GPUs with parallelism.fsdp=true "
            f"(job.processes_per_node x job.instance_count > 1; `hlat plan` says how many)"
        )


def reduce_gradients(model: nn.Module, world: World) -> None:
    """On XLA, average the gradients over data-parallel processes once per optimizer step, after the last backward."""
    if world.on_xla and world.world_size > 1 and world.nxd is None:
        from hlat.training import xla

        xla.reduce_gradients(model.parameters(), world.world_size)
