"""Model parallelism through neuronx-distributed (NxD): thin, and imported only where NxD is.

Rules:
- nothing imports NxD at module level; functions that need it call `require_nxd()`.
- NxD's CPU mode (`NXD_CPU_MODE=1`) runs the same layers and groups anywhere (tests/nxd).
- the layers, groups, optimizer wrapper and pipeline are NxD's; the model and its init are ours.
docs/trn1.md ("Model parallelism on trn1") describes the whole path.
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
    """neuronx-distributed is not available here."""


def nxd_cpu_mode() -> bool:
    """NxD's CPU mode: its layers and groups on CPU over gloo."""
    return os.environ.get("NXD_CPU_MODE", "0") not in ("", "0")


def nxd_available() -> bool:
    """NxD can run here: a Neuron container, or CPU mode with its source."""
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
    """Our parallel config as NxD's `neuronx_distributed_config` arguments."""
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
    """Whether ZeRO-1's masters hold more than the device's parameters, and so go into checkpoints.

    True under bf16-mixed with Neuron 2.24's flags and under bf16-sr without flags.
    Elsewhere they equal the parameters bit for bit (tests/nxd/test_zero1.py).
    """
    flags = neuron_sdk(cfg).precision_flags
    mode = cfg.precision.mode
    return (mode == "bf16-mixed" and flags) or (mode == "bf16-sr" and not flags)


def nxd_config(cfg: HlatConfig) -> dict[str, Any]:
    """NxD's trainer config for `cfg`; forms NxD's groups."""
    require_nxd()
    from neuronx_distributed.trainer import neuronx_distributed_config

    return dict(neuronx_distributed_config(**parallel_settings(cfg)))


def coordinates() -> tuple[int, int, int]:
    """This rank's tensor, pipeline and data-parallel rank."""
    from neuronx_distributed.parallel_layers import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()


def formed_dims() -> ParallelDims:
    """The layout NxD's groups formed."""
    from neuronx_distributed.parallel_layers import parallel_state as ps

    return ParallelDims(
        ps.get_tensor_model_parallel_size(), ps.get_pipeline_model_parallel_size(), ps.get_data_parallel_size()
    )


class NxdLayers:
    """`training.model.Layers` on NxD's tensor-parallel layers; each rank keeps its slice of the dense init."""

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
        """Mean cross-entropy of vocabulary-parallel logits via NxD (on a copy: it shifts in place)."""
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
    """(B, T, ...) <-> (T, B, ...), contiguous, as NxD's layers need."""

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
    """The optimizer through NxD's `initialize_parallel_optimizer`."""
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
    """`model` split into pipeline stages by NxD's NxDPPModel (one stage per PP rank, 1F1B).

    The loss stays on the device on every rank. A meta-device model is materialised stage by stage.
    """
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
    """NxDPPModel returning the loss on every stage as a device tensor."""
    from neuronx_distributed.pipeline import NxDPPModel

    class DeviceLossPipeline(NxDPPModel):
        def run_train(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return _loss_on_every_stage(super().run_train(*args, **kwargs))

        def run_eval(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return _loss_on_every_stage(super().run_eval(*args, **kwargs))

    return DeviceLossPipeline


def _loss_on_every_stage(loss: torch.Tensor | None) -> torch.Tensor:
    """The last stage's loss averaged over DP and summed over PP: the same on every rank, on the device.

    An all-reduce, not a broadcast: broadcast returns 0.0 in XLA mode.
    """
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
    """The shard a model-parallel position writes."""
    return f"tp{tensor_rank:02d}-pp{pipeline_rank:02d}"


def shard_names(dims: ParallelDims) -> list[str]:
    """Every shard of this layout, stage by stage."""
    return [shard_name(t, p) for p in range(dims.pipeline) for t in range(dims.tensor)]
