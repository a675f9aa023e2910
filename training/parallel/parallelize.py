"""Parallelism of a job's model, in a fixed order driven by the validated parallel degrees.

Order: tensor parallel → activation checkpointing → compile → data-parallel wrapping or FSDP2 sharding.
1. Tensor (and sequence) parallelism is part of the model's construction: `model_layers` gives the Transformer
   neuronx-distributed's parallel layers when the model is split (`training/parallel/neuron.py`; NxD's groups were
   formed by `init_world`), dense layers otherwise.
2. Activation checkpointing: 'selective' recomputes what HLAT's training scripts recompute, the core attention
   (softmax(QK^T)V) and SwiGLU's silu(gate) * up: no projection and no sequence-parallel collective runs twice;
   'full' recomputes the whole block (torch-xla's checkpoint on XLA).
3. torch.compile on CPU and CUDA, one transformer block at a time (`compile_blocks`; XLA compiles the whole step
   itself).
4. Data parallelism: DistributedDataParallel over gloo or nccl on CPU and CUDA, or, with parallelism.fsdp, FSDP2
   (`fully_shard` on every block, then on the whole model: parameters, gradients and optimizer states sharded over
   the ranks; bf16-mixed gathers parameters in BF16 and reduces gradients in FP32, the FP32 shards being the
   master weights). When the model is split, NxD's optimizer reduces the gradients over the data-parallel group
   (never over TP peers); on XLA without NxD the loop averages them itself (`reduce_gradients`, one all-reduce per
   optimizer step, inside the step's graph).
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

    The blocks run one code path, so Dynamo traces one graph (forward and backward) that every block reuses: the
    compile time of one block, not of the whole depth, and the compiled code fuses the norms, the rotary embedding
    and SwiGLU's elementwise work around the matrix multiplies. The embedding and the output head stay eager. On
    CUDA, document masks become FlexAttention block masks, fused inside the compiled block (SDPA with a dense
    (B, 1, T, T) mask has no flash kernel)."""
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
    """FSDP2 over every rank of the job: each block its own unit (gathered just before it runs, freed after), then
    the rest (embedding, final norm, output) as the root unit. The model's parameters become DTensors in place. A
    model built on the meta device gets uninitialised storage for this rank's shards (its weights are then loaded,
    e.g. `hf_import.import_weights`)."""
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
    """On CUDA, refuse a whole replica (DDP, or one process) whose weights, gradients and AdamW states exceed the
    GPU's memory, with the fix, rather than run out of memory at the first step."""
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
    """On XLA, average the gradients over the data-parallel processes (DDP does it on CPU and CUDA); call once per
    optimizer step, after the last backward."""
    if world.on_xla and world.world_size > 1 and world.nxd is None:
        from hlat.training import xla

        xla.reduce_gradients(model.parameters(), world.world_size)
