"""prepare-data throughput per worker process: the real worker path against a plain-Python peer.

A deterministic jsonl corpus of `--mb` MB (default 200) is generated in a temporary folder: documents of varied
length (log-normal, median about 2.5 KB, up to 200 KB) drawn from a Zipf vocabulary with some non-ASCII words,
JSON escapes and paragraphs, plus what real corpora hold now and then: truncated lines, empty and short
documents, exact duplicates, invalid UTF-8, a lone-surrogate escape, objects without the text key, blank lines.

The worker path is what each prepare-data worker runs: `plan_units` -> `read_unit` -> `DocumentValidator.validate`
(every great-expectations expectation on: null, invalid_utf8 regex, length bounds, duplicate) -> the held-out split
-> `ShardWriter`, unit by unit (training.data.units.run_worker, which also commits each unit). The peer reads the same
file with `json`, applies the same row checks by hand and writes the same parquet shards; both must keep the same
documents. MB/s is raw jsonl bytes per second of one process; the one-off cost of a worker process (importing
great-expectations, building the suite) is timed apart. Then the job program itself (`training.prepare_data`:
worker processes, then the merge) runs over the corpus with 1 and with 2 workers. Run:

    .venv/bin/python -m benchmarks.bench_prepare_data [--mb 200] [--repeats 3] [--batch-rows N]

With `--docs`, the curation benchmark instead (training/data/curation.py, datatrove's exact and MinHash dedup): for
each size, a corpus of documents of about `--chars` characters from the same Zipf vocabulary, in parquet unit shards,
with planted exact copies (one document in 20 copies the one 3 before it) and near copies (one in 20 copies the one 5
before it with one word changed): each dedup's precision and recall against the planted pairs; the peak RSS of the
largest process (the run is a child process; its VmHWM and its children's ru_maxrss), which must stay flat as the
documents double (the tasks of a phase grow with them, `--docs-per-task`, as a job's units do); the time of each
phase; MB/s per worker of curate() against datatrove's own plain pipeline (its readers -> the same dedup blocks -> its
writer, on a local folder, no split metadata, barrier or shard writer) on the same shards, as a ratio in the same run.
The full run of the issue:

    .venv/bin/python -m benchmarks.bench_prepare_data --docs 1000000 2000000 4000000 [--docs-per-task 50000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from benchmarks.measure import best_of, table

SEED = 1234


# -- the corpus -----------------------------------------------------------------------------------------------
# Common English words, Zipf-weighted in this order, then rarer ones: non-ASCII, characters JSON escapes.
_COMMON = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if can more will no out so said what up its about "
    "into than them only other time new some could these two may then do first any my now such like our over man "
    "me even most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come since "
    "against go came right used take three data model training tokens shard corpus"
)
_RARE = ["naïve", "café", "Zürich", "résumé", "日本語", "データ", "Москва", "π", "—", "“quoted”", '"q"', "a\\b", "\t"]


def generate_corpus(path: Path, mb: float, documents: int | None = None, seed: int = SEED) -> tuple[int, int]:
    """Write the corpus (`documents` lines when given, else about `mb` MB); returns (lines, bytes)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.array([*_COMMON.split(), *_RARE], dtype=object)
    weights = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    weights /= weights.sum()
    target = int(mb * 1e6)
    written = lines = 0
    previous = ""
    with path.open("wb") as fh:
        while (documents is None and written < target) or (documents is not None and lines < documents):
            chars = int(min(200_000, max(20, rng.lognormal(np.log(2500), 1.0))))
            text = " ".join(words[rng.choice(len(words), size=max(3, chars // 6), p=weights)].tolist())
            text = text.replace(" and ", ".\n\nAnd ", 3)
            row: dict[str, Any] = {"id": lines, "text": text, "meta": {"url": f"https://example.org/{lines}"}}
            k = lines % 1000
            if k == 101:
                row["text"] = ""  # empty: too short
            elif k == 202:
                row["text"] = "tiny"
            elif k == 303:
                row["text"] = previous  # an exact duplicate
            elif k == 404:
                del row["text"]  # no text key: null
            line = json.dumps(row, ensure_ascii=False).encode()
            if lines % 4999 == 11:
                line = line[: len(line) // 2]  # truncated: not JSON
            elif lines % 3001 == 17:
                line = line.replace(b"the", b"th\xff", 1)  # invalid UTF-8
            elif lines % 7919 == 23:
                line = line.replace(b'"text": "', b'"text": "\\udc80', 1)  # a lone surrogate escape
            elif lines % 2003 == 29:
                line += b"\n"  # followed by a blank line
            fh.write(line + b"\n")
            written += len(line) + 1
            previous = text
            lines += 1
    return lines, written


# -- the two pipelines ----------------------------------------------------------------------------------------
def worker_path(cfg: Any, out: Any) -> tuple[int, int, int]:
    """One worker over every unit of the plan, as the stage runs it (training.data.units.run_worker: read, validate,
    shard, set aside, commit each unit); returns rows read, kept, held out."""
    from hlat.training.data.units import plan, run_worker

    work = "work-bench"
    results = run_worker(cfg, out, work, plan(cfg, out, work), worker=0)
    held = sum(s.rows for r in results for s in r.shards if s.split == "validation")
    return sum(r.rows_read for r in results), sum(r.rows_kept for r in results), held


def job_seconds(corpus: Path, tmp: Path, workers: int, unit_mb: int) -> tuple[float, float]:
    """Wall-clock of the prepare-data job program (`python -m hlat.training.prepare_data`, what each instance of the job
    runs: the workers as processes, then the merge) over the corpus with `workers` workers, and the MB/s of its
    workers together while they work (the report's bytes over the busiest worker's seconds in its units: what a
    long job approaches, once the fixed start of processes and the merge no longer count)."""
    import time

    from hlat.core.presets import load_config
    from hlat.core.run import open_run

    overrides = {"data.source": str(corpus), "data.max_documents": None, "data.workers": workers,
                 "data.unit_mb": unit_mb, "data.validation_fraction": 0.01, "data.shard_rows": 50_000,
                 "data.batch_rows": 20_000, "data.validation.min_chars": 16, "data.validation.max_chars": 1_000_000,
                 "data.validation.max_duplicate_rate": 0.5}  # fmt: skip
    config = load_config("tiny", overrides, run_id=f"w{workers}", storage=str(tmp / "jobs"))
    run = open_run(config)
    start = time.perf_counter()
    command = [
        sys.executable,
        "-m",
        "hlat.training.prepare_data",
        "--config",
        run.uri + "/config.json",
        "--key",
        "bench",
        "--sources",  # each source's cache key (tasks/prepare_data.py source_keys); any fresh one prepares it
        json.dumps({s.resolved_name: f"bench-{workers}" for s in config.data.mixture}),
    ]
    subprocess.run(command, check=True, capture_output=True, cwd=Path(__file__).resolve().parents[1])
    wall = time.perf_counter() - start
    report = run.stage("data").read_json("report.json")
    busiest = max(w["seconds"] for w in report["workers"])
    return wall, report["raw_bytes"] / 1e6 / busiest


def plain_python(cfg: Any, source: Path, out: Any) -> tuple[int, int, int]:
    """The same checks and shards without great-expectations, pandas or the reader."""
    from hlat.core.shards import ShardWriter
    from hlat.training.data.units import assign_split

    v = cfg.validation
    seen: set[bytes] = set()
    writer = ShardWriter(out, "plain", cfg.shard_format, cfg.shard_rows)
    read = kept = 0
    with source.open(encoding="utf-8", errors="replace", newline="\n") as fh:
        for line in fh:
            if not line.strip():
                continue
            read += 1
            try:
                row = json.loads(line)
            except ValueError:
                continue
            text = row.get(cfg.text_column) if isinstance(row, dict) else None
            if not isinstance(text, str) or "\ufffd" in text or not v.min_chars <= len(text) <= v.max_chars:
                continue
            try:
                digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
            except UnicodeEncodeError:  # a lone surrogate: invalid UTF-8
                continue
            if digest in seen:
                continue
            seen.add(digest)
            writer.add(text, assign_split(text, cfg.validation_fraction))  # type: ignore[arg-type]
            kept += 1
    return read, kept, _held_out(writer.close())


def _held_out(shards: list[Any]) -> int:
    return sum(s.rows for s in shards if s.split == "validation")


_SETUP = """
import time
start = time.perf_counter()
from hlat.training.data.validation import DocumentValidator
from hlat.core.config import DataConfig
cfg = DataConfig()
DocumentValidator(cfg.validation, cfg.text_column)
print(time.perf_counter() - start)
"""


def worker_setup_seconds(repeats: int = 2) -> float:
    """What a fresh worker process spends before its first row (imports, the great-expectations suite), best of
    `repeats` fresh processes."""
    times = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", _SETUP], capture_output=True, text=True, check=True)
        times.append(float(done.stdout.strip().splitlines()[-1]))
    return min(times)


def job_row(workers: int, run: tuple[float, float], docs: int, mb: float, one: tuple[float, float]) -> list[Any]:
    """A job program's row: MB/s while its workers work, then with everything (process starts, merge) counted."""
    (seconds, working), name = run, f"job program, {workers} worker{'s' * (workers > 1)}"
    speed = f"{seconds / one[0]:.2f}x of 1 worker's time; {working / one[1]:.2f}x its working MB/s"
    return [name, docs, "", f"{seconds:.2f}", f"{docs / seconds:,.0f}", f"{working:.1f}", f"{mb / seconds:.1f}", speed]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=None, help="curation benchmark at these corpus sizes")
    parser.add_argument("--chars", type=int, default=300, help="curation benchmark: characters per document")
    parser.add_argument("--docs-per-task", type=int, default=50_000, help="curation benchmark: documents per task")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "FOLDER", "TASKS"), help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=float, default=200, help="size of the generated corpus in MB")
    parser.add_argument("--documents", type=int, default=None, help="generate this many lines instead of --mb")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-rows", type=int, default=None, help="data.batch_rows (default: the config's)")
    parser.add_argument("--job-unit-mb", type=int, default=16, help="data.unit_mb of the job rows")
    args = parser.parse_args(argv)
    if args.child:
        return curation_child(args.child[0], args.child[1], int(args.child[2]))
    if args.docs:
        return curation_main(args.docs, args.chars, args.docs_per_task)

    from hlat.core.config import DataConfig
    from hlat.core.storage import Storage

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        lines, size = generate_corpus(corpus, args.mb, args.documents)
        overrides = {} if args.batch_rows is None else {"batch_rows": args.batch_rows}
        cfg = DataConfig(source=str(corpus), **overrides)
        counts: dict[str, tuple[int, int, int]] = {}

        runs = iter(range(1_000))

        def hlat_worker() -> None:  # a fresh folder each time: committed units would be skipped
            counts["hlat"] = worker_path(cfg, Storage(f"{tmp}/out-hlat-{next(runs)}"))

        def peer() -> None:
            counts["plain"] = plain_python(cfg, corpus, Storage(f"{tmp}/out-plain"))

        hlat_worker()  # warm: imports, the page cache, great-expectations' first run
        t_hlat, t_peer = best_of(hlat_worker, args.repeats), best_of(peer, args.repeats)
        # The job program with 1 and 2 workers (fresh processes, merge included), smaller units so 2 can share.
        jobs = {n: job_seconds(corpus, Path(tmp) / f"job{n}", n, args.job_unit_mb) for n in (1, 2)}
    assert counts["hlat"] == counts["plain"], f"the two disagree on rows read, kept and held out: {counts}"
    setup = worker_setup_seconds()
    mb = size / 1e6
    docs, kept, _ = counts["hlat"]
    rows = [
        [
            "hlat worker (reader + GX + shards)",
            docs,
            kept,
            f"{t_hlat:.2f}",
            f"{docs / t_hlat:,.0f}",
            f"{mb / t_hlat:.1f}",
            f"{mb / (t_hlat + setup):.1f}",
            f"{t_hlat / t_peer:.1f}x",
        ],
        ["plain Python peer", docs, kept, f"{t_peer:.2f}", f"{docs / t_peer:,.0f}", f"{mb / t_peer:.1f}", "", "1.0x"],
        *(job_row(n, t, docs, mb, jobs[1]) for n, t in jobs.items()),
    ]
    head = ["pipeline", "docs", "kept", "seconds", "docs/s", "MB/s", "MB/s with setup", "time vs peer"]
    out = table(head, rows)
    print(
        f"prepare-data on {mb:.1f} MB of generated jsonl ({lines} lines), one process, batch_rows {cfg.batch_rows}, "
        f"best of {args.repeats}; a worker's setup (imports, great-expectations suite): {setup:.1f} s; job rows: "
        f"one run each, units of {args.job_unit_mb} MB, {os.cpu_count()} cores\n{out}"
    )
    return out


# -- curation (training/data/curation.py) ------------------------------------------------------------------------
SHARD_DOCS = 10_000
EXACT_EVERY, EXACT_OFFSET, EXACT_BACK = 20, 7, 3
NEAR_EVERY, NEAR_OFFSET, NEAR_BACK = 20, 13, 5


def curation_corpus(folder: Any, docs: int, chars: int, seed: int = SEED) -> tuple[list[Any], int]:
    """Parquet unit shards of `docs` documents (the last shard held out); returns the shards and their bytes of text.
    Planted: document i with i % 20 == 7 is document i - 3 again; with i % 20 == 13, document i - 5 with one word
    changed (at a random place)."""
    import numpy as np

    from hlat.core.shards import write_shard

    rng = np.random.default_rng(seed)
    words = np.array(_COMMON.split(), dtype=object)
    weights = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    weights /= weights.sum()
    per_doc = max(8, chars // 6)
    shards: list[Any] = []
    texts: list[str] = []
    size = 0
    picks = rng.choice(len(words), size=(docs, per_doc), p=weights)
    places = rng.integers(0, per_doc, size=docs)
    for i in range(docs):
        if i % EXACT_EVERY == EXACT_OFFSET and i >= EXACT_BACK:
            text = texts[i - EXACT_BACK]
        elif i % NEAR_EVERY == NEAR_OFFSET and i >= NEAR_BACK:
            changed = texts[i - NEAR_BACK].split(" ")
            changed[int(places[i]) % len(changed)] = f"zq{i}"
            text = " ".join(changed)
        else:
            text = " ".join(words[picks[i]].tolist())
        texts.append(text)
        if len(texts) % SHARD_DOCS == 0 or i == docs - 1:
            start = (len(texts) - 1) // SHARD_DOCS * SHARD_DOCS
            batch = texts[start:]
            split: Literal["train", "validation"] = "validation" if i == docs - 1 and start > 0 else "train"
            shards.append(
                write_shard(folder, f"units/{split}-{start // SHARD_DOCS:05d}.parquet", split, batch, "parquet")
            )
            size += sum(len(t.encode()) for t in batch)
    return shards, size


def planted(docs: int) -> tuple[set[int], set[int]]:
    """The documents each dedup should remove: the planted copies (the kept member of a pair may be either)."""
    exact = {i for i in range(EXACT_BACK, docs) if i % EXACT_EVERY == EXACT_OFFSET}
    near = {i for i in range(NEAR_BACK, docs) if i % NEAR_EVERY == NEAR_OFFSET}
    return exact, near


def _pair(i: int, rule: str) -> tuple[int, int]:
    back = EXACT_BACK if rule == "exact_dedup" else NEAR_BACK
    return (i - back, i)


def precision_recall(removed: list[int], rule: str, docs: int) -> tuple[float, float]:
    """A removal is right when it removes one member of a planted pair of its kind (each pair counted once)."""
    exact, near = planted(docs)
    truth = exact if rule == "exact_dedup" else near
    pairs_of = {m: _pair(c, rule) for c in truth for m in _pair(c, rule)}
    hit_pairs = {pairs_of[i] for i in removed if i in pairs_of}
    right = sum(1 for i in removed if i in pairs_of)
    precision = right / len(removed) if removed else 1.0
    return precision, len(hit_pairs) / len(truth) if truth else 1.0


def _removed_indices(folder: Any, rule: str) -> list[int]:
    """Global document numbers of what a rule removed (ids are <unit shard>/<row>)."""
    out: list[int] = []
    rel = f"work-bench/curate/removed/{rule}"
    if not folder.exists(rel):
        return out
    for name in folder.list(rel):
        for line in folder.read_text(f"{rel}/{name.rsplit('/', 1)[-1]}").splitlines():
            doc_id = json.loads(line)["id"]
            shard, row = doc_id.rsplit("/", 1)
            out.append(int(shard.rsplit("-", 1)[1].split(".")[0]) * SHARD_DOCS + int(row))
    return out


def curation_child(mode: str, root: str, tasks: int) -> str:
    """One measured run in a fresh process: curate() ("hlat") or datatrove's plain pipeline ("plain") over the unit
    shards under `root`; prints a JSON line with its seconds per phase, kept documents and peak RSS (MB)."""
    import resource
    import time

    from hlat.core.config import CurationConfig
    from hlat.core.shards import ShardInfo
    from hlat.core.storage import Storage
    from hlat.training.data.curation import curate

    folder = Storage(root)
    shards = [ShardInfo.model_validate(s) for s in folder.read_json("units.json")]
    cfg = CurationConfig(exact_dedup=True, minhash=True, finder_workers=tasks)
    start = time.perf_counter()
    if mode == "hlat":
        result = curate(cfg, folder, "work-bench", shards, "parquet", 100_000, tasks=tasks, workers=1)
        seconds, kept = result.seconds, result.kept
    else:
        seconds, kept = plain_datatrove(cfg, root, tasks)
    total = time.perf_counter() - start
    rss = max(_own_peak_kb(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    line = json.dumps({"seconds": seconds, "total": total, "kept": kept, "rss_mb": rss / 1024})
    print(line)
    return line


def _own_peak_kb() -> int:
    """This process's peak RSS in kB: /proc's VmHWM, the high-water mark of this program's memory. Not ru_maxrss of
    RUSAGE_SELF, which Linux carries across execve: a child started from the benchmark would report the benchmark's
    own peak (its corpus generation) whenever that is higher."""
    import resource

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def plain_datatrove(cfg: Any, root: str, tasks: int) -> tuple[dict[str, float], int]:
    """datatrove's own pipeline, as its examples write it: readers and writers on local folders, the same dedup blocks
    and hash function as curate(), exact dedup then MinHash; returns seconds per phase and the documents kept."""
    import time

    from datatrove.executor.local import LocalPipelineExecutor
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
    from datatrove.pipeline.readers import JsonlReader, ParquetReader
    from datatrove.pipeline.writers import JsonlWriter

    from hlat.training.data.curation import HASH, TOKENIZER, _doc_text

    p = f"{root}/plain"
    exact = ExactDedupConfig(content_getter=_doc_text, hash_config=HASH)
    mh = MinhashConfig(cfg.minhash_ngrams, cfg.minhash_buckets, cfg.minhash_hashes_per_bucket, hash_config=HASH)
    stages = {
        "exact_signatures": ([ParquetReader(f"{root}/units"), ExactDedupSignature(f"{p}/esig", exact, tasks)], tasks),
        "exact_find": ([ExactFindDedups(f"{p}/esig", f"{p}/edup", exact)], tasks),
        "exact_filter": (
            [
                ParquetReader(f"{root}/units"),
                ExactDedupFilter(f"{p}/edup", exact),
                JsonlWriter(f"{p}/kept1", compression=None),
                MinhashDedupSignature(f"{p}/msig", config=mh, language=TOKENIZER),
            ],
            tasks,
        ),
        "minhash_buckets": ([MinhashDedupBuckets(f"{p}/msig", f"{p}/mbuck", config=mh)], cfg.minhash_buckets),
        "minhash_cluster": ([MinhashDedupCluster(f"{p}/mbuck", f"{p}/mrem", config=mh)], 1),
        "write": (
            [JsonlReader(f"{p}/kept1"), MinhashDedupFilter(f"{p}/mrem"), JsonlWriter(f"{p}/out", compression=None)],
            tasks,
        ),
    }
    seconds = {}
    for name, (pipeline, n) in stages.items():
        start = time.perf_counter()
        LocalPipelineExecutor(pipeline, tasks=n, workers=1, logging_dir=f"{p}/logs/{name}").run()
        seconds[name] = round(time.perf_counter() - start, 3)
    kept = sum(sum(1 for _ in path.open()) for path in Path(f"{p}/out").glob("*.jsonl"))
    return seconds, kept


def _child(mode: str, root: str, tasks: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.bench_prepare_data", "--child", mode, root, str(tasks)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def curation_main(sizes: list[int], chars: int, docs_per_task: int) -> str:
    """The curation benchmark at each size (see the module docstring); prints and returns its tables. The tasks of a
    phase grow with the corpus (`docs_per_task`), as a prepare-data job's units do: datatrove's signature blocks sort
    a task's signatures in memory, so a task's memory follows its share of the corpus, not the corpus."""
    from hlat.core.storage import Storage

    rows, phase_rows = [], []
    for docs in sizes:
        tasks = max(1, -(-docs // docs_per_task))
        with tempfile.TemporaryDirectory() as tmp:
            folder = Storage(tmp)
            shards, size = curation_corpus(folder, docs, chars)
            folder.write_json("units.json", [s.model_dump(mode="json") for s in shards])
            ours = _child("hlat", tmp, tasks)
            plain = _child("plain", tmp, tasks)
            quality = {
                rule: precision_recall(_removed_indices(folder, rule), rule, docs)
                for rule in ("exact_dedup", "minhash")
            }
        mb = size / 1e6
        # Per worker: one worker ran every task, so the corpus over the whole run's time is one worker's rate.
        ours_mbs, plain_mbs = mb / ours["total"], mb / plain["total"]
        (ep, er), (mp, mr) = quality["exact_dedup"], quality["minhash"]
        rows.append(
            [
                f"{docs:,}",
                tasks,
                f"{mb:.0f}",
                f"{ep:.4f} / {er:.4f}",
                f"{mp:.4f} / {mr:.4f}",
                f"{ours['kept']:,} / {plain['kept']:,}",
                f"{ours['rss_mb']:.0f} / {plain['rss_mb']:.0f}",
                f"{ours_mbs:.2f} / {plain_mbs:.2f}",
                f"{ours_mbs / plain_mbs:.2f}",
            ]
        )
        phase_rows.append([f"{docs:,}", *(f"{v:.1f}" for v in ours["seconds"].values())])
        phases = list(ours["seconds"])
    head = [
        "docs",
        "tasks",
        "MB",
        "exact P / R",
        "MinHash P / R",
        "kept hlat / plain",
        "peak RSS MB hlat / plain",
        "MB/s per worker hlat / plain",
        "ratio",
    ]
    out = table(head, rows) + "\n" + table(["docs", *(f"{p} s" for p in phases)], phase_rows)
    print(
        f"curation (exact dedup + MinHash 14x8 of 5-grams, datatrove {_datatrove_version()}), documents of ~{chars} "
        f"chars, {docs_per_task:,} documents per task, all run by 1 worker, {os.cpu_count()} cores; planted: 1 in "
        f"{EXACT_EVERY} an exact copy, 1 in {NEAR_EVERY} a near copy (one word changed)\n{out}"
    )
    return out


def _datatrove_version() -> str:
    from importlib.metadata import version

    return version("datatrove")


if __name__ == "__main__":
    main()
