"""The loader over a mixture of prepared sources: the mixing rule against a slow reference, the 2-point window
rule on real sentencepiece, the weight schedule, per-source token counts, and bit-exact resume.

Each source is written as prepare-data writes one (core.shards.write_shard and a DataManifest in its own folder),
and the run's data folder holds the MixtureManifest that lists them.
"""

from __future__ import annotations

import io
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import torch

from hlat.core.config import TokenizerConfig
from hlat.core.layout import MANIFEST_FILE, REPORT_FILE
from hlat.core.run import Run
from hlat.core.shards import DataManifest, MixtureManifest, MixtureSource, write_shard
from hlat.core.storage import Storage
from hlat.infra.inputs.tokenizer import EOS_ID, train_sentencepiece, training_lines
from hlat.training.data.loader import SEED_STRIDE, Batch, PackedLoader, pick_source, source_seed

SEED = 11
WORDS = [
    *("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this"),
    *("wiki", "code", "paper", "river", "stone", "green", "fast", "lambda", "proof", "theorem", "city", "song"),
]


def make_docs(n: int, seed: int, tag: str, longest: int) -> list[str]:
    """Documents of varied lengths, from empty to `longest` words (a few long ones, many short)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = rng.randint(0, longest) if rng.random() < 0.1 else rng.randint(0, longest // 8)
        docs.append(f"{tag} {i} " + " ".join(rng.choice(WORDS) for _ in range(words)))
    return docs


def write_source(folder: Storage, train: list[str], validation: list[str], rows: int = 23) -> DataManifest:
    """One prepared source, as prepare-data writes it: shards of `rows` documents and its manifest."""
    shards = []
    for split, texts in (("train", train), ("validation", validation)):
        for n, start in enumerate(range(0, len(texts), rows)):
            rel = f"shards/{split}-{n:05d}.parquet"
            shards.append(write_shard(folder, rel, split, texts[start : start + rows], "parquet"))  # type: ignore[arg-type]
    manifest = DataManifest(fingerprint=f"fp-{folder.uri()}", format="parquet", shards=shards)
    folder.write_json(MANIFEST_FILE, manifest.model_dump(mode="json"))
    return manifest


def write_mixture(
    data: Storage, sources: list[tuple[str, float, Storage, DataManifest]], schedule: list[dict[str, Any]] | None = None
) -> Storage:
    """A run's data folder: the mixture manifest over prepared sources (name, weight, folder, manifest)."""
    entries = [
        MixtureSource(
            name=name, weight=weight, max_epochs=None, folder=folder.uri(), fingerprint=m.fingerprint,
            checksum=m.checksum, train_rows=m.rows("train"), validation_rows=m.rows("validation"),
            train_bytes=m.bytes("train"), validation_bytes=m.bytes("validation"),
        )
        for name, weight, folder, m in sources
    ]  # fmt: skip
    mixture = MixtureManifest(fingerprint="mix", sources=entries, schedule=schedule or [])
    data.write_json(MANIFEST_FILE, mixture.model_dump(mode="json"))
    return data


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mixture")
    texts = {
        "web": (make_docs(300, 1, "web", 400), make_docs(12, 2, "webval", 40)),
        "code": (make_docs(150, 3, "code", 300), make_docs(7, 4, "codeval", 40)),
        "books": (make_docs(60, 5, "books", 500), []),  # no validation split
    }
    every = [t for train, val in texts.values() for t in train + val]
    model = train_sentencepiece(training_lines(every, 10**6, 4096), 400, TokenizerConfig(), str(root / "tok"))
    sources = {}
    for name, (train, val) in texts.items():
        folder = Storage(str(root / "sources" / name))
        sources[name] = (folder, write_source(folder, train, val))
    return {"root": root, "model": model, "sp": spm.SentencePieceProcessor(model_file=model), "sources": sources}


def run_data(corpus: dict[str, Any], name: str, weights: dict[str, float], **kw: Any) -> Storage:
    parts = [(n, w, *corpus["sources"][n]) for n, w in weights.items()]
    return write_mixture(Storage(str(corpus["root"] / "runs" / name / "data")), parts, **kw)


def take(it: PackedLoader, n: int) -> list[Batch]:
    return [next(it) for _ in range(n)]


def stream_of(batches: list[Batch]) -> list[int]:
    return [int(batches[0].inputs[0, 0]), *(t for b in batches for t in b.targets.flatten().tolist())]


def assert_same(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
        assert x.source_tokens == y.source_tokens and x.state == y.state


def source_documents(folder: Storage, sp: spm.SentencePieceProcessor, index: int, epochs: int) -> list[list[int]]:
    """Slow, obvious order of one source (rank 0 of 1): shuffle its shards, then rows, from its own seed."""
    manifest = DataManifest.model_validate(folder.read_json(MANIFEST_FILE))
    shards = [s for s in manifest.shards if s.split == "train"]
    docs = []
    for epoch in range(epochs):
        rng = random.Random((SEED + index * 1_000_000_007) * 1_000_003 + epoch)
        order = list(range(len(shards)))
        rng.shuffle(order)
        row_seeds = [rng.getrandbits(64) for _ in shards]
        for pos, i in enumerate(order):
            texts = pq.read_table(io.BytesIO(folder.read_bytes(shards[i].path))).column("text").to_pylist()
            perm = list(range(len(texts)))
            random.Random(row_seeds[pos]).shuffle(perm)
            docs += [[*sp.encode(texts[k]), EOS_ID] for k in perm]
    return docs


def reference_mix(docs: list[list[list[int]]], weights: list[float], tokens: int) -> tuple[list[int], list[int]]:
    """The documented rule, spelled out: before each document, the largest deficit w_i * T - t_i (ties: first).
    Returns the stream and the source of each of its tokens."""
    drawn, nxt = [0] * len(docs), [0] * len(docs)
    stream: list[int] = []
    owner: list[int] = []
    while len(stream) < tokens:
        total = sum(drawn)
        deficits = [w * total - t if w > 0 else float("-inf") for w, t in zip(weights, drawn, strict=True)]
        i = deficits.index(max(deficits))
        doc = docs[i][nxt[i]]
        nxt[i] += 1
        drawn[i] += len(doc)
        stream += doc
        owner += [i] * len(doc)
    return stream, owner


# -- the rule ---------------------------------------------------------------------------------------------
def test_pick_source_takes_the_largest_deficit_first_index_on_ties_never_weight_zero() -> None:
    assert pick_source([0.5, 0.5], [0, 0]) == 0
    assert pick_source([0.5, 0.5], [10, 0]) == 1
    assert pick_source([0.0, 1.0], [0, 0]) == 1
    assert pick_source([0.0, 1.0], [0, 100]) == 1  # weight 0 is never picked, whatever its deficit
    assert pick_source([0.6, 0.3, 0.1], [60, 30, 10]) == 0
    with pytest.raises(ValueError, match="positive weight"):
        pick_source([0.0, 0.0], [0, 0])
    assert source_seed(SEED, 0) == SEED and source_seed(SEED, 1) != source_seed(SEED, 2)
    assert SEED_STRIDE == 1_000_003


def test_the_stream_and_its_source_counts_follow_the_rule(corpus: dict[str, Any]) -> None:
    weights = {"web": 0.6, "code": 0.3, "books": 0.1}
    data = run_data(corpus, "rule", weights)
    with PackedLoader(data, corpus["model"], 32, 2, SEED) as it:
        assert it.source_names == ["web", "code", "books"]
        batches = take(it, 300)
    docs = [source_documents(corpus["sources"][n][0], corpus["sp"], i, 3) for i, n in enumerate(weights)]
    stream, owner = reference_mix(docs, list(weights.values()), 300 * 64 + 1)
    assert stream_of(batches) == stream[: 300 * 64 + 1]
    for k, b in enumerate(batches):  # each target counted for the source whose document it belongs to
        mine = owner[1 + 64 * k : 1 + 64 * (k + 1)]
        assert b.source_tokens == [mine.count(i) for i in range(3)]
        assert sum(b.source_tokens) == 64
        assert [s["tokens"] for s in b.state["sources"]] == [
            sum(x.source_tokens[i] for x in batches[: k + 1]) for i in range(3)
        ]


def window_deviation(batches: list[Batch], weights: list[float], window: int) -> float:
    """The largest |share - weight| of any source over any `window` consecutive batches, in points."""
    prefix = [[0] * len(weights)]
    for b in batches:
        prefix.append([p + n for p, n in zip(prefix[-1], b.source_tokens, strict=True)])
    worst = 0.0
    for start in range(0, len(batches) - window + 1):
        sums = [e - s for s, e in zip(prefix[start], prefix[start + window], strict=True)]
        total = sum(sums)
        worst = max(worst, *(abs(s / total - w) * 100 for s, w in zip(sums, weights, strict=True)))
    return worst


def test_any_window_of_1000_sequences_is_within_2_points_of_the_weights(corpus: dict[str, Any]) -> None:
    """3 sources 0.6 / 0.3 / 0.1, documents from a few tokens to ~500 words, rows of 256 tokens (one per batch)."""
    data = run_data(corpus, "window", {"web": 0.6, "code": 0.3, "books": 0.1})
    with PackedLoader(data, corpus["model"], 256, 1, SEED) as it:
        batches = take(it, 2500)
    worst = window_deviation(batches, [0.6, 0.3, 0.1], 1000)
    print(f"window of 1000 rows x 256 tokens: worst deviation {worst:.3f} points")
    assert worst < 2.0
    longest = max(
        len(d) for i, n in enumerate(("web", "code", "books")) for d in source_documents(
            corpus["sources"][n][0], corpus["sp"], i, 1
        )
    )  # fmt: skip
    assert worst <= (3 + 2) * longest / (1000 * 256) * 100  # the docstring's bound


def test_weights_follow_the_schedule_by_optimizer_step(corpus: dict[str, Any]) -> None:
    """Weights change at step 300 = batch 600 with 2 micro-batches per step; weight 0 draws nothing."""
    schedule = [{"step": 300, "weights": {"web": 0.0, "code": 0.5, "books": 0.5}}]
    data = run_data(corpus, "schedule", {"web": 0.6, "code": 0.3, "books": 0.1}, schedule=schedule)
    with PackedLoader(data, corpus["model"], 128, 1, SEED, micro_batches_per_step=2, prefetch=8) as it:
        batches = take(it, 1200)
    assert window_deviation(batches[:600], [0.6, 0.3, 0.1], 500) < 2.5
    after = batches[600 + 2 :]  # the document in progress at the change ends first
    assert sum(b.source_tokens[0] for b in after) == 0
    assert window_deviation(after, [0.0, 0.5, 0.5], len(after)) < 2.0
    assert batches[-1].state["mix"]["weights"] == [0.0, 0.5, 0.5]


def test_validation_mixes_the_validation_splits_at_the_first_weights(corpus: dict[str, Any]) -> None:
    data = run_data(corpus, "val", {"web": 0.5, "code": 0.3, "books": 0.2})  # books has no validation split
    with PackedLoader(data, corpus["model"], 32, 1, SEED, split="validation") as val:
        batches = take(val, 400)
    web, code, books = (sum(b.source_tokens[i] for b in batches) for i in range(3))
    assert books == 0 and abs(web / (web + code) - 0.5 / 0.8) < 0.02
    assert batches[-1].state["split"] == "validation"
    # code has 7 validation documents: with 8 data ranks it is left out on every rank, web (12) is not.
    for rank in (0, 7):
        with PackedLoader(data, corpus["model"], 32, 1, SEED, split="validation", data_rank=rank, data_degree=8) as it:
            counts = [sum(c) for c in zip(*(b.source_tokens for b in take(it, 20)), strict=True)]
        assert counts[0] == 20 * 32 and counts[1:] == [0, 0]
    with pytest.raises(ValueError, match=r"source 'web' has 12, source 'code' has 7 documents, too few for 16"):
        PackedLoader(data, corpus["model"], 32, 1, SEED, split="validation", data_rank=0, data_degree=16)


def test_a_source_without_training_documents_but_with_weight_is_refused(corpus: dict[str, Any], tmp_path: Path) -> None:
    empty = Storage(str(tmp_path / "empty"))
    manifest = write_source(empty, [], ["only validation"])
    parts = [("web", 0.5, *corpus["sources"]["web"]), ("empty", 0.5, empty, manifest)]
    data = write_mixture(Storage(str(tmp_path / "data")), parts)
    with pytest.raises(ValueError, match=r"source 'empty' has weight 0\.5 at step 0 but no 'train' documents"):
        PackedLoader(data, corpus["model"], 32, 1, SEED)
    parts[1] = ("empty", 0.0, empty, manifest)
    with PackedLoader(write_mixture(data, parts), corpus["model"], 32, 1, SEED) as ok:
        assert next(ok).source_tokens[1] == 0


# -- resume -----------------------------------------------------------------------------------------------
def chained(data: Storage, model: str, cuts: list[int], total: int, **kw: Any) -> list[Batch]:
    """`total` batches from loaders each killed at the next cut and rebuilt from the state of its last batch."""
    out: list[Batch] = []
    state: dict[str, Any] | None = None
    for end in [*cuts, total]:
        with PackedLoader(data, model, 24, 2, SEED, prefetch=3, **kw) as it:
            if state is not None:
                it.load_state_dict(json.loads(json.dumps(state)))
            out += take(it, end - len(out))
            state = it.state_dict()
    return out


@pytest.mark.parametrize(
    ("weights", "rank", "dp"),
    [
        ({"web": 0.7, "code": 0.3}, 0, 1),
        ({"web": 0.6, "code": 0.3, "books": 0.1}, 0, 1),
        ({"web": 0.6, "code": 0.3, "books": 0.1}, 1, 2),
    ],
)
def test_resume_is_bit_exact_across_several_kills_and_a_schedule_change(
    corpus: dict[str, Any], weights: dict[str, float], rank: int, dp: int
) -> None:
    names = list(weights)
    schedule = [{"step": 40, "weights": {names[0]: 0.2, names[1]: 0.8}}]  # batch 120 with 3 micro-batches a step
    data = run_data(corpus, f"resume-{len(names)}-{rank}", weights, schedule=schedule)
    kw = {"data_rank": rank, "data_degree": dp, "micro_batches_per_step": 3}
    with PackedLoader(data, corpus["model"], 24, 2, SEED, prefetch=5, **kw) as it:
        straight = take(it, 260)
    inside = [i + 1 for i, b in enumerate(straight) if b.state["current"] is not None]
    cuts = sorted({7, inside[3], 119, 120, 121, inside[-5], 250})  # mid-document, around the change, late
    resumed = chained(data, corpus["model"], cuts, 260, **kw)
    assert_same(resumed, straight)
    assert straight[200].state["mix"]["weights"][:2] == [0.2, 0.8]
    epochs = [s["epoch"] for s in straight[-1].state["sources"]]
    assert max(epochs) >= 1  # some source rolled over into its next epoch along the way
    print(f"{len(names)} sources, rank {rank}/{dp}: resumed at {cuts}, 260 batches equal; epochs {epochs}")


def test_resume_refuses_other_sources_and_maps_a_version_1_state(corpus: dict[str, Any], tmp_path: Path) -> None:
    two = run_data(corpus, "two", {"web": 0.5, "code": 0.5})
    three = run_data(corpus, "three", {"web": 0.5, "code": 0.3, "books": 0.2})
    with PackedLoader(two, corpus["model"], 24, 2, SEED) as it:
        state = take(it, 3)[-1].state
    with PackedLoader(three, corpus["model"], 24, 2, SEED) as other, pytest.raises(ValueError, match="different data"):
        other.load_state_dict(state)
    with PackedLoader(two, corpus["model"], 24, 2, SEED) as same, pytest.raises(ValueError, match="malformed"):
        same.load_state_dict({**state, "current": 5})
    # A data folder from before mixtures (one DataManifest) is a one-source mixture, and its version-1 states load.
    folder, _ = corpus["sources"]["web"]
    old = Storage(str(tmp_path / "old"))
    for rel in folder.walk_files():
        old.write_bytes(rel, folder.read_bytes(rel))
    with PackedLoader(old, corpus["model"], 24, 2, SEED) as it:
        straight = take(it, 40)
    k = next(i for i, b in enumerate(straight) if b.state["current"] is not None)
    new = straight[k].state
    (position,) = new["sources"]
    v1 = {
        **{key: new[key] for key in ("carry", "batches", "seq_len", "micro_batch_size", "seed", "split")},
        **{key: position[key] for key in ("epoch", "shard", "row", "offset")},
        "version": 1, "dp_rank": 0, "dp_size": 1, "data_fingerprint": position["fingerprint"],
        "tokenizer_sha256": new["tokenizer_sha256"],
    }  # fmt: skip
    with PackedLoader(old, corpus["model"], 24, 2, SEED) as resumed:
        resumed.load_state_dict(v1)
        more = take(resumed, 6)
    assert [torch.equal(a.inputs, b.inputs) for a, b in zip(more, straight[k + 1 :], strict=False)] == [True] * 6
    assert more[-1].state["sources"][0]["tokens"] == straight[k + 6].state["sources"][0]["tokens"]
    with PackedLoader(two, corpus["model"], 24, 2, SEED) as mixed, pytest.raises(ValueError, match="version 1"):
        mixed.load_state_dict(v1)


def test_per_source_tokens_sum_to_the_targets(corpus: dict[str, Any]) -> None:
    data = run_data(corpus, "sums", {"web": 0.6, "code": 0.3, "books": 0.1})
    with PackedLoader(data, corpus["model"], 16, 3, SEED) as it:
        batches = take(it, 50)
    for k, b in enumerate(batches):
        assert sum(b.source_tokens) == 48
        assert sum(s["tokens"] for s in b.state["sources"]) == 48 * (k + 1)
    assert all(x <= y for a, b in itertools.pairwise(batches) for x, y in zip(
        [s["tokens"] for s in a.state["sources"]], [s["tokens"] for s in b.state["sources"]], strict=True
    ))  # fmt: skip


# -- what the loop records and the train stage reports ---------------------------------------------------
def test_the_loop_records_rank_0s_cumulative_tokens_per_source_and_the_data_degree(corpus: dict[str, Any]) -> None:
    from types import SimpleNamespace

    from hlat.training.loop import Trainer

    data = run_data(corpus, "loop", {"web": 0.6, "code": 0.3, "books": 0.1})
    with PackedLoader(data, corpus["model"], 16, 2, SEED) as it:
        batches = take(it, 20)
    trainer = SimpleNamespace(_loader_state=batches[-1].state, world=SimpleNamespace(layout=SimpleNamespace(data=2)))
    values = Trainer._source_tokens(trainer)  # type: ignore[arg-type]
    assert values == {
        **{f"tokens/{n}": sum(b.source_tokens[i] for b in batches) for i, n in enumerate(("web", "code", "books"))},
        "data_degree": 2,
    }
    assert sum(values[f"tokens/{n}"] for n in ("web", "code", "books")) == 20 * 32
    assert Trainer._source_tokens(SimpleNamespace(_loader_state=None)) == {}  # type: ignore[arg-type]


def test_the_training_report_and_progress_show_each_sources_tokens_and_share(tmp_path: Path) -> None:
    from hlat.core.layout import METRICS_FILE
    from hlat.tasks.train import latest_source_tokens, mixture_line, summary_rows, training_summary

    run = Run.at(str(tmp_path / "run"))
    records = [
        {"step": 10, "loss": 5.0, "tokens/web": 600, "tokens/code": 300, "tokens/books": 100, "data_degree": 2},
        {"step": 15, "val_loss": 4.9},
        {"step": 20, "loss": 4.0, "tokens/web": 1210, "tokens/code": 590, "tokens/books": 200, "data_degree": 2},
    ]
    run.storage.write_text(METRICS_FILE, "".join(json.dumps(r) + "\n" for r in records))
    summary = training_summary(run)
    assert summary["tokens/web"] == 1210 and summary["data_degree"] == 2 and summary["loss"] == 4.0
    rows = {r["metric"]: r["value"] for r in summary_rows(summary)}
    assert rows["tokens from source web (data rank 0 of 2)"] == "1,210 (60.5%)"
    assert rows["tokens from source books (data rank 0 of 2)"] == "200 (10.0%)"
    assert "data_degree" not in rows
    assert latest_source_tokens(run) == {"web": 1210, "code": 590, "books": 200}
    assert latest_source_tokens(run, tail_bytes=150) == {"web": 1210, "code": 590, "books": 200}  # a cut first line
    assert mixture_line({"web": 1210, "code": 590, "books": 200}) == "web 60.5%, code 29.5%, books 10.0%"
    assert latest_source_tokens(Run.at(str(tmp_path / "none"))) == {}


def test_the_stage_estimates_each_sources_tokens_and_refuses_over_repetition(
    corpus: dict[str, Any], tmp_path: Path
) -> None:
    from hlat.core.config import ConfigError
    from hlat.core.presets import load_config
    from hlat.tasks.train import measured_source_tokens

    data = run_data(corpus, "measured", {"web": 0.6, "code": 0.3, "books": 0.1})
    tokenizer = Storage(str(tmp_path / "tokenizer"))
    assert measured_source_tokens(data, tokenizer) == {}  # no tokenizer report yet: nothing measured
    tokenizer.write_json(REPORT_FILE, {"bytes_per_token": 2.5})
    measured = measured_source_tokens(data, tokenizer)
    for name in ("web", "code", "books"):
        assert measured[name] == round(corpus["sources"][name][1].bytes("train") / 2.5)
    # The stage's check: the run's draws against these estimates, refused naming the source and the numbers.
    from hlat.tasks.train import check_training_repetition

    sources = [{"name": "web", "source": "web.jsonl", "weight": 0.6}, {"name": "code", "source": "code.jsonl"}]
    sources += [{"name": "books", "source": "books.jsonl", "weight": 0.1, "max_epochs": 2.0}]
    sources[1]["weight"] = 0.3
    cfg = load_config("tiny", {"data.sources": sources})
    run = Run.at(str(corpus["root"] / "runs" / "measured"), cfg, run_id="measured")
    run.stage("tokenizer").write_json(REPORT_FILE, {"bytes_per_token": 1e-6})  # every source is huge
    assert [d.name for d in check_training_repetition(run)] == ["web", "code", "books"]
    books_bytes = corpus["sources"]["books"][1].bytes("train")
    run.stage("tokenizer").write_json(REPORT_FILE, {"bytes_per_token": books_bytes / 10})  # books: 10 tokens
    refusal = r"data.sources\[books\]: the run draws [\d,]+ tokens from it = .* of its 10 tokens"
    with pytest.raises(ConfigError, match=refusal):
        check_training_repetition(run)
