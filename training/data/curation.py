"""Curation of one source with datatrove (https://github.com/huggingface/datatrove): quality, decontamination, dedup.

Rules:
- each phase is a datatrove pipeline; the run's storage is the only medium between phases.
- hosts run their share of a phase, then wait for its completion files (a barrier through storage).
- a killed phase redoes only its unfinished tasks.
- output shard names and order depend only on the task count and input order.
docs/data.md ("Curation with datatrove") lists the phases.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import regex
from datatrove.data import Document, DocumentsPipeline
from datatrove.executor.local import LocalPipelineExecutor
from datatrove.io import DataFolder
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.decont.n_grams import NGramsDecontConfig, NGramsDecontFilter, NGramsDecontIndexer
from datatrove.pipeline.dedup.exact_dedup import (
    ExactDedupConfig,
    ExactDedupFilter,
    ExactDedupSignature,
    ExactFindDedups,
)
from datatrove.pipeline.dedup.minhash import (
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
    MinhashDedupSignature,
)
from datatrove.pipeline.filters import (
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
)
from datatrove.pipeline.readers import JsonlReader, ParquetReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.hashing import HashConfig
from datatrove.utils.word_tokenizers import WordTokenizer
from loguru import logger as loguru_logger

from hlat.core.config import ConfigError, CurationConfig
from hlat.core.shards import ShardInfo, ShardWriter
from hlat.core.storage import Storage

log = logging.getLogger("hlat.data")

RULES = (
    "gopher_quality",
    "gopher_repetition",
    "c4_quality",
    "fineweb_quality",
    "decontamination",
    "exact_dedup",
    "minhash",
)
EXAMPLE_CHARS = 200
BARRIER_POLL_SECONDS = 1.0
BARRIER_REPORT_SECONDS = 600.0
SPLIT_KEY = "split"
VALIDATION_PRIORITY, TRAIN_PRIORITY = 2, 1
# datatrove's default hash is xxhash, which it calls with str; xxhash 4 (our pin) takes only bytes ("Strings must be
# encoded before hashing"), so every block hashes with datatrove's sha1 (hashlib, the first 8 bytes of the digest).
HASH = HashConfig(precision=64, hash_fc="sha1")


class RegexWordTokenizer(WordTokenizer):
    """English words and sentences by regular expression (docs/data.md says why not spaCy)."""

    WORD = regex.compile(r"[\p{L}\p{N}_]+(?:['’][\p{L}]+)*|[^\p{L}\p{N}_\s]+")
    SENTENCE_END = regex.compile(r"(?<=[.!?])\s+")

    def __init__(self) -> None:
        super().__init__("en")

    def word_tokenize(self, text: str) -> list[str]:
        return self.WORD.findall(text)

    def sent_tokenize(self, text: str) -> list[str]:
        return [s.strip() for s in self.SENTENCE_END.split(text) if s.strip()]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        spans, start = [], 0
        for m in self.SENTENCE_END.finditer(text):
            spans.append((start, m.start()))
            start = m.end()
        spans.append((start, len(text)))
        return [(a, b) for a, b in spans if b > a]


TOKENIZER = RegexWordTokenizer()


@dataclass
class CurationResult:
    """What curate() produced and removed."""

    shards: list[ShardInfo]
    """Curated shards, train then validation, each in task order."""
    removed: dict[str, int]
    """Documents removed per rule that ran (0 when it removed none)."""
    examples: dict[str, list[str]]
    """Per rule, a few excerpts of removed documents."""
    seconds: dict[str, float]
    """Wall time per phase (on this host, barrier included)."""
    kept: int


@dataclass
class _Phase:
    name: str
    pipeline: list[Any]
    tasks: int
    rules: dict[str, str] = field(default_factory=dict)
    """rule -> the datatrove step that removes its documents."""


# -- datatrove blocks adapted to our layout ------------------------------------------------------------------------
class _DocumentsDecontIndexer(NGramsDecontIndexer):
    """datatrove's n-gram index built from fed documents only, so lighteval is never needed."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _DocumentsDecontIndexer:
        return object.__new__(cls)

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if world_size != 1:
            raise ValueError("the decontamination index is built by one task")
        hashes: dict[str, set[int]] = defaultdict(set)
        for doc in data or ():
            hashes[doc.metadata["task"]].update(self.compute_hashes(doc.text, doc.metadata.get("query") or None))
        for task, values in sorted(hashes.items()):
            array = np.array(sorted(values), dtype=self.config.hash_config.np_descr)
            with self.output_folder.open(f"{task.replace(' ', '_')}.index.hashes", mode="wb") as f:
                f.write(array.tobytes())
        return
        yield


class _TrainDecontFilter(NGramsDecontFilter):
    """datatrove's n-gram decontamination on training documents; held-out ones pass."""

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if doc.metadata.get(SPLIT_KEY) == "validation":
            return True
        return super().filter(doc)


class _AssignedFiles:
    """A reader over the unit shards: task r of T reads the r-th contiguous block."""

    assigned: list[str]

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        n = len(self.assigned)
        for doc in self.read_files_shard(self.assigned[n * rank // world_size : n * (rank + 1) // world_size]):  # type: ignore[attr-defined]
            self.update_doc_stats(doc)  # type: ignore[attr-defined]
            yield doc


class _ParquetInputs(_AssignedFiles, ParquetReader):
    pass


class _JsonlInputs(_AssignedFiles, JsonlReader):
    pass


class _RankReader(JsonlReader):
    """The file this task's rank wrote in the previous phase.

    datatrove's dedup filters drop documents by stream position, so each task reads exactly its own.
    """

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        name = f"{rank:05d}.jsonl"
        if self.data_folder.exists(name):
            yield from self.read_files_shard([name])


class _ShardSink(PipelineStep):
    """Writes the documents as our shards, one folder per task."""

    type = "💽 - WRITER"
    name = "hlat shards"

    def __init__(self, folder: Storage, work: str, fmt: Literal["parquet", "jsonl"], shard_rows: int) -> None:
        super().__init__()
        self.folder, self.work, self.fmt, self.shard_rows = folder, work, fmt, shard_rows

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        writer = ShardWriter(self.folder, f"{self.work}/curated/{rank:05d}", self.fmt, self.shard_rows)
        for doc in data or ():
            with self.track_time():
                writer.add(doc.text, doc.metadata[SPLIT_KEY])
                self.stat_update("written")
        shards = writer.close()
        self.folder.write_json(_shard_list(self.work, rank), [s.model_dump(mode="json") for s in shards])
        return
        yield


def _shard_list(work: str, rank: int) -> str:
    return f"{work}/curate/shards/{rank:05d}.json"


@contextmanager
def _datatrove_quiet() -> Iterator[None]:
    """Silence datatrove's loguru output; this module logs one line per phase."""
    loguru_logger.disable("datatrove")
    try:
        yield
    finally:
        loguru_logger.enable("datatrove")


# -- the pipeline ---------------------------------------------------------------------------------------------------
def curate(
    cfg: CurationConfig,
    folder: Storage,
    work: str,
    inputs: list[ShardInfo],
    fmt: Literal["parquet", "jsonl"],
    shard_rows: int,
    *,
    tasks: int,
    workers: int = 1,
    host: int = 0,
    hosts: int = 1,
    contamination: dict[str, list[str]] | None = None,
    text_column: str = "text",
) -> CurationResult:
    """Curate the validated unit shards `inputs` into `{work}/curated/`; this host runs its share of each phase."""
    if not 0 <= host < hosts:
        raise ValueError(f"host {host} is not one of {hosts} hosts")
    tasks = max(1, min(tasks, len(inputs))) if inputs else 1
    with _datatrove_quiet():
        base = f"{work}/curate"
        phases = _phases(cfg, folder, work, inputs, fmt, shard_rows, tasks, contamination or {}, text_column)
        seconds: dict[str, float] = {}
        for phase in phases:
            started = time.monotonic()
            _run_phase(phase, folder, f"{base}/logs/{phase.name}", workers, host, hosts)
            seconds[phase.name] = round(time.monotonic() - started, 3)
            log.info("curation %s: %d task(s) done in %.1f s", phase.name, phase.tasks, seconds[phase.name])
        removed = {rule: 0 for phase in phases for rule in phase.rules}
        for phase in phases:
            for rule, step in phase.rules.items():
                removed[rule] += _dropped(folder, f"{base}/logs/{phase.name}", phase.tasks, step)
        examples = {rule: _examples(folder, f"{base}/removed/{rule}", cfg.examples_per_rule) for rule in removed}
        shards = _gather_shards(folder, work, tasks)
        return CurationResult(
            shards=shards,
            removed={r: removed[r] for r in RULES if r in removed},
            examples={r: examples[r] for r in RULES if r in examples},
            seconds=seconds,
            kept=sum(s.rows for s in shards),
        )


def _phases(
    cfg: CurationConfig,
    folder: Storage,
    work: str,
    inputs: list[ShardInfo],
    fmt: Literal["parquet", "jsonl"],
    shard_rows: int,
    tasks: int,
    contamination: dict[str, list[str]],
    text_column: str,
) -> list[_Phase]:
    base = f"{work}/curate"

    def at(rel: str) -> DataFolder:
        return DataFolder(folder.path(f"{base}/{rel}"), fs=folder.fs)

    def excluded(rule: str) -> JsonlWriter:
        return JsonlWriter(at(f"removed/{rule}"), output_filename="${rank}.jsonl", compression=None)

    def survivors(stage: str) -> JsonlWriter:
        return JsonlWriter(at(f"kept/{stage}"), output_filename="${rank}.jsonl", compression=None)

    phases: list[_Phase] = []
    exact_config = ExactDedupConfig(content_getter=_doc_text, document_priority=_priority, hash_config=HASH)
    minhash_config = MinhashConfig(
        n_grams=cfg.minhash_ngrams,
        num_buckets=cfg.minhash_buckets,
        hashes_per_bucket=cfg.minhash_hashes_per_bucket,
        hash_config=HASH,
    )
    decont = cfg.decontaminate and any(contamination.values())
    if decont:
        docs = [
            Document(text=text, id=f"{task}/{i}", metadata={"task": task, "query": ""})
            for task, texts in sorted(contamination.items())
            for i, text in enumerate(texts)
            if text.strip()
        ]
        indexer = _DocumentsDecontIndexer(
            at("decont_index"),
            config=_decont_config(cfg),
            language=TOKENIZER,
        )
        phases.append(_Phase("decont_index", [docs, indexer], 1))

    split_of = {s.path: s.split for s in inputs}
    reader_cls = _ParquetInputs if fmt == "parquet" else _JsonlInputs
    reader = reader_cls(
        DataFolder(folder.path(), fs=folder.fs),
        text_key=text_column,
        adapter=_SplitAdapter(split_of, folder.path(), text_column),
    )
    reader.assigned = [s.path for s in inputs]
    filters: list[tuple[str, PipelineStep]] = []
    lang: Any = TOKENIZER
    # Each quality rule is datatrove's block with the config's arguments over its defaults (data.curation.*_params).
    # C4's defaults here leave out its bad-words list (C4BadWordsFilter downloads it) and do not drop every line that
    # does not end in punctuation (filter_no_terminal_punct: it would cut code and lists line by line); its other line
    # cuts (citations, javascript and policy lines, lines under 3 words) rewrite a kept document as C4 did.
    quality: list[tuple[str, bool, type[PipelineStep], dict[str, Any]]] = [
        ("gopher_quality", cfg.gopher_quality, GopherQualityFilter, cfg.gopher_quality_params),
        ("gopher_repetition", cfg.gopher_repetition, GopherRepetitionFilter, cfg.gopher_repetition_params),
        (
            "c4_quality",
            cfg.c4_quality,
            C4QualityFilter,
            {"split_paragraph": True, "filter_no_terminal_punct": False, **cfg.c4_quality_params},
        ),
        ("fineweb_quality", cfg.fineweb_quality, FineWebQualityFilter, cfg.fineweb_quality_params),
    ]
    for rule, on, block, params in quality:
        if on:
            filters.append((rule, _quality_filter(rule, block, params, excluded(rule), lang)))
    if decont:
        dfilter = _TrainDecontFilter(
            at("decont_index"), config=_decont_config(cfg), exclusion_writer=excluded("decontamination"), language=lang
        )
        filters.append(("decontamination", dfilter))
    elif cfg.decontaminate:
        filters.append(("decontamination", _NoOp()))

    first: list[Any] = [reader, *(f for _, f in filters if not isinstance(f, _NoOp)), survivors("filter")]
    rules = {rule: str(step) for rule, step in filters if not isinstance(step, _NoOp)}
    rules.update({rule: "" for rule, step in filters if isinstance(step, _NoOp)})
    if cfg.exact_dedup:
        first.append(ExactDedupSignature(at("exact/sigs"), exact_config, finder_workers=cfg.finder_workers))
    elif cfg.minhash:
        first.append(MinhashDedupSignature(at("minhash/sigs"), config=minhash_config, language=lang))
    phases.append(_Phase("filter", first, tasks, rules))

    last_kept = "filter"
    final: list[Any] = [_RankReader(at(f"kept/{last_kept}"))]
    final_rules: dict[str, str] = {}
    if cfg.exact_dedup:
        phases.append(
            _Phase(
                "exact_find", [ExactFindDedups(at("exact/sigs"), at("exact/dups"), exact_config)], cfg.finder_workers
            )
        )
        exact_filter = ExactDedupFilter(at("exact/dups"), exact_config, exclusion_writer=excluded("exact_dedup"))
        if cfg.minhash:
            phases.append(
                _Phase(
                    "exact_filter",
                    [
                        _RankReader(at("kept/filter")),
                        exact_filter,
                        survivors("exact"),
                        MinhashDedupSignature(at("minhash/sigs"), config=minhash_config, language=lang),
                    ],
                    tasks,
                    {"exact_dedup": str(exact_filter)},
                )
            )
            final = [_RankReader(at("kept/exact"))]
        else:
            final.append(exact_filter)
            final_rules["exact_dedup"] = str(exact_filter)
    if cfg.minhash:
        buckets = MinhashDedupBuckets(at("minhash/sigs"), at("minhash/buckets"), config=minhash_config)
        phases.append(_Phase("minhash_buckets", [buckets], cfg.minhash_buckets))
        cluster = MinhashDedupCluster(at("minhash/buckets"), at("minhash/remove"), config=minhash_config)
        phases.append(_Phase("minhash_cluster", [cluster], 1))
        minhash_filter = MinhashDedupFilter(at("minhash/remove"), exclusion_writer=excluded("minhash"))
        final.append(minhash_filter)
        final_rules["minhash"] = str(minhash_filter)
    final.append(_ShardSink(folder, work, fmt, shard_rows))
    phases.append(_Phase("write", final, tasks, final_rules))
    return phases


class _NoOp(PipelineStep):
    """Decontamination with nothing to check against: counted as 0, runs nothing."""

    name = "nothing to decontaminate against"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        return data


def _quality_filter(rule: str, block: type[PipelineStep], params: dict[str, Any], writer: Any, lang: Any) -> Any:
    """datatrove's `block` with `params` over its defaults; unknown arguments are a config error."""
    known = [
        p for p in inspect.signature(block.__init__).parameters if p not in ("self", "exclusion_writer", "language")
    ]
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ConfigError(
            f"data.curation.{rule}_params: {', '.join(map(repr, unknown))} is not an argument of datatrove's "
            f"{block.__name__}; it takes {', '.join(known)}"
        )
    tuples = {
        k: [tuple(v) for v in value] if k in ("top_n_grams", "dup_n_grams") else value for k, value in params.items()
    }
    return block(exclusion_writer=writer, language=lang, **tuples)


def _decont_config(cfg: CurationConfig) -> NGramsDecontConfig:
    return NGramsDecontConfig(
        n_grams=cfg.decontamination_ngrams, find_query_ngrams=True, find_overlap_ngrams=False, hash_config=HASH
    )


def _doc_text(doc: Document) -> str:
    return doc.text


def _priority(doc: Document) -> int:
    return VALIDATION_PRIORITY if doc.metadata.get(SPLIT_KEY) == "validation" else TRAIN_PRIORITY


class _SplitAdapter:
    """A reader adapter: the text, its split in metadata, ids `<shard path>/<row>`."""

    def __init__(self, split_of: Mapping[str, str], root: str, text_column: str) -> None:
        self.split_of, self.root, self.text_column = split_of, root.rstrip("/") + "/", text_column

    def __call__(self, reader: Any, data: dict, path: str, id_in_file: int | str) -> dict:
        rel = path[len(self.root) :] if path.startswith(self.root) else path
        return {
            "text": data[self.text_column],
            "id": f"{rel}/{id_in_file}",
            "metadata": {SPLIT_KEY: self.split_of[rel]},
        }


# -- running, the barrier and the tallies ---------------------------------------------------------------------------
def _share(tasks: int, host: int, hosts: int) -> tuple[int, int]:
    """This host's tasks of a phase: [offset, offset + count)."""
    lo, hi = tasks * host // hosts, tasks * (host + 1) // hosts
    return lo, hi - lo


def _run_phase(phase: _Phase, folder: Storage, logs: str, workers: int, host: int, hosts: int) -> None:
    offset, count = _share(phase.tasks, host, hosts)
    logging_dir = DataFolder(folder.path(logs), fs=folder.fs)
    if count:
        LocalPipelineExecutor(
            phase.pipeline,
            tasks=phase.tasks,
            workers=min(workers, count),
            logging_dir=logging_dir,
            skip_completed=True,
            local_tasks=count,
            local_rank_offset=offset,
        ).run()
    _barrier(folder, logs, phase.tasks, hosts)


def _barrier(folder: Storage, logs: str, tasks: int, hosts: int = 1) -> None:
    """Wait until every task of the phase has its completion file in storage, naming laggards periodically.

    No timeout: a dead host ends the job, and max runtime bounds a hung one.
    """
    expected = {f"{rank:05d}" for rank in range(tasks)}
    started = reported = time.monotonic()
    while True:
        done = set(folder.list(f"{logs}/completions")) if folder.exists(f"{logs}/completions") else set()
        missing = sorted(expected - {name.rsplit("/", 1)[-1] for name in done})
        if not missing:
            return
        if time.monotonic() - reported >= BARRIER_REPORT_SECONDS:
            reported = time.monotonic()
            log.info("%s", _waiting_line(logs, [int(m) for m in missing], tasks, hosts, reported - started))
        time.sleep(BARRIER_POLL_SECONDS)


def _waiting_line(logs: str, missing: list[int], tasks: int, hosts: int, seconds: float) -> str:
    """'curation minhash_buckets: waiting 600 s for 2 of 64 task(s): 12, 13 (host 3)'."""
    owners = sorted({host for host in range(hosts) for rank in missing if _owns(tasks, host, hosts, rank)})
    shown = ", ".join(str(rank) for rank in missing[:8]) + (", ..." if len(missing) > 8 else "")
    hosts_text = ", ".join(str(h) for h in owners)
    return (
        f"curation {logs.rsplit('/', 1)[-1]}: waiting {seconds:.0f} s for {len(missing)} of {tasks} task(s): "
        f"{shown} (host{'s' if len(owners) > 1 else ''} {hosts_text})"
    )


def _owns(tasks: int, host: int, hosts: int, rank: int) -> bool:
    offset, count = _share(tasks, host, hosts)
    return offset <= rank < offset + count


def _dropped(folder: Storage, logs: str, tasks: int, step: str) -> int:
    """Documents a step dropped, from datatrove's stats files."""
    if not step:
        return 0
    total = 0
    for rank in range(tasks):
        rel = f"{logs}/stats/{rank:05d}.json"
        if not folder.exists(rel):
            continue
        for entry in folder.read_json(rel):
            if entry.get("name") == step:
                value = entry.get("stats", {}).get("dropped", 0)
                total += int(value["total"] if isinstance(value, dict) else value)
    return total


def _examples(folder: Storage, rel: str, limit: int) -> list[str]:
    """The first `limit` removed documents of a rule, cut to 200 characters."""
    out: list[str] = []
    if limit <= 0 or not folder.exists(rel):
        return out
    for name in sorted(folder.list(rel)):
        with folder.open(f"{rel}/{name.rsplit('/', 1)[-1]}", "rb") as f:
            for line in f:
                if line.strip():
                    out.append(json.loads(line)["text"][:EXAMPLE_CHARS])
                    if len(out) >= limit:
                        return out
    return out


def _gather_shards(folder: Storage, work: str, tasks: int) -> list[ShardInfo]:
    shards = [ShardInfo.model_validate(s) for rank in range(tasks) for s in folder.read_json(_shard_list(work, rank))]
    return [s for s in shards if s.split == "train"] + [s for s in shards if s.split == "validation"]


# -- what to decontaminate against ------------------------------------------------------------------------------------


def contamination_texts(
    tasks: list[str], validation_texts: Iterable[str], include_path: str | None
) -> tuple[dict[str, list[str]], list[str]]:
    """The texts of the run's evaluation tasks, and the tasks not available offline.

    Offline tasks use `validation_texts`; hub tasks load through lm-eval with the hub offline.
    """
    from hlat.training.evaluation.lm_harness import CHOICE_TASK, CLOZE_TASK, _hub_offline

    texts: dict[str, list[str]] = {}
    unavailable: list[str] = []
    offline = [t for t in tasks if t in (CLOZE_TASK, CHOICE_TASK)]
    if offline:
        held_out = [t for t in validation_texts if t and t.strip()]
        for task in offline:
            texts[task] = held_out
    hub = [t for t in tasks if t not in offline]
    if not hub:
        return texts, unavailable
    with _hub_offline():
        for task in hub:
            try:
                texts[task] = list(_hub_task_texts(task, include_path))
            except Exception as exc:  # lm-eval raises many kinds when a dataset is not in the cache
                log.warning("decontamination: %s is not available offline (%s: %s)", task, type(exc).__name__, exc)
                unavailable.append(task)
    return texts, unavailable


def _hub_task_texts(task: str, include_path: str | None) -> Iterator[str]:
    """Question and answer text of one lm-eval task's documents, subtasks included."""
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    for obj in _leaf_tasks(get_task_dict([task], manager)):
        docs = obj.test_docs() if obj.has_test_docs() else obj.validation_docs()
        for doc in docs or ():
            question = str(obj.doc_to_text(doc))
            answer = _answer_text(obj, doc)
            yield f"{question} {answer}".strip()


def _leaf_tasks(tree: Any) -> Iterator[Any]:
    for value in tree.values():
        if isinstance(value, dict):
            yield from _leaf_tasks(value)
        else:
            yield value


def _answer_text(obj: Any, doc: Any) -> str:
    target = obj.doc_to_target(doc)
    choices = obj.doc_to_choice(doc) if getattr(obj.config, "doc_to_choice", None) else None
    if isinstance(target, int) and choices and 0 <= target < len(choices):
        return str(choices[target])
    if isinstance(target, list):
        return " ".join(str(t) for t in target)
    return str(target)
