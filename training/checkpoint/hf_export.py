"""Export a trained `training.model.Transformer` as a Hugging Face `LlamaForCausalLM` or `GPTNeoXForCausalLM`
checkpoint (and back).

`training.model`'s llama follows HF Llama's conventions (rotate_half RoPE pairing, `repeat_kv` head grouping,
float32 RMSNorm statistics, SwiGLU gate/up/down), so the conversion is a renaming of tensors, with no
permutation. The exported folder (config.json, generation_config.json, model.safetensors, and the tokenizer
files when given) loads with `LlamaForCausalLM.from_pretrained(out_dir)` offline, e.g. for lm-eval-harness.

Partial rotary (`rotary_fraction < 1`, the Pythia and NeoX presets) is exported exactly, as a RoPE variant
transformers' Llama has: `rope_type: longrope` with one frequency divisor per rotary pair (`short_factor` =
`long_factor`, `factor` and `attention_factor` 1, so neither the context length nor a scale changes anything).
Llama's pair i turns at `1 / (f_i * theta^(2i/d))`; `training.model` turns its first r/2 pairs at `theta^(-2i/r)`
and the others not at all, which is `f_i = theta^(2i/r - 2i/d)` for i < r/2 and `f_i = UNROTATED` beyond: 1e30, a
finite stand-in for infinity (JSON has no Infinity, and config.json must stay standard JSON), whose frequency
(below 1e-30 radians a position) leaves cos exactly 1 and sin under 1e-26 over any context in float32.
The pairing is Llama's in both, so the weights need no permutation. (Llama's `partial_rotary_factor` would not do:
the default RoPE rotates every dim whatever it says.)

`arch=gpt_neox` exports as `GPTNeoXForCausalLM` (parallel residual, `rotary_pct`, biased attention): the same
renaming, except that GPT-NeoX fuses Q, K and V into one `query_key_value` layer whose output rows are laid out per
head, `(n_heads, 3, head_dim)` (head h's query, key, value rows in turn), which is taken apart and put back here
(`fuse_qkv`, `split_qkv`). `training.model` applies GPT-NeoX's partial rotary exactly (its module docstring), so the
weights need no other change.

The vocabulary's padded rows (`model.vocab_multiple`) are dropped on export: the HF model has the tokenizer's
`vocab_size` rows. BOS and EOS ids come from the tokenizer's own files (`special_token_ids`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hlat.core.config import HlatConfig, ModelConfig, validate_config
from hlat.core.layout import TOKENIZER_MODEL, CheckpointError, CheckpointRef, locate_checkpoint
from hlat.core.storage import Storage
from hlat.training.checkpoint import CheckpointManager
from hlat.training.model import Transformer
from hlat.training.parallel.tensor_slices import consolidate

if TYPE_CHECKING:
    from transformers import GPTNeoXConfig, LlamaConfig

BOS_ID, EOS_ID = 1, 2  # the sentencepiece ids of <s> and </s> (infra/tokenizer.py): the run's own tokenizer

SAFETENSORS_FILE = "model.safetensors"

# Files a tokenizer folder (infra/tokenizer.py, or any HF tokenizer) may hold that from_pretrained reads;
# anything else there (e.g. the tokenizer stage's report.json) is not copied.
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_FILES = (
    TOKENIZER_MODEL,
    TOKENIZER_JSON,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)

# (our name, HF name) patterns; {i} is the layer index.
_LLAMA_NAMES = (
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


# GPT-NeoX (HF GPTNeoXForCausalLM); our q_proj, k_proj and v_proj are its one query_key_value (`fuse_qkv`).
_GPT_NEOX_NAMES = (
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
_NAMES = {"llama": _LLAMA_NAMES, "gpt_neox": _GPT_NEOX_NAMES}
# Names read but never written: transformers 5's GPTNeoXForCausalLM holds the output projection as lm_head.
_HF_ALIASES = {"llama": (), "gpt_neox": (("output.weight", "lm_head.weight"),)}


def _compile(src: str, dst: str) -> tuple[re.Pattern[str], str]:
    return re.compile(re.escape(src).replace(r"\{i\}", r"(\d+)") + "$"), dst


_TO_HF = {arch: [_compile(ours, hf) for ours, hf in names] for arch, names in _NAMES.items()}
_FROM_HF = {arch: [_compile(hf, ours) for ours, hf in (*names, *_HF_ALIASES[arch])] for arch, names in _NAMES.items()}


def _rename(name: str, arch: str, direction: str) -> str:
    table = (_TO_HF if direction == "to_hf_state_dict" else _FROM_HF)[arch]
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.format(i=m.group(1)) if m.groups() else target
    known = ", ".join(pair[0 if direction == "to_hf_state_dict" else 1] for pair in _NAMES[arch])
    raise ValueError(f"{direction}: unexpected tensor {name!r} for arch={arch} (known: {known})")


def hf_config(cfg: ModelConfig) -> LlamaConfig | GPTNeoXConfig:
    """The transformers config describing the same network as `cfg`: `hf_llama_config` or `hf_gpt_neox_config`."""
    return hf_gpt_neox_config(cfg) if cfg.arch == "gpt_neox" else hf_llama_config(cfg)


def hf_gpt_neox_config(cfg: ModelConfig, bos_id: int | None = 0, eos_id: int | None = 0) -> GPTNeoXConfig:
    """The `transformers.GPTNeoXConfig` of an arch=gpt_neox `cfg` (float32 weights, the tokenizer's vocab_size rows;
    BOS/EOS default to GPT-NeoX's tokenizer's <|endoftext|>, 0). `rotary_pct` and `rotary_emb_base` are also written
    under those names, which transformers before 5 read (5 reads `rope_parameters`)."""
    from transformers import GPTNeoXConfig

    if cfg.arch != "gpt_neox":
        raise ValueError(f"hf_gpt_neox_config: model.arch={cfg.arch}; use hf_config")
    config = GPTNeoXConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        intermediate_size=cfg.ffn_hidden,
        hidden_act="gelu",
        rope_parameters={
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.rotary_fraction,
        },
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        layer_norm_eps=cfg.norm_eps,
        use_parallel_residual=True,
        attention_bias=True,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
        dtype="float32",
        architectures=["GPTNeoXForCausalLM"],
    )
    config.rotary_pct = cfg.rotary_fraction
    config.rotary_emb_base = cfg.rope_theta
    return config


def hf_llama_config(cfg: ModelConfig, bos_id: int | None = BOS_ID, eos_id: int | None = EOS_ID) -> LlamaConfig:
    """The `transformers.LlamaConfig` describing the same network as `cfg` (float32 weights, the tokenizer's
    vocab_size rows); partial rotary as `rope_parameters` of type longrope (`rope_parameters`). An arch=gpt_neox
    config is refused (`hf_config` gives its GPTNeoXConfig)."""
    if cfg.arch != "llama":
        raise ValueError(f"model.arch={cfg.arch} does not export as LlamaForCausalLM (hf_config gives its config)")
    # Imported here: transformers takes seconds to import and training jobs do not need it.
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope_parameters(cfg),
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
        dtype="float32",
        architectures=["LlamaForCausalLM"],
    )


UNROTATED = 1e30
"""The longrope divisor of a pair that does not rotate (the module's docstring): finite, so config.json is JSON."""


def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """HF Llama's `rope_parameters` for `cfg`'s rotary embedding: the default RoPE, or for partial rotary a longrope
    whose per-pair divisors give `training.model.rope_tables`'s frequencies (the module's docstring)."""
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


def to_hf_state_dict(model: nn.Module | Mapping[str, Tensor], cfg: ModelConfig | None = None) -> dict[str, Tensor]:
    """Our tensors under HF names (sharing storage with the model, except GPT-NeoX's fused QKV, which is built).

    Accepts a `Transformer` or its state dict (e.g. from a checkpoint) with its `cfg` (default: the model's own;
    a state dict without one is taken as an unpadded llama). The padded vocabulary rows are dropped. A tied output
    projection (the same tensor as the embedding) is left out, as HF's own `save_pretrained` does; HF ties it on load.
    """
    if cfg is None and isinstance(model, Transformer):
        cfg = model.cfg
    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    embed, output = state.get("embed.weight"), state.get("output.weight")
    tied = embed is not None and output is not None and (output is embed or _same_storage(output, embed))
    arch = cfg.arch if cfg is not None else "llama"
    if arch == "gpt_neox":
        assert cfg is not None
        state = fuse_qkv(state, cfg)
    out = {}
    for name, t in state.items():
        if tied and name == "output.weight":
            continue
        if cfg is not None and name in ("embed.weight", "output.weight"):
            t = t[: cfg.vocab_size]  # the padded rows are not the tokenizer's: dropped
        out[_rename(name, arch, "to_hf_state_dict")] = t.detach()
    return out


def from_hf_state_dict(state_dict: Mapping[str, Tensor], cfg: ModelConfig | None = None) -> dict[str, Tensor]:
    """HF Llama or GPT-NeoX tensors under our names, ready for `Transformer.load_state_dict` (the inverse of
    `to_hf_state_dict`). Without `lm_head.weight` (tied embeddings) the output projection is the embedding. With
    `cfg` (needed for GPT-NeoX, whose fused QKV is split by heads) the vocabulary is padded with zero rows up to
    `cfg.padded_vocab_size` (rows no token reaches and the loss masks)."""
    arch = "gpt_neox" if any(name.startswith("gpt_neox.") for name in state_dict) else "llama"
    if cfg is not None and cfg.arch != arch:
        raise ValueError(f"from_hf_state_dict: the tensors are HF {arch}'s, the config says model.arch={cfg.arch}")
    if arch == "gpt_neox" and cfg is None:
        raise ValueError("from_hf_state_dict: GPT-NeoX tensors need the ModelConfig (heads of the fused QKV)")
    out = {_rename(name, arch, "from_hf_state_dict"): t for name, t in state_dict.items()}
    if arch == "gpt_neox":
        assert cfg is not None
        out = split_qkv(out, cfg)
    if "output.weight" not in out and "embed.weight" in out:
        out["output.weight"] = out["embed.weight"]
    if cfg is not None:
        for name in ("embed.weight", "output.weight"):
            if name in out and out[name].shape[0] < cfg.padded_vocab_size:
                out[name] = _pad_rows(out[name], cfg.padded_vocab_size)
        if cfg.tie_embeddings and "embed.weight" in out:
            out["output.weight"] = out["embed.weight"]
    return out


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """t with zero rows appended up to `rows`."""
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


_QKV = ("q_proj", "k_proj", "v_proj")


def fuse_qkv(state: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Our per-layer q_proj, k_proj, v_proj weights and biases as GPT-NeoX's fused `attn.qkv.*`: output rows per
    head, (n_heads, 3, head_dim), i.e. head h's query, key and value rows in turn (HF GPTNeoXAttention views the
    output as (..., n_heads, 3 * head_dim) and chunks the last dim in three)."""
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
    """The inverse of `fuse_qkv`: each `attn.qkv.*` taken apart into q_proj, k_proj and v_proj."""
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


def export_hf(
    model: Transformer | Mapping[str, Tensor], cfg: ModelConfig, out_dir: str | Path, tokenizer_dir: str | None = None
) -> Path:
    """Write `out_dir` as a float32 HF checkpoint that `LlamaForCausalLM.from_pretrained` (arch llama) or
    `GPTNeoXForCausalLM.from_pretrained` (gpt_neox) loads offline.

    `model` is a `Transformer` built from `cfg`, or its (full, gathered) state dict. Tokenizer files found
    in `tokenizer_dir` (see TOKENIZER_FILES) are copied alongside, and BOS/EOS are theirs (`special_token_ids`).
    Returns the output folder.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    bos_id: int | None = BOS_ID
    eos_id: int | None = EOS_ID
    if tokenizer_dir is not None:
        bos_id, eos_id = special_token_ids(tokenizer_dir)
    elif cfg.arch == "gpt_neox":
        bos_id, eos_id = 0, 0  # GPT-NeoX's tokenizer's <|endoftext|>
    # Refuses unexportable configs before anything is written.
    config = hf_gpt_neox_config(cfg, bos_id, eos_id) if cfg.arch == "gpt_neox" else hf_llama_config(cfg, bos_id, eos_id)
    if isinstance(model, Transformer) and model.cfg != cfg:
        raise ValueError("export_hf: the model was built from a different ModelConfig than the one given")
    tensors = {name: t.to("cpu", torch.float32).contiguous() for name, t in to_hf_state_dict(model, cfg).items()}
    if cfg.tie_embeddings:
        # A checkpoint may hold the tied projection as its own copy; HF ties it to the embedding on load.
        tensors.pop("lm_head.weight", None)
    _check_shapes(tensors, cfg)
    tokenizer_files: list[Path] = []
    if tokenizer_dir is not None:
        tokenizer_files = [Path(tokenizer_dir) / n for n in TOKENIZER_FILES if (Path(tokenizer_dir) / n).is_file()]
        if not tokenizer_files:
            raise ValueError(f"export_hf: no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {tokenizer_dir}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # metadata format=pt: transformers refuses safetensors files without it.
    save_file(tensors, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id).save_pretrained(out)
    for src in tokenizer_files:
        shutil.copyfile(src, out / src.name)
    return out


def _check_shapes(tensors: Mapping[str, Tensor], cfg: ModelConfig) -> None:
    """Every tensor HF expects is there with its shape, so a mismatched config fails here, not on load."""
    expected = _gpt_neox_shapes(cfg) if cfg.arch == "gpt_neox" else _llama_shapes(cfg)
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])
        raise ValueError(
            f"export_hf: tensors do not match the config (missing {missing[:5]}, unexpected {extra[:5]}, "
            f"wrong shape {[(n, got[n], expected[n]) for n in wrong[:5]]})"
        )


def _llama_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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


def _gpt_neox_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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


def special_token_ids(tokenizer_dir: str | Path) -> tuple[int | None, int | None]:
    """(BOS id, EOS id) of the Hugging Face tokenizer in `tokenizer_dir`, from its own files: the tokens that
    tokenizer_config.json (else special_tokens_map.json) names, looked up in its added tokens and tokenizer.json's
    vocabulary. A token the files do not name (or map) is None, unless the folder is a sentencepiece tokenizer
    (tokenizer.model, as the run's own tokenizer stage writes): then <s> = 1 and </s> = 2, its fixed ids."""
    folder = Path(tokenizer_dir)
    names: dict[str, Any] = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        names |= {k: v for k, v in _read_json(folder / file).items() if k in ("bos_token", "eos_token") and v}
    ids = _token_ids(folder)
    sentencepiece = (folder / TOKENIZER_MODEL).is_file()
    found: list[int | None] = []
    for key, default in (("bos_token", BOS_ID), ("eos_token", EOS_ID)):
        token = names.get(key)
        content = token.get("content") if isinstance(token, dict) else token
        token_id = ids.get(content) if isinstance(content, str) else None
        found.append(token_id if token_id is not None else (default if sentencepiece else None))
    return found[0], found[1]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_ids(folder: Path) -> dict[str, int]:
    """Token -> id from a tokenizer folder's files: tokenizer.json's vocabulary (a dict for BPE/WordPiece, a list of
    [piece, score] for Unigram) and added tokens, tokenizer_config.json's added_tokens_decoder."""
    ids: dict[str, int] = {}
    tokenizer = _read_json(folder / TOKENIZER_JSON)
    vocab = tokenizer.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        ids |= {str(k): int(v) for k, v in vocab.items()}
    elif isinstance(vocab, list):
        ids |= {str(entry[0]): i for i, entry in enumerate(vocab)}
    ids |= {str(t["content"]): int(t["id"]) for t in tokenizer.get("added_tokens", []) if "content" in t}
    decoder = _read_json(folder / "tokenizer_config.json").get("added_tokens_decoder", {})
    ids |= {str(t["content"]): int(i) for i, t in decoder.items() if isinstance(t, dict) and "content" in t}
    return ids


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.device == b.device and a.data_ptr() == b.data_ptr()


# -- from a run's checkpoint ------------------------------------------------------------------------------------
def read_checkpoint(ref: CheckpointRef) -> tuple[dict[str, Any], HlatConfig]:
    """The checkpoint's shared state (with the model's dense state dict) and the run config saved with it. A
    checkpoint of a split model (one shard per tensor/pipeline-parallel position) is consolidated: each TP rank's
    pipeline stages merged, then every parameter's slices put back together
    (`training.parallel.tensor_slices.consolidate`); an FSDP2 checkpoint's shards are gathered from its
    torch.distributed.checkpoint files."""
    manager = CheckpointManager(ref.checkpoints, keep_last=1)
    if manager.read_meta(ref.step).get("distributed"):
        # FSDP2: every rank's shards of the model, gathered from torch.distributed.checkpoint's files.
        state = manager.load_shared(ref.step)
        state["model"] = manager.load_distributed_full(ref.step)["model"]
        return state, validate_config(state["config"])
    names = manager.shard_names(ref.step)
    shared = manager.load_shards(ref.step) if names else {"": manager.load_shared(ref.step)}
    for name, state in shared.items():
        if "config" not in state or "model" not in state:
            raise CheckpointError(f"{ref.uri} {name or ''} holds no model and config (keys: {sorted(state)})".strip())
    first = next(iter(shared.values()))
    config = validate_config(first["config"])
    if not names:
        return first, config
    by_tp: dict[int, dict[str, Tensor]] = {}
    for name, state in shared.items():
        match = re.fullmatch(r"tp(\d+)-pp(\d+)", name)
        if match is None:
            raise CheckpointError(f"{ref.uri}: shard {name!r} is not a tensor/pipeline-parallel position (tpXX-ppYY)")
        by_tp.setdefault(int(match.group(1)), {}).update(state["model"])
    states = [by_tp[rank] for rank in sorted(by_tp)]
    return {**first, "model": consolidate(states, config.model)}, config


def load_checkpoint_model(ref: CheckpointRef, device: str | torch.device = "cpu") -> tuple[Transformer, HlatConfig]:
    """The checkpoint's model (eval mode, the dtype it was saved in) and the run config saved with it."""
    shared, config = read_checkpoint(ref)
    model = Transformer(config.model, device="meta")
    model.to_empty(device=device)
    model.init_rope_tables()
    model.load_state_dict(shared["model"], strict=True)
    return model.eval(), config


def export_checkpoint(
    source: str,
    out_dir: str | Path,
    step: int | None = None,
    tokenizer: str | None = None,
    build_tokenizer_json: Callable[[str, str, int], object] | None = None,
) -> tuple[Path, CheckpointRef]:
    """`hlat export`: write the checkpoint `source` (see `locate_checkpoint`) as a Hugging Face Llama or GPT-NeoX
    folder with the run's tokenizer files (from `tokenizer`, a folder or s3:// URI, else `<run>/tokenizer/`).

    The folder must load with `AutoTokenizer.from_pretrained` as it is: that takes `tokenizer.json` (without it
    transformers would convert the sentencepiece model itself, through protobuf, and fall back to other
    defaults). When the tokenizer folder has none (a tokenizer made elsewhere, or before the stage wrote one),
    `build_tokenizer_json(tokenizer.model, folder, max_length)` writes it (the CLI passes
    `infra.tokenizer.export_hf_tokenizer`, the tokenizer stage's own); without it the export is refused. A
    pretrained tokenizer's folder may hold tokenizer.json and no sentencepiece tokenizer.model: it is exported as
    it is."""
    ref = locate_checkpoint(source, step)
    shared, config = read_checkpoint(ref)
    hf_config(config.model)  # refuse an unexportable model before fetching anything else
    if tokenizer is None and ref.run is None:
        raise ValueError(f"{ref.checkpoints.uri()} is not inside a run folder: pass the tokenizer folder too")
    tokenizer_store = Storage(tokenizer) if tokenizer else ref.run.child("tokenizer")  # type: ignore[union-attr]
    if not tokenizer_store.exists(TOKENIZER_MODEL) and not tokenizer_store.exists(TOKENIZER_JSON):
        raise ValueError(
            f"no {TOKENIZER_MODEL} or {TOKENIZER_JSON} in {tokenizer_store.uri()}: run train-tokenizer, or pass "
            "the tokenizer"
        )
    with tempfile.TemporaryDirectory(prefix="hlat-export-") as tmp:
        fetch_tokenizer_files(tokenizer_store, tmp)
        if not os.path.isfile(os.path.join(tmp, TOKENIZER_JSON)):
            if build_tokenizer_json is None:
                raise ValueError(
                    f"no {TOKENIZER_JSON} in {tokenizer_store.uri()}: transformers would not load the export as "
                    "it is; export with `hlat export`, which builds it from tokenizer.model"
                )
            try:
                build_tokenizer_json(os.path.join(tmp, TOKENIZER_MODEL), tmp, config.model.max_seq_len)
            except Exception as exc:
                raise ValueError(
                    f"no {TOKENIZER_JSON} in {tokenizer_store.uri()}, and none could be built from its "
                    f"{TOKENIZER_MODEL}: {type(exc).__name__}: {exc}"
                ) from exc
        out = export_hf(shared["model"], config.model, out_dir, tokenizer_dir=tmp)
    return out, ref


def fetch_tokenizer_files(tokenizer: Storage, folder: str) -> None:
    """Copy the tokenizer files (TOKENIZER_FILES) found in `tokenizer` (a folder or s3:// URI) into `folder`."""
    os.makedirs(folder, exist_ok=True)
    for name in TOKENIZER_FILES:
        if tokenizer.exists(name):
            tokenizer.get_file(name, os.path.join(folder, name))
