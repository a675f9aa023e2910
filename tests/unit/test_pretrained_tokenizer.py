"""An existing tokenizer: the training layer's `Tokenizer` over a GPT-NeoX-like tokenizer.json and a LLaMA-like
sentencepiece folder (both built here and saved in Hugging Face's format), the loader and perplexity on them, the
tokenizer stage with tokenizer.pretrained (a local folder, a hub name from an offline cache), and the model's
vocabulary following the tokenizer."""

from __future__ import annotations

import hashlib
import http.server
import itertools
import json
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sentencepiece as spm

from hlat.core.config import ConfigError, TokenizerConfig
from hlat.core.contract import model_follows_tokenizer
from hlat.core.layout import MANIFEST_FILE, REPORT_FILE
from hlat.core.presets import load_config
from hlat.core.shards import DataManifest, ShardWriter
from hlat.core.storage import Storage
from hlat.infra.inputs.tokenizer import (
    build_pretrained_tokenizer,
    build_tokenizer,
    fetch_pretrained,
    pretrained_fingerprint,
    vocabulary_note,
)
from hlat.training.data.loader import PackedLoader
from hlat.training.data.tokenizer import Tokenizer
from hlat.training.evaluation.perplexity import token_stream
from tests.pretrained_tokenizers import NEOX_EOS, hub_cache, llama_like, neox_like

WORDS = [
    *("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this"),
    *("model", "token", "shard", "epoch", "rank", "resume", "batch", "loader", "stream", "value", "error"),
]
ODD = "caf\u00e9 \u00fcber \u65e5\u672c \U0001f600 tab\tend  two  spaces\n\nnew </s> <s> " + NEOX_EOS


def make_docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 80))]
        for j in range(4, len(words), rng.randint(5, 12)):
            words[j] += rng.choice([".", ",", ":\n", "\n\n", " 42;"])
        docs.append(f"doc {i} " + " ".join(words))
    return docs


TRAIN, VALIDATION = make_docs(120, 1), make_docs(30, 2)


def write_data(root: Path) -> Storage:
    """A prepared-data folder (shards and manifest.json) holding TRAIN and VALIDATION."""
    data = Storage(str(root))
    writer = ShardWriter(data, "shards", "parquet", 16)
    for text in TRAIN:
        writer.add(text, "train")
    for text in VALIDATION:
        writer.add(text, "validation")
    manifest = DataManifest(fingerprint="test", format="parquet", shards=writer.close())
    data.write_json(MANIFEST_FILE, manifest.model_dump(mode="json"))
    return data


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    return {
        "neox": neox_like(root / "neox", TRAIN),
        "llama": llama_like(root / "llama", TRAIN),
        "data": root / "data",
    }


@pytest.fixture(scope="module")
def data(folders: dict[str, Path]) -> Storage:
    return write_data(folders["data"])


# -- the Tokenizer seam -----------------------------------------------------------------------------------------


def test_a_neox_like_tokenizer_json_loads_with_tokenizers_and_gives_transformers_ids(folders: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    folder = folders["neox"]
    assert not (folder / "tokenizer.model").exists()
    tok = Tokenizer.load(str(folder))
    hf = AutoTokenizer.from_pretrained(str(folder))
    assert tok.kind == "tokenizers" and tok.path == str(folder / "tokenizer.json")
    assert tok.eos_id == hf.eos_token_id == tok.bos_id and tok.vocab_size == len(hf)
    assert tok.byte_ids == frozenset()  # byte-level BPE: every byte is a symbol, nothing falls back
    plain = ODD.replace(NEOX_EOS, "")
    for text in [*VALIDATION[:10], plain]:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # The EOS's spelling inside a document is text: it never injects the separator.
    assert tok.eos_id not in tok.encode(f"a {NEOX_EOS} b") and tok.decode(tok.encode(NEOX_EOS)) == NEOX_EOS
    arrays = tok.encode_batch(VALIDATION[:4], add_eos=True)
    assert all(a.dtype == np.int32 and a[-1] == tok.eos_id for a in arrays)
    assert [a[:-1].tolist() for a in arrays] == [tok.encode(t) for t in VALIDATION[:4]]
    assert [a.tolist() for a in tok.encode_batch(VALIDATION[:4], add_eos=True, threads=2)] == [
        a.tolist() for a in arrays
    ]


def test_its_identity_is_the_sha256_of_tokenizer_json_and_the_files_that_name_its_specials(
    folders: dict[str, Path],
) -> None:
    folder = folders["neox"]
    tok = Tokenizer.load(str(folder))
    names = sorted(tok.files)
    specials = {"tokenizer_config.json", "special_tokens_map.json"} & {p.name for p in folder.iterdir()}
    assert tok.files[0] == "tokenizer.json" and set(names) == {"tokenizer.json", *specials} and specials
    lines = "".join(f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    assert tok.sha256 == hashlib.sha256(lines.encode()).hexdigest()


def test_a_llama_like_folder_prefers_sentencepiece_and_its_tokenizer_json_gives_the_same_ids(
    folders: dict[str, Path],
) -> None:
    folder = folders["llama"]
    tok = Tokenizer.load(str(folder))
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert tok.kind == "sentencepiece" and tok.files == ("tokenizer.model",)
    assert tok.sha256 == hashlib.sha256((folder / "tokenizer.model").read_bytes()).hexdigest()
    assert (tok.eos_id, tok.bos_id, tok.vocab_size) == (sp.eos_id(), sp.bos_id(), sp.get_piece_size())
    assert len(tok.byte_ids) == 256
    as_json = Tokenizer.load(str(folder / "tokenizer.json"))
    assert as_json.kind == "tokenizers" and (as_json.eos_id, as_json.bos_id) == (tok.eos_id, tok.bos_id)
    assert as_json.byte_ids == tok.byte_ids and as_json.vocab_size == tok.vocab_size
    for text in [*VALIDATION[:10], ODD]:
        assert as_json.encode(text) == tok.encode(text) == sp.encode(text)
        assert tok.decode(tok.encode(text)) == text


def test_a_tokenizer_json_without_a_named_eos_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    shutil.copyfile(folders["neox"] / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=r"has no EOS: none of tokenizer_config\.json, special_tokens_map\.json"):
        Tokenizer.load(str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer"):
        Tokenizer.load(str(tmp_path / "empty"))


# -- the loader and perplexity on a tokenizer.json ----------------------------------------------------------------


def test_the_loader_packs_documents_with_the_tokenizer_json_and_refuses_another_tokenizer_on_resume(
    folders: dict[str, Path], data: Storage
) -> None:
    tok = Tokenizer.load(str(folders["neox"]))
    with PackedLoader(data, str(folders["neox"]), 64, 2, seed=3) as loader:
        batches = [next(loader) for _ in range(6)]
        state = loader.state_dict()
    assert state["tokenizer_sha256"] == tok.sha256
    stream = np.concatenate([batches[0].inputs[0, :1].numpy(), *(b.targets.flatten().numpy() for b in batches)])
    assert int(stream.max()) < tok.vocab_size
    # Whole documents lie between consecutive EOS: each decodes to a training document.
    cuts = np.flatnonzero(stream == tok.eos_id)
    assert len(cuts) >= 3
    whole = [tok.decode(stream[a + 1 : b].tolist()) for a, b in itertools.pairwise(cuts)]
    assert whole and set(whole) <= set(TRAIN)
    with PackedLoader(data, str(folders["neox"]), 64, 2, seed=3) as again:
        again.load_state_dict(state)
        assert again.state_dict()["tokenizer_sha256"] == tok.sha256
    other = PackedLoader(data, str(folders["llama"]), 64, 2, seed=3)
    with other, pytest.raises(ValueError, match="different tokenizer"):
        other.load_state_dict(state)


def test_a_trained_tokenizer_keeps_its_ids_and_loader_state_bit_for_bit(
    folders: dict[str, Path], data: Storage
) -> None:
    """The folder and its tokenizer.model are one tokenizer: the ids are sentencepiece's, the recorded hash is
    tokenizer.model's sha256, as every earlier run's loader state holds it."""
    model = str(folders["llama"] / "tokenizer.model")
    sp = spm.SentencePieceProcessor(model_file=model)
    with (
        PackedLoader(data, model, 32, 2, seed=5) as by_file,
        PackedLoader(data, str(folders["llama"]), 32, 2, seed=5) as by_folder,
    ):
        for _ in range(4):
            a, b = next(by_file), next(by_folder)
            assert a.inputs.equal(b.inputs) and a.targets.equal(b.targets)
        assert by_file.state_dict() == by_folder.state_dict()
        assert by_file.state_dict()["tokenizer_sha256"] == hashlib.sha256(Path(model).read_bytes()).hexdigest()
    stream, eos, documents, _ = token_stream(VALIDATION, model, 10**9)
    expected = [sp.eos_id()]
    for text in VALIDATION:
        expected += [*sp.encode(text), sp.eos_id()]
    assert stream == expected and eos == sp.eos_id() and documents == len(VALIDATION)


def test_perplexity_streams_a_tokenizer_json(folders: dict[str, Path]) -> None:
    tok = Tokenizer.load(str(folders["neox"]))
    stream, eos, documents, size = token_stream(VALIDATION[:5], str(folders["neox"] / "tokenizer.json"), 10**9)
    assert eos == tok.eos_id and documents == 5 and size == sum(len(t.encode()) for t in VALIDATION[:5])
    assert stream == [eos, *[i for t in VALIDATION[:5] for i in (*tok.encode(t), eos)]]


# -- the stage with tokenizer.pretrained -------------------------------------------------------------------------


def test_the_stage_copies_a_pretrained_folder_and_reports_it_without_training(
    folders: dict[str, Path], data: Storage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_training(**_: Any) -> None:
        raise AssertionError("a pretrained tokenizer must not be trained")

    out = Storage(str(tmp_path / "tokenizer"))
    # A trained tokenizer was there before: its tokenizer.model must not survive beside the new tokenizer.json.
    build_tokenizer(data, out, 300, 128, TokenizerConfig(sample_bytes=100_000))
    assert out.exists("tokenizer.model")
    monkeypatch.setattr(spm.SentencePieceTrainer, "train", no_training)
    source = str(folders["neox"])
    report = build_pretrained_tokenizer(data, out, source, 128, TokenizerConfig(), Tokenizer.load)
    tok = Tokenizer.load(source)
    names = sorted(p.name for p in folders["neox"].iterdir())
    assert sorted(out.list()) == sorted([*names, REPORT_FILE]) and not out.exists("tokenizer.model")
    for name in names:
        assert report["file_sha256"][name] == hashlib.sha256((folders["neox"] / name).read_bytes()).hexdigest()
    assert report["pretrained"] == {"source": source, "from": "local", "revision": None}
    assert report["tokenizer_sha256"] == tok.sha256 == Tokenizer.load(out.url).sha256
    assert report["vocab_size"] == tok.vocab_size and report["eos_id"] == tok.eos_id
    assert report["report_split"] == "validation" and report["texts"] == len(VALIDATION)
    assert report["bytes"] == sum(len(t.encode()) for t in VALIDATION)
    assert report["bytes_per_token"] == round(report["bytes"] / report["tokens"], 4) > 1
    assert report["byte_fallback_rate"] == 0.0 and report["round_trip_failures"] == 0
    assert "trainer_options" not in report and report["samples"]
    assert json.loads(Path(out.path(REPORT_FILE)).read_text()) == report

    llama = build_pretrained_tokenizer(data, out, str(folders["llama"]), 128, TokenizerConfig(), Tokenizer.load)
    assert llama["kind"] == "sentencepiece" and llama["defining_files"] == ["tokenizer.model"]
    assert 0 <= llama["byte_fallback_rate"] < 0.05 and llama["round_trip_failures"] == 0


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("./no/such/folder", r"tokenizer.pretrained='./no/such/folder': no such folder; point tokenizer.pretrained"),
        ("EMPTY", r"holds no tokenizer \(neither tokenizer.json nor tokenizer.model\); point tokenizer.pretrained"),
    ],
)
def test_a_source_without_a_tokenizer_is_one_clear_line(tmp_path: Path, source: str, message: str) -> None:
    if source == "EMPTY":
        source = str(tmp_path / "empty")
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "README.md").write_text("no tokenizer")
    with pytest.raises(ValueError, match=message) as caught:
        fetch_pretrained(source, str(tmp_path / "dest"))
    assert "\n" not in str(caught.value) and "or remove it to train a tokenizer" in str(caught.value)


def test_a_hub_name_comes_from_the_hub_cache_offline(
    folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = hub_cache(tmp_path / "hub", "test-org/neox-like", folders["neox"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = fetch_pretrained("test-org/neox-like", str(tmp_path / "dest"))
    assert info["from"] == "hub" and info["revision"] == "0123456789abcdef0123456789abcdef01234567"
    assert Tokenizer.load(str(tmp_path / "dest")).sha256 == Tokenizer.load(str(folders["neox"])).sha256
    with pytest.raises(ValueError, match=r"tokenizer.pretrained='test-org/absent'.*HF_HUB_OFFLINE is set") as caught:
        fetch_pretrained("test-org/absent", str(tmp_path / "dest2"))
    assert "\n" not in str(caught.value)


# -- the model's vocabulary follows the tokenizer -------------------------------------------------------------


def test_with_a_pretrained_tokenizer_the_model_vocabulary_is_the_tokenizers_padded_to_the_multiple() -> None:
    cfg = load_config("tiny", {"tokenizer.pretrained": "EleutherAI/gpt-neox-20b", "model.vocab_multiple": 128})
    followed, change = model_follows_tokenizer(cfg, 50277)
    assert followed.model.vocab_size == 50277 and followed.model.padded_vocab_size == 50304
    assert (
        change == f"model.vocab_size {cfg.model.vocab_size} -> 50277 (the tokenizer's), padded to 50304 rows by "
        "model.vocab_multiple=128"
    )
    assert model_follows_tokenizer(followed, 50277) == (followed, None)
    # Everything else stays the config's.
    assert followed.model_dump(exclude={"model": {"vocab_size"}}) == cfg.model_dump(exclude={"model": {"vocab_size"}})


def test_a_trained_tokenizer_keeps_the_config_and_one_larger_than_the_model_is_refused() -> None:
    cfg = load_config("tiny")
    assert model_follows_tokenizer(cfg, cfg.model.vocab_size) == (cfg, None)
    with pytest.raises(ValueError, match="re-run the train-tokenizer stage"):
        model_follows_tokenizer(cfg, cfg.model.vocab_size + 1)


def test_a_padded_vocabulary_that_does_not_divide_over_the_tensor_ranks_is_refused() -> None:
    tp2 = {"tokenizer.pretrained": "x/y", "parallelism.tensor": 2, "job.processes_per_node": 2}
    cfg = load_config("tiny", tp2)
    with pytest.raises(ConfigError, match=r"does not divide over parallelism\.tensor=2"):
        model_follows_tokenizer(cfg, 50277)


def test_the_stage_cache_key_input_changes_with_the_tokenizer_files(folders: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(folders["neox"], copy)
    before = pretrained_fingerprint(str(copy))
    assert before == pretrained_fingerprint(str(copy)) and before["source"] == str(copy)
    assert before["sha256"] == Tokenizer.load(str(copy)).sha256
    (copy / "README.md").write_text("not a tokenizer file")
    assert pretrained_fingerprint(str(copy)) == before
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "doc"}))
    assert pretrained_fingerprint(str(copy))["sha256"] != before["sha256"]


def test_the_dry_runs_note_says_where_the_vocabulary_comes_from() -> None:
    assert vocabulary_note(load_config("tiny")) is None
    cfg = load_config("tiny", {"tokenizer.pretrained": "EleutherAI/gpt-neox-20b", "model.vocab_multiple": 128})
    note = vocabulary_note(cfg)
    assert note is not None and "model.vocab_size comes from tokenizer.pretrained=EleutherAI/gpt-neox-20b" in note
    assert f"model.vocab_size={cfg.model.vocab_size} ({cfg.model.padded_vocab_size} rows)" in note


class _NoSuchRepo(http.server.BaseHTTPRequestHandler):
    """A hub on 127.0.0.1 that answers every request as the real one answers a repository that does not exist."""

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("X-Error-Message", "Repository not found")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("backend", ["local", "sagemaker"])
def test_preflight_leaves_a_hub_that_does_not_answer_unchecked_for_sagemaker_and_fails_a_name_it_does_not_have(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    from hlat.infra.checks.sources import tokenizer_finding

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:1")  # nothing listens: no answer
    silent = tokenizer_finding("test-org/neox-like", backend)
    assert silent.ok == (backend == "sagemaker") and silent.checked == (backend == "local"), silent
    expected = "does not answer from here" if backend == "sagemaker" else "tokenizer.pretrained='test-org/neox-like'"
    assert expected in silent.message and "\n" not in silent.message
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        missing = tokenizer_finding("test-org/no-such-tokenizer", backend)
    finally:
        server.shutdown()
    assert not missing.ok and missing.checked, missing  # a wrong name fails wherever the stage will run
    assert "tokenizer.pretrained='test-org/no-such-tokenizer'" in missing.message and "\n" not in missing.message
