"""How the model's parameters are split over tensor-parallel ranks: pure functions of the config and the degree.

The model's weights are defined once, densely (`dense_parameters`: every parameter of the single-device model,
its shape, how it is initialised, and how tensor parallelism splits it). A tensor-parallel rank holds a slice of
each (`shard`), and an exporter puts the slices back together (`unshard`). The model initialises every parameter
from its dense tensor (drawn from a generator seeded by the run's seed and the parameter's name) and keeps its
slice, so a TP run starts from exactly the dense model's weights, whatever the degree; and the layout here is the
one neuronx-distributed's parallel layers compute with (`training/parallel/neuron.py`), so no import of NxD is needed to
shard or consolidate a checkpoint.

Each family lists its block's parameters and their kinds (training/models/). Kinds (Megatron's split of a LLaMA
block, one all-reduce per sub-layer):
- `column`: the output features are split (w1, w3; the output projection over the vocabulary);
- `row`: the input features are split (w2);
- `vocab`: the embedding table's rows (the vocabulary) are split;
- `replicated`: every rank holds all of it (the norms' scales);
- `q` / `o`: the query projection's output heads / the output projection's input heads are split, heads kept
  whole. With more TP ranks than KV heads the heads are reordered as `q_head_order` says (below);
- `kv`: the key/value projections' heads. With TP <= KV heads they are split like `q`. With more ranks than
  KV heads every rank holds one head, replicated over `core.parallel.kv_replicas` ranks in trn1's layout of
  neuronx-distributed's GQAQKVColumnParallelLinear: rank r holds KV head r mod n_kv ("(K0, K1, ..., K7) repeated").

Grouped-query attention pairs query head h with KV head h // (n_heads / n_kv) (HF Llama's grouping). Under trn1's
replicated layout rank r holds KV head g = r mod n_kv, so it must hold query heads of group g: the j-th replica
(j = r // n_kv) takes the j-th run of n_heads/tp heads of that group. `q_head_order` lists the dense query heads
in that rank order; `q` and `o` slices follow it, so attention on every rank sees its own heads' queries and keys.
"""

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
    """Every parameter of the dense model, in a fixed order (names as in its state dict). The embedding and the
    output projection have `cfg.padded_vocab_size` rows."""
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
    """The dense query heads in the order the TP ranks hold them (rank r: positions r*h .. (r+1)*h - 1, with h =
    n_heads / tp); the identity unless TP exceeds the KV heads (see the module docstring)."""
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
    """Rank `rank`'s slice of the dense tensor `full` of `param` (a copy when it is not the whole)."""
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
    """The dense tensor `param` starts from: drawn on the CPU from a generator seeded by (seed, name), so it does
    not depend on the order parameters are initialised in, the device, or how the model is split."""
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
    """The dense state dict from the tensor-parallel ranks' state dicts (rank order; each the union over pipeline
    stages): every parameter unsharded under its dense name."""
    tp = len(states)
    out = {}
    for param in dense_parameters(cfg):
        name = local_name(param.name, cfg, tp)
        missing = [rank for rank, state in enumerate(states) if name not in state]
        if missing:
            raise KeyError(f"{name} (dense {param.name}) is missing from tensor-parallel rank(s) {missing}")
        out[param.name] = unshard(param, [state[name] for state in states], cfg)
    return out
