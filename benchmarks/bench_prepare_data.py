"""prepare-data throughput: the real stage (datasets + great-expectations + shards) against a plain-Python peer.

The peer reads the same jsonl with `json`, applies the same row checks (null, U+FFFD, length, exact duplicate)
by hand and writes the same parquet shards; the ratio is what the real libraries cost per document. Run:

    .venv/bin/python -m benchmarks.bench_prepare_data [--documents N] [--repeats R]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path

from benchmarks.common import best_of, table
from infra.corpus import build_stdlib_corpus
from infra.prepare import assign_split, prepare_dataset
from infra.shards import ShardWriter
from infra.storage import Storage
from training.config import DataConfig
from training.presets import load_config


def plain_python(cfg: DataConfig, source: Path, out: Storage) -> int:
    """The same checks and shards without datasets or great-expectations."""
    v = cfg.validation
    seen: set[bytes] = set()
    writer = ShardWriter(out, "plain", cfg.shard_format, cfg.shard_rows)
    kept = 0
    with source.open(encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh):
            if cfg.max_documents is not None and n >= cfg.max_documents:
                break
            text = json.loads(line).get(cfg.text_column)
            if text is None or "\ufffd" in text or not v.min_chars <= len(text) <= v.max_chars:
                continue
            digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
            if digest in seen:
                continue
            seen.add(digest)
            writer.add(text, assign_split(text, cfg.validation_fraction))  # type: ignore[arg-type]
            kept += 1
    writer.close()
    return kept


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--documents", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    corpus = build_stdlib_corpus()
    cfg = load_config("tiny", {"data.source": str(corpus), "data.max_documents": args.documents}).data
    lines = [line for _, line in zip(range(args.documents), corpus.open(encoding="utf-8"), strict=False)]
    docs, mb = len(lines), sum(len(line.encode()) for line in lines) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        kept = {}

        def hlat_stage() -> None:
            kept["hlat"] = prepare_dataset(cfg, Storage(f"{tmp}/hlat"), "bench").rows_kept

        def peer() -> None:
            kept["plain"] = plain_python(cfg, corpus, Storage(f"{tmp}/plain"))

        t_hlat, t_peer = best_of(hlat_stage, args.repeats), best_of(peer, args.repeats)
    assert kept["hlat"] == kept["plain"], f"the two disagree on what to keep: {kept}"
    rows = [
        [
            "hlat prepare-data (datasets + GX)",
            docs,
            kept["hlat"],
            f"{t_hlat:.2f}",
            f"{docs / t_hlat:,.0f}",
            f"{mb / t_hlat:.1f}",
            f"{t_hlat / t_peer:.1f}x",
        ],
        [
            "plain Python peer",
            docs,
            kept["plain"],
            f"{t_peer:.2f}",
            f"{docs / t_peer:,.0f}",
            f"{mb / t_peer:.1f}",
            "1.0x",
        ],
    ]
    out = table(["pipeline", "docs", "kept", "seconds", "docs/s", "MB/s", "time vs peer"], rows)
    print(f"prepare-data on {mb:.1f} MB of the builtin corpus, best of {args.repeats}\n{out}")
    return out


if __name__ == "__main__":
    main()
