"""The GPT-NeoX family's torch code: LayerNorm, GeLU MLP, partial rotary, TP rules and HF weight names.

Blocks follow HF `GPTNeoXForCausalLM` with `use_parallel_residual`. HF fuses Q, K and V per head, (n_heads, 3,
head_dim): see `fuse_qkv` and `split_qkv`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hlat.core.config import ModelConfig
from hlat.core.models.gpt_neox import GPT_NEOX as CORE
from hlat.training.models.base import DenseParameter, FamilyModules, Layers, build_hf_config


class LayerNorm(nn.Module):
    """LayerNorm with a learned scale and bias, as nn.LayerNorm computes it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class GeLUMLP(nn.Module):
    """GPT-NeoX's MLP: fc_out(gelu(fc_in x)), both biased (HF's dense_h_to_4h and dense_4h_to_h)."""

    def __init__(self, cfg: ModelConfig, parallel: Layers) -> None:
        super().__init__()
        self.fc_in = parallel.linear("column", cfg.d_model, cfg.ffn_hidden, bias=True)
        self.fc_out = parallel.linear("row", cfg.ffn_hidden, cfg.d_model, bias=True)
        self.act = GeLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(self.act(self.fc_in(x)))  # (B, T, d_model)


class GeLU(nn.Module):
    """The exact (erf) GeLU: what 'selective' checkpointing recomputes in a gpt_neox block."""

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x)


# GPT-NeoX (HF GPTNeoXForCausalLM); our q_proj, k_proj and v_proj are its one query_key_value (`fuse_qkv`).
NAMES = (
    ("embed.weight", "gpt_neox.embed_in.weight"),
    ("layers.{i}.attn_norm.weight", "gpt_neox.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attn_norm.bias", "gpt_neox.layers.{i}.input_layernorm.bias"),
    ("layers.{i}.attn.qkv.weight", "gpt_neox.layers.{i}.attention.query_key_value.weight"),
    ("layers.{i}.attn.qkv.bias", "gpt_neox.layers.{i}.attention.query_key_value.bias"),
    ("layers.{i}.attn.o_proj.weight", "gpt_neox.layers.{i}.attention.dense.weight"),
    ("layers.{i}.attn.o_proj.bias", "gpt_neox.layers.{i}.attention.dense.bias"),
    ("layers.{i}.mlp_norm.weight", "gpt_neox.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.mlp_norm.bias", "gpt_neox.layers.{i}.post_attention_layernorm.bias"),
    ("layers.{i}.mlp.fc_in.weight", "gpt_neox.layers.{i}.mlp.dense_h_to_4h.weight"),
    ("layers.{i}.mlp.fc_in.bias", "gpt_neox.layers.{i}.mlp.dense_h_to_4h.bias"),
    ("layers.{i}.mlp.fc_out.weight", "gpt_neox.layers.{i}.mlp.dense_4h_to_h.weight"),
    ("layers.{i}.mlp.fc_out.bias", "gpt_neox.layers.{i}.mlp.dense_4h_to_h.bias"),
    ("norm.weight", "gpt_neox.final_layer_norm.weight"),
    ("norm.bias", "gpt_neox.final_layer_norm.bias"),
    # The name in GPT-NeoX's and Pythia's published files, which transformers 4 reads and 5 renames to lm_head.
    ("output.weight", "embed_out.weight"),
)
ALIASES = (("output.weight", "lm_head.weight"),)
"""Read, never written: transformers 5 names the output projection lm_head."""

_QKV = ("q_proj", "k_proj", "v_proj")


def fuse_qkv(state: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Our q, k, v projections as GPT-NeoX's fused `attn.qkv.*`, rows per head (n_heads, 3, head_dim)."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        prefix, _, rest = name.partition(".attn.q_proj.")
        if rest:  # the query part of a layer: fuse its three
            parts = [state[f"{prefix}.attn.{proj}.{rest}"] for proj in _QKV]
            heads = [p.reshape(cfg.n_heads, cfg.head_dim, *p.shape[1:]) for p in parts]
            out[f"{prefix}.attn.qkv.{rest}"] = torch.stack(heads, dim=1).reshape(3 * cfg.d_model, *t.shape[1:])
        elif ".attn.k_proj." not in name and ".attn.v_proj." not in name:
            out[name] = t
    return out


def split_qkv(state: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """The inverse of `fuse_qkv`."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        prefix, _, rest = name.partition(".attn.qkv.")
        if not rest:
            out[name] = t
            continue
        heads = t.reshape(cfg.n_heads, 3, cfg.head_dim, *t.shape[1:])
        for j, proj in enumerate(_QKV):
            out[f"{prefix}.attn.{proj}.{rest}"] = heads[:, j].reshape(cfg.d_model, *t.shape[1:])
    return out


def _fused(name: str) -> str | None:
    """The fused `attn.qkv.*` name of a q/k/v parameter (None otherwise)."""
    for proj in _QKV:
        prefix, _, rest = name.partition(f".attn.{proj}.")
        if rest in ("weight", "bias") and prefix.startswith("layers."):
            return f"{prefix}.attn.qkv.{rest}"
    return None


class GptNeoxModules(FamilyModules):
    core = CORE
    norm_class = LayerNorm
    attention_bias = True
    parallel_residual = True
    hf_names = NAMES
    hf_aliases = ALIASES
    hf_prefix = "gpt_neox."
    hf_non_parameters = (
        r"gpt_neox\.(layers\.\d+\.(self_attn|attention)\.)?rotary_emb\.inv_freq",
        # Older GPT-NeoX files (Pythia, NeoX-20B) hold each layer's causal mask and its fill value as buffers.
        r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias)",
    )

    def norm(self, cfg: ModelConfig, parallel: Layers) -> nn.Module:
        norm = LayerNorm(cfg.d_model, cfg.norm_eps)
        parallel.norm(norm.bias)
        parallel.norm(norm.weight)
        return norm

    def mlp(self, cfg: ModelConfig, parallel: Layers) -> nn.Module:
        return GeLUMLP(cfg, parallel)

    def rotary_block(self, cfg: ModelConfig) -> int | None:
        """A head's rotated dims, `head_dim * rotary_fraction`: also the width of each turned run."""
        return round(cfg.head_dim * cfg.rotary_fraction)

    def rope_angles(self, cfg: ModelConfig, positions: Tensor, exponents: Tensor) -> Tensor:
        """The first run of r dims turns at theta^(-2i/r); the rest of the head does not turn."""
        angles = torch.outer(positions, torch.pow(cfg.rope_theta, -exponents))  # (T, r/2)
        rest = cfg.head_dim - 2 * exponents.shape[0]
        return torch.cat([angles, angles, angles.new_zeros(positions.shape[0], rest)], dim=-1)

    def norm_parameters(self, cfg: ModelConfig, name: str) -> list[DenseParameter]:
        return [
            DenseParameter(f"{name}.weight", (cfg.d_model,), "ones", "replicated"),
            DenseParameter(f"{name}.bias", (cfg.d_model,), "zeros", "replicated"),
        ]

    def block_parameters(self, cfg: ModelConfig, prefix: str) -> list[DenseParameter]:
        """Biased Q, K, V, O and GeLU MLP. Column-parallel biases split with outputs; row-parallel ones replicate."""
        d, f, p = cfg.d_model, cfg.ffn_hidden, prefix
        return [
            *self.norm_parameters(cfg, f"{p}.attn_norm"),
            DenseParameter(f"{p}.attn.q_proj.weight", (d, d), "normal", "q"),
            DenseParameter(f"{p}.attn.q_proj.bias", (d,), "zeros", "q"),
            DenseParameter(f"{p}.attn.k_proj.weight", (d, d), "normal", "kv"),
            DenseParameter(f"{p}.attn.k_proj.bias", (d,), "zeros", "kv"),
            DenseParameter(f"{p}.attn.v_proj.weight", (d, d), "normal", "kv"),
            DenseParameter(f"{p}.attn.v_proj.bias", (d,), "zeros", "kv"),
            DenseParameter(f"{p}.attn.o_proj.weight", (d, d), "output", "o"),
            DenseParameter(f"{p}.attn.o_proj.bias", (d,), "zeros", "replicated"),
            *self.norm_parameters(cfg, f"{p}.mlp_norm"),
            DenseParameter(f"{p}.mlp.fc_in.weight", (f, d), "normal", "column"),
            DenseParameter(f"{p}.mlp.fc_in.bias", (f,), "zeros", "column"),
            DenseParameter(f"{p}.mlp.fc_out.weight", (d, f), "output", "row"),
            DenseParameter(f"{p}.mlp.fc_out.bias", (d,), "zeros", "replicated"),
        ]

    def to_hf(self, state: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        return fuse_qkv(state, cfg)

    def from_hf(self, state: Mapping[str, Tensor], cfg: ModelConfig | None) -> dict[str, Tensor]:
        if cfg is None:
            raise ValueError("from_hf_state_dict: GPT-NeoX tensors need the ModelConfig (heads of the fused QKV)")
        return split_qkv(state, cfg)

    def hf_sources(self, name: str) -> tuple[str, ...]:
        return (_fused(name) or name,)

    def hf_shape(self, param: DenseParameter) -> tuple[int, ...]:
        if _fused(param.name):
            return (3 * param.shape[0], *param.shape[1:])
        return param.shape

    def split_hf(self, param: DenseParameter, ours: str, tensor: Tensor, cfg: ModelConfig) -> dict[str, Tensor]:
        return split_qkv({ours: tensor}, cfg) if _fused(param.name) else {param.name: tensor}

    def hf_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        d, f, v = cfg.d_model, cfg.ffn_hidden, cfg.vocab_size
        expected: dict[str, tuple[int, ...]] = {
            "gpt_neox.embed_in.weight": (v, d),
            "gpt_neox.final_layer_norm.weight": (d,),
            "gpt_neox.final_layer_norm.bias": (d,),
            "embed_out.weight": (v, d),
        }
        for i in range(cfg.n_layers):
            p = f"gpt_neox.layers.{i}."
            expected |= {
                p + "input_layernorm.weight": (d,),
                p + "input_layernorm.bias": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "post_attention_layernorm.bias": (d,),
                p + "attention.query_key_value.weight": (3 * d, d),
                p + "attention.query_key_value.bias": (3 * d,),
                p + "attention.dense.weight": (d, d),
                p + "attention.dense.bias": (d,),
                p + "mlp.dense_h_to_4h.weight": (f, d),
                p + "mlp.dense_h_to_4h.bias": (f,),
                p + "mlp.dense_4h_to_h.weight": (d, f),
                p + "mlp.dense_4h_to_h.bias": (d,),
            }
        return expected


GPT_NEOX = GptNeoxModules()


def hf_gpt_neox_config(cfg: ModelConfig, bos_id: int | None = 0, eos_id: int | None = 0) -> Any:
    """The `transformers.GPTNeoXConfig` of a gpt_neox `cfg` (float32; BOS/EOS 0, GPT-NeoX's <|endoftext|>). Also writes
    `rotary_pct` and `rotary_emb_base` for transformers before 5."""
    if cfg.arch != GPT_NEOX.name:
        raise ValueError(f"hf_gpt_neox_config: model.arch={cfg.arch}; use hf_config")
    return build_hf_config(GPT_NEOX, cfg, bos_id, eos_id)
