"""How parameters split over tensor-parallel ranks: pure functions of the config and the degree.

Weights are defined once, densely (`dense_parameters`); a rank holds `shard`s and an exporter calls `unshard`. Each
dense tensor is seeded by the run seed and its name, so a TP run starts from the dense model's weights. The layout
matches neuronx-distributed's layers (`training/parallel/neuron.py`) without importing NxD. Kinds (Megatron's split):
`column` and `row` split output and input features; `vocab` the embedding rows; `replicated` is whole on every rank; `q`
/ `o` split heads, kept whole; `kv` splits KV heads like `q`. With more ranks than KV heads, rank r holds KV head r mod
n_kv (NxD's GQAQKVColumnParallelLinear). Then `q_head_order` reorders query heads so each rank holds its KV head's
group."""

from __future__ import annotations

import hashlib
import math

import torch

from hlat.core.config import ModelConfig
from hlat.training.models import modules_of
from hlat.training.models.base import DenseParameter as DenseParameter
from hlat.training.models.base import Init as Init
from hlat.training.models.base import Kind as Kind


def dense_parameters(cfg: ModelConfig) -> list[DenseParameter]:
    """Every dense parameter in a fixed order, named as in the state dict; vocabulary rows are padded."""
    d, v = cfg.d_model, cfg.padded_vocab_size
    out: list[DenseParameter] = [DenseParameter("embed.weight", (v, d), "normal", "vocab")]
    family = modules_of(cfg)
    for i in range(cfg.n_layers):
        out += family.block_parameters(cfg, f"layers.{i}")
    out += family.norm_parameters(cfg, "norm")
    if not cfg.tie_embeddings:
        out.append(DenseParameter("output.weight", (v, d), "normal", "column"))
    return out


def q_head_order(cfg: ModelConfig, tp: int) -> list[int]:
    """The dense query heads in the order TP ranks hold them; the identity unless TP exceeds the KV heads."""
    n_heads, n_kv = cfg.n_heads, cfg.kv_heads
    if tp <= n_kv:
        return list(range(n_heads))
    group, per_rank = n_heads // n_kv, n_heads // tp
    order: list[int] = []
    for rank in range(tp):
        g, j = rank % n_kv, rank // n_kv
        order += [g * group + j * per_rank + i for i in range(per_rank)]
    return order


def _heads(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """View `t`'s `dim` as (n heads, head_dim)."""
    shape = list(t.shape)
    return t.reshape(*shape[:dim], n, shape[dim] // n, *shape[dim + 1 :])


def shard(param: DenseParameter, full: torch.Tensor, rank: int, tp: int, cfg: ModelConfig) -> torch.Tensor:
    """Rank `rank`'s slice of `param`'s dense tensor `full` (a copy unless whole)."""
    if tp == 1 or param.kind == "replicated":
        return full
    if param.kind in ("column", "vocab"):
        return full.chunk(tp, dim=0)[rank].clone()
    if param.kind == "row":
        return full.chunk(tp, dim=1)[rank].clone()
    order = torch.tensor(q_head_order(cfg, tp))
    if param.kind == "q":
        heads = _heads(full, cfg.n_heads, 0)[order]  # (n_heads, head_dim, d) in rank order
        return heads.flatten(0, 1).chunk(tp, dim=0)[rank].clone()
    if param.kind == "o":
        heads = _heads(full, cfg.n_heads, 1)[:, order]  # (d, n_heads, head_dim) in rank order
        return heads.flatten(1, 2).chunk(tp, dim=1)[rank].clone()
    # kv
    if tp <= cfg.kv_heads:
        return full.chunk(tp, dim=0)[rank].clone()
    return _heads(full, cfg.kv_heads, 0)[rank % cfg.kv_heads].clone()  # one whole head, replicated


def unshard(param: DenseParameter, pieces: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The dense tensor of `param` from every TP rank's slice, in rank order (the inverse of `shard`)."""
    tp = len(pieces)
    if tp == 1 or param.kind == "replicated":
        return pieces[0]
    if param.kind in ("column", "vocab"):
        return torch.cat(pieces, dim=0)
    if param.kind == "row":
        return torch.cat(pieces, dim=1)
    inverse = torch.argsort(torch.tensor(q_head_order(cfg, tp)))
    if param.kind == "q":
        heads = _heads(torch.cat(pieces, dim=0), cfg.n_heads, 0)[inverse]
        return heads.flatten(0, 1)
    if param.kind == "o":
        heads = _heads(torch.cat(pieces, dim=1), cfg.n_heads, 1)[:, inverse]
        return heads.flatten(1, 2)
    if tp <= cfg.kv_heads:
        return torch.cat(pieces, dim=0)
    return torch.cat(pieces[: cfg.kv_heads], dim=0)  # ranks 0 .. n_kv - 1 hold KV heads 0 .. n_kv - 1


def init_std(param: DenseParameter, cfg: ModelConfig) -> float | None:
    """The normal init's standard deviation of `param` (None: a constant, ones or zeros)."""
    if param.init in ("ones", "zeros"):
        return None
    if param.init == "output" and cfg.scale_output_init:
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def dense_init(param: DenseParameter, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """`param`'s dense starting tensor, drawn on CPU from a (seed, name) generator, so any split agrees."""
    std = init_std(param, cfg)
    if std is None:
        return torch.zeros(param.shape) if param.init == "zeros" else torch.ones(param.shape)
    digest = hashlib.blake2b(f"init:{seed}:{param.name}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return torch.randn(param.shape, generator=generator) * std


GQA_LOCAL_NAMES = {"q_proj": "weight_q", "k_proj": "weight_k", "v_proj": "weight_v"}
"""Where a dense attention projection lives when TP exceeds the KV heads: NxD's GQAQKVColumnParallelLinear
(module `attn.qkv`, unfused)."""


def local_name(name: str, cfg: ModelConfig, tp: int) -> str:
    """The name of the tensor-parallel model's parameter that holds a slice of dense parameter `name`."""
    if tp > cfg.kv_heads:
        for dense, local in GQA_LOCAL_NAMES.items():
            suffix = f".attn.{dense}.weight"
            if name.endswith(suffix):
                return name[: -len(suffix)] + f".attn.qkv.{local}"
    return name


def consolidate(states: list[dict[str, torch.Tensor]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The dense state dict from the TP ranks' state dicts, in rank order."""
    tp = len(states)
    out = {}
    for param in dense_parameters(cfg):
        name = local_name(param.name, cfg, tp)
        missing = [rank for rank, state in enumerate(states) if name not in state]
        if missing:
            raise KeyError(f"{name} (dense {param.name}) is missing from tensor-parallel rank(s) {missing}")
        out[param.name] = unshard(param, [state[name] for state in states], cfg)
    return out
