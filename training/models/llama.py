"""The LLaMA family's torch code: RMSNorm, SwiGLU, TP slicing rules and HF weight names.

Blocks follow HF `LlamaForCausalLM`, so import and export are a pure renaming (`NAMES`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hlat.core.config import ModelConfig
from hlat.core.models.llama import LLAMA as CORE
from hlat.training.models.base import DenseParameter, FamilyModules, Layers, build_hf_config


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale; statistics in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        # Same order of operations and casts as HF's LlamaRMSNorm, so bf16 outputs match bit for bit.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): gate w1, up w3, down w2."""

    def __init__(self, cfg: ModelConfig, parallel: Layers) -> None:
        super().__init__()
        self.w1 = parallel.linear("column", cfg.d_model, cfg.ffn_hidden)
        self.w3 = parallel.linear("column", cfg.d_model, cfg.ffn_hidden)
        self.w2 = parallel.linear("row", cfg.ffn_hidden, cfg.d_model)
        self.act = GatedSiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x)))  # (B, T, d_model)


class GatedSiLU(nn.Module):
    """silu(gate) * up: SwiGLU's elementwise part, which 'selective' checkpointing recomputes (as HLAT does)."""

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up


NAMES = (
    ("embed.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.mlp.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
"""(our name, HF name) of every tensor; {i} is the layer index."""


class LlamaModules(FamilyModules):
    core = CORE
    norm_class = RMSNorm
    hf_names = NAMES
    hf_prefix = "model."
    hf_non_parameters = (r"model\.(layers\.\d+\.(self_attn|attention)\.)?rotary_emb\.inv_freq",)

    def norm(self, cfg: ModelConfig, parallel: Layers) -> nn.Module:
        norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        parallel.norm(norm.weight)
        return norm

    def mlp(self, cfg: ModelConfig, parallel: Layers) -> nn.Module:
        return SwiGLU(cfg, parallel)

    def norm_parameters(self, cfg: ModelConfig, name: str) -> list[DenseParameter]:
        return [DenseParameter(f"{name}.weight", (cfg.d_model,), "ones", "replicated")]

    def block_parameters(self, cfg: ModelConfig, prefix: str) -> list[DenseParameter]:
        d, hd, p = cfg.d_model, cfg.head_dim, prefix
        q_dim, kv_dim = cfg.n_heads * hd, cfg.kv_heads * hd
        return [
            *self.norm_parameters(cfg, f"{p}.attn_norm"),
            DenseParameter(f"{p}.attn.q_proj.weight", (q_dim, d), "normal", "q"),
            DenseParameter(f"{p}.attn.k_proj.weight", (kv_dim, d), "normal", "kv"),
            DenseParameter(f"{p}.attn.v_proj.weight", (kv_dim, d), "normal", "kv"),
            DenseParameter(f"{p}.attn.o_proj.weight", (d, q_dim), "output", "o"),
            *self.norm_parameters(cfg, f"{p}.mlp_norm"),
            DenseParameter(f"{p}.mlp.w1.weight", (cfg.ffn_hidden, d), "normal", "column"),
            DenseParameter(f"{p}.mlp.w3.weight", (cfg.ffn_hidden, d), "normal", "column"),
            DenseParameter(f"{p}.mlp.w2.weight", (d, cfg.ffn_hidden), "output", "row"),
        ]

    def hf_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        d, kv_dim, f, v = cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size
        expected: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
        if not cfg.tie_embeddings:
            expected["lm_head.weight"] = (v, d)
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            expected |= {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (d, d),
                p + "self_attn.k_proj.weight": (kv_dim, d),
                p + "self_attn.v_proj.weight": (kv_dim, d),
                p + "self_attn.o_proj.weight": (d, d),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        return expected


LLAMA = LlamaModules()


def hf_llama_config(cfg: ModelConfig, bos_id: int | None = 1, eos_id: int | None = 2) -> Any:
    """The `transformers.LlamaConfig` of the same network as `cfg` (float32; partial rotary as a longrope)."""
    if cfg.arch != LLAMA.name:
        raise ValueError(f"model.arch={cfg.arch} does not export as LlamaForCausalLM (hf_config gives its config)")
    return build_hf_config(LLAMA, cfg, bos_id, eos_id)
