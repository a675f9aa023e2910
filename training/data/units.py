"""The prepare-data body of one source: units cut, validated and sharded, then curated, then merged.

Rules:
- `plan` cuts the source into deterministic units; `assign` deals them out, largest first.
- a unit commits with `unit.json`, written last, and is never redone.
- the output depends on the plan alone, not on worker count or restarts.
- a failed source leaves the previous manifest and shards untouched.
docs/stages.md ("prepare-data") explains the stage.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

import pandas as pd
from pydantic import BaseModel, Field

from hlat.core.config import DataConfig, SourceConfig
from hlat.core.layout import MANIFEST_FILE, REPORT_FILE
from hlat.core.shards import (
    DataManifest,
    MixtureManifest,
    MixtureSource,
    ShardInfo,
    ShardWriter,
    read_manifest,
    shard_texts,
)
from hlat.core.storage import Storage
from hlat.training.data.reader import BadRow, Unit, absolute_line, plan_units, read_unit
from hlat.training.data.validation import DataValidationError, DocumentValidator, ValidationTally, check_totals

if TYPE_CHECKING:
    from hlat.training.data.curation import CurationResult

log = logging.getLogger("hlat.data")

PLAN_FILE = "plan.json"
UNIT_FILE = "unit.json"
QUARANTINE_TEXT_LIMIT = 65_536  # characters of a quarantined row kept for inspection
EXAMPLES_PER_UNIT = 20  # set-aside rows named (file and line) in a unit's record, and so in the report


def work_dir(fingerprint: str) -> str:
    """The folder of one key's units."""
    return f"work-{fingerprint[-12:]}"


class BadExample(BaseModel):
    reason: str
    file: str
    line: int
    """1-based line in the unit (parquet: row group)."""
    excerpt: str = ""


class UnitResult(BaseModel):
    """What one unit produced: its commit record (unit.json)."""

    index: int
    label: str
    file: str
    kind: str
    start: int
    rows_read: int
    rows_kept: int
    non_null_rows: int
    quarantined_by_reason: dict[str, int]
    expectation_failures: dict[str, int]
    lines: int
    """jsonl: the unit's lines, blank ones included."""
    bytes: int
    seconds: float
    worker: int
    job: str = ""
    """The job that committed the unit (empty outside a job)."""
    shards: list[ShardInfo]
    quarantine: list[str]
    examples: list[BadExample]


class WorkerReport(BaseModel):
    worker: int
    units: int
    bytes: int
    rows_read: int
    seconds: float
    mb_per_s: float


class DataReport(BaseModel):
    """What prepare-data did; rows_read == rows_kept + rows_quarantined, also per reason."""

    source: str
    fingerprint: str
    policy: str
    rows_read: int
    rows_kept: int
    rows_quarantined: int
    quarantined_by_reason: dict[str, int]
    expectation_failures: dict[str, int]
    duplicate_rate: float
    cross_unit_duplicates: int = 0
    """Exact duplicates across the whole source, found by curation."""
    train_rows: int
    validation_rows: int
    train_bytes: int
    validation_bytes: int
    shards: int
    units: int = 1
    raw_bytes: int = 0
    workers: list[WorkerReport] = Field(default_factory=list)
    examples: list[BadExample] = Field(default_factory=list)
    """The first set-aside rows with their file and line."""
    manifest_checksum: str
    seconds: float
    curation_seconds: dict[str, float] = Field(default_factory=dict)
    """Seconds of each curation phase."""
    name: str = ""
    """The source's name (a source's report); empty in a run's report."""
    sources: list[DataReport] = Field(default_factory=list)
    """A run's report: each source's report."""


def held_out(sha256: bytes, validation_fraction: float) -> bool:
    """Held-out membership by the text's sha256: stable across re-runs."""
    return int.from_bytes(sha256[:8], "big") < validation_fraction * 2**64


def assign_split(text: str, validation_fraction: float) -> str:
    """The split of `text` (see held_out)."""
    return "validation" if held_out(hashlib.sha256(text.encode("utf-8")).digest(), validation_fraction) else "train"


# -- the plan ---------------------------------------------------------------------------------------------------
def plan(cfg: DataConfig, data: Storage, work: str) -> list[Unit]:
    """The units of `work`, planned once: a restarted job reads the same plan."""
    rel = f"{work}/{PLAN_FILE}"
    if data.exists(rel):
        return [Unit(**u) for u in data.read_json(rel)["units"]]
    units = plan_units(cfg, cfg.unit_mb * 2**20, cfg.workers)
    data.write_json(rel, {"source": cfg.source, "units": [asdict(u) for u in units]})
    return units


def assign(units: list[Unit], workers: int) -> list[list[Unit]]:
    """Units per worker: largest first to the least loaded, each list in plan order."""
    load = [0] * workers
    shares: list[list[Unit]] = [[] for _ in range(workers)]
    for unit in sorted(units, key=lambda u: (-u.size, u.index)):
        w = min(range(workers), key=lambda i: (load[i], i))
        shares[w].append(unit)
        load[w] += max(unit.size, 1)
    return [sorted(share, key=lambda u: u.index) for share in shares]


def unit_dir(work: str, unit: Unit | int) -> str:
    index = unit if isinstance(unit, int) else unit.index
    return f"{work}/units/{index:06d}"


def committed(data: Storage, work: str, unit: Unit) -> UnitResult | None:
    rel = f"{unit_dir(work, unit)}/{UNIT_FILE}"
    return UnitResult.model_validate(data.read_json(rel)) if data.exists(rel) else None


# -- one unit -----------------------------------------------------------------------------------------------------
def prepare_unit(
    cfg: DataConfig,
    data: Storage,
    work: str,
    unit: Unit,
    worker: int = 0,
    limit: int | None = None,
    on_batch: Callable[[Unit, int], None] = lambda unit, rows: None,
    job: str = "",
) -> UnitResult:
    """Read, validate and shard one unit (at most `limit` rows), then commit it; committed units return as they are."""
    done = committed(data, work, unit)
    if done is not None:
        return done
    start = time.perf_counter()
    folder = unit_dir(work, unit)
    if data.exists(folder):  # what a worker that died left of this unit
        data.remove(folder, recursive=True)
    writer = ShardWriter(data, folder, cfg.shard_format, cfg.shard_rows)
    # The stage's policy is applied here, where each row's file and line are known.
    validator = DocumentValidator(cfg.validation.model_copy(update={"policy": "quarantine"}), cfg.text_column)
    quarantine = QuarantineWriter(data, folder, unit.file)
    examples: list[BadExample] = []
    unreadable: Counter[str] = Counter()
    rows_read = lines = raw = 0
    for batch in read_unit(unit, cfg):
        if rows_read == 0 and batch.columns:
            validator.check_columns(pd.DataFrame(columns=batch.columns))  # the text column is in the source
        raw += batch.bytes
        lines = batch.lines_so_far
        texts, where = batch.texts, batch.lines
        if limit is not None and rows_read + len(texts) + len(batch.bad) > limit:
            texts, where, bad = _cut(texts, where, batch.bad, limit - rows_read)
        else:
            bad = batch.bad
        for row in bad:
            unreadable[row.reason] += 1
            quarantine.add(row.excerpt, row.reason, row.line)
            _example(examples, row.reason, unit.file, row.line, row.excerpt)
        if bad and cfg.validation.policy == "fail":
            raise _refused(cfg, unit, bad[0].line, bad[0].reason)
        rows_read += len(texts) + len(bad)
        if texts:
            outcome = validator.validate(pd.DataFrame({cfg.text_column: pd.Series(texts, dtype=object)}))
            for i, (text, reason) in zip(outcome.quarantined_index, outcome.quarantined, strict=True):
                quarantine.add(text, reason, where[i])
                _example(examples, reason, unit.file, where[i], text or "")
            if outcome.quarantined and cfg.validation.policy == "fail":
                first = outcome.quarantined_index[0]
                raise _refused(cfg, unit, where[first], outcome.quarantined[0][1])
            # The validator's sha256 of each kept text: its first 8 bytes are assign_split's hash.
            for text, sha in zip(outcome.kept, outcome.kept_digests, strict=True):
                writer.add(text, "validation" if held_out(sha, cfg.validation_fraction) else "train")
        on_batch(unit, rows_read)
        if limit is not None and rows_read >= limit:
            break
    shards = writer.close()
    tally = validator.tally
    by_reason = tally.by_reason + unreadable
    result = UnitResult(
        index=unit.index,
        label=unit.label(),
        file=unit.file,
        kind=unit.kind,
        start=unit.start,
        rows_read=rows_read,
        rows_kept=tally.rows_kept,
        non_null_rows=tally.non_null_rows,
        quarantined_by_reason=dict(sorted(by_reason.items())),
        expectation_failures=dict(sorted(tally.expectation_failures.items())),
        lines=lines,
        bytes=raw,
        seconds=round(time.perf_counter() - start, 3),
        worker=worker,
        job=job,
        shards=shards,
        quarantine=quarantine.close(),
        examples=examples,
    )
    assert result.rows_read == result.rows_kept + sum(by_reason.values()), "a unit's row counts must reconcile"
    data.write_json(f"{folder}/{UNIT_FILE}", result.model_dump(mode="json"))  # the commit
    return result


def _cut(
    texts: list[str | None], lines: list[int], bad: list[BadRow], room: int
) -> tuple[list[str | None], list[int], list[BadRow]]:
    """The first `room` rows of a batch, good and bad."""
    rows = sorted([(line, 0, i) for i, line in enumerate(lines)] + [(b.line, 1, i) for i, b in enumerate(bad)])
    keep = rows[: max(room, 0)]
    good = [i for _, kind, i in keep if kind == 0]
    return [texts[i] for i in good], [lines[i] for i in good], [bad[i] for _, kind, i in keep if kind == 1]


def _example(examples: list[BadExample], reason: str, file: str, line: int, text: str) -> None:
    if len(examples) < EXAMPLES_PER_UNIT:
        examples.append(BadExample(reason=reason, file=file, line=line, excerpt=text[:200]))


REFUSALS = {
    "null": "has no text",
    "invalid_utf8": "is not valid UTF-8",
    "too_short": "is shorter than data.validation.min_chars",
    "too_long": "is longer than data.validation.max_chars",
    "duplicate": "is an exact duplicate of an earlier document",
    "unparseable_json": "is not valid JSON",
    "not_an_object": "is not a JSON object",
    "corrupt_row_group": "cannot be read",
}
"""What a bad row is, by reason, for the 'fail' policy's message."""


def _refused(cfg: DataConfig, unit: Unit, line: int, reason: str) -> DataValidationError:
    where = {"parquet": f" row group {line}", "txt": ""}.get(unit.kind, f" line {absolute_line(unit, line)}")
    what = REFUSALS.get(reason, f"breaks the expectation {reason}")
    return DataValidationError(
        f"data.validation.policy='fail': {unit.file}{where} {what}; fix the source or set "
        "data.validation.policy=quarantine to set such rows aside"
    )


class QuarantineWriter:
    """A unit's set-aside rows, with reason and line, in parquet files."""

    def __init__(self, data: Storage, folder: str, file: str, rows_per_file: int = 50_000) -> None:
        self.data, self.folder, self.file, self.rows_per_file = data, folder, file, rows_per_file
        self.rows: list[tuple[str | None, str, int]] = []
        self.files: list[str] = []

    def add(self, text: str | None, reason: str, line: int) -> None:
        self.rows.append((text, reason, line))
        if len(self.rows) >= self.rows_per_file:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table(
            {
                "text": pa.array([t if t is None else t[:QUARANTINE_TEXT_LIMIT] for t, _, _ in self.rows], pa.string()),
                "reason": [r for _, r, _ in self.rows],
                "file": [self.file] * len(self.rows),
                "line": pa.array([n for _, _, n in self.rows], pa.int64()),
            }
        )
        rel = f"{self.folder}/quarantine-{len(self.files):05d}.parquet"
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        self.data.write_bytes(rel, buf.getvalue())
        self.files.append(rel)
        self.rows = []

    def close(self) -> list[str]:
        self.flush()
        return self.files


# -- one worker, and the whole stage in this process -------------------------------------------------------------
def run_worker(
    cfg: DataConfig,
    data: Storage,
    work: str,
    units: list[Unit],
    worker: int,
    limit: int | None = None,
    on_batch: Callable[[Unit, int], None] = lambda unit, rows: None,
    job: str = "",
) -> list[UnitResult]:
    """Prepare `units` in order, skipping committed ones; with `limit`, stop after that many rows."""
    results: list[UnitResult] = []
    read = 0
    for unit in units:
        if limit is not None and read >= limit:
            break
        was = committed(data, work, unit)
        room = None if limit is None else limit - read
        result = was or prepare_unit(cfg, data, work, unit, worker, room, on_batch, job)
        log.info(
            "worker %d: unit %d (%s) %s: %d rows read, %d kept", worker, unit.index, unit.label(),
            "committed before" if was else f"done in {result.seconds:.1f} s", result.rows_read, result.rows_kept,
        )  # fmt: skip
        results.append(result)
        read += result.rows_read
    return results


def prepare_dataset(
    cfg: DataConfig, data: Storage, fingerprint: str, evaluation_tasks: tuple[str, ...] = ()
) -> DataReport:
    """One source, the whole stage in this process."""
    start = time.time()
    work = work_dir(fingerprint)
    units = plan(cfg, data, work)
    run_worker(cfg, data, work, units, worker=0, limit=cfg.max_documents)
    curated = curate_units(cfg, data, work, units, evaluation_tasks=evaluation_tasks)
    return merge(cfg, data, work, units, fingerprint, started=start, curated=curated)


CONTAMINATION_DOCUMENTS = 2000
"""Held-out documents per source that offline evaluation tasks may quote."""


def curate_units(
    cfg: DataConfig,
    data: Storage,
    work: str,
    units: list[Unit],
    *,
    evaluation_tasks: tuple[str, ...] | list[str] = (),
    host: int = 0,
    hosts: int = 1,
    workers: int = 1,
) -> CurationResult | None:
    """Curate a source's committed units, this host running its share; None when every rule is off."""
    if not cfg.curation.any_rule:
        return None
    from hlat.training.data.curation import contamination_texts, curate

    results = _results(cfg, data, work, units)
    inputs = [s for r in results for s in r.shards]
    contamination = None
    if cfg.curation.decontaminate:
        held_out = (t for s in inputs if s.split == "validation" for t in shard_texts(data, s, cfg.shard_format))
        texts, missing = contamination_texts(
            list(evaluation_tasks), itertools.islice(held_out, CONTAMINATION_DOCUMENTS), None
        )
        if missing:
            log.warning("decontamination: the texts of %s are not available offline here; not checked", missing)
        contamination = texts
    return curate(
        cfg.curation, data, work, inputs, cfg.shard_format, cfg.shard_rows, tasks=len(results), workers=workers,
        host=host, hosts=hosts, contamination=contamination, text_column="text",
    )  # fmt: skip


def prepared(folder: Storage, key: str) -> bool:
    """Whether `folder` holds a source prepared under `key`."""
    if not folder.exists(REPORT_FILE) or not folder.exists(MANIFEST_FILE):
        return False
    return bool(folder.read_json(REPORT_FILE).get("fingerprint") == key == read_manifest(folder).fingerprint)


def write_mixture(cfg: DataConfig, data: Storage, sources: list[tuple[SourceConfig, Storage]], key: str) -> DataReport:
    """Write the run's mixture manifest, then its report."""
    reports, entries = [], []
    for source, folder in sources:
        manifest = read_manifest(folder)
        report = DataReport.model_validate(folder.read_json(REPORT_FILE))
        name = source.resolved_name
        reports.append(report.model_copy(update={"name": name}))
        entries.append(
            MixtureSource(
                name=name, weight=source.weight, max_epochs=source.max_epochs, folder=folder.uri(),
                fingerprint=manifest.fingerprint, checksum=manifest.checksum, train_rows=manifest.rows("train"),
                validation_rows=manifest.rows("validation"), train_bytes=manifest.bytes("train"),
                validation_bytes=manifest.bytes("validation"),
            )
        )  # fmt: skip
    mixture = MixtureManifest(
        fingerprint=key, sources=entries, schedule=[e.model_dump(mode="json") for e in cfg.schedule]
    )
    data.write_json(MANIFEST_FILE, mixture.model_dump(mode="json"))
    for old in data.list():
        if old.startswith(("work-", "shards-")):
            data.remove(old, recursive=True)
    report = combined_report(reports, key, mixture.checksum, cfg.validation.policy)
    data.write_json(REPORT_FILE, report.model_dump(mode="json"))
    return report


def combined_report(reports: list[DataReport], key: str, checksum: str, policy: str) -> DataReport:
    """The run's report: the sources' counts added up."""

    def total(field: str) -> int:
        return sum(int(getattr(r, field)) for r in reports)

    def merged(field: str) -> dict[str, int]:
        out: Counter[str] = Counter()
        for r in reports:
            out.update(getattr(r, field))
        return dict(sorted(out.items()))

    read = total("rows_read")
    duplicates = merged("quarantined_by_reason").get("duplicate", 0)
    return DataReport(
        source=", ".join(r.name for r in reports),
        fingerprint=key,
        policy=policy,
        rows_read=read,
        rows_kept=total("rows_kept"),
        rows_quarantined=total("rows_quarantined"),
        quarantined_by_reason=merged("quarantined_by_reason"),
        expectation_failures=merged("expectation_failures"),
        duplicate_rate=round(duplicates / read, 6) if read else 0.0,
        cross_unit_duplicates=total("cross_unit_duplicates"),
        train_rows=total("train_rows"),
        validation_rows=total("validation_rows"),
        train_bytes=total("train_bytes"),
        validation_bytes=total("validation_bytes"),
        shards=total("shards"),
        units=total("units"),
        raw_bytes=total("raw_bytes"),
        workers=[w for r in reports for w in r.workers],
        examples=[e for r in reports for e in r.examples][:100],
        manifest_checksum=checksum,
        seconds=round(sum(r.seconds for r in reports), 3),
        sources=reports,
    )


# -- the merge ----------------------------------------------------------------------------------------------------
def merge(
    cfg: DataConfig,
    data: Storage,
    work: str,
    units: list[Unit],
    fingerprint: str,
    started: float,
    curated: CurationResult | None = None,
) -> DataReport:
    """The source's manifest, then its report, from its units and what curation kept.

    Data-set-level rules fail here, before the manifest.
    """
    results = _results(cfg, data, work, units)
    removed = {RULE_REASONS.get(rule, rule): n for rule, n in (curated.removed if curated else {}).items()}
    shards = curated.shards if curated is not None else [s for r in results for s in r.shards]
    tally = ValidationTally()
    for r in results:
        tally.rows_read += r.rows_read
        tally.non_null_rows += r.non_null_rows
        tally.by_reason.update(r.quarantined_by_reason)
        tally.expectation_failures.update(r.expectation_failures)
    cross = removed.get("duplicate", 0)
    tally.by_reason.update(removed)
    tally.expectation_failures["duplicate"] += cross
    tally.by_reason = +tally.by_reason
    tally.expectation_failures = +tally.expectation_failures
    tally.rows_kept = tally.rows_read - tally.rows_quarantined
    check_totals(tally, cfg.validation)

    manifest = DataManifest(fingerprint=fingerprint, format=cfg.shard_format, shards=shards)
    assert manifest.rows("train") + manifest.rows("validation") == tally.rows_kept, "the manifest must hold every row"
    data.write_json(MANIFEST_FILE, manifest.model_dump(mode="json"))
    for old in data.list():
        if old.startswith(("work-", "shards-")) and old != work:
            data.remove(old, recursive=True)

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
        cross_unit_duplicates=cross,
        train_rows=manifest.rows("train"),
        validation_rows=manifest.rows("validation"),
        train_bytes=manifest.bytes("train"),
        validation_bytes=manifest.bytes("validation"),
        shards=len(shards),
        units=len(results),
        raw_bytes=sum(r.bytes for r in results),
        workers=_per_worker(results),
        examples=(_examples(results) + _rule_examples(curated))[:100] if curated else _examples(results)[:100],
        curation_seconds=curated.seconds if curated else {},
        manifest_checksum=manifest.checksum,
        seconds=round(time.time() - started, 3),
    )
    assert report.rows_read == report.rows_kept + report.rows_quarantined, "row counts must reconcile"
    data.write_json(REPORT_FILE, report.model_dump(mode="json"))
    return report


def _results(cfg: DataConfig, data: Storage, work: str, units: list[Unit]) -> list[UnitResult]:
    """The committed units in plan order (with max_documents, the prefix read)."""
    results: list[UnitResult] = []
    for unit in units:
        result = committed(data, work, unit)
        if result is None:
            if cfg.max_documents is not None and sum(r.rows_read for r in results) >= cfg.max_documents:
                break
            raise RuntimeError(f"prepare-data: unit {unit.index} ({unit.label()}) has no {UNIT_FILE}: not prepared")
        results.append(result)
    return results


RULE_REASONS = {"exact_dedup": "duplicate"}
"""Curation rules reported under another name."""


def _rule_examples(curated: CurationResult | None) -> list[BadExample]:
    """A few documents each curation rule removed."""
    if curated is None:
        return []
    return [
        BadExample(reason=RULE_REASONS.get(rule, rule), file="", line=0, excerpt=text[:200])
        for rule, texts in sorted(curated.examples.items())
        for text in texts
    ]


def _per_worker(results: list[UnitResult]) -> list[WorkerReport]:
    out = []
    for w in sorted({r.worker for r in results}):
        mine = [r for r in results if r.worker == w]
        seconds = sum(r.seconds for r in mine)
        size = sum(r.bytes for r in mine)
        out.append(
            WorkerReport(
                worker=w,
                units=len(mine),
                bytes=size,
                rows_read=sum(r.rows_read for r in mine),
                seconds=round(seconds, 3),
                mb_per_s=round(size / 1e6 / seconds, 2) if seconds else 0.0,
            )
        )
    return out


def _examples(results: list[UnitResult]) -> list[BadExample]:
    """Set-aside rows with their line in the whole file."""
    before: dict[str, int] = {}
    out: list[BadExample] = []
    for r in results:
        offset = before.get(r.file, 0) if r.kind == "jsonl" else 0
        out.extend(e.model_copy(update={"line": e.line + offset}) for e in r.examples)
        if r.kind == "jsonl":
            before[r.file] = offset + r.lines
    return out
