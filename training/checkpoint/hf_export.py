"""Export a trained `training.model.Transformer` as a Hugging Face `LlamaForCausalLM` checkpoint (and back).

`training.model` follows HF Llama's conventions (rotate_half RoPE pairing, `repeat_kv` head grouping,
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
"""

from __future__ import annotations

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
    from transformers import LlamaConfig

BOS_ID, EOS_ID = 1, 2  # the sentencepiece ids of <s> and </s> (infra/tokenizer.py)

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
_NAMES = (
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


def _compile(src: str, dst: str) -> tuple[re.Pattern[str], str]:
    return re.compile(re.escape(src).replace(r"\{i\}", r"(\d+)") + "$"), dst


_TO_HF = [_compile(ours, hf) for ours, hf in _NAMES]
_FROM_HF = [_compile(hf, ours) for ours, hf in _NAMES]


def _rename(name: str, table: list[tuple[re.Pattern[str], str]], direction: str) -> str:
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.format(i=m.group(1)) if m.groups() else target
    raise ValueError(f"{direction}: unexpected tensor {name!r} (known: {', '.join(n for n, _ in _NAMES)})")


def hf_llama_config(cfg: ModelConfig) -> LlamaConfig:
    """The `transformers.LlamaConfig` describing the same network as `cfg` (float32 weights); partial rotary as
    `rope_parameters` of type longrope (`rope_parameters`)."""
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
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
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


def to_hf_state_dict(model: nn.Module | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Our tensors under HF Llama names (sharing storage with the model; nothing is copied).

    Accepts a `Transformer` or its state dict (e.g. from a checkpoint). A tied output projection (the same
    tensor as the embedding) is left out, as HF's own `save_pretrained` does; HF ties it on load.
    """
    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    embed, output = state.get("embed.weight"), state.get("output.weight")
    tied = embed is not None and output is not None and (output is embed or _same_storage(output, embed))
    return {
        _rename(name, _TO_HF, "to_hf_state_dict"): t.detach()
        for name, t in state.items()
        if not (tied and name == "output.weight")
    }


def from_hf_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """HF Llama tensors under our names, ready for `Transformer.load_state_dict` (the inverse of
    `to_hf_state_dict`). Without `lm_head.weight` (tied embeddings) the output projection is the embedding."""
    out = {_rename(name, _FROM_HF, "from_hf_state_dict"): t for name, t in state_dict.items()}
    if "output.weight" not in out and "embed.weight" in out:
        out["output.weight"] = out["embed.weight"]
    return out


def export_hf(
    model: Transformer | Mapping[str, Tensor], cfg: ModelConfig, out_dir: str | Path, tokenizer_dir: str | None = None
) -> Path:
    """Write `out_dir` as a float32 HF Llama checkpoint that `LlamaForCausalLM.from_pretrained` loads offline.

    `model` is a `Transformer` built from `cfg`, or its (full, gathered) state dict. Tokenizer files found
    in `tokenizer_dir` (see TOKENIZER_FILES) are copied alongside. Returns the output folder.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    hf_config = hf_llama_config(cfg)  # refuses unexportable configs before anything is written
    if isinstance(model, Transformer) and model.cfg != cfg:
        raise ValueError("export_hf: the model was built from a different ModelConfig than the one given")
    tensors = {name: t.to("cpu", torch.float32).contiguous() for name, t in to_hf_state_dict(model).items()}
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
    hf_config.save_pretrained(out)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(out)
    for src in tokenizer_files:
        shutil.copyfile(src, out / src.name)
    return out


def _check_shapes(tensors: Mapping[str, Tensor], cfg: ModelConfig) -> None:
    """Every tensor HF expects is there with its shape, so a mismatched config fails here, not on load."""
    d, kv_dim, f, v = cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size
    expected = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
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
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])
        raise ValueError(
            f"export_hf: tensors do not match the config (missing {missing[:5]}, unexpected {extra[:5]}, "
            f"wrong shape {[(n, got[n], expected[n]) for n in wrong[:5]]})"
        )


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
    """`hlat export`: write the checkpoint `source` (see `locate_checkpoint`) as a Hugging Face Llama folder
    with the run's tokenizer files (from `tokenizer`, a folder or s3:// URI, else `<run>/tokenizer/`).

    The folder must load with `AutoTokenizer.from_pretrained` as it is: that takes `tokenizer.json` (without it
    transformers would convert the sentencepiece model itself, through protobuf, and fall back to other
    defaults). When the tokenizer folder has none (a tokenizer made elsewhere, or before the stage wrote one),
    `build_tokenizer_json(tokenizer.model, folder, max_length)` writes it (the CLI passes
    `infra.tokenizer.export_hf_tokenizer`, the tokenizer stage's own); without it the export is refused."""
    ref = locate_checkpoint(source, step)
    shared, config = read_checkpoint(ref)
    hf_llama_config(config.model)  # refuse an unexportable model before fetching anything else
    if tokenizer is None and ref.run is None:
        raise ValueError(f"{ref.checkpoints.uri()} is not inside a run folder: pass the tokenizer folder too")
    tokenizer_store = Storage(tokenizer) if tokenizer else ref.run.child("tokenizer")  # type: ignore[union-attr]
    if not tokenizer_store.exists(TOKENIZER_MODEL):
        raise ValueError(f"no tokenizer.model in {tokenizer_store.uri()}: run train-tokenizer, or pass the tokenizer")
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
