"""The GPT-NeoX family's torch-free rules: shape checks, parameter count and GPTNeoXForCausalLM mapping.

Multi-head attention only, untied embeddings (blocks: training/models/gpt_neox.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hlat.core.models.base import HfConfigRefused, ModelFamily, ModelShape, require


class GptNeox(ModelFamily):
    name = "gpt_neox"
    hf_architecture = "GPTNeoXForCausalLM"
    hf_model_type = "gpt_neox"
    hf_config_class = "GPTNeoXConfig"
    special_ids = (0, 0)  # GPT-NeoX's tokenizer's <|endoftext|>

    def check(self, cfg: ModelShape) -> None:
        """Multi-head attention, untied embeddings, and a rotated width that divides the head."""
        head_dim = cfg.head_dim
        rotated = int(head_dim * cfg.rotary_fraction)
        if cfg.kv_heads != cfg.n_heads:
            raise ValueError(
                f"n_kv_heads={cfg.n_kv_heads}: arch=gpt_neox has no grouped-query attention; "
                f"set n_kv_heads to None or {cfg.n_heads}"
            )
        if cfg.tie_embeddings:
            raise ValueError("tie_embeddings=True: arch=gpt_neox has untied embeddings; set tie_embeddings to false")
        if head_dim % rotated:
            raise ValueError(
                f"rotary_fraction={cfg.rotary_fraction} rotates {rotated} of {head_dim} head dims; with "
                "arch=gpt_neox the rotated dims must divide the head (e.g. rotary_fraction 0.25, 0.5 or 1)"
            )

    def block_params(self, cfg: ModelShape) -> int:
        """Q, K, V, O d x d with biases, the GeLU MLP with biases, two LayerNorms."""
        d, f = cfg.d_model, cfg.ffn_hidden
        return 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d

    def final_norm_params(self, cfg: ModelShape) -> int:
        """LayerNorm's weight and bias."""
        return 2 * cfg.d_model

    def fields_from_hf(self, hf: Mapping[str, Any], rope: Mapping[str, Any]) -> dict[str, Any]:
        require(hf, hidden_act="gelu", use_parallel_residual=True, attention_bias=True)
        if hf.get("tie_word_embeddings", False):
            raise HfConfigRefused("tie_word_embeddings=true: hlat's GPT-NeoX has untied embeddings (as GPT-NeoX has)")
        return {
            "n_kv_heads": None,
            "norm_eps": float(hf.get("layer_norm_eps", 1e-5)),
            "rotary_fraction": rope["partial_rotary_factor"],
            "tie_embeddings": False,
        }

    def hf_config(self, cfg: ModelShape, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
        return {
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "intermediate_size": cfg.ffn_hidden,
            "hidden_act": "gelu",
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": cfg.rope_theta,
                "partial_rotary_factor": cfg.rotary_fraction,
            },
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "layer_norm_eps": cfg.norm_eps,
            "use_parallel_residual": True,
            "attention_bias": True,
            "tie_word_embeddings": False,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": None,
            "dtype": "float32",
            "architectures": [self.hf_architecture],
        }

    def hf_config_attributes(self, cfg: ModelShape) -> dict[str, Any]:
        """`rotary_pct` and `rotary_emb_base`: what transformers before 5 reads."""
        return {"rotary_pct": cfg.rotary_fraction, "rotary_emb_base": cfg.rope_theta}


GPT_NEOX = GptNeox()
