"""training/data/curation.py: datatrove's dedup, quality and decontamination blocks over planted documents, counted
per rule; multi-host equals one host; a killed phase redoes only its unfinished tasks."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from hlat.core.config import CurationConfig
from hlat.core.shards import ShardInfo, shard_texts, write_shard
from hlat.core.storage import Storage
from hlat.training.data import curation
from hlat.training.data.curation import curate

STOP = ["the", "of", "and", "to", "with", "that", "have", "from", "this", "for"]


def _vocab(rng: random.Random, n: int = 800) -> list[str]:
    return ["".join(rng.choice("abcdefghijklmnoprstuvwy") for _ in range(rng.randint(4, 8))) for _ in range(n)]


def _sentence(rng: random.Random, vocab: list[str], words: int = 12) -> str:
    out = [rng.choice(vocab) if i % 3 else rng.choice(STOP) for i in range(words)]
    return " ".join(out).capitalize() + "."


def _good(rng: random.Random, vocab: list[str], sentences: int = 8) -> str:
    return " ".join(_sentence(rng, vocab) for _ in range(sentences))


class Corpus:
    """Documents that pass every rule, and planted ones with known fates."""

    def __init__(self, seed: int = 7, good_train: int = 40, good_validation: int = 10) -> None:
        rng = random.Random(seed)
        vocab = _vocab(rng)
        self.eval_passage = " ".join(rng.choice(vocab) for _ in range(40))
        train = [_good(rng, vocab) for _ in range(good_train)]
        validation = [_good(rng, vocab) for _ in range(good_validation)]
        # Exact duplicates: two copies of one training document, one of another, and a validation document copied
        # into training (the validation copy stays).
        self.cross_split = validation[0]
        exact = [train[0], train[0], train[1], self.cross_split]
        # Near duplicates: a long document and two copies with three words changed each.
        long_doc = _good(rng, vocab, sentences=35)
        words = long_doc.split(" ")
        near = []
        for k in range(2):
            changed = list(words)
            for j in (50 + k, 200 + k, 350 + k):
                changed[j] = "zzchanged"
            near.append(" ".join(changed))
        train.append(long_doc)
        # A training document that quotes the evaluation passage.
        contaminated = _sentence(rng, vocab) + " " + self.eval_passage + ". " + _good(rng, vocab, 6)
        self.quality = {
            "gopher_quality": "Too short to be a document of the web.",
            "gopher_repetition": "\n".join([_sentence(rng, vocab)] * 10),
            "c4_quality": _good(rng, vocab) + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit.",
            "fineweb_quality": "\n".join(_sentence(rng, vocab)[:-1] for _ in range(8)),
        }
        self.train = train + exact + near + [contaminated] + list(self.quality.values())
        self.validation = validation
        self.expected = {
            "gopher_quality": 1,
            "gopher_repetition": 1,
            "c4_quality": 1,
            "fineweb_quality": 1,
            "decontamination": 1,
            "exact_dedup": 4,
            "minhash": 2,
        }
        self.contaminated = contaminated

    def write(self, storage: Storage, fmt: str = "parquet", per_shard: int = 9) -> list[ShardInfo]:
        """Unit shards in plan order: train shards, then validation ones."""
        shards = []
        for split, docs in (("train", self.train), ("validation", self.validation)):
            for i in range(0, len(docs), per_shard):
                rel = f"units/{split}-{i // per_shard:03d}.{fmt}"
                shards.append(write_shard(storage, rel, split, docs[i : i + per_shard], fmt))  # type: ignore[arg-type]
        return shards


ALL_ON = CurationConfig(
    exact_dedup=True,
    minhash=True,
    gopher_quality=True,
    gopher_repetition=True,
    c4_quality=True,
    fineweb_quality=True,
    decontaminate=True,
    examples_per_rule=2,
    finder_workers=2,
)


def _texts(storage: Storage, shards: list[ShardInfo], fmt: str = "parquet") -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"train": [], "validation": []}
    for s in shards:
        out[s.split].extend(shard_texts(storage, s, fmt))  # type: ignore[arg-type]
    return out


def _run(storage: Storage, corpus: Corpus, inputs: list[ShardInfo], **kwargs):
    return curate(
        ALL_ON,
        storage,
        "work-1",
        inputs,
        "parquet",
        shard_rows=16,
        tasks=3,
        contamination={"eval_task": [corpus.eval_passage]},
        **kwargs,
    )


def test_every_rule_removes_its_planted_documents(tmp_path: Path) -> None:
    corpus = Corpus()
    storage = Storage(str(tmp_path))
    result = _run(storage, corpus, corpus.write(storage))
    assert result.removed == corpus.expected
    for rule, count in corpus.expected.items():
        assert 0 < len(result.examples[rule]) <= min(count, 2)
        assert all(len(e) <= 200 for e in result.examples[rule])
    texts = _texts(storage, result.shards)
    total = len(corpus.train) + len(corpus.validation)
    assert result.kept == total - sum(corpus.expected.values()) == len(texts["train"]) + len(texts["validation"])
    # Each survivor kept its split; the document in both splits stays in validation only.
    assert texts["validation"] == corpus.validation
    assert corpus.cross_split not in texts["train"]
    assert corpus.contaminated not in texts["train"]
    assert all(t not in texts["train"] for t in corpus.quality.values())
    assert len(set(texts["train"])) == len(texts["train"])
    assert [s.split for s in result.shards] == sorted(
        (s.split for s in result.shards), key=["train", "validation"].index
    )
    assert all(s.path.startswith("work-1/curated/") for s in result.shards)
    assert set(result.seconds) >= {
        "decont_index",
        "filter",
        "exact_find",
        "minhash_buckets",
        "minhash_cluster",
        "write",
    }


def test_two_hosts_write_the_same_shards_as_one(tmp_path: Path) -> None:
    corpus = Corpus(seed=11)
    one = Storage(str(tmp_path / "one"))
    single = _run(one, corpus, corpus.write(one))
    two = Storage(str(tmp_path / "two"))
    inputs = corpus.write(two)
    results: dict[int, curation.CurationResult] = {}
    errors: list[BaseException] = []

    def host(h: int) -> None:
        try:
            results[h] = _run(two, corpus, inputs, host=h, hosts=2)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=host, args=(h,)) for h in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    for h in (0, 1):
        assert results[h].shards == single.shards
        assert results[h].removed == single.removed


def test_a_killed_phase_redoes_only_its_unfinished_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = Corpus(seed=3)
    storage = Storage(str(tmp_path))
    inputs = corpus.write(storage)
    real = curation._ShardSink.run
    calls: list[int] = []

    def flaky(self, data=None, rank: int = 0, world_size: int = 1):
        calls.append(rank)
        if rank == 1 and calls.count(1) == 1:
            raise RuntimeError("killed")
        yield from real(self, data, rank, world_size)

    monkeypatch.setattr(curation._ShardSink, "run", flaky)
    with pytest.raises(RuntimeError, match="killed"):
        _run(storage, corpus, inputs)
    assert calls == [0, 1]
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "work-1/curate/logs/filter/completions").iterdir()}
    result = _run(storage, corpus, inputs)
    assert calls == [0, 1, 1, 2]  # task 0 of the write phase was not run again, nor any earlier phase's
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "work-1/curate/logs/filter/completions").iterdir()}
    assert before == after
    assert result.removed == corpus.expected


def test_a_barrier_names_the_tasks_and_hosts_it_waits_for_and_returns_when_they_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    storage = Storage(str(tmp_path))
    logs = "work/curate/logs/minhash_buckets"
    for rank in (0, 1, 2, 3, 5):  # of 8 tasks on 3 hosts (0-1, 2-4, 5-7): 4 of host 1, 6 and 7 of host 2 missing
        storage.write_bytes(f"{logs}/completions/{rank:05d}", b"")
    monkeypatch.setattr(curation, "BARRIER_POLL_SECONDS", 0.05)
    monkeypatch.setattr(curation, "BARRIER_REPORT_SECONDS", 0.0)

    def finish() -> None:
        for rank in (4, 6, 7):
            storage.write_bytes(f"{logs}/completions/{rank:05d}", b"")

    late = threading.Timer(0.5, finish)
    late.start()
    with caplog.at_level("INFO", logger="hlat.data"):
        curation._barrier(storage, logs, 8, hosts=3)
    late.join()
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.endswith("for 3 of 8 task(s): 4, 6, 7 (hosts 1, 2)") for line in lines), lines
    assert lines[0].startswith("curation minhash_buckets: waiting ")


def test_rules_that_are_off_are_not_counted_and_nothing_changes(tmp_path: Path) -> None:
    corpus = Corpus(seed=5)
    storage = Storage(str(tmp_path))
    cfg = CurationConfig(exact_dedup=False, minhash=False, decontaminate=True)
    result = curate(cfg, storage, "work-2", corpus.write(storage, "jsonl"), "jsonl", 1000, tasks=2, contamination={})
    assert result.removed == {"decontamination": 0}
    texts = _texts(storage, result.shards, "jsonl")
    assert sorted(texts["train"]) == sorted(corpus.train)
    assert texts["validation"] == corpus.validation


@pytest.mark.slow  # lm-eval builds its index of every task (~10 s)
def test_offline_tasks_decontaminate_against_the_held_out_text(monkeypatch: pytest.MonkeyPatch) -> None:
    texts, unavailable = curation.contamination_texts(
        ["hlat_cloze", "hlat_choice", "no_such_task_anywhere"], ["held out one", " ", "held out two"], None
    )
    assert texts["hlat_cloze"] == texts["hlat_choice"] == ["held out one", "held out two"]
    assert unavailable == ["no_such_task_anywhere"]


@pytest.mark.slow  # lm-eval builds its index of every task (~10 s)
def test_a_task_whose_data_are_cached_gives_its_questions_and_answers(tmp_path: Path) -> None:
    """An lm-eval task read offline from local data (as a hub task is from the datasets cache)."""
    import json

    import yaml

    data = tmp_path / "qa.jsonl"
    rows = [{"question": "Where is the red door?", "choices": ["north", "south"], "gold": 1}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {
        "task": "local_qa",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "cache")},
        "test_split": "test",
        "doc_to_text": "question",
        "output_type": "multiple_choice",
        "doc_to_target": "gold",
        "doc_to_choice": "choices",
        "metadata": {"version": 1.0},
    }
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "local_qa.yaml").write_text(yaml.safe_dump(task))
    texts, unavailable = curation.contamination_texts(["local_qa"], [], str(tmp_path / "tasks"))
    assert texts == {"local_qa": ["Where is the red door? south"]}
    assert unavailable == []


def test_regex_tokenizer_splits_words_and_sentences() -> None:
    tok = curation.RegexWordTokenizer()
    assert tok.word_tokenize("It's a dog, isn't it?") == ["It's", "a", "dog", ",", "isn't", "it", "?"]
    text = "One two. Three four! Five"
    assert tok.sent_tokenize(text) == ["One two.", "Three four!", "Five"]
    assert [text[a:b] for a, b in tok.span_tokenize(text)] == ["One two.", "Three four!", "Five"]


def test_the_curation_benchmark_finds_its_planted_duplicates() -> None:
    from benchmarks.bench_prepare_data import curation_main

    out = curation_main([1500], chars=300, docs_per_task=750)
    row = next(line for line in out.splitlines() if line.startswith("| 1,500"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "1.0000 / 1.0000"  # exact dedup: every planted copy and nothing else
    precision, recall = (float(v) for v in cells[4].split(" / "))
    assert precision == 1.0 and recall >= 0.8  # MinHash: LSH finds most one-word changes of 50-word documents
