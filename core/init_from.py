"""Starting from published weights (`model.init_from`): what the run records about them, and the model they define.

The train stage resolves `model.init_from` (a hub name, a local folder or an s3:// prefix) once, before any job, into
a folder every job can read (`location`) and writes `init/import.json` in the run: the source, where it was read
(the hub's commit), the checkpoint's `config.json`, its files with their sizes and sha256, and one `sha256` over
them, so that the run records exactly which weights it started from. Jobs read that record (`import_record`), build
the model the checkpoint's config describes (`model_follows_checkpoint`) and read the weights tensor by tensor from
`location` (training/checkpoint/hf_import.py).

The shared config.json keys are read here, under both transformers 4 and 5 names (`rope_theta`, `rotary_pct`,
`rope_parameters`). Each family maps its own keys (`core.models`). What no family can represent (a RoPE scaling,
biases on a LLaMA, another activation) is refused in one line that names the key, before anything is trained.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hlat.core.config import HlatConfig, validate_config
from hlat.core.layout import IMPORT_RECORD
from hlat.core.models import HfConfigRefused, hf_family
from hlat.core.run import Run
from hlat.core.storage import StorageNotFound

# The ModelConfig fields a checkpoint decides, in the order the change line lists them.
DECIDED = (
    "arch",
    "n_layers",
    "d_model",
    "n_heads",
    "n_kv_heads",
    "ffn_hidden",
    "max_seq_len",
    "norm_eps",
    "rope_theta",
    "rotary_fraction",
    "tie_embeddings",
)


class InitFromError(ValueError):
    """A checkpoint hlat cannot start from, in one line naming model.init_from, the key and the fix."""


def _refuse(source: str, what: str) -> InitFromError:
    return InitFromError(f"model.init_from={source!r}: {what}")


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE settings under either transformers' names: {"rope_type", "rope_theta", "partial_rotary_factor"}."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", 1.0)))
    return {"rope_type": rope_type, "rope_theta": float(theta), "partial_rotary_factor": float(fraction)}


def model_fields(hf: Mapping[str, Any], source: str = "") -> dict[str, Any]:
    """The ModelConfig fields (`DECIDED`) a transformers config.json of a registered family gives (`core.models`),
    and `vocab_size` (the checkpoint's embedding rows); InitFromError for what hlat's model cannot represent."""
    try:
        return _model_fields(hf)
    except HfConfigRefused as exc:
        raise _refuse(source, str(exc)) from None


def _model_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    found = hf_family(hf)
    rope = _rope(hf)
    if rope["rope_type"] != "default":
        raise HfConfigRefused(f"RoPE scaling {rope['rope_type']!r} (config.json rope_scaling / rope_parameters): "
                              "hlat's models use the default RoPE; start from a checkpoint without it")  # fmt: skip
    d_model, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    fields: dict[str, Any] = {
        "arch": found.name,
        "n_layers": int(hf["num_hidden_layers"]),
        "d_model": d_model,
        "n_heads": heads,
        "ffn_hidden": int(hf["intermediate_size"]),
        "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
        "rope_theta": rope["rope_theta"],
        "vocab_size": int(hf["vocab_size"]),
    }
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) != d_model // heads:
        raise HfConfigRefused(f"head_dim={head_dim} is not hidden_size / num_attention_heads ({d_model // heads})")
    return fields | found.fields_from_hf(hf, rope)


def model_follows_checkpoint(cfg: HlatConfig, hf: Mapping[str, Any]) -> tuple[HlatConfig, str | None]:
    """The config a job trains with, given the imported checkpoint's config.json, and one line saying what changed
    (None: the config already described the checkpoint). The checkpoint decides the family and the shape (`DECIDED`);
    model.vocab_size stays the tokenizer's (`contract.model_follows_tokenizer`), and `check_embedding_rows` then
    checks the checkpoint's rows fit it. The config's own checks run again on the result (e.g. a
    parallelism.tensor that does not divide the checkpoint's heads is refused there)."""
    source = cfg.model.init_from or ""
    fields = model_fields(hf, source)
    fields.pop("vocab_size")
    current = cfg.model.model_dump(mode="json")
    changed = [f"{k} {current[k]} -> {fields[k]}" for k in DECIDED if current[k] != fields[k]]
    if not changed:
        return cfg, None
    data = cfg.model_dump(mode="json")
    data["model"].update(fields)
    try:
        followed = validate_config(data)
    except ValueError as exc:  # validate_config's "invalid config:" then one indented line per problem
        problems = "; ".join(line.strip() for line in str(exc).splitlines()[1:]) or str(exc)
        raise _refuse(source, f"the checkpoint's model does not fit this run's config: {problems}") from None
    return followed, f"model: {', '.join(changed)} (the config.json of model.init_from={source})"


def check_embedding_rows(cfg: HlatConfig, rows: int) -> None:
    """The checkpoint's embedding (`rows`, config.json vocab_size) must hold every id of the run's tokenizer
    (model.vocab_size) and fit in the model's padded embedding (model.padded_vocab_size; the rows beyond the
    checkpoint's are zero and masked like any padding)."""
    m = cfg.model
    if rows < m.vocab_size:
        raise _refuse(
            m.init_from or "",
            f"its embedding has {rows} rows but the tokenizer (tokenizer.pretrained={cfg.tokenizer.pretrained}) "
            f"has {m.vocab_size} ids; use the tokenizer the weights were trained with",
        )
    if rows > m.padded_vocab_size:
        raise _refuse(
            m.init_from or "",
            f"its embedding has {rows} rows, more than the {m.padded_vocab_size} this run's model has for "
            f"model.vocab_size={m.vocab_size} padded to model.vocab_multiple={m.vocab_multiple}; set "
            f"model.vocab_multiple so that {m.vocab_size} pads to at least {rows} rows (e.g. "
            f"model.vocab_multiple={_multiple_for(m.vocab_size, rows)})",
        )


def _multiple_for(vocab: int, rows: int) -> int:
    """The smallest power of two that pads `vocab` to at least `rows` rows (NxDT and Megatron use 128 or 256)."""
    multiple = 1
    while -(-vocab // multiple) * multiple < rows:
        multiple *= 2
    return multiple


def import_record(run: Run) -> dict[str, Any]:
    """The run's record of its imported weights (`IMPORT_RECORD`); StorageNotFound naming the stage that writes
    it."""
    if not run.storage.exists(IMPORT_RECORD):
        raise StorageNotFound(
            f"{run.storage.uri(IMPORT_RECORD)} is missing: model.init_from is set but its weights were not imported; "
            "run the train stage (it imports them before the first job)"
        )
    record: dict[str, Any] = run.storage.read_json(IMPORT_RECORD)
    return record
