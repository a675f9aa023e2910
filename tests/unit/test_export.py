"""`hlat export`: a run's checkpoint as a Hugging Face folder that transformers loads offline with the same logits,
found from a checkpoint, checkpoints or run folder; clear errors for what cannot be exported."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch

from hlat.cli import main
from hlat.core.config import TokenizerConfig
from hlat.core.presets import load_config
from hlat.core.storage import Storage
from hlat.infra.inputs.tokenizer import export_hf_tokenizer, train_sentencepiece
from hlat.training.checkpoint import MARKER, CheckpointError, CheckpointManager, step_dir
from hlat.training.checkpoint.hf_export import export_checkpoint, locate_checkpoint
from hlat.training.model import Transformer


def make_run(root: Path, steps: tuple[int, ...] = (5, 10), **overrides: object) -> tuple[Path, Transformer]:
    """A run folder with committed checkpoints at `steps` (the model changes between them) and tokenizer files."""
    config = load_config("tiny", {"model.n_layers": 1, "model.d_model": 64, "model.n_heads": 2, **overrides})
    run = root / "run-a"
    manager = CheckpointManager(Storage(str(run / "checkpoints")), keep_last=5)
    torch.manual_seed(3)
    model = Transformer(config.model)
    model.init_weights()
    for step in steps:
        with torch.no_grad():
            model.norm.weight.fill_(1.0 + step / 100)
        shared = {"step": step, "model": model.state_dict(), "config": config.model_dump(mode="json")}
        manager.save(step, shared, {"rng": {}})
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "tokenizer.model").write_bytes(sentencepiece_model())
    export_hf_tokenizer(str(run / "tokenizer" / "tokenizer.model"), str(run / "tokenizer"), config.model.max_seq_len)
    (run / "tokenizer" / "report.json").write_text("{}")
    return run, model


@functools.cache
def sentencepiece_model() -> bytes:
    """A small sentencepiece BPE model with the tokenizer stage's options (byte fallback included)."""
    text = Path(json.__file__).read_text().splitlines() * 4
    with tempfile.TemporaryDirectory() as tmp:
        path = train_sentencepiece(iter(text), 400, TokenizerConfig(threads=1), tmp)
        return Path(path).read_bytes()


def test_the_newest_checkpoint_exports_and_transformers_reproduces_its_logits(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    run, model = make_run(tmp_path)
    out, ref = export_checkpoint(str(run), tmp_path / "hf")
    assert ref.step == 10 and ref.uri.endswith(step_dir(10))
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.model", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "report.json" not in names
    hf = LlamaForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model.eval()(tokens), rtol=0, atol=1e-5)
    assert hf.model.norm.weight[0].item() == pytest.approx(1.10)


def test_a_checkpoint_is_found_from_its_folder_the_checkpoints_folder_or_the_run(tmp_path: Path) -> None:
    run, _ = make_run(tmp_path)
    assert locate_checkpoint(str(run / "checkpoints" / step_dir(5))).step == 5
    assert locate_checkpoint(str(run / "checkpoints")).step == 10
    assert locate_checkpoint(str(run), step=5).step == 5
    ref = locate_checkpoint(str(run / "checkpoints"))
    assert ref.run_folder is not None and ref.run_folder.uri() == str(run)
    with pytest.raises(CheckpointError, match="is step 5, not the step 10"):
        locate_checkpoint(str(run / "checkpoints" / step_dir(5)), step=10)


def test_missing_or_incomplete_checkpoints_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 1
    assert "no checkpoint at" in capsys.readouterr().err
    run, _ = make_run(tmp_path, steps=(5,))
    (run / "checkpoints" / step_dir(5) / MARKER).unlink()  # an interrupted save
    with pytest.raises(CheckpointError, match=r"no complete checkpoint under .*COMMITTED"):
        locate_checkpoint(str(run))
    with pytest.raises(CheckpointError, match="not usable: no COMMITTED marker"):
        locate_checkpoint(str(run), step=5)
    assert not (tmp_path / "out").exists()


def test_a_step_that_was_never_saved_lists_the_committed_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = make_run(tmp_path, steps=(5, 10))
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 999 under .*: the committed steps are 5, 10"):
        locate_checkpoint(str(run), step=999)
    # Through the CLI, as a user types it: one line naming the steps that exist, nothing written.
    assert main(["export", str(run), str(tmp_path / "out"), "--step", "999"]) == 1
    err = capsys.readouterr().err
    assert "committed steps are 5, 10" in err and "COMMITTED marker" not in err
    assert not (tmp_path / "out").exists()
    # An interrupted save is not listed as committed, and keeps its own message when asked for.
    (run / "checkpoints" / step_dir(10) / MARKER).unlink()
    with pytest.raises(CheckpointError, match="committed steps are 5;"):
        locate_checkpoint(str(run), step=7)
    with pytest.raises(CheckpointError, match="no COMMITTED marker"):
        locate_checkpoint(str(run), step=10)


def test_a_partial_rotary_checkpoint_exports_as_a_longrope_llama(tmp_path: Path) -> None:
    run, _ = make_run(tmp_path, steps=(5,), **{"model.rotary_fraction": 0.25})
    out, ref = export_checkpoint(str(run), tmp_path / "hf")
    assert ref.step == 5 and json.loads((out / "config.json").read_text())["rope_parameters"]["rope_type"] == "longrope"


def test_the_cli_exports_and_says_how_to_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = make_run(tmp_path)
    assert main(["export", str(run / "checkpoints"), str(tmp_path / "hf"), "--step", "5"]) == 0
    printed = capsys.readouterr().out
    assert "step 5" in printed and "LlamaForCausalLM.from_pretrained" in printed
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 1
    (run / "tokenizer" / "tokenizer.model").unlink()
    (run / "tokenizer" / "tokenizer.json").unlink()
    assert main(["export", str(run), str(tmp_path / "hf2")]) == 1
    assert "no tokenizer.model or tokenizer.json" in capsys.readouterr().err


def test_a_tokenizer_without_tokenizer_json_is_completed_by_the_cli_so_transformers_loads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import sentencepiece as spm
    from transformers import AutoTokenizer

    run, _ = make_run(tmp_path)
    (run / "tokenizer" / "tokenizer.json").unlink()  # a tokenizer made elsewhere: tokenizer.model alone
    with pytest.raises(ValueError, match=r"no tokenizer\.json in .*hlat export.* builds it"):
        export_checkpoint(str(run), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    sp = spm.SentencePieceProcessor(model_file=str(run / "tokenizer" / "tokenizer.model"))
    text = "def dumps(obj, *, skipkeys=False):\n    return ü 42"
    assert hf(text)["input_ids"] == [1, *sp.encode(text)]
    # A tokenizer.model that is not one: the cause, in one line, and nothing written.
    (run / "tokenizer" / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    capsys.readouterr()
    assert main(["export", str(run), str(tmp_path / "hf3")]) == 1
    assert "none could be built from its tokenizer.model" in capsys.readouterr().err
    assert not (tmp_path / "hf3").exists()


@pytest.mark.parametrize("kv_heads", [2, 1])  # 1: TP exceeds the KV heads (NxD's GQA layer, heads reordered)
def test_a_tensor_parallel_checkpoint_consolidates_and_exports_as_the_dense_model(
    tmp_path: Path, kv_heads: int
) -> None:
    """Two TP ranks' shards, sliced as training/parallel/tensor_slices.py slices them (the layout tests/nxd proves
    against NxD's layers), written as a sharded checkpoint: the export equals the dense model."""
    from transformers import LlamaForCausalLM

    from hlat.training.parallel.tensor_slices import dense_parameters, local_name, shard

    config = load_config(
        "tiny", {"model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.n_kv_heads": kv_heads}
    )
    dense = Transformer(config.model)
    dense.init_weights(seed=5)
    weights = dense.state_dict()
    run = tmp_path / "run-tp"
    names = ["tp00-pp00", "tp01-pp00"]
    for rank, name in reversed(list(enumerate(names))):  # rank 0 last: it commits once the other's files exist
        local = {
            local_name(p.name, config.model, 2): shard(p, weights[p.name], rank, 2, config.model)
            for p in dense_parameters(config.model)
        }
        manager = CheckpointManager(
            Storage(str(run / "checkpoints")), keep_last=2, rank=rank, world_size=2, shard=name, shard_writer=True,
            shards=names, commit_timeout_s=30,
        )  # fmt: skip
        shared = {"step": 7, "model": local, "config": config.model_dump(mode="json")}
        manager.save(7, shared, {"rng": {}})
    if kv_heads == 1:
        assert "layers.0.attn.qkv.weight_q" in manager.load_shards(7)["tp01-pp00"]["model"]
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "tokenizer.model").write_bytes(sentencepiece_model())
    out, ref = export_checkpoint(str(run), tmp_path / "hf", build_tokenizer_json=export_hf_tokenizer)
    assert ref.step == 7
    hf = LlamaForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokens = torch.randint(0, config.model.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, dense.eval()(tokens), rtol=0, atol=1e-5)


def test_a_gpt_neox_run_with_a_tokenizer_json_only_tokenizer_exports_with_its_bos_and_eos(tmp_path: Path) -> None:
    """A pretrained tokenizer's folder (tokenizer.json and tokenizer_config.json, no sentencepiece model) is exported
    as it is, BOS/EOS from its files; the gpt_neox checkpoint, padded vocabulary dropped, loads as GPTNeoXForCausalLM
    with our logits."""
    from tokenizers import Tokenizer, models
    from transformers import GPTNeoXForCausalLM

    run, model = make_run(
        tmp_path, steps=(5,), **{"model.arch": "gpt_neox", "model.rotary_fraction": 0.5, "model.vocab_multiple": 128}
    )
    folder = run / "tokenizer"
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    vocab = {f"t{i}": i for i in range(model.cfg.vocab_size) if i != 7} | {"<|endoftext|>": 7}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(special))
    out, _ = export_checkpoint(str(run), tmp_path / "hf")
    assert {p.name for p in out.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    assert not (out / "tokenizer.model").exists()
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (7, 7, model.cfg.vocab_size)
    hf = GPTNeoXForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model.eval()(x)[..., : model.cfg.vocab_size] - hf(x).logits).abs().max().item()
    assert diff < 1e-5
