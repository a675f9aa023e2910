"""model.init_from resolved before the first job (infra/inputs/init_from.py, tasks/init_from.py): the run's record of
the
weights it starts from (source, commit, files and their hashes, the folder the jobs read), from a local folder, an
s3:// prefix (moto) and a hub name (a hub cache the test makes, offline); the model the checkpoint's config.json
describes, and what hlat's families cannot hold refused in one line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from hlat.core.config import HlatConfig
from hlat.core.init_from import InitFromError, check_embedding_rows, model_fields, model_follows_checkpoint
from hlat.core.layout import IMPORT_RECORD, IMPORTS_DIR
from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.infra.inputs.init_from import import_checkpoint
from tests.pretrained_tokenizers import HUB_COMMIT, hub_cache


def _llama(folder: Path, shard_bytes: str | None = None, **overrides: Any) -> Path:
    """A tiny random LlamaForCausalLM saved by transformers (sharded when `shard_bytes` is given)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    settings: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "max_position_embeddings": 128,
        **overrides,
    }
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.save_pretrained(folder, max_shard_size=shard_bytes or "10GB")
    return folder


def _config(**model: Any) -> HlatConfig:
    overrides = {f"model.{k}": v for k, v in model.items()}
    return load_config("tiny", {**overrides, "tokenizer.pretrained": "org/tokenizer"})


def test_a_local_folder_is_recorded_with_each_file_s_sha256_and_read_in_place(tmp_path: Path) -> None:
    folder = _llama(tmp_path / "llama", shard_bytes="40KB")
    run = Run.at(str(tmp_path / "run"))
    record = import_checkpoint(_config(init_from=str(folder)), run)
    names = [f["name"] for f in record["files"]]
    assert names[:2] == ["config.json", "model.safetensors.index.json"] and len(names) > 3  # sharded
    for entry in record["files"]:
        assert entry["sha256"] == hashlib.sha256((folder / entry["name"]).read_bytes()).hexdigest()
    assert record["location"] == str(folder) and record["from"] == "local"
    assert record["config"]["hidden_size"] == 64 and record["bytes"] == sum(f["bytes"] for f in record["files"])
    assert run.storage.read_json(IMPORT_RECORD) == json.loads(json.dumps(record))
    # A second resolution keeps the record (the run started from those weights).
    (folder / "config.json").write_text((folder / "config.json").read_text().replace("64", "64 "))
    assert import_checkpoint(_config(init_from=str(folder)), run)["sha256"] == record["sha256"]


def test_a_hub_name_comes_from_the_hub_cache_offline_with_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = hub_cache(tmp_path / "hub", "org/tiny-llama", _llama(tmp_path / "llama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    record = import_checkpoint(_config(init_from="org/tiny-llama"), Run.at(str(tmp_path / "run")))
    assert record["from"] == "hub" and record["revision"] == HUB_COMMIT
    assert Path(record["location"]).name == HUB_COMMIT
    with pytest.raises(ValueError, match=r"model.init_from='org/absent'.*HF_HUB_OFFLINE is set"):
        import_checkpoint(_config(init_from="org/absent"), Run.at(str(tmp_path / "run2")))


def test_an_s3_prefix_is_read_in_place_and_a_local_folder_is_uploaded_once_for_a_run_on_s3(
    s3_env: Any, tmp_path: Path
) -> None:
    folder = _llama(tmp_path / "llama")
    prefix = Storage(f"{s3_env.url}/weights")
    for path in folder.iterdir():
        prefix.put_file(str(path), path.name)
    run = Run.at(f"{s3_env.url}/runs/r1")
    record = import_checkpoint(_config(init_from=prefix.url), run)
    assert record["location"] == prefix.url and record["from"] == "s3"
    assert all(f["etag"] for f in record["files"])
    # A local folder with a run on S3: the jobs cannot read this disk, so it is uploaded under the storage root.
    first = import_checkpoint(_config(init_from=str(folder)), Run.at(f"{s3_env.url}/runs/r2"))
    assert first["location"].startswith(f"{s3_env.url}/runs/{IMPORTS_DIR}/")
    uploaded = Storage(first["location"])
    assert sorted(uploaded.list()) == ["COMPLETE", "config.json", "model.safetensors"]  # what the import reads
    second = import_checkpoint(_config(init_from=str(folder)), Run.at(f"{s3_env.url}/runs/r3"))
    assert second["location"] == first["location"] and second["sha256"] == first["sha256"]


@pytest.mark.parametrize(
    ("remove", "write", "message"),
    [
        ("config.json", None, r"has no config.json"),
        ("model.safetensors", "pytorch_model.bin", r"only pickled weights \(pytorch_model.bin\): convert them"),
        ("model.safetensors", None, r"no model.safetensors or model.safetensors.index.json"),
    ],
)
def test_a_folder_without_a_usable_checkpoint_is_refused_naming_the_field(
    tmp_path: Path, remove: str, write: str | None, message: str
) -> None:
    folder = _llama(tmp_path / "llama")
    (folder / remove).unlink()
    if write:
        (folder / write).write_bytes(b"pickle")
    run = Run.at(str(tmp_path / "run"))
    with pytest.raises(ValueError, match=rf"model.init_from='.*llama': .*{message}"):
        import_checkpoint(_config(init_from=str(folder)), run)
    assert not run.storage.exists(IMPORT_RECORD)


def test_an_index_naming_a_missing_shard_is_refused(tmp_path: Path) -> None:
    folder = _llama(tmp_path / "llama", shard_bytes="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=rf"names 1 shard file\(s\) the folder lacks \({shard.name}\)"):
        import_checkpoint(_config(init_from=str(folder)), Run.at(str(tmp_path / "run")))


def _hf(kind: str, **overrides: Any) -> dict[str, Any]:
    from transformers import GPTNeoXConfig, LlamaConfig

    if kind == "llama":
        made: Any = LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"],
        )  # fmt: skip
    else:
        made = GPTNeoXConfig(
            hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=320,
            max_position_embeddings=256, rotary_pct=0.25, architectures=["GPTNeoXForCausalLM"],
        )  # fmt: skip
    data: dict[str, Any] = json.loads(made.to_json_string())
    data.update(overrides)
    return data


def test_the_checkpoint_decides_family_and_shape_with_one_line_saying_what_changed() -> None:
    config = _config(init_from="org/llama")
    followed, line = model_follows_checkpoint(config, _hf("llama"))
    m = followed.model
    assert (m.arch, m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.max_seq_len) == (
        "llama", 3, 64, 4, 2, 96, 256
    )  # fmt: skip
    assert line is not None and line.startswith("model: n_layers ") and "n_kv_heads None -> 2" in line
    assert line.endswith("(the config.json of model.init_from=org/llama)")
    assert model_follows_checkpoint(followed, _hf("llama")) == (followed, None)
    neox, line = model_follows_checkpoint(config, _hf("gpt_neox"))
    assert neox.model.arch == "gpt_neox" and neox.model.rotary_fraction == 0.25 and "arch llama -> gpt_neox" in line


@pytest.mark.parametrize(
    ("kind", "overrides", "message"),
    [
        ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, r"RoPE scaling 'linear'"),
        ("llama", {"attention_bias": True}, r"config.json attention_bias=True: hlat's model has attention_bias=False"),
        ("gpt_neox", {"use_parallel_residual": False}, r"use_parallel_residual=False"),
        ("llama", {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, r"MistralForCausalLM"),
    ],
)
def test_what_hlat_cannot_hold_is_refused_in_one_line(kind: str, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InitFromError, match=rf"^model.init_from='org/x': .*{message}"):
        model_fields(_hf(kind, **overrides), "org/x")


def test_a_checkpoint_that_does_not_fit_the_parallelism_names_the_field() -> None:
    config = _config(init_from="org/llama")
    data = config.model_dump(mode="json")
    data["parallelism"]["tensor"] = 8
    data["job"]["processes_per_node"] = 8
    data["model"].update(d_model=128, n_heads=8, vocab_multiple=8)
    with pytest.raises(InitFromError, match=r"does not fit this run's config: .*parallelism.tensor=8"):
        model_follows_checkpoint(HlatConfig.model_validate(data), _hf("llama"))  # 4 heads over 8 ranks


def test_the_imported_embedding_must_hold_the_tokenizer_and_fit_the_padded_rows() -> None:
    config = _config(init_from="org/x", vocab_size=300, vocab_multiple=1)
    check_embedding_rows(config, 300)
    with pytest.raises(InitFromError, match=r"has 280 rows but the tokenizer .* has 300 ids"):
        check_embedding_rows(config, 280)
    with pytest.raises(InitFromError, match=r"set model.vocab_multiple .* model.vocab_multiple=32\)"):
        check_embedding_rows(config, 320)
    check_embedding_rows(_config(init_from="org/x", vocab_size=300, vocab_multiple=64), 320)


def test_preflight_reads_only_the_small_files_and_fails_what_the_import_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hlat.infra.checks.sources import init_from_finding

    folder = _llama(tmp_path / "llama", shard_bytes="40KB")
    found = init_from_finding(str(folder))
    assert found.ok and found.message.endswith(
        ": llama, 2 layers, d_model 64, " + f"{len(list(folder.glob('*.safetensors')))} safetensors file(s)"
    )
    # A hub name: config.json and the index only (the weights stay on the hub until the stage imports them).
    cache = hub_cache(tmp_path / "hub", "org/tiny-llama", folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert init_from_finding("org/tiny-llama").message == (
        f"org/tiny-llama at {HUB_COMMIT[:12]}: llama, 2 layers, d_model 64, {len(list(folder.glob('*.safetensors')))} "
        "safetensors file(s)"
    )
    (folder / "config.json").write_text(
        json.dumps({**json.loads((folder / "config.json").read_text()), "mlp_bias": True})
    )
    bad = init_from_finding(str(folder))
    assert not bad.ok and "config.json mlp_bias=True" in bad.message


def test_the_dry_run_says_where_the_weights_come_from() -> None:
    from hlat.infra.inputs.init_from import model_notes

    notes = model_notes(_config(init_from="org/tiny-llama"))
    assert notes[0].startswith("weights: from model.init_from=org/tiny-llama; its config.json decides")
    assert notes[1].startswith("vocabulary: model.vocab_size comes from tokenizer.pretrained=org/tokenizer")
    assert model_notes(load_config("tiny")) == []


@pytest.mark.slow
def test_the_train_stage_imports_published_weights_and_trains_and_exports_from_them(
    prefect_server: None, prepared: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The continued-pretraining recipe's path at tiny scale: one folder holds a LLaMA checkpoint and its tokenizer
    (model.init_from and tokenizer.pretrained), the tokenizer stage copies the tokenizer, the train stage imports the
    weights, the job's model takes the checkpoint's shape, and two steps at a negligible learning rate leave weights
    that export to what transformers computes with the original ones."""
    import itertools
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    from hlat.core.run import open_run
    from hlat.core.shards import iter_documents, read_manifest
    from hlat.flows.train import train
    from hlat.flows.train_tokenizer import train_tokenizer
    from hlat.training.checkpoint.hf_export import export_checkpoint
    from tests.conftest import SMALL_RUN
    from tests.jobs import source_data
    from tests.pretrained_tokenizers import llama_like

    data = source_data(Storage(str(prepared / "data")))
    texts = list(itertools.islice(iter_documents(data, read_manifest(data), "train"), 200))
    folder = llama_like(tmp_path / "published", texts, vocab_size=400)
    _llama(folder, vocab_size=400, max_position_embeddings=256)
    overrides: dict[str, Any] = {
        **SMALL_RUN,
        "model.init_from": str(folder),
        "tokenizer.pretrained": str(folder),
        "training.max_steps": 2,
        "training.checkpoint_every": 2,
        "training.eval_every": 2,
        "training.warmup_steps": 1,
        "training.lr": 1e-9,  # the weights stay the imported ones to ~1e-9
        "training.schedule": "wsd",
        "training.decay_steps": 1,
    }
    open_run(load_config("tiny", overrides, run_id="continued", storage=str(tmp_path)))
    run = tmp_path / "continued"
    shutil.copytree(prepared / "data", run / "data")
    train_tokenizer(preset="tiny", overrides=overrides, run_id="continued", storage=str(tmp_path))
    summary = train(preset="tiny", overrides=overrides, run_id="continued", storage=str(tmp_path))
    assert summary["final_step"] == 2
    record = json.loads((run / IMPORT_RECORD).read_text())
    assert record["source"] == str(folder) and record["config"]["hidden_size"] == 64
    lines = [r.getMessage() for r in caplog.records]
    changed = "model: d_model 128 -> 64, n_kv_heads None -> 2, ffn_hidden 344 -> 96, norm_eps 1e-05 -> 1e-06 (the"
    assert any(line.startswith(f"train: {changed}") for line in lines)  # the stage says it once
    assert any(line.startswith(f"rank0 {changed}") for line in lines)  # and the job (its log)
    assert any(line.startswith("rank0 imported 21 tensors") and record["sha256"][:12] in line for line in lines)

    exported, _ = export_checkpoint(str(run), tmp_path / "hf")
    ours, theirs = LlamaForCausalLM.from_pretrained(exported), LlamaForCausalLM.from_pretrained(folder)
    tokens = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(tokens).logits, theirs(tokens).logits, atol=1e-4)


def test_the_continued_pretraining_recipe_is_a_valid_config_file() -> None:
    from hlat.cli import read_config_file

    recipe = Path(__file__).resolve().parents[2] / "deployments" / "continue-llama2-7b.yaml"
    preset, overrides = read_config_file(str(recipe))
    config = load_config(preset or "tiny", overrides)
    assert config.model.init_from == config.tokenizer.pretrained == "meta-llama/Llama-2-7b-hf"
    assert (config.training.schedule, config.training.max_steps) == ("wsd", 2500)
    # The preset's shape is LLaMA-2 7B's already: the import changes nothing in it.
    llama2 = {
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "max_position_embeddings": 4096, "vocab_size": 32000, "rms_norm_eps": 1e-5,
    }  # fmt: skip
    hf = _hf("llama", **llama2, head_dim=128)
    assert model_follows_checkpoint(config, hf) == (config, None)
