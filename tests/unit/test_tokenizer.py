"""The tokenizer stage on a small real corpus: real sentencepiece training and a real Hugging Face export."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may come from the hub

import argparse
import calendar
import collections
import dataclasses
import fractions
import functools
import inspect
import itertools
import json
import random
import string
import textwrap
import typing
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm

from hlat.core.config import TokenizerConfig
from hlat.core.layout import MANIFEST_FILE, REPORT_FILE
from hlat.core.shards import DataManifest, ShardWriter
from hlat.core.storage import Storage, StorageNotFound
from hlat.infra.inputs.tokenizer import (
    MODEL_FILE,
    build_tokenizer,
    tokenizer_report,
    train_sentencepiece,
    training_lines,
)

VOCAB = 512
MAX_SEQ = 1024
TRAIN_MODULES = [argparse, textwrap, collections, typing, dataclasses, functools, string, json]
VALIDATION_MODULES = [calendar, fractions]

TRICKY_TEXTS = [
    "",
    " ",
    "   ",
    " leading space",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple   inner    spaces",
    "\ttabs\tand\t\ttabs\t",
    "\n",
    "\n\nblank lines around\n\n",
    "windows\r\nline\r\nends\r\n",
    "lonely\rcarriage return",
    "日本語のテキストと中文和한국어",
    "👍 👨‍👩‍👧‍👦 🏳️‍🌈 👋🏽 🇫🇷🇯🇵🇺🇳",
    "e\u0301 a\u0308\u0304 Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇",
    "Å (precomposed) vs Å (combining)",
    "שלום עולם, مرحبا بالعالم",
    "\u202eright-to-left override\u202c and \u200f marks",
    "\x00nul \x01\x02\x1f\x7f controls \x1b[31mred\x1b[0m",
    "\u200b\u200c\u200d\ufeff zero width",
    "ﬁ ligature, Ｆｕｌｌｗｉｄｔｈ, ① and ½: NFKC would change these",
    "\u00a0no-break\u3000ideographic\u2028line\u2029paragraph\x85next",
    "1234567890 3.14159e-10 0x1F 1,000,000",
    "def f(x):\n    return x  # comment\n\n\tif y:\n\t\tpass\n        deeply()\n",
    "<s> </s> <unk> <0x41> <pad> look like special tokens",
    "ᚠᛇᚻ᛫ᛒᛦᚦ runes, 𓀀𓀁 hieroglyphs, \ue000 private use, \U0010fffd last plane",
    "x" * 3000,
    " " * 200,
]

CODE_POINT_RANGES = [
    (0x20, 0x7E),  # ASCII
    (0x00, 0x1F),  # C0 controls
    (0x80, 0x2FF),  # Latin-1, Latin extended
    (0x300, 0x36F),  # combining marks
    (0x370, 0x52F),  # Greek, Cyrillic
    (0x590, 0x6FF),  # Hebrew, Arabic
    (0x900, 0x97F),  # Devanagari
    (0x2000, 0x206F),  # general punctuation, bidi controls
    (0x3000, 0x30FF),  # CJK punctuation, kana
    (0x4E00, 0x9FFF),  # CJK ideographs
    (0xAC00, 0xD7A3),  # Hangul
    (0xE000, 0xF8FF),  # private use
    (0xFE00, 0xFFFD),  # variation selectors, specials
    (0x1F300, 0x1FAFF),  # emoji
    (0x10000, 0x10FFFF),  # every astral plane
]


def random_texts(count: int, seed: int = 1234) -> list[str]:
    """Seeded random strings over many scripts (no surrogates: not text; no U+2581: see its own test)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        chars = []
        for _ in range(rng.randint(0, 60)):
            roll = rng.random()
            if roll < 0.15:
                chars.append(" " * rng.randint(1, 4))
            elif roll < 0.25:
                chars.append(rng.choice(["\n", "\t", "\r\n", "def ", "return ", "self"]))
            else:
                chars.append(chr(rng.randint(*rng.choice(CODE_POINT_RANGES))))
        texts.append("".join(chars).replace("\u2581", " "))
    return texts


def write_prepared_data(root: Path, train: list[str], validation: list[str]) -> Storage:
    """A prepared-data folder as prepare-data leaves it: shards plus data/manifest.json."""
    data = Storage(str(root / "data"))
    writer = ShardWriter(data, "shards-test", "parquet", shard_rows=3)
    for text in train:
        writer.add(text, "train")
    for text in validation:
        writer.add(text, "validation")
    manifest = DataManifest(fingerprint="test", format="parquet", shards=writer.close())
    data.write_json(MANIFEST_FILE, manifest.model_dump(mode="json"))
    return data


class RecordingStorage(Storage):
    """Local storage that remembers the order in which objects were written."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.writes: list[str] = []

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.writes.append(rel)
        super().write_bytes(rel, data)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tok")
    data = write_prepared_data(
        root,
        [inspect.getsource(m) for m in TRAIN_MODULES],
        [inspect.getsource(m) for m in VALIDATION_MODULES],
    )
    out = RecordingStorage(str(root / "tokenizer"))
    report = build_tokenizer(data, out, VOCAB, MAX_SEQ, TokenizerConfig())
    return {"root": root, "data": data, "out": out, "report": report}


@pytest.fixture(scope="module")
def sp(built: dict[str, Any]) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=built["out"].path(MODEL_FILE))


@pytest.fixture(scope="module")
def hf(built: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built["out"].url)


def assert_exact(sp: spm.SentencePieceProcessor, hf: Any, text: str) -> None:
    ids = sp.encode(text)
    assert sp.decode(ids) == text
    assert hf.encode(text, add_special_tokens=False, verbose=False) == ids
    assert hf(text, verbose=False)["input_ids"] == [sp.bos_id(), *ids]
    assert hf.decode(ids) == text
    assert hf.decode([sp.bos_id(), *ids], skip_special_tokens=True) == text


# -- the stage ---------------------------------------------------------------------------------------------


def test_build_writes_the_files_and_report_json_last(built: dict[str, Any]) -> None:
    out, report = built["out"], built["report"]
    assert set(out.list()) == {MODEL_FILE, "tokenizer.json", "tokenizer_config.json", REPORT_FILE}
    assert out.writes[-1] == REPORT_FILE
    assert out.writes[0] == MODEL_FILE
    assert out.read_json(REPORT_FILE) == json.loads(json.dumps(report))
    manifest = DataManifest.model_validate(built["data"].read_json(MANIFEST_FILE))
    assert report["data_checksum"] == manifest.checksum
    assert report["report_split"] == "validation"
    assert "report_note" not in report
    assert report["hf_id_mismatches"] == 0
    assert report["round_trip_failures"] == 0
    assert report["unk_count"] == 0
    assert 0 < report["training_bytes"] <= TokenizerConfig().sample_bytes
    assert report["trainer_options"]["vocab_size"] == VOCAB
    assert report["files"] == [MODEL_FILE, "tokenizer.json", "tokenizer_config.json", REPORT_FILE]
    for sample in report["samples"]:
        assert sample["text"] and len(sample["ids"]) == len(sample["pieces"]) > 0


def test_vocab_size_is_exact(built: dict[str, Any], sp: spm.SentencePieceProcessor, hf: Any) -> None:
    assert sp.get_piece_size() == VOCAB
    assert built["report"]["vocab_size"] == VOCAB
    assert hf.vocab_size == VOCAB and len(hf) == VOCAB
    assert len(json.loads(built["out"].read_text("tokenizer.json"))["model"]["vocab"]) == VOCAB
    assert [sp.id_to_piece(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]


def test_newlines_are_learned_not_left_to_byte_fallback(sp: spm.SentencePieceProcessor) -> None:
    assert sp.piece_to_id("\n") != sp.unk_id()
    assert not any(sp.is_byte(i) for i in sp.encode("x = 1\ny = 2\n"))


def test_hf_tokenizer_loads_offline_as_fast_llama(built: dict[str, Any], hf: Any) -> None:
    assert type(hf).__name__ == "LlamaTokenizer"
    assert hf.is_fast
    assert hf.model_max_length == MAX_SEQ
    assert (hf.unk_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert hf.eos_token == "</s>" and hf.pad_token is None
    assert hf.clean_up_tokenization_spaces is False
    ids = hf.encode("hello world")
    assert ids[0] == hf.bos_token_id and ids[-1] != hf.eos_token_id
    config = json.loads(built["out"].read_text("tokenizer_config.json"))
    assert config["tokenizer_class"] == "LlamaTokenizer"
    assert config["add_bos_token"] is True and config["add_eos_token"] is False


# -- exactness ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TRICKY_TEXTS, ids=range(len(TRICKY_TEXTS)))
def test_tricky_texts_round_trip_with_identical_ids(sp: spm.SentencePieceProcessor, hf: Any, text: str) -> None:
    assert_exact(sp, hf, text)


def test_random_unicode_round_trips_with_identical_ids(sp: spm.SentencePieceProcessor, hf: Any) -> None:
    for text in random_texts(400):
        assert_exact(sp, hf, text)


def test_in_domain_text_round_trips_with_identical_ids(sp: spm.SentencePieceProcessor, hf: Any) -> None:
    source = inspect.getsource(fractions)
    rng = random.Random(7)
    for _ in range(100):
        start = rng.randrange(len(source))
        assert_exact(sp, hf, source[start : start + rng.randint(0, 400)])
    assert_exact(sp, hf, source)


def test_literal_metaspace_character_decodes_as_space(sp: spm.SentencePieceProcessor, hf: Any) -> None:
    # The one documented exception: U+2581 is sentencepiece's whitespace symbol. The ids still agree.
    text = "a\u2581b \u2581"
    ids = sp.encode(text)
    assert hf.encode(text, add_special_tokens=False) == ids
    assert sp.decode(ids) == hf.decode(ids) == "a b  "


def test_without_byte_fallback_ids_still_match_and_unknown_text_is_unk(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    data = write_prepared_data(tmp_path, [inspect.getsource(m) for m in TRAIN_MODULES], ["日本語 and é"])
    out = Storage(str(tmp_path / "tok"))
    report = build_tokenizer(data, out, 400, MAX_SEQ, TokenizerConfig(byte_fallback=False))
    assert report["unk_count"] > 0 and report["byte_fallback_rate"] == 0
    assert report["round_trip_failures"] == 1 and report["hf_id_mismatches"] == 0
    sp = spm.SentencePieceProcessor(model_file=out.path(MODEL_FILE))
    hf = AutoTokenizer.from_pretrained(out.url)
    assert hf.model_max_length == MAX_SEQ
    for text in TRICKY_TEXTS + random_texts(200):
        ids = sp.encode(text)
        assert hf.encode(text, verbose=False) == [sp.bos_id(), *ids]
        if sp.unk_id() not in ids:
            assert hf.decode(ids) == sp.decode(ids) == text


# -- report ------------------------------------------------------------------------------------------------


def test_byte_fallback_is_rare_in_domain_and_common_for_unseen_scripts(built: dict[str, Any]) -> None:
    model = built["out"].path(MODEL_FILE)
    assert built["report"]["byte_fallback_rate"] < 0.02
    unseen = tokenizer_report(model, ["ᚠᛇᚻ᛫ᛒᛦᚦ", "日本語のテキストです", "𓀀𓀁𓀂", "🙂🙃👨‍👩‍👧"], 10_000)
    assert unseen["byte_fallback_rate"] > 0.9
    assert unseen["unk_count"] == 0 and unseen["round_trip_failures"] == 0
    json.dumps(unseen)


def test_report_is_bounded_by_report_sample_bytes(built: dict[str, Any]) -> None:
    report = tokenizer_report(built["out"].path(MODEL_FILE), itertools.repeat("é" * 100), 1001, n_samples=2)
    assert report["bytes"] == 1000  # no cut through the 2-byte character that would cross the bound
    assert report["texts"] == 5 and len(report["samples"]) == 2
    assert report["bytes_per_token"] == round(report["bytes"] / report["tokens"], 4)


def test_report_falls_back_to_train_without_validation(tmp_path: Path) -> None:
    data = write_prepared_data(tmp_path, [inspect.getsource(m) for m in TRAIN_MODULES], [])
    report = build_tokenizer(data, Storage(str(tmp_path / "tok")), 400, MAX_SEQ, TokenizerConfig())
    assert report["report_split"] == "train"
    assert "no validation split" in report["report_note"]
    assert report["texts"] > 0 and report["vocab_size"] == 400


# -- training ----------------------------------------------------------------------------------------------


def test_training_is_deterministic(tmp_path: Path) -> None:
    texts = [inspect.getsource(m) for m in TRAIN_MODULES[:4]]
    cfg = TokenizerConfig(sample_bytes=200_000)

    def model_bytes(name: str, threads: int | None) -> bytes:
        lines = training_lines(iter(texts), cfg.sample_bytes, cfg.max_sentence_length)
        path = train_sentencepiece(lines, 400, cfg.model_copy(update={"threads": threads}), str(tmp_path / name))
        return Path(path).read_bytes()

    assert model_bytes("a", None) == model_bytes("b", None)
    # The thread count is recorded in the model, but it does not change the pieces.
    one, two = (spm.SentencePieceProcessor(model_proto=model_bytes(n, t)) for n, t in (("c", 1), ("d", 2)))
    assert [one.id_to_piece(i) for i in range(400)] == [two.id_to_piece(i) for i in range(400)]


def test_too_small_sample_says_what_to_change(tmp_path: Path) -> None:
    lines = iter(["hello world", "the quick brown fox jumps over the lazy dog"] * 20)
    with pytest.raises(ValueError, match=r"tokenizer\.sample_bytes.*model\.vocab_size"):
        train_sentencepiece(lines, 4096, TokenizerConfig(), str(tmp_path))


def test_too_small_sample_through_the_stage_publishes_nothing(tmp_path: Path) -> None:
    data = write_prepared_data(tmp_path, [inspect.getsource(m) for m in TRAIN_MODULES[:2]], [])
    out = Storage(str(tmp_path / "tok"))
    with pytest.raises(ValueError, match=r"too small.*tokenizer\.sample_bytes"):
        build_tokenizer(data, out, 4096, MAX_SEQ, TokenizerConfig(sample_bytes=1_000))
    assert not out.exists(REPORT_FILE)


def test_too_small_vocab_for_the_characters_says_what_to_change(tmp_path: Path) -> None:
    rng = random.Random(0)
    lines = iter(["".join(chr(rng.randint(0x4E00, 0x4EFF)) for _ in range(40)) for _ in range(300)])
    with pytest.raises(ValueError, match=r"model\.vocab_size.*tokenizer\.character_coverage"):
        train_sentencepiece(lines, 300, TokenizerConfig(character_coverage=1.0), str(tmp_path))


def test_no_training_text_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no training text"):
        train_sentencepiece(iter([]), 300, TokenizerConfig(), str(tmp_path))
    data = write_prepared_data(tmp_path, [], ["only validation text"])
    with pytest.raises(ValueError, match="no training documents"):
        build_tokenizer(data, Storage(str(tmp_path / "tok")), 300, MAX_SEQ, TokenizerConfig())


def test_missing_manifest_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StorageNotFound, match=r"manifest\.json does not exist: run the prepare-data stage"):
        build_tokenizer(
            Storage(str(tmp_path / "data")), Storage(str(tmp_path / "tok")), VOCAB, MAX_SEQ, TokenizerConfig()
        )


# -- training_lines ----------------------------------------------------------------------------------------


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def test_training_lines_stop_at_sample_bytes_on_an_endless_stream() -> None:
    endless = itertools.repeat("hello world\nsecond line\n" * 40)
    lines = list(training_lines(endless, 10_000, 256))
    assert sum(utf8_len(line) for line in lines) == 10_000
    assert all(0 < utf8_len(line) <= 256 for line in lines)


def test_training_lines_cut_the_last_sentence_on_a_character_boundary() -> None:
    lines = list(training_lines(["日本語" * 100], 10, 256))
    assert lines == ["日本語"]  # 9 bytes: a 4th character would cross the 10-byte bound


def test_long_lines_are_chunked_under_max_sentence_length_without_breaking_characters() -> None:
    line = "é" * 300 + "😀" * 100 + "a" * 10 + "中" * 100
    chunks = list(training_lines([line], 1_000_000, 257))
    assert "".join(chunks) == line
    assert all(254 <= utf8_len(c) <= 257 for c in chunks[:-1]) and 0 < utf8_len(chunks[-1]) <= 257
    for chunk in chunks:
        assert chunk.encode("utf-8").decode("utf-8") == chunk


def test_lines_are_packed_per_document_and_empty_lines_skipped() -> None:
    docs = ["\n\n\n", "", "first\n\nsecond\n", "other document", "a" * 10 + "\n" + "b" * 10]
    assert list(training_lines(docs, 10_000, 16)) == [
        "first\n\nsecond\n",
        "other document",
        "a" * 10,
        "b" * 10,
    ]


def test_training_lines_reject_impossible_bounds() -> None:
    with pytest.raises(ValueError, match="sample_bytes"):
        list(training_lines(["x"], 0, 256))
    with pytest.raises(ValueError, match="max_sentence_length"):
        list(training_lines(["x"], 100, 3))
