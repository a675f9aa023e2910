"""The LLaMA family's torch-free rules: parameter count and the LlamaForCausalLM config.json mapping.

Partial rotary exports as a longrope whose divisors give hlat's frequencies (`rope_parameters`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hlat.core.models.base import ModelFamily, ModelShape, require

UNROTATED = 1e30
"""The longrope divisor of a pair that does not rotate: finite, so config.json stays JSON."""


def rope_parameters(cfg: ModelShape) -> dict[str, Any]:
    """HF Llama's `rope_parameters` for `cfg`: default RoPE, or a longrope for partial rotary.

    Llama turns pair i at 1 / (f_i * theta^(2i/d)); hlat turns its first r/2 pairs at theta^(-2i/r). So f_i =
    theta^(2i/r - 2i/d) for i < r/2, and UNROTATED beyond."""
    if cfg.rotary_fraction == 1.0:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    d = cfg.head_dim
    r = round(d * cfg.rotary_fraction)
    divisors = [cfg.rope_theta ** (2 * i / r - 2 * i / d) if i < r // 2 else UNROTATED for i in range(d // 2)]
    return {
        "rope_type": "longrope",
        "rope_theta": cfg.rope_theta,
        "short_factor": divisors,
        "long_factor": divisors,
        "factor": 1.0,
        "attention_factor": 1.0,
        "original_max_position_embeddings": cfg.max_seq_len,
    }


class Llama(ModelFamily):
    name = "llama"
    hf_architecture = "LlamaForCausalLM"
    hf_model_type = "llama"
    hf_config_class = "LlamaConfig"
    special_ids = (1, 2)  # the sentencepiece ids of <s> and </s> (infra/inputs/tokenizer.py): the run's own tokenizer

    def block_params(self, cfg: ModelShape) -> int:
        """GQA attention (Q, O: d x d; K, V: d x kv_dim), SwiGLU (three d x ffn_hidden), two RMSNorms."""
        d, f, kv_dim = cfg.d_model, cfg.ffn_hidden, cfg.kv_heads * cfg.head_dim
        return 2 * d * d + 2 * d * kv_dim + 3 * d * f + 2 * d

    def final_norm_params(self, cfg: ModelShape) -> int:
        """RMSNorm's weight."""
        return cfg.d_model

    def fields_from_hf(self, hf: Mapping[str, Any], rope: Mapping[str, Any]) -> dict[str, Any]:
        require(hf, hidden_act="silu", attention_bias=False, mlp_bias=False)
        heads, kv = int(hf["num_attention_heads"]), hf.get("num_key_value_heads")
        return {
            "n_kv_heads": None if kv in (None, heads) else int(kv),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "rotary_fraction": 1.0,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }

    def hf_config(self, cfg: ModelShape, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
        return {
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_hidden,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": rope_parameters(cfg),
            "tie_word_embeddings": cfg.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": None,
            "dtype": "float32",
            "architectures": [self.hf_architecture],
        }


LLAMA = Llama()
