"""Model parallelism through neuronx-distributed (NxD): thin, and imported only where NxD is.

NxD exists in the Neuron training container (with torch-neuronx: the NeuronCores). Its CPU mode
(`NXD_CPU_MODE=1`: gloo collectives on CPU tensors) runs the same layers and process groups on any machine that has
its source, which is how the tests prove this module against the real library (tests/nxd). Nothing here imports NxD
at module level; the functions that do call `require_nxd()` first, which fails with a clear message elsewhere (the
PyPI packages of NxD and torch-neuronx are empty placeholders).

- `nxd_config(cfg)`: our parallel degrees as NxD's trainer config (`neuronx_distributed_config`), which also
  forms NxD's process groups (`parallel_state`: tensor, pipeline, data parallel).
- `NxdLayers`: the model's layer factory (`training.model.Layers`) on NxD's parallel layers:
  `ColumnParallelLinear`, `RowParallelLinear`, `ParallelEmbedding`, and `GQAQKVColumnParallelLinear` where TP
  exceeds the KV heads; sequence parallelism along the model's sequence dimension (1: the model is (batch, time,
  dim)); each rank's slices of the dense initialisation (`training/parallel/tensor_slices.py`).
- `parallel_optimizer(...)`: the optimizer through NxD's `initialize_parallel_optimizer`: gradients all-reduced
  over the data-parallel group, the sequence-parallel norms' gradients over the tensor-parallel group, clipping
  by the global norm across TP and PP, and ZeRO-1 (optimizer states sharded over DP, FP32 masters in mixed
  precision: HLAT 70B) when `parallelism.zero1`, its master weights checkpointed where they hold more than the
  parameters (`zero1_masters_outrank_parameters`). ZeRO-1 needs the XLA device: the NxD tier runs it on XLA:CPU in
  one process (a checkpoint's round trip); across ranks it is verified only on trn1.
- `pipeline_model(model, cfg)`: NxD's `NxDPPModel` over the built model (stages cut from the layer count, the step's
  micro-batches through its 1F1B schedule, the loss from the last stage on every rank, kept on the device: no host
  read inside a step).
- `shard_name(s)`: the checkpoint shard of each (TP, PP) position (`training.checkpoint`).

NxD's `initialize_parallel_model` is not used: it builds and moves the model itself (to the XLA device, also in
CPU mode), where ours is built by its own factory with the dense initialisation sliced; the parallel layers,
process groups, optimizer wrapper and pipeline are NxD's.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hlat.core.config import ConfigError, HlatConfig, ModelConfig
from hlat.core.environment import neuron_available, neuron_sdk
from hlat.core.parallel import ParallelDims, heads_problem, kv_replicas
from hlat.training.models import norm_classes
from hlat.training.models.base import LinearKind
from hlat.training.parallel.tensor_slices import DenseParameter, local_name, shard


class NeuronUnavailable(ImportError):
    """neuronx-distributed is not available (outside a Neuron container, and not in NxD's CPU mode)."""


def nxd_cpu_mode() -> bool:
    """NxD's CPU mode: its layers and groups on CPU tensors over gloo (NXD_CPU_MODE=1), where its source is."""
    return os.environ.get("NXD_CPU_MODE", "0") not in ("", "0")


def nxd_available() -> bool:
    """NxD can run here: inside a Neuron container, or in its CPU mode with its source importable."""
    if importlib.util.find_spec("neuronx_distributed") is None:
        return False
    return neuron_available() or nxd_cpu_mode()


def require_nxd() -> None:
    if not nxd_available():
        raise NeuronUnavailable(
            "tensor and pipeline parallelism and ZeRO-1 run through neuronx-distributed, which exists only in the "
            "AWS Neuron training container (the PyPI packages of that name are placeholders); run on trn1 with "
            "job.backend=sagemaker, or set parallelism.tensor=1, parallelism.pipeline=1 and parallelism.zero1=false "
            "on CPU/CUDA (data parallelism takes every device)"
        )


def needs_nxd(cfg: HlatConfig) -> bool:
    return cfg.parallel_dims.splits_model or cfg.parallelism.zero1


def parallel_settings(cfg: HlatConfig) -> dict[str, Any]:
    """Our parallel config as the arguments of NxD's `neuronx_distributed_config` (checked against the heads)."""
    p, m, t = cfg.parallelism, cfg.model, cfg.training
    if (problem := heads_problem(m.n_heads, m.kv_heads, p.tensor)) is not None:
        raise ConfigError(f"parallelism.tensor={p.tensor}: {problem}")
    return {
        "tensor_parallel_size": p.tensor,
        "pipeline_parallel_size": p.pipeline,
        "sequence_parallel": p.sequence_parallel,
        "optimizer_config": {
            "zero_one_enabled": p.zero1,
            "grad_clipping": t.grad_clip > 0,
            "max_grad_norm": t.grad_clip if t.grad_clip > 0 else 1.0,
        },
        # HLAT 70B: ZeRO-1 keeps FP32 master weights (and accumulates gradients in FP32) under bf16-mixed.
        "mixed_precision_config": {
            "use_master_weights": p.zero1 and cfg.precision.mode == "bf16-mixed",
            "use_fp32_grad_acc": p.zero1 and cfg.precision.mode == "bf16-mixed",
            "use_master_weights_in_ckpt": p.zero1 and zero1_masters_outrank_parameters(cfg),
        },
    }


def zero1_masters_outrank_parameters(cfg: HlatConfig) -> bool:
    """Whether ZeRO-1's master weights hold more than the parameters do on the device, and so go into checkpoints
    (NxD's use_master_weights_in_ckpt: torch-xla's ZeroRedundancyOptimizer(save_master_weights=True) adds them to
    its state_dict as `sharded_master_weights`, each rank its shard, which `training.checkpoint.Zero1` writes into
    that rank's file). Without them, loading rebuilds the masters from the parameters
    (`ZeroRedundancyOptimizer.load_state_dict` calls `init_zero`, which shards the parameters afresh), and torch-xla
    warns "Not saving master weights may have accuracy issues when resuming training!"
    (torch_xla/distributed/zero_redundancy_optimizer.py, torch-xla 2.7 and 2.9). They outrank the parameters:
    - bf16-mixed under Neuron 2.24's flags (HLAT 70B): XLA_DOWNCAST_BF16 keeps the parameters in BF16 on the device
      and NxD makes the masters FP64, FP32 on the device (optimizer_dtype=torch.double: trainer/trainer.py,
      `initialize_optimizer_from_class`, NxD 0.13 and 0.17);
    - bf16-sr without the flags (Neuron 2.28): a BF16 model, FP32 masters.
    Elsewhere (fp32; bf16-mixed on 2.28, autocast over FP32 parameters; bf16-sr under XLA_USE_BF16, where the masters
    are BF16 on the device too) the masters have the parameters' precision and are their exact copy after every
    step (the optimizer's all-gather copies each master shard into its parameter): rebuilt, they are the same bits,
    and saved they would add 4 bytes a parameter to every checkpoint for nothing. The NxD tier shows both cases
    round-trip bitwise (tests/nxd/test_zero1.py)."""
    flags = neuron_sdk(cfg).precision_flags
    mode = cfg.precision.mode
    return (mode == "bf16-mixed" and flags) or (mode == "bf16-sr" and not flags)


def nxd_config(cfg: HlatConfig) -> dict[str, Any]:
    """NxD's trainer config for `cfg`; forms NxD's process groups (after torch.distributed's). On trn1 the
    `xla` process group, in CPU mode gloo's."""
    require_nxd()
    from neuronx_distributed.trainer import neuronx_distributed_config

    return dict(neuronx_distributed_config(**parallel_settings(cfg)))


def coordinates() -> tuple[int, int, int]:
    """This rank's place in NxD's groups: its tensor, pipeline and data-parallel rank."""
    from neuronx_distributed.parallel_layers import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()


def formed_dims() -> ParallelDims:
    """The layout NxD's groups formed, to check against the config's (`ParallelDims.check`)."""
    from neuronx_distributed.parallel_layers import parallel_state as ps

    return ParallelDims(
        ps.get_tensor_model_parallel_size(), ps.get_pipeline_model_parallel_size(), ps.get_data_parallel_size()
    )


class NxdLayers:
    """`training.model.Layers` on NxD's tensor-parallel layers (see the module docstring). Build the model under
    `torch.device("meta")` (Transformer does), then `to_empty` and `init_weights`: NxD's own initialisation is
    never used, every rank keeps its slice of the dense weights."""

    def __init__(self, cfg: HlatConfig) -> None:
        require_nxd()
        from neuronx_distributed.parallel_layers import parallel_state as ps

        self.model: ModelConfig = cfg.model
        dims = cfg.parallel_dims  # NxD's groups were checked against it when the world was formed
        self.tensor = dims.tensor
        self.rank = ps.get_tensor_model_parallel_rank()
        self.sequence_parallel = dims.sequence_parallel
        self.grouped = self.tensor > cfg.model.kv_heads

    def _sequence(self) -> dict[str, Any]:
        return {"sequence_parallel_enabled": self.sequence_parallel, "sequence_dimension": 1}

    def linear(self, kind: LinearKind, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
        from neuronx_distributed.parallel_layers import layers

        # With a bias (gpt_neox), the column layer splits it with its outputs and the row layer adds its whole bias
        # once, after the reduction over the ranks (tests/nxd/test_tensor_parallel.py).
        if kind == "row":
            return layers.RowParallelLinear(
                in_features, out_features, bias=bias, input_is_parallel=True, **self._sequence()
            )
        if kind == "column":
            return layers.ColumnParallelLinear(
                in_features, out_features, bias=bias, gather_output=False, **self._sequence()
            )
        # The output projection keeps the vocabulary split: each rank holds the logits of its slice of it, and the
        # loss is NxD's vocabulary-parallel cross-entropy (`cross_entropy`), as HLAT's training script does; no rank
        # gathers B x T x V logits. NxD's layer cannot gather the sequence itself without sequence parallelism, so
        # under SP it is gathered first (its backward only splits: the layer's own backward already sums the input
        # gradient over the TP group).
        output = layers.ColumnParallelLinear(in_features, out_features, bias=False, gather_output=False)
        if self.sequence_parallel:
            output.register_forward_pre_hook(_gather_sequence)
        return output

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of vocabulary-parallel logits (B, T, V / TP): NxD's `parallel_cross_entropy` (a max
        and a sum all-reduced over the TP group; it shifts its input in place, so it gets a copy)."""
        from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy

        return parallel_cross_entropy(logits.float().clone(), targets).mean()

    def embedding(self, num_embeddings: int, dim: int) -> nn.Module:
        from neuronx_distributed.parallel_layers import layers

        embedding = layers.ParallelEmbedding(num_embeddings, dim, **self._sequence())
        if self.sequence_parallel:
            # Given a sequence dimension, NxD's embedding returns its partial sums unreduced for the caller to
            # reduce-scatter along that dimension: each rank keeps its part of the sequence.
            embedding.register_forward_hook(_reduce_scatter_sequence)
        return embedding

    def grouped_qkv(self, cfg: ModelConfig) -> nn.Module | None:
        if not self.grouped:
            return None
        from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear

        qkv = GQAQKVColumnParallelLinear(
            cfg.d_model,
            [cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim],
            bias=False,
            gather_output=False,
            kv_size_multiplier=kv_replicas(cfg.kv_heads, self.tensor),
            fuse_qkv=False,
            sequence_parallel_enabled=self.sequence_parallel,
        )
        if self.sequence_parallel:
            # This layer gathers the sequence along dimension 0 (NxD's sequence-first layout): give it (T, B, d)
            # and hand (B, T, ...) back.
            qkv.register_forward_pre_hook(lambda module, args: (_swap_batch_and_time(args[0]), *args[1:]))
            qkv.register_forward_hook(lambda module, args, out: tuple(_swap_batch_and_time(t) for t in out))
        return qkv

    def norm(self, weight: nn.Parameter) -> None:
        # NxD's optimizer all-reduces these parameters' gradients over the TP group (each rank saw its part of the
        # sequence).
        if self.sequence_parallel:
            weight.sequence_parallel_enabled = True  # type: ignore[attr-defined]

    def local_name(self, name: str) -> str:
        return local_name(name, self.model, self.tensor)

    def shard(self, param: DenseParameter, full: torch.Tensor) -> torch.Tensor:
        return shard(param, full, self.rank, self.tensor, self.model)


class _SwapBatchAndTime(torch.autograd.Function):
    """(B, T, ...) <-> (T, B, ...), contiguous both ways: NxD's layers `.view` their inputs and gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.transpose(0, 1).contiguous()


def _swap_batch_and_time(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _SwapBatchAndTime.apply(x)
    return out


def _gather_sequence(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.parallel_layers.mappings import gather_from_sequence_parallel_region

    group = parallel_state.get_tensor_model_parallel_group()
    whole = gather_from_sequence_parallel_region(args[0], 1, to_model_parallel=False, process_group=group)
    return (whole.contiguous(), *args[1:])  # gathered along dim 1: a transposed view, which NxD's backward views


def _reduce_scatter_sequence(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.parallel_layers.mappings import reduce_scatter_to_sequence_parallel_region

    group = parallel_state.get_tensor_model_parallel_group()
    return reduce_scatter_to_sequence_parallel_region(output, sequence_dimension=1, process_group=group)


def parallel_optimizer(
    config: dict[str, Any], optimizer_class: type[torch.optim.Optimizer], params: list[nn.Parameter], **hyper: Any
) -> Any:
    """The optimizer through NxD's trainer API (`initialize_parallel_optimizer`); its `step()` reduces gradients
    over DP, the sequence-parallel norms over TP, clips by the global norm, and exposes it as `grad_norm`."""
    require_nxd()
    from neuronx_distributed.trainer import initialize_parallel_optimizer

    if config["optimizer_config"]["zero_one_enabled"] and any(p.device.type != "xla" for p in params):
        raise NeuronUnavailable(
            "parallelism.zero1: NxD's ZeRO-1 optimizer runs on the XLA device only (it refuses the CPU tensors of "
            "NxD's CPU mode); it is verified only on trn1"
        )
    return initialize_parallel_optimizer(config, optimizer_class, params, **hyper)


def pipeline_model(
    model: nn.Module, cfg: HlatConfig, init: Callable[[nn.Module, torch.device], None] | None = None
) -> Any:
    """`model` split into pipeline stages by NxD's NxDPPModel (FX-traced; a stage per PP rank): cuts from the layer
    count (auto partition: the blocks spread evenly, any remainder to the later stages), the step's
    `gradient_accumulation` micro-batches through the 1F1B schedule, the loss computed on the last stage and
    averaged over the micro-batches and the data-parallel group onto every rank, where it stays on the device
    (`_loss_on_every_stage`). Gradients are left to NxD's optimizer (`parallel_optimizer`), which reduces them over
    DP and clips by the norm across every stage.

    A model built on the meta device is materialised stage by stage: each rank gives storage to its own stage's
    parameters only and fills them with `init(module, device)` (`Transformer.initialiser`)."""
    require_nxd()
    from hlat.training.model import Block

    inputs = ["tokens", "doc_ids", "targets"] if cfg.training.document_masking else ["tokens", "targets"]
    return _device_loss_pipeline()(
        model,
        transformer_layer_cls=Block,
        num_microbatches=cfg.gradient_accumulation,
        output_loss_value_spec=True,
        input_names=inputs,
        tracer_cls="torch",
        # The final norm (every family's) uses its own parameters outside the blocks: a leaf, or its weight has no
        # stage.
        leaf_module_cls=[cls.__name__ for cls in norm_classes()],
        auto_partition=True,
        use_optimizer_wrapper=True,
        # The loss stays on the device: NxD's own averaging and broadcast (broadcast_and_average_loss) ends in an
        # unconditional `.cpu()` on every stage but the last, in NxD 0.13 and 0.17 alike (pipeline/model.py,
        # `_process_loss`), and return_loss_on_cpu (its default: True) adds one on the last: a host read that
        # runs the step's graph and waits for it, every step. HLAT turned both off (RETURN_LOSS_ON_CPU=0 in
        # 70b/tp_zero1_llama2_70b_hf_pretrain.sh, and its patch of that line, common/nxd_patches/model.py, in
        # github.com/awslabs/HLAT). Here the last stage hands back its micro-batches' mean on the device, and the
        # subclass averages it over DP and shares it with the other stages itself.
        broadcast_and_average_loss=False,
        return_loss_on_cpu=False,
        param_init_fn=init,
    )


@functools.cache
def _device_loss_pipeline() -> type:
    """NxD's NxDPPModel, whose `run_train` and `run_eval` return the step's loss on every stage as a device tensor
    (made here, where NxD is importable)."""
    from neuronx_distributed.pipeline import NxDPPModel

    class DeviceLossPipeline(NxDPPModel):
        def run_train(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return _loss_on_every_stage(super().run_train(*args, **kwargs))

        def run_eval(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return _loss_on_every_stage(super().run_eval(*args, **kwargs))

    return DeviceLossPipeline


def _loss_on_every_stage(loss: torch.Tensor | None) -> torch.Tensor:
    """The last stage's loss (the mean over its micro-batches; None on the other stages) averaged over the
    data-parallel group and summed over the pipeline group (zero from every other stage): the same value on every
    rank, on the device, with no host read. Collectives on NxD's groups, as NxD's own averaging makes them
    (all-reduce over the pipeline group: its note says broadcast returns 0.0 in XLA mode); traced into the
    optimizer step's graph (NxD's run_train has cut the graph before returning)."""
    import torch.distributed as dist
    from neuronx_distributed.parallel_layers import parallel_state as ps

    if loss is None:
        device = torch.device("cpu") if nxd_cpu_mode() else _xla_device()
        loss = torch.zeros((), dtype=torch.float32, device=device)
    else:
        loss = loss.detach().float().reshape(()) / ps.get_data_parallel_size()
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
    dist.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
    return loss


def _xla_device() -> torch.device:
    from hlat.training import xla

    return xla.device()


def shard_name(tensor_rank: int, pipeline_rank: int) -> str:
    """The checkpoint shard a model-parallel position writes: one per (TP rank, PP rank)."""
    return f"tp{tensor_rank:02d}-pp{pipeline_rank:02d}"


def shard_names(dims: ParallelDims) -> list[str]:
    """Every shard of a checkpoint of this layout, pipeline stage by stage."""
    return [shard_name(t, p) for p in range(dims.pipeline) for t in range(dims.tensor)]
