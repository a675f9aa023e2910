"""Export a `training.model.Transformer` as a Hugging Face checkpoint of its family, and read one back.

Each family's HF names and layout live in training/models/; this module applies them (docs/models.md). The folder loads
offline with `from_pretrained`; padded vocabulary rows are dropped. BOS and EOS ids come from the tokenizer's own files.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hlat.core.config import HlatConfig, ModelConfig, validate_config
from hlat.core.layout import TOKENIZER_MODEL, CheckpointError, CheckpointRef, locate_checkpoint
from hlat.core.models import DEFAULT
from hlat.core.storage import Storage
from hlat.training.checkpoint import CheckpointManager
from hlat.training.model import Transformer
from hlat.training.models import FAMILIES, hf_config, hf_state_family, modules_of
from hlat.training.models.base import FamilyModules, build_hf_config
from hlat.training.parallel.tensor_slices import consolidate

BOS_ID, EOS_ID = 1, 2  # the sentencepiece ids of <s> and </s> (infra/inputs/tokenizer.py): the run's own tokenizer

SAFETENSORS_FILE = "model.safetensors"

# Files a tokenizer folder (infra/inputs/tokenizer.py, or any HF tokenizer) may hold that from_pretrained reads;
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


@functools.cache
def _patterns(family: FamilyModules, direction: str) -> list[tuple[re.Pattern[str], str]]:
    """The family's (source pattern, target name) pairs for `direction`; `{i}` in a name is a layer index."""
    if direction == "to_hf_state_dict":
        pairs = family.hf_names
    else:
        pairs = tuple((hf, ours) for ours, hf in (*family.hf_names, *family.hf_aliases))
    return [(re.compile(re.escape(src).replace(r"\{i\}", r"(\d+)") + "$"), dst) for src, dst in pairs]


def _rename(name: str, family: FamilyModules, direction: str) -> str:
    """`name` under the other side's name (`to_hf_state_dict`: ours to HF; `from_hf_state_dict`: HF to ours)."""
    for pattern, target in _patterns(family, direction):
        m = pattern.match(name)
        if m:
            return target.format(i=m.group(1)) if m.groups() else target
    known = ", ".join(pair[0 if direction == "to_hf_state_dict" else 1] for pair in family.hf_names)
    raise ValueError(f"{direction}: unexpected tensor {name!r} for arch={family.name} (known: {known})")


def hf_names(ours: str, family: FamilyModules) -> tuple[str, ...]:
    """Every HF name tensor `ours` may have: the one written, then those only read."""
    aliases = tuple(hf for name, hf in family.hf_aliases if name == ours)
    return (_rename(ours, family, "to_hf_state_dict"), *aliases)


def to_hf_state_dict(model: nn.Module | Mapping[str, Tensor], cfg: ModelConfig | None = None) -> dict[str, Tensor]:
    """Our tensors under HF names, sharing storage except GPT-NeoX's built fused QKV.

    Takes a `Transformer` or a state dict with its `cfg` (default: unpadded llama). Padded rows are dropped. A tied
    output projection is left out, as HF's `save_pretrained` does."""
    if cfg is None and isinstance(model, Transformer):
        cfg = model.cfg
    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    embed, output = state.get("embed.weight"), state.get("output.weight")
    tied = embed is not None and output is not None and (output is embed or _same_storage(output, embed))
    family = modules_of(cfg) if cfg is not None else FAMILIES[DEFAULT]
    if cfg is not None:
        state = family.to_hf(state, cfg)
    out = {}
    for name, t in state.items():
        if tied and name == "output.weight":
            continue
        if cfg is not None and name in ("embed.weight", "output.weight"):
            t = t[: cfg.vocab_size]  # the padded rows are not the tokenizer's: dropped
        out[_rename(name, family, "to_hf_state_dict")] = t.detach()
    return out


def from_hf_state_dict(state_dict: Mapping[str, Tensor], cfg: ModelConfig | None = None) -> dict[str, Tensor]:
    """HF Llama or GPT-NeoX tensors under our names, the inverse of `to_hf_state_dict`. Without `lm_head.weight` the
    output is the embedding. `cfg` (needed for GPT-NeoX) pads the vocabulary with zero rows."""
    family = hf_state_family(state_dict)
    configured = modules_of(cfg) if cfg is not None else family
    if configured is not family:
        raise ValueError(f"from_hf_state_dict: the tensors are HF {family.name}'s, the config is {configured.name}'s")
    out = family.from_hf({_rename(name, family, "from_hf_state_dict"): t for name, t in state_dict.items()}, cfg)
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


def export_hf(
    model: Transformer | Mapping[str, Tensor], cfg: ModelConfig, out_dir: str | Path, tokenizer_dir: str | None = None
) -> Path:
    """Write `out_dir` as a float32 HF checkpoint that the family's `from_pretrained` loads offline.

    `model` is a `Transformer` or its full state dict. Tokenizer files in `tokenizer_dir` are copied too."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    family = modules_of(cfg)
    bos_id, eos_id = family.core.special_ids  # the family's tokenizer's, without tokenizer files
    if tokenizer_dir is not None:
        bos_id, eos_id = special_token_ids(tokenizer_dir)
    # Refuses unexportable configs before anything is written.
    config = build_hf_config(family, cfg, bos_id, eos_id)
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
    """Check every tensor HF expects is there with its shape, so a bad config fails here."""
    expected = modules_of(cfg).hf_shapes(cfg)
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])
        raise ValueError(
            f"export_hf: tensors do not match the config (missing {missing[:5]}, unexpected {extra[:5]}, "
            f"wrong shape {[(n, got[n], expected[n]) for n in wrong[:5]]})"
        )


def special_token_ids(tokenizer_dir: str | Path) -> tuple[int | None, int | None]:
    """(BOS id, EOS id) of the HF tokenizer in `tokenizer_dir`, from its own files; None where not named. A
    sentencepiece folder (tokenizer.model) has <s> = 1 and </s> = 2."""
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
    """Token -> id from a tokenizer folder's tokenizer.json vocabulary and added tokens."""
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
    """The checkpoint's shared state (with the dense model state dict) and its run config. TP, PP and FSDP2 checkpoints
    are consolidated first (`tensor_slices.consolidate`)."""
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
    """The checkpoint's model (eval mode, saved dtype) and its run config."""
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
    """`hlat export`: write checkpoint `source` as an HF folder with the run's tokenizer files.

    `AutoTokenizer.from_pretrained` needs tokenizer.json; when missing, `build_tokenizer_json` writes it. Without it the
    export is refused."""
    ref = locate_checkpoint(source, step)
    shared, config = read_checkpoint(ref)
    hf_config(config.model)  # refuse an unexportable model before fetching anything else
    if tokenizer is None and ref.run_folder is None:
        raise ValueError(f"{ref.checkpoints.uri()} is not inside a run folder: pass the tokenizer folder too")
    tokenizer_store = Storage(tokenizer) if tokenizer else ref.run_folder.child("tokenizer")  # type: ignore[union-attr]
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
