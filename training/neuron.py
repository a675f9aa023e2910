"""Trainium (trn1) through torch-xla and neuronx-distributed: thin, and imported only inside a Neuron container.

What can be checked anywhere lives in plain functions: the environment a precision needs
(`training.devices.neuron_environment`), the translation of our parallel degrees into neuronx-distributed's
arguments (`parallel_settings`), and which layer of our model becomes which tensor-parallel layer
(`tensor_parallel_plan`). The functions that touch torch-xla or neuronx-distributed call `require_neuron()`
first, which fails with a clear message outside a Neuron container (the PyPI packages of the same names are
empty placeholders).
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

from training.config import ConfigError, HlatConfig
from training.devices import neuron_available

ParallelKind = Literal["column", "row", "embedding"]

# Megatron-style split of a LLaMA block: the projections that fan out are split by output features (column),
# the ones that fan back in by input features (row), so each block needs one all-reduce per sub-layer.
_PLAN: dict[str, ParallelKind] = {
    "attn.q_proj": "column",
    "attn.k_proj": "column",
    "attn.v_proj": "column",
    "attn.o_proj": "row",
    "mlp.w1": "column",
    "mlp.w3": "column",
    "mlp.w2": "row",
}


class NeuronUnavailable(ImportError):
    """torch-neuronx / torch-xla / neuronx-distributed are not installed (outside a Neuron container)."""


def require_neuron() -> None:
    if not neuron_available():
        raise NeuronUnavailable(
            "Trainium support needs torch-neuronx, torch-xla and neuronx-distributed, which exist only in the AWS "
            "Neuron training container (the PyPI packages of those names are placeholders); run on trn1 with "
            "job.backend=sagemaker, or set parallelism.tensor=1 and parallelism.pipeline=1 on CPU/CUDA"
        )


def parallel_settings(cfg: HlatConfig) -> dict[str, Any]:
    """Our parallel config as neuronx-distributed's arguments (checked against the device count)."""
    p, m = cfg.parallelism, cfg.model
    if m.kv_heads % p.tensor and p.tensor % m.kv_heads:
        raise ConfigError(f"parallelism.tensor={p.tensor} must divide or be a multiple of {m.kv_heads} KV heads")
    return {
        "initialize_model_parallel": {
            "tensor_model_parallel_size": p.tensor,
            "pipeline_model_parallel_size": p.pipeline,
        },
        "sequence_parallel_enabled": p.sequence_parallel,
        "zero1": p.zero1,
        "data_parallel_size": cfg.data_parallel_size,
        # With GQA and more TP ranks than KV heads, each KV head is replicated across tensor-parallel ranks.
        "kv_replication": max(1, p.tensor // m.kv_heads),
        "activation_checkpointing": p.activation_checkpointing,
    }


def tensor_parallel_plan(model: nn.Module) -> dict[str, ParallelKind]:
    """Fully qualified module name -> the tensor-parallel layer that replaces it."""
    plan: dict[str, ParallelKind] = {"embed": "embedding", "output": "column"}
    for name, _ in model.named_modules():
        for suffix, kind in _PLAN.items():
            if name.endswith(suffix) and name.startswith("layers."):
                plan[name] = kind
    return plan


def init_model_parallel(cfg: HlatConfig) -> None:
    """Form neuronx-distributed's tensor/pipeline/data-parallel groups (after the `xla` process group exists:
    `training.distributed.init_world` calls this on trn1)."""
    require_neuron()
    from neuronx_distributed.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(**parallel_settings(cfg)["initialize_model_parallel"])


def apply_tensor_parallel(model: nn.Module, cfg: HlatConfig) -> nn.Module:
    """Swap the layers of `tensor_parallel_plan` for neuronx-distributed's parallel layers, in place."""
    require_neuron()
    from neuronx_distributed.parallel_layers import layers

    sequence_parallel = cfg.parallelism.sequence_parallel
    for name, kind in tensor_parallel_plan(model).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        new: nn.Module
        if kind == "embedding":
            new = layers.ParallelEmbedding(old.num_embeddings, old.embedding_dim)
        elif kind == "column":
            new = layers.ColumnParallelLinear(
                old.in_features, old.out_features, bias=False, gather_output=child == "output",
                sequence_parallel_enabled=sequence_parallel,
            )  # fmt: skip
        else:
            new = layers.RowParallelLinear(
                old.in_features, old.out_features, bias=False, input_is_parallel=True,
                sequence_parallel_enabled=sequence_parallel,
            )  # fmt: skip
        setattr(parent, child, new)
    return model


def zero1_optimizer(model: nn.Module, cfg: HlatConfig) -> Any:
    """AdamW with optimizer states sharded over data-parallel ranks (HLAT 70B)."""
    require_neuron()
    import torch
    from neuronx_distributed.optimizer import NeuronZero1Optimizer
    from neuronx_distributed.parallel_layers import parallel_state

    t = cfg.training
    return NeuronZero1Optimizer(
        model.parameters(),
        torch.optim.AdamW,
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        weight_decay=t.weight_decay,
        grad_clipping=t.grad_clip > 0,
        max_norm=t.grad_clip,
        pin_layout=False,
        sharding_groups=parallel_state.get_data_parallel_group(as_list=True),
        grad_norm_groups=parallel_state.get_tensor_model_parallel_group(as_list=True),
    )
