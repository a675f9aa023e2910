"""Published-checkpoint stand-ins the tests build: tiny random `LlamaForCausalLM` and `GPTNeoXForCausalLM` saved by
transformers (`save_pretrained`: safetensors, one file, or shards and their index with `max_shard_size`), the run
config a job would build for them (`run_config`: the model the checkpoint's config.json describes), and the run's
import record (`write_import_record`), as the train stage writes it before the first job (core/init_from.py).
Nothing is downloaded.

The XLA and NxD tiers' environments have no transformers (the Neuron images' job side): there
`write_checkpoint` writes the same layout itself (config.json with transformers' keys, the tensors under their HF
names in shards with model.safetensors.index.json); tests/unit/test_hf_import.py shows transformers loads it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from hlat.core.config import HlatConfig
from hlat.core.init_from import model_follows_checkpoint
from hlat.core.layout import IMPORT_RECORD
from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.core.storage import Storage

VOCAB = 320
"""The checkpoints' vocabulary: small, and what the NxD tier's data can be tokenized into."""
LLAMA: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
NEOX: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 96,
    "rotary_pct": 0.25,
    "hidden_act": "gelu",
    "use_parallel_residual": True,
    "attention_bias": True,
    "max_position_embeddings": 64,
    "layer_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
ARCHS = ("llama", "gpt_neox")


def hf_model(arch: str, seed: int = 0, **config: Any) -> Any:
    """A random transformers model of `arch` (LLAMA's or NEOX's shape, `config` overriding), every parameter drawn
    from N(0, 0.2) (norms and biases too, so that every tensor's mapping matters), float32, eval mode."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    if arch == "llama":
        model: Any = LlamaForCausalLM(LlamaConfig(**{**LLAMA, **config}))
    else:
        model = GPTNeoXForCausalLM(GPTNeoXConfig(**{**NEOX, **config}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return model.eval()


def save(model: Any, folder: Path, max_shard_size: str | int | None = None) -> Path:
    """`model.save_pretrained(folder)`: one model.safetensors, or shards and model.safetensors.index.json."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(str(folder), **kwargs)
    return folder


def saved(arch: str, folder: Path, seed: int = 0, max_shard_size: str | int | None = None, **config: Any) -> Any:
    """`hf_model(arch, seed, **config)` saved into `folder`; returns the model."""
    model = hf_model(arch, seed, **config)
    save(model, folder, max_shard_size)
    return model


def original_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `folder`, as saved."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def import_record(location: str | Path, source: str | None = None) -> dict[str, Any]:
    """The import record of the checkpoint folder `location` (a local folder or s3:// prefix): its source (default:
    the location), config.json, files with their sizes and sha256, and one sha256 over those."""
    store = Storage(str(location))
    files = sorted(n for n in store.list() if n.endswith((".json", ".safetensors")))
    listed = []
    for name in files:
        data = store.read_bytes(name)
        listed.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    overall = hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest()
    return {
        "source": source or str(location),
        "location": str(location),
        "config": store.read_json("config.json"),
        "sha256": overall,
        "files": listed,
    }


def write_import_record(run: Run, location: str | Path, source: str | None = None) -> dict[str, Any]:
    """Write `import_record(location, source)` as the run's IMPORT_RECORD; return it."""
    record = import_record(location, source)
    run.storage.write_json(IMPORT_RECORD, record)
    return record


def config_overrides(location: str | Path, vocab_multiple: int = 1, **overrides: Any) -> dict[str, Any]:
    """The dotted overrides of a tiny run that starts from the checkpoint in `location` (its model's family and
    shape, its vocabulary padded to `vocab_multiple`)."""
    from hlat.core.init_from import model_fields

    fields = model_fields(Storage(str(location)).read_json("config.json"))
    return {
        **{f"model.{k}": v for k, v in fields.items()},
        "model.init_from": str(location),
        "model.vocab_multiple": vocab_multiple,
        "tokenizer.pretrained": str(location),
        "training.seq_len": 32,
        **overrides,
    }


def run_config(location: str | Path, vocab_multiple: int = 1, **overrides: Any) -> HlatConfig:
    """The tiny preset starting from the checkpoint in `location`, its model the checkpoint's
    (`model_follows_checkpoint`, as a job's `job_config` makes it)."""
    cfg = load_config("tiny", config_overrides(location, vocab_multiple, **overrides))
    followed, _ = model_follows_checkpoint(cfg, Storage(str(location)).read_json("config.json"))
    return followed


def fake_trainer(cfg: HlatConfig, run: str | Path, model: torch.nn.Module | None = None, **extra: Any) -> Any:
    """What `hf_import.import_weights` uses of a Trainer, for one process: the config, the run, a world of one, the
    model (default: the config's, randomly initialised); `extra` attributes (e.g. optimizer)."""
    from hlat.training.model import Transformer

    if model is None:
        model = Transformer(cfg.model)
        model.init_weights(0)
    world = SimpleNamespace(layout=SimpleNamespace(pipeline=1), is_main=True)
    return SimpleNamespace(cfg=cfg, run=Run.at(str(run)), world=world, model=model, wrapped=model, **extra)


HF_CONFIG = {
    "llama": {
        **LLAMA,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    },
    "gpt_neox": {
        **NEOX,
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "rotary_emb_base": 10000,
        "torch_dtype": "float32",
    },
}
"""config.json of `write_checkpoint`'s models: LLAMA's and NEOX's shapes under transformers' keys."""


def write_checkpoint(arch: str, folder: Path, seed: int = 0, shard_bytes: int = 40_000) -> dict[str, torch.Tensor]:
    """A random float32 checkpoint of `arch` (HF_CONFIG's shape) as save_pretrained lays one out, without
    transformers: config.json, shards of about `shard_bytes` and model.safetensors.index.json; every tensor drawn
    from N(0, 0.2). Returns the tensors."""
    from safetensors.torch import save_file

    from hlat.core.config import ModelConfig
    from hlat.core.init_from import model_fields
    from hlat.training.models import modules_of

    config = HF_CONFIG[arch]
    cfg = ModelConfig(**model_fields(config))
    shapes = modules_of(cfg).hf_shapes(cfg)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=generator) * 0.2 for name, shape in sorted(shapes.items())}
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, tensor in tensors.items():
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + tensor.nbytes > shard_bytes:
            shards.append({})
        shards[-1][name] = tensor
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


def dense_import(folder: Path, vocab_multiple: int = 1) -> Any:
    """The dense model (`training.model.Transformer`, float32, eval mode) of the run starting from `folder`, its
    weights imported (`hf_import.fill_parameters`)."""
    from hlat.training.checkpoint.hf_import import SafetensorsReader, fill_parameters
    from hlat.training.model import Transformer

    cfg = run_config(folder, vocab_multiple)
    model = Transformer(cfg.model)
    fill_parameters(model, dict(model.named_parameters()), SafetensorsReader(Storage(str(folder))))
    return model.eval()


def assert_first_checkpoint_exports_the_original(run: Path, folder: Path) -> None:
    """The checkpoint a job saved right after its import (step 0 under <run>/checkpoints, any layout) exports as
    exactly the tensors of the checkpoint in `folder`: the same names, bitwise the same values."""
    from hlat.core.layout import CheckpointRef
    from hlat.training.checkpoint.hf_export import read_checkpoint, to_hf_state_dict

    shared, config = read_checkpoint(
        CheckpointRef(checkpoints=Storage(str(run / "checkpoints")), step=0, run_folder=None)
    )
    exported = to_hf_state_dict(shared["model"], config.model)
    original = original_tensors(folder)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
