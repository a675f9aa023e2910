"""The online tokenize-and-pack loader against a slow reference, and its bit-exact resume.

A small corpus of generated documents (short ones, empty ones, ones that span many rows, odd characters) is
written as shards with the real ShardWriter and tokenized with a real sentencepiece model trained on it.
"""

from __future__ import annotations

import gc
import io
import itertools
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import torch

from hlat.core.config import TokenizerConfig
from hlat.core.layout import MANIFEST_FILE
from hlat.core.shards import DataManifest, ShardWriter
from hlat.core.storage import Storage
from hlat.infra.inputs.tokenizer import EOS_ID, train_sentencepiece, training_lines
from hlat.training.data.loader import Batch, PackedLoader, epoch_plan

SEED = 7
SEQ, MB = 32, 2  # 64 targets per batch: short enough that long documents span many batches
WORDS = [
    *("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this"),
    *("are", "from", "or", "an", "at", "which", "not", "have", "data", "model", "token", "shard", "epoch"),
    *("rank", "resume", "batch", "loader", "packed", "stream", "document", "value", "error", "return", "def"),
]


def make_docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        long = rng.random() < 0.08
        words = [rng.choice(WORDS) for _ in range(rng.randint(300, 600) if long else rng.randint(0, 40))]
        for j in range(5, len(words), rng.randint(6, 14)):
            words[j] += rng.choice([".", ",", ":\n", "\n\n    ", "()", " 42;"])
        docs.append(f"doc {i} " + " ".join(words))
    docs[3] = ""  # an empty document is just its EOS
    docs[5] = "doc 5 line\u2028separator, caf\u00e9 \u00fcber \u65e5\u672c \U0001f600 tab\tend"
    return docs


def write_data(root: Path, train: list[str], validation: list[str], fmt: str = "parquet", rows: int = 13) -> Storage:
    data = Storage(str(root))
    writer = ShardWriter(data, "shards", fmt, rows)  # type: ignore[arg-type]
    for text in train:
        writer.add(text, "train")
    for text in validation:
        writer.add(text, "validation")
    manifest = DataManifest(fingerprint="test", format=fmt, shards=writer.close())
    data.write_json(MANIFEST_FILE, manifest.model_dump(mode="json"))
    return data


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("loader")
    train, validation = make_docs(120, 1), make_docs(9, 2)
    model = train_sentencepiece(training_lines(train, 10**6, 4096), 512, TokenizerConfig(), str(root / "tok"))
    return {
        "root": root,
        "train": train,
        "model": model,
        "sp": spm.SentencePieceProcessor(model_file=model),
        "parquet": write_data(root / "parquet", train, validation),
        "jsonl": write_data(root / "jsonl", train, validation, fmt="jsonl", rows=17),
    }


def loader(corpus: dict[str, Any], fmt: str = "parquet", **kw: Any) -> PackedLoader:
    args: dict[str, Any] = {"seq_len": SEQ, "micro_batch_size": MB, "seed": SEED, **kw}
    return PackedLoader(corpus[fmt], corpus["model"], **args)


def take(it: PackedLoader, n: int) -> list[Batch]:
    return [next(it) for _ in range(n)]


def stream_of(batches: list[Batch]) -> list[int]:
    """The token stream the batches were cut from: the first input, then every target in order."""
    return [int(batches[0].inputs[0, 0]), *(t for b in batches for t in b.targets.flatten().tolist())]


def shard_texts(data: Storage, fmt: str, path: str) -> list[str]:
    if fmt == "parquet":
        return pq.read_table(io.BytesIO(data.read_bytes(path))).column("text").to_pylist()
    # Not core.shards.iter_documents: its str.splitlines() also splits at U+2028, which json leaves unescaped.
    return [json.loads(line)["text"] for line in data.read_text(path).split("\n") if line]


def reference_stream(
    data: Storage, sp: spm.SentencePieceProcessor, epoch: int, rank: int = 0, dp: int = 1
) -> list[int]:
    """Slow, obvious version of the documented order: shuffle shards, then rows, with seed * 1_000_003 + epoch;
    document g (in that order) belongs to rank g % dp; each is encoded and followed by EOS."""
    manifest = DataManifest.model_validate(data.read_json(MANIFEST_FILE))
    shards = [s for s in manifest.shards if s.split == "train"]
    rng = random.Random(SEED * 1_000_003 + epoch)
    order = list(range(len(shards)))
    rng.shuffle(order)
    row_seeds = [rng.getrandbits(64) for _ in shards]
    out: list[int] = []
    g = 0
    for pos, index in enumerate(order):
        texts = shard_texts(data, manifest.format, shards[index].path)
        perm = list(range(len(texts)))
        random.Random(row_seeds[pos]).shuffle(perm)
        for k in range(len(texts)):
            if g % dp == rank:
                out += [*sp.encode(texts[perm[k]]), EOS_ID]
            g += 1
    return out


def split_docs(stream: list[int]) -> list[tuple[int, ...]]:
    docs, cur = [], []
    for t in stream:
        cur.append(t)
        if t == EOS_ID:
            docs.append(tuple(cur))
            cur = []
    return docs


def assert_same(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
        assert x.state == y.state


# -- packing ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_stream_is_the_tokenized_documents_in_epoch_order_without_padding(corpus: dict[str, Any], fmt: str) -> None:
    ref = reference_stream(corpus[fmt], corpus["sp"], 0) + reference_stream(corpus[fmt], corpus["sp"], 1)
    with loader(corpus, fmt) as it:
        batches = take(it, len(ref) // (SEQ * MB) - 1)
    for b in batches:
        assert b.inputs.shape == b.targets.shape == (MB, SEQ)
        assert b.inputs.dtype == b.targets.dtype == torch.long
        assert b.doc_ids is None
        assert int(b.inputs.min()) >= 0 and int(b.inputs.max()) < 512  # real ids only: nothing is padding
        assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])  # targets are the inputs shifted by one
        assert torch.equal(b.inputs[1:, 0], b.targets[:-1, -1])  # rows overlap by one token
    for prev, nxt in itertools.pairwise(batches):
        assert int(nxt.inputs[0, 0]) == int(prev.targets[-1, -1])  # ... across batches too (carried)
    stream = stream_of(batches)
    assert stream == ref[: len(stream)]  # across shards and the epoch boundary
    # EOS separates the documents, and they come back as written.
    texts = [corpus["sp"].decode(list(d[:-1])) for d in split_docs(stream)]
    assert set(texts[:120]) == set(corpus["train"])


def test_document_masking_ids_start_after_each_eos(corpus: dict[str, Any]) -> None:
    with loader(corpus, document_masking=True) as it:
        batches = take(it, 40)
    seen_boundary = False
    for b in batches:
        assert b.doc_ids is not None and b.doc_ids.shape == (MB, SEQ) and b.doc_ids.dtype == torch.long
        for row, ids in zip(b.inputs.tolist(), b.doc_ids.tolist(), strict=True):
            expected = [sum(1 for t in row[:j] if t == EOS_ID) for j in range(SEQ)]
            assert ids == expected
            seen_boundary |= ids[-1] > 0
    assert seen_boundary


# -- order and ranks --------------------------------------------------------------------------------------
def test_epochs_reshuffle_and_the_same_seed_and_epoch_give_the_same_order(corpus: dict[str, Any]) -> None:
    with loader(corpus) as it:
        stream = stream_of(take(it, 2 * len(reference_stream(corpus["parquet"], corpus["sp"], 0)) // (SEQ * MB) + 2))
    docs = split_docs(stream)
    epoch0, epoch1 = docs[:120], docs[120:240]
    assert len(epoch1) == 120 and sorted(epoch0) == sorted(epoch1) and len(set(epoch0)) == 120
    assert epoch0 != epoch1
    with loader(corpus, prefetch=1) as again:
        assert stream_of(take(again, 30)) == stream[: 30 * SEQ * MB + 1]
    with loader(corpus, seed=SEED + 1) as other:
        assert stream_of(take(other, 30)) != stream[: 30 * SEQ * MB + 1]
    assert epoch_plan(SEED, 3, 10) == epoch_plan(SEED, 3, 10) != epoch_plan(SEED, 4, 10)


def test_two_ranks_see_disjoint_documents_that_cover_the_epoch(corpus: dict[str, Any]) -> None:
    per_rank = []
    for rank in (0, 1):
        ref = reference_stream(corpus["parquet"], corpus["sp"], 0, rank, 2)
        with loader(corpus, data_rank=rank, data_degree=2) as it:
            stream = stream_of(take(it, len(ref) // (SEQ * MB) + 2))
        assert stream[: len(ref)] == ref
        per_rank.append(set(split_docs(stream)[:60]))
    assert not per_rank[0] & per_rank[1]
    everything = {(*corpus["sp"].encode(t), EOS_ID) for t in corpus["train"]}
    assert per_rank[0] | per_rank[1] == everything


# -- resume -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("rank", "dp"), [(0, 1), (1, 2)])
def test_resume_is_bit_exact_at_any_batch(corpus: dict[str, Any], rank: int, dp: int) -> None:
    per_epoch = len(reference_stream(corpus["parquet"], corpus["sp"], 0, rank, dp)) // (SEQ * MB)
    with loader(corpus, data_rank=rank, data_degree=dp, prefetch=4) as it:
        straight = take(it, per_epoch + 12)
    # Each batch's state was attached while the producer ran up to four batches ahead.
    mid_document = next(i for i, b in enumerate(straight) if b.state["sources"][0]["offset"] > 0)
    crossing = next(i for i, b in enumerate(straight) if b.state["sources"][0]["epoch"] == 1) - 2
    for n in sorted({1, mid_document + 1, crossing, per_epoch + 1}):
        saved = json.loads(json.dumps(straight[n - 1].state))
        with loader(corpus, data_rank=rank, data_degree=dp, prefetch=2) as resumed:
            resumed.load_state_dict(saved)
            assert_same(take(resumed, 6), straight[n : n + 6])
    # The last resume above ran across the epoch boundary.
    assert straight[crossing + 5].state["sources"][0]["epoch"] == 1
    # A state saved before the degrees had one name each (dp_rank, dp_size) resumes the same way.
    old = {{"data_rank": "dp_rank", "data_degree": "dp_size"}.get(k, k): v for k, v in straight[4].state.items()}
    with loader(corpus, data_rank=rank, data_degree=dp, prefetch=2) as resumed:
        resumed.load_state_dict(old)
        assert_same(take(resumed, 3), straight[5:8])


def test_state_dict_follows_the_consumer_not_the_producer(corpus: dict[str, Any]) -> None:
    with loader(corpus, prefetch=4) as it:
        fresh = it.state_dict()
        (position,) = fresh["sources"]
        assert fresh["carry"] == [] and fresh["current"] is None
        assert [position[k] for k in ("epoch", "shard", "row", "offset", "tokens")] == [0, 0, 0, 0, 0]
        batches = take(it, 5)
        time.sleep(0.2)  # let the producer run ahead
        state = it.state_dict()
        assert state == batches[-1].state and state["batches"] == 5
        assert json.loads(json.dumps(state)) == state
        assert set(state) >= {"sources", "current", "mix", "carry", "data_rank", "data_degree", "seq_len"}
        assert set(state) >= {"micro_batch_size", "seed", "split", "data_fingerprint"}
        # Loading into a running loader drops what it had built ahead.
        it.load_state_dict(batches[1].state)
        assert_same(take(it, 3), batches[2:5])


def test_resume_from_the_initial_state_and_with_another_sequence_length(corpus: dict[str, Any]) -> None:
    with loader(corpus) as it:
        first = take(it, 6)
    with loader(corpus) as again:
        again.load_state_dict(again.state_dict())
        assert_same(take(again, 6), first)
    # The stream position does not depend on the shape: a new seq_len continues the same stream.
    with loader(corpus, seq_len=16, micro_batch_size=3) as reshaped:
        reshaped.load_state_dict(first[1].state)
        more = take(reshaped, 3)
    assert more[0].inputs.shape == (3, 16) and more[0].state["seq_len"] == 16
    stream = stream_of(first)
    assert stream_of(more) == stream[2 * SEQ * MB : 2 * SEQ * MB + 3 * 3 * 16 + 1]


def test_resume_refuses_a_changed_data_parallel_size(corpus: dict[str, Any]) -> None:
    with loader(corpus, data_rank=1, data_degree=2) as it:
        take(it, 2)
        state = it.state_dict()
    with (
        loader(corpus, data_rank=1, data_degree=4) as other,
        pytest.raises(ValueError, match=r"data-parallel size 2 .* has 4: resharding on a changed DP degree"),
    ):
        other.load_state_dict(state)
    with loader(corpus, data_rank=0, data_degree=2) as wrong_rank, pytest.raises(ValueError, match="rank 1, not 0"):
        wrong_rank.load_state_dict(state)


def test_resume_refuses_other_data_tokenizer_seed_or_split(corpus: dict[str, Any], tmp_path: Path) -> None:
    with loader(corpus) as it:
        take(it, 2)
        state = it.state_dict()
    changed = [*corpus["train"][:-1], corpus["train"][-1] + " changed"]
    other = write_data(tmp_path / "other", changed, [])
    with PackedLoader(other, corpus["model"], SEQ, MB, SEED) as on_other:
        with pytest.raises(ValueError, match="different data"):
            on_other.load_state_dict(state)
        assert on_other.state_dict()["batches"] == 0
    with loader(corpus, fmt="jsonl") as jsonl, pytest.raises(ValueError, match="different data"):
        jsonl.load_state_dict(state)
    other_model = train_sentencepiece(training_lines(changed, 10**6, 4096), 520, TokenizerConfig(), str(tmp_path))
    with PackedLoader(corpus["parquet"], other_model, SEQ, MB, SEED) as tok, pytest.raises(ValueError, match="token"):
        tok.load_state_dict(state)
    with loader(corpus, seed=SEED + 1) as seeded, pytest.raises(ValueError, match="seed=7"):
        seeded.load_state_dict(state)
    with loader(corpus, split="validation") as val, pytest.raises(ValueError, match="different data"):
        val.load_state_dict(state)
    with loader(corpus) as same, pytest.raises(ValueError, match="version"):
        same.load_state_dict({**state, "version": 99})


def test_validation_split_and_bad_arguments(corpus: dict[str, Any], tmp_path: Path) -> None:
    with loader(corpus, split="validation") as val:
        batches = take(val, 30)  # 9 short documents: many epochs
    assert batches[-1].state["sources"][0]["epoch"] > 1 and batches[-1].state["split"] == "validation"
    with pytest.raises(ValueError, match="data_rank"):
        loader(corpus, data_rank=2, data_degree=2)
    with pytest.raises(ValueError, match="too few for 16 data-parallel ranks"):
        loader(corpus, split="validation", data_rank=12, data_degree=16)
    no_val = write_data(tmp_path / "noval", ["just one document"], [])
    with pytest.raises(ValueError, match="no 'validation' documents"):
        PackedLoader(no_val, corpus["model"], SEQ, MB, SEED, split="validation")


# -- the producer thread ----------------------------------------------------------------------------------
def copy_data(src: Storage, dst: Path) -> Storage:
    out = Storage(str(dst))
    for rel in src.walk_files():
        out.write_bytes(rel, src.read_bytes(rel))
    return out


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hlat-packed-loader")]


def test_a_producer_exception_surfaces_in_the_consumer(corpus: dict[str, Any], tmp_path: Path) -> None:
    data = copy_data(corpus["parquet"], tmp_path / "data")
    manifest = DataManifest.model_validate(data.read_json(MANIFEST_FILE))
    shards = [s for s in manifest.shards if s.split == "train"]
    second = shards[epoch_plan(SEED, 0, len(shards))[0][1]]
    data.write_bytes(second.path, data.read_bytes(second.path) + b"corrupt")
    it = PackedLoader(data, corpus["model"], SEQ, MB, SEED, prefetch=2)
    got = 0
    with pytest.raises(ValueError, match="does not match its checksum"):
        for _ in it:
            got += 1
    assert got > 0  # the first shard's batches came through before the second shard failed
    assert it._worker is None and not loader_threads()
    with pytest.raises(ValueError, match="does not match its checksum"):
        next(it)  # a retry starts again from the last good batch, and meets the same fault
    it.close()


def test_close_and_garbage_collection_stop_the_thread(corpus: dict[str, Any]) -> None:
    it = loader(corpus, prefetch=2)
    next(it)
    (thread,) = loader_threads()
    assert thread.daemon and thread.is_alive()
    it.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        next(it)

    dropped = loader(corpus, prefetch=2)
    next(dropped)
    (thread,) = loader_threads()
    del dropped
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


@pytest.mark.slow
def test_loader_benchmark_runs_against_its_peer() -> None:
    from benchmarks.bench_loader import main

    out = main(["--mb", "0.3", "--vocab", "600", "--seq-len", "128", "--micro-batch", "4", "--repeats", "1"])
    assert "PackedLoader" in out and "group_texts" in out
