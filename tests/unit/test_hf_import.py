"""Importing Hugging Face checkpoints (model.init_from, training/checkpoint/hf_import.py) into the dense model: tiny
random LlamaForCausalLM and GPTNeoXForCausalLM saved by transformers in the test (one file, or shards and their
index) give transformers' logits, export back bitwise, pad the vocabulary with zero rows, and are read one tensor at a
time by ranged reads; what the checkpoint lacks or holds in excess fails in one line. The tensor-parallel slices are
checked against the dense import here with the slicing rules alone (NxD's own layers: tests/nxd/test_hf_import.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hlat.core.config import HlatConfig
from hlat.core.init_from import InitFromError
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training.checkpoint.hf_export import export_hf
from hlat.training.checkpoint.hf_import import SafetensorsReader, fill_parameters, import_weights
from hlat.training.model import Transformer
from hlat.training.parallel.tensor_slices import dense_parameters, local_name, shard, unshard
from tests.hf_checkpoints import (
    ARCHS,
    HF_CONFIG,
    VOCAB,
    dense_import,
    fake_trainer,
    original_tensors,
    run_config,
    saved,
    write_checkpoint,
    write_import_record,
)

os.environ["HF_HUB_OFFLINE"] = "1"

SHARDED = "40KB"
"""max_shard_size that splits the tiny models over several files (each tensor is 8-100 KB in float32)."""


def imported(
    folder: Path, run: Path, vocab_multiple: int = 1, **overrides: Any
) -> tuple[Transformer, dict[str, Any], HlatConfig]:
    """The dense model of the run starting from `folder`, after `import_weights`; what it returned; the config."""
    cfg = run_config(folder, vocab_multiple, **overrides)
    write_import_record(Run.at(str(run)), folder)
    trainer = fake_trainer(cfg, run)
    return trainer.model, import_weights(trainer), cfg


def tokens(vocab: int = VOCAB, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(seed))


def assert_exports_bitwise(model: Transformer, folder: Path, out: Path) -> None:
    """export_hf of the imported model gives every tensor of the original files, bit for bit."""
    export_hf(model, model.cfg, out)
    exported, original = original_tensors(out), original_tensors(folder)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shards", [None, SHARDED])
def test_an_import_gives_transformers_logits_and_exports_bitwise(arch: str, shards: str | None, tmp_path: Path) -> None:
    hf = saved(arch, tmp_path / "hf", seed=1, max_shard_size=shards)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == (shards is not None)
    model, found, _ = imported(tmp_path / "hf", tmp_path / "run")
    n_tensors = len(original_tensors(tmp_path / "hf"))
    assert found["tensors"] == n_tensors and found["parameters"] == len(dense_parameters(model.cfg))
    x = tokens()
    with torch.no_grad():
        diff = (model.eval()(x) - hf(x).logits).abs().max().item()
    assert diff < 1e-5, diff
    assert_exports_bitwise(model, tmp_path / "hf", tmp_path / "export")


@pytest.mark.parametrize("arch", ARCHS)
def test_a_padded_vocabulary_imports_zero_rows_and_exports_the_original(arch: str, tmp_path: Path) -> None:
    hf = saved(arch, tmp_path / "hf", seed=2)
    model, _, cfg = imported(tmp_path / "hf", tmp_path / "run", vocab_multiple=128)
    assert cfg.model.padded_vocab_size == 384 and model.embed.weight.shape[0] == 384
    assert torch.count_nonzero(model.embed.weight[VOCAB:]) == torch.count_nonzero(model.output.weight[VOCAB:]) == 0
    x = tokens()
    with torch.no_grad():
        ours = model.eval()(x)
        diff = (ours[..., :VOCAB] - hf(x).logits).abs().max().item()
    assert diff < 1e-5 and torch.isneginf(ours[..., VOCAB:]).all()
    assert_exports_bitwise(model, tmp_path / "hf", tmp_path / "export")


def test_a_tied_llama_without_lm_head_takes_its_embedding(tmp_path: Path) -> None:
    hf = saved("llama", tmp_path / "hf", seed=3, tie_word_embeddings=True)
    assert "lm_head.weight" not in original_tensors(tmp_path / "hf")
    model, _, cfg = imported(tmp_path / "hf", tmp_path / "run")
    assert cfg.model.tie_embeddings and model.output.weight is model.embed.weight
    x = tokens()
    with torch.no_grad():
        assert (model.eval()(x) - hf(x).logits).abs().max().item() < 1e-5
    assert_exports_bitwise(model, tmp_path / "hf", tmp_path / "export")


def test_a_bf16_model_takes_the_weights_in_bf16_and_a_bf16_checkpoint_imports_exactly(tmp_path: Path) -> None:
    saved("gpt_neox", tmp_path / "hf", seed=4)
    cfg = run_config(tmp_path / "hf", 1)
    write_import_record(Run.at(str(tmp_path / "run")), tmp_path / "hf")
    model = Transformer(cfg.model).to(torch.bfloat16)  # bf16-sr: the trainer's BF16 model
    import_weights(fake_trainer(cfg, tmp_path / "run", model))
    dense, _, _ = imported(tmp_path / "hf", tmp_path / "run-fp32")
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, dense.get_parameter(name).to(torch.bfloat16)), name

    hf16 = saved("llama", tmp_path / "hf16", seed=5).to(torch.bfloat16)
    hf16.save_pretrained(str(tmp_path / "hf16"))
    assert {t.dtype for t in original_tensors(tmp_path / "hf16").values()} == {torch.bfloat16}
    model16, _, _ = imported(tmp_path / "hf16", tmp_path / "run16")  # a float32 model: BF16 values widen exactly
    export_hf(model16, model16.cfg, tmp_path / "export16")
    exported = original_tensors(tmp_path / "export16")
    for name, tensor in original_tensors(tmp_path / "hf16").items():
        assert torch.equal(exported[name], tensor.float()), name


class CountingStorage(Storage):
    """A Storage that records every ranged read (file, start, end)."""

    ranges: list[tuple[str, int, int]]

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        self.ranges.append((rel, start, end))
        return super().read_range(rel, start, end)


def test_the_reader_reads_one_tensor_at_a_time_never_a_whole_file(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    saved("llama", folder, seed=6, max_shard_size=SHARDED)
    store = CountingStorage(str(folder))
    store.ranges = []
    reader = SafetensorsReader(store, "tiny-llama")
    cfg = run_config(folder)
    model = Transformer(cfg.model)
    tensors = fill_parameters(model, dict(model.named_parameters()), reader)
    sizes = {p.name: p.stat().st_size for p in folder.glob("*.safetensors")}
    assert len(sizes) > 3 and tensors == len(original_tensors(folder))
    for file, start, end in store.ranges:
        if file in sizes:
            assert (start, end) != (0, sizes[file]) and end - start < sizes[file], (file, start, end)
    # Each file: its header in two reads, then each tensor once; nothing read twice.
    assert reader.reads == len(store.ranges) == 1 + 2 * len(sizes) + tensors
    tensor_bytes = sum(t.numel() * t.element_size() for t in original_tensors(folder).values())
    header_bytes = reader.bytes_read - tensor_bytes - (folder / "model.safetensors.index.json").stat().st_size
    assert 0 < header_bytes < 2000 * len(sizes)
    assert reader.largest_read == max(t.numel() * 4 for t in original_tensors(folder).values())


def drop_tensor(folder: Path, name: str) -> None:
    """Rewrite the safetensors file holding `name` without it (the index still names it)."""
    from safetensors.torch import load_file, save_file

    for file in folder.glob("*.safetensors"):
        tensors = load_file(str(file))
        if name in tensors:
            del tensors[name]
            save_file(tensors, str(file), metadata={"format": "pt"})


def add_tensor(folder: Path, name: str, value: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    save_file({**load_file(str(file)), name: value}, str(file), metadata={"format": "pt"})


def import_error(folder: Path, run: Path) -> str:
    with pytest.raises(InitFromError) as caught:
        imported(folder, run)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"model.init_from={str(folder)!r}: ")
    return message


def test_a_tensor_the_model_needs_that_the_checkpoint_lacks_fails_in_one_line(tmp_path: Path) -> None:
    saved("gpt_neox", tmp_path / "one", seed=7)
    drop_tensor(tmp_path / "one", "gpt_neox.layers.1.mlp.dense_h_to_4h.bias")
    message = import_error(tmp_path / "one", tmp_path / "run1")
    assert "lacks 1 tensor(s)" in message and "gpt_neox.layers.1.mlp.dense_h_to_4h.bias" in message

    # Named by the index, absent from the file it names.
    saved("llama", tmp_path / "sharded", seed=7, max_shard_size=SHARDED)
    drop_tensor(tmp_path / "sharded", "model.layers.0.self_attn.k_proj.weight")
    message = import_error(tmp_path / "sharded", tmp_path / "run2")
    assert "model.layers.0.self_attn.k_proj.weight" in message and "does not hold it" in message


def test_a_missing_shard_and_a_truncated_file_fail_in_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    saved("llama", folder, seed=8, max_shard_size=SHARDED)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = index["weight_map"]["model.norm.weight"]
    data = (folder / victim).read_bytes()
    (folder / victim).unlink()
    assert f"{victim} is missing (named by model.safetensors.index.json)" in import_error(folder, tmp_path / "r1")
    (folder / victim).write_bytes(data[:-3])
    assert f"{victim} is truncated" in import_error(folder, tmp_path / "r2")
    (folder / victim).write_bytes(data[:5])
    assert f"{victim} is truncated: its header length needs bytes 0-8" in import_error(folder, tmp_path / "r3")


def test_unknown_tensors_fail_and_known_buffers_are_ignored(tmp_path: Path) -> None:
    saved("gpt_neox", tmp_path / "hf", seed=9)
    # Pythia's files hold each layer's rotary inv_freq, causal mask and masked_bias: buffers, not weights.
    add_tensor(tmp_path / "hf", "gpt_neox.layers.0.attention.rotary_emb.inv_freq", torch.ones(2))
    add_tensor(tmp_path / "hf", "gpt_neox.layers.1.attention.bias", torch.ones(1, 1, 4, 4))
    add_tensor(tmp_path / "hf", "gpt_neox.layers.1.attention.masked_bias", torch.tensor(-1e9))
    _, found, _ = imported(tmp_path / "hf", tmp_path / "run")
    assert found["tensors"] == len(original_tensors(tmp_path / "hf")) - 3
    add_tensor(tmp_path / "hf", "gpt_neox.layers.0.attention.extra.weight", torch.ones(3))
    message = import_error(tmp_path / "hf", tmp_path / "run2")
    assert "does not take: gpt_neox.layers.0.attention.extra.weight" in message


def test_a_shape_that_differs_from_the_config_fails_in_one_line(tmp_path: Path) -> None:
    saved("llama", tmp_path / "hf", seed=10)
    cfg = run_config(tmp_path / "hf", 1, **{"model.ffn_hidden": 128})  # the config wins over config.json here
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"ffn_hidden": 128})})
    write_import_record(Run.at(str(tmp_path / "run")), tmp_path / "hf")
    with pytest.raises(InitFromError, match=r"mlp\.gate_proj\.weight has shape \[96, 64\]; this run's model needs"):
        import_weights(fake_trainer(cfg, tmp_path / "run"))


class SlicedModel:
    """What `fill_parameters` uses of a tensor-parallel rank's model (its config, `local_name` and `shard`), with
    parameters of that rank's shapes: the slicing rules of training/parallel/tensor_slices.py without NxD."""

    def __init__(self, cfg: HlatConfig, rank: int, tp: int) -> None:
        self.cfg = cfg.model
        self.parallel = SimpleNamespace(
            local_name=lambda name: local_name(name, self.cfg, tp),
            shard=lambda param, full: shard(param, full, rank, tp, self.cfg),
        )
        self.params = {
            local_name(p.name, self.cfg, tp): torch.nn.Parameter(shard(p, torch.empty(p.shape), rank, tp, self.cfg))
            for p in dense_parameters(self.cfg)
        }


@pytest.mark.parametrize(("arch", "tp", "extra"), [("llama", 2, {}), ("llama", 4, {}), ("gpt_neox", 2, {})])
def test_tensor_parallel_slices_put_back_together_are_the_dense_import(
    arch: str, tp: int, extra: dict[str, Any], tmp_path: Path
) -> None:
    """Each TP rank fills its slices (for llama at TP 4, more ranks than its 2 KV heads: NxD's GQA names); unsharded,
    they are the dense import, padded vocabulary included."""
    saved(arch, tmp_path / "hf", seed=11, max_shard_size=SHARDED, **extra)
    dense, _, cfg = imported(tmp_path / "hf", tmp_path / "run", vocab_multiple=128)
    ranks = [SlicedModel(cfg, rank, tp) for rank in range(tp)]
    for rank in ranks:
        reader = SafetensorsReader(Storage(str(tmp_path / "hf")), "x")
        fill_parameters(rank, rank.params, reader)  # type: ignore[arg-type]
    for param in dense_parameters(cfg.model):
        name = local_name(param.name, cfg.model, tp)
        whole = unshard(param, [rank.params[name].detach() for rank in ranks], cfg.model)
        assert torch.equal(whole, dense.get_parameter(param.name)), param.name


def test_zero1_master_weights_are_made_again_from_the_imported_parameters(tmp_path: Path) -> None:
    saved("llama", tmp_path / "hf", seed=12)
    cfg = run_config(tmp_path / "hf", 1, **{"parallelism.zero1": True})
    write_import_record(Run.at(str(tmp_path / "run")), tmp_path / "hf")
    calls: list[int] = []
    zero1 = SimpleNamespace(init_zero=lambda: calls.append(1))
    import_weights(fake_trainer(cfg, tmp_path / "run", optimizer=SimpleNamespace(optimizer=zero1)))
    assert calls == [1]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_xla_and_nxd_tiers_checkpoint_writer_lays_out_what_transformers_loads(arch: str, tmp_path: Path) -> None:
    """`write_checkpoint` (for the tiers without transformers): transformers loads it with every tensor it has and
    no other, and the dense import gives its logits."""
    from transformers import AutoModelForCausalLM

    tensors = write_checkpoint(arch, tmp_path / "hf", seed=13)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 3
    hf, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(hf).__name__ == HF_CONFIG[arch]["architectures"][0]
    x = tokens()
    with torch.no_grad():
        assert (dense_import(tmp_path / "hf")(x) - hf.eval()(x).logits).abs().max().item() < 1e-5
    assert set(tensors) == set(original_tensors(tmp_path / "hf"))
