"""The prepare-data stage body: read the source, validate every document, write shards, manifest and report.

Outputs under the run's `data/` folder:
```
data/shards-<key>-<attempt>/train-00000.parquet ...       kept documents (validation-00000... for the held-out split)
data/shards-<key>-<attempt>/quarantine-00000.parquet ...  set-aside rows with their reason
data/manifest.json                              shards with rows, bytes, sha256 (written after the shards)
data/report.json                                counts, reasons, expectations, timing (written last)
```
A run that fails leaves the previous manifest and its shards untouched; shards of earlier successful runs
that the new manifest no longer names are removed only after the new manifest is in place.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid

from pydantic import BaseModel

from infra.corpus import iter_batches
from infra.shards import MANIFEST_FILE, DataManifest, ShardWriter
from infra.storage import Storage
from infra.validation import DocumentValidator
from training.config import DataConfig

log = logging.getLogger("hlat.data")

REPORT_FILE = "report.json"
QUARANTINE_TEXT_LIMIT = 65_536  # characters of a quarantined row kept for inspection


class DataReport(BaseModel):
    """What prepare-data did; rows_read == rows_kept + rows_quarantined always."""

    source: str
    fingerprint: str
    policy: str
    rows_read: int
    rows_kept: int
    rows_quarantined: int
    quarantined_by_reason: dict[str, int]
    expectation_failures: dict[str, int]
    duplicate_rate: float
    train_rows: int
    validation_rows: int
    train_bytes: int
    validation_bytes: int
    shards: int
    manifest_checksum: str
    seconds: float


def assign_split(text: str, validation_fraction: float) -> str:
    """Held-out membership by content hash: stable across re-runs, orders and shard sizes."""
    h = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
    return "validation" if h / 2**64 < validation_fraction else "train"


def prepare_dataset(cfg: DataConfig, data: Storage, fingerprint: str) -> DataReport:
    """Run the whole stage into `data` (the run's data/ folder); raises on invalid data per policy."""
    start = time.perf_counter()
    # A fresh folder per attempt: the current manifest's shards stay valid until the new manifest replaces it.
    shard_dir = f"shards-{fingerprint[-12:]}-{uuid.uuid4().hex[:6]}"
    writer = ShardWriter(data, shard_dir, cfg.shard_format, cfg.shard_rows)
    validator = DocumentValidator(cfg.validation, cfg.text_column)
    quarantine: list[tuple[str | None, str]] = []
    quarantine_files = 0

    def flush_quarantine() -> None:
        nonlocal quarantine, quarantine_files
        if quarantine:
            _write_quarantine(data, f"{shard_dir}/quarantine-{quarantine_files:05d}.parquet", quarantine)
            quarantine_files += 1
            quarantine = []

    for frame in iter_batches(cfg):
        outcome = validator.validate(frame)
        for text in outcome.kept:
            writer.add(text, assign_split(text, cfg.validation_fraction))  # type: ignore[arg-type]
        quarantine.extend(outcome.quarantined)
        if len(quarantine) >= cfg.shard_rows:
            flush_quarantine()
        log.info("read %d rows, kept %d", validator.tally.rows_read, validator.tally.rows_kept)
    validator.finish()
    flush_quarantine()
    shards = writer.close()
    manifest = DataManifest(fingerprint=fingerprint, format=cfg.shard_format, shards=shards)
    data.write_json(MANIFEST_FILE, manifest.model_dump(mode="json"))
    for old in data.list():
        if old.startswith("shards-") and old != shard_dir:
            data.remove(old, recursive=True)

    tally = validator.tally
    report = DataReport(
        source=cfg.source,
        fingerprint=fingerprint,
        policy=cfg.validation.policy,
        rows_read=tally.rows_read,
        rows_kept=tally.rows_kept,
        rows_quarantined=tally.rows_quarantined,
        quarantined_by_reason=dict(sorted(tally.by_reason.items())),
        expectation_failures=dict(sorted(tally.expectation_failures.items())),
        duplicate_rate=round(tally.duplicate_rate, 6),
        train_rows=manifest.rows("train"),
        validation_rows=manifest.rows("validation"),
        train_bytes=manifest.bytes("train"),
        validation_bytes=manifest.bytes("validation"),
        shards=len(shards),
        manifest_checksum=manifest.checksum,
        seconds=round(time.perf_counter() - start, 3),
    )
    assert report.rows_read == report.rows_kept + report.rows_quarantined, "row counts must reconcile"
    data.write_json(REPORT_FILE, report.model_dump(mode="json"))
    return report


def _write_quarantine(data: Storage, rel: str, rows: list[tuple[str | None, str]]) -> None:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [t if t is None else t[:QUARANTINE_TEXT_LIMIT] for t, _ in rows]
    table = pa.table({"text": pa.array(texts, pa.string()), "reason": [r for _, r in rows]})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    data.write_bytes(rel, buf.getvalue())
