r"""The prepare-data reading layer: the source cut into deterministic units, each streamed in batches of rows.

A unit is what one worker reads alone: a jsonl byte range, a txt file, parquet row groups, or a hub shard.
Rules:
- a bad row never fails a read: it becomes a `BadRow`.
- invalid UTF-8 becomes U+FFFD, which validation quarantines.
- only a missing file or an unreadable source raises `SourceError`.
- jsonl records end at b"\n" only; blank lines are not rows.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from typing import IO, Any

from hlat.core.config import DataConfig
from hlat.core.storage import Storage, StorageNotFound, storage_errors
from hlat.training.data.sources import SourceError, resolve_source

# Bytes read from a jsonl file at a time; a batch never waits for more than one such read.
READ_BYTES = 4 << 20
# Bytes read around a planned cut to find the next line start (repeated while a line runs on).
CUT_WINDOW = 64 << 10
# Characters of a bad row kept in its BadRow for the report.
EXCERPT_CHARS = 200
# A batch also ends once it holds this many bytes of input, so that a corpus of long documents keeps memory bounded
# whatever data.batch_rows says.
BATCH_BYTES = 64 << 20

_KINDS = {"json": "jsonl", "text": "txt", "parquet": "parquet"}
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_JSON_SPACE = " \t\r\n"
# The C scanner that json.loads runs, without its wrapper: (value, end) of the JSON value at an index.
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Unit:
    """A piece of the source that one worker reads on its own."""

    index: int
    """Position in the plan (0-based)."""
    kind: str
    """"jsonl" | "txt" | "parquet" | "hub"."""
    file: str
    """File URI or path; for "hub", the data set name."""
    start: int = 0
    """jsonl: first byte; parquet: first row group; hub: worker shard index."""
    end: int | None = None
    """jsonl: end byte (None: end of file); parquet: row group end; hub: shard count."""
    size: int = 0
    """Bytes of raw input in this unit (parquet: compressed; hub: 0, unknown)."""

    def label(self) -> str:
        """How messages name the unit: the file, and the part when not whole."""
        if self.kind == "jsonl" and (self.start or self.end is not None):
            end = "end" if self.end is None else str(self.end)
            return f"{self.file} bytes {self.start}-{end}"
        if self.kind == "parquet":
            # Row groups as BadRow numbers them: 1-based, both ends included.
            return f"{self.file} row groups {self.start + 1}-{self.end}"
        if self.kind == "hub":
            return f"{self.file} shard {self.start + 1} of {self.end}"
        return self.file


@dataclass
class BadRow:
    """A row set aside while reading: where it was and what it looked like."""

    reason: str
    """"unparseable_json" | "not_an_object" | "not_a_string" | "corrupt_row_group"."""
    file: str
    line: int
    """jsonl: 1-based line in the unit; parquet: 1-based row group."""
    excerpt: str
    """Up to 200 characters of the raw line, or the error message."""


@dataclass
class Rows:
    """One batch of a unit: the good rows' texts, in order, and the rows set aside."""

    texts: list[str | None]
    """The text column's values, one per good row (None when missing or null)."""
    lines: list[int]
    """Each text's 1-based line (jsonl), row group (parquet) or row number (hub); 1 for txt."""
    bad: list[BadRow]
    """Rows set aside while reading this batch, in order."""
    bytes: int
    """Raw input bytes this batch covered."""
    columns: list[str] = field(default_factory=list)
    """Column names seen in this batch, to name them when data.text_column is wrong."""
    lines_so_far: int = 0
    """jsonl: the unit's lines read so far, blank ones included."""


# -- planning ---------------------------------------------------------------------------------------------
def plan_units(cfg: DataConfig, unit_bytes: int, workers: int = 1) -> list[Unit]:
    """Deterministic units for data.source, in output order; for files independent of `workers`.

    jsonl is cut at line starts and parquet at row groups, about `unit_bytes` each.
    """
    if unit_bytes < 1:
        raise ValueError(f"unit_bytes must be at least 1, got {unit_bytes}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    spec = resolve_source(cfg)
    if spec.kind == "hub":
        return [Unit(index=i, kind="hub", file=spec.name, start=i, end=workers) for i in range(workers)]
    kind = _KINDS[spec.builder or ""]
    units: list[Unit] = []
    for file in spec.data_files:
        if kind == "jsonl":
            ranges = _jsonl_ranges(file, unit_bytes)
        elif kind == "parquet":
            ranges = _row_group_runs(file, unit_bytes)
        else:
            ranges = [(0, None, _size(file))]
        base = len(units)
        units.extend(Unit(base + k, kind, file, s, e, n) for k, (s, e, n) in enumerate(ranges))
    return units


def _jsonl_ranges(file: str, unit_bytes: int) -> list[tuple[int, int | None, int]]:
    size = _size(file)
    starts = [0]
    if size > unit_bytes:
        with _open(file, block_size=CUT_WINDOW) as fh:  # a window per cut, not a whole read-ahead block
            cut = unit_bytes
            while cut < size:
                start = _next_line_start(fh, cut, size)
                if start is None or start >= size:
                    break
                starts.append(start)
                cut = start + unit_bytes
    ends: list[int | None] = [*starts[1:], None]
    return [(s, e, (size if e is None else e) - s) for s, e in zip(starts, ends, strict=True)]


def _next_line_start(fh: IO[bytes], cut: int, size: int) -> int | None:
    """The first line start at or after `cut`, or None."""
    pos = cut - 1
    while pos < size:
        fh.seek(pos)
        window = fh.read(CUT_WINDOW)
        if not window:
            return None
        found = window.find(b"\n")
        if found >= 0:
            return pos + found + 1
        pos += len(window)
    return None


def _row_group_runs(file: str, unit_bytes: int) -> list[tuple[int, int | None, int]]:
    with _parquet(file) as pf:
        meta = pf.metadata
        sizes = [
            sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
            for rg in (meta.row_group(i) for i in range(meta.num_row_groups))
        ]
    runs: list[tuple[int, int | None, int]] = []
    start, acc = 0, 0
    for i, n in enumerate(sizes):
        acc += n
        if acc >= unit_bytes:
            runs.append((start, i + 1, acc))
            start, acc = i + 1, 0
    if start < len(sizes) or not runs:
        runs.append((start, len(sizes), acc))
    return runs


# -- reading ----------------------------------------------------------------------------------------------
def read_unit(unit: Unit, cfg: DataConfig) -> Iterator[Rows]:
    """Stream one unit in batches of about data.batch_rows rows (or BATCH_BYTES); bad rows become BadRows."""
    if unit.kind == "jsonl":
        yield from _read_jsonl(unit, cfg.text_column, cfg.batch_rows)
    elif unit.kind == "txt":
        yield from _read_txt(unit)
    elif unit.kind == "parquet":
        yield from _read_parquet(unit, cfg.text_column, cfg.batch_rows)
    elif unit.kind == "hub":
        yield from _read_hub(unit, cfg)
    else:
        raise ValueError(f"unit {unit.label()}: unknown kind {unit.kind!r}")


def absolute_line(unit: Unit, line_in_unit: int) -> int:
    """A unit's line number in the whole file, for messages."""
    if unit.kind != "jsonl" or unit.start == 0:
        return line_in_unit
    before = 0
    with _open(unit.file) as fh:
        left = unit.start
        while left > 0:
            chunk = fh.read(min(READ_BYTES, left))
            if not chunk:
                break
            before += chunk.count(b"\n")
            left -= len(chunk)
    return before + line_in_unit


def _read_jsonl(unit: Unit, column: str, batch_rows: int) -> Iterator[Rows]:
    batch = _JsonlBatch(unit.file, column)
    for block in _jsonl_blocks(unit):
        i, n = 0, len(block.lines)
        while i < n:
            j = min(n, i + max(1, batch_rows - batch.rows))
            batch.add(block.lines[i:j], block.escapes)
            batch.bytes += block.bytes_of(i, j)
            i = j
            if batch.rows >= batch_rows or batch.bytes >= BATCH_BYTES:
                yield batch.take()
    if batch.rows or batch.bytes:
        yield batch.take()


class _Block:
    r"""Whole lines of a jsonl file from one read, decoded at once: faster than line by line, and exact."""

    def __init__(self, raw: bytes | memoryview, first: bool) -> None:
        self.raw = raw
        self.size = len(raw)
        text = codecs.utf_8_decode(raw, "replace", True)[0]
        self.lines = text.split("\n")
        self.ends_line = text.endswith("\n")
        if self.ends_line:
            self.lines.pop()
        if first and self.lines and self.lines[0].startswith("\ufeff"):
            self.lines[0] = self.lines[0][1:]  # a UTF-8 byte order mark opens the file
        # Whether a JSON escape here may be a lone surrogate ("\udc80"): only then are texts searched for one.
        self.escapes = _SURROGATE_ESCAPE.search(raw) is not None
        self._sizes: list[int] | None = None

    def bytes_of(self, i: int, j: int) -> int:
        """Bytes of lines i to j (exclusive), newlines included."""
        if i == 0 and j == len(self.lines):
            return self.size
        if self._sizes is None:
            parts = bytes(self.raw).split(b"\n")
            if self.ends_line:
                parts.pop()
            self._sizes = [len(p) + 1 for p in parts]
            if not self.ends_line:
                self._sizes[-1] -= 1
        return sum(self._sizes[i:j])


def _jsonl_blocks(unit: Unit) -> Iterator[_Block]:
    """The unit's lines, one read at a time."""
    with _open(unit.file) as fh:
        fh.seek(unit.start)
        left = None if unit.end is None else unit.end - unit.start
        pending: list[bytes] = []  # the start of a line that runs on past the last read
        first = unit.start == 0
        while left is None or left > 0:
            chunk = fh.read(READ_BYTES if left is None else min(READ_BYTES, left))
            if not chunk:
                break
            if left is not None:
                left -= len(chunk)
            cut = chunk.rfind(b"\n") + 1
            if not cut:
                pending.append(chunk)
                continue
            head = memoryview(chunk)[:cut]
            yield _Block(b"".join([*pending, head]) if pending else head, first)
            pending = [chunk[cut:]] if cut < len(chunk) else []
            first = False
        if pending:  # the file's last line, without a b"\n"
            yield _Block(b"".join(pending), first)


class _JsonlBatch:
    """Parses lines into one batch's Rows; line numbers run on across batches."""

    def __init__(self, file: str, column: str) -> None:
        self.file, self.column = file, column
        self.line = 0  # lines of the unit so far, blank ones included
        self._reset()

    def _reset(self) -> None:
        self.texts: list[str | None] = []
        self.lines: list[int] = []
        self.bad: list[BadRow] = []
        self.columns: dict[str, None] = {}
        self.rows = 0  # lines in this batch, blank ones included
        self.bytes = 0

    def add(self, lines: list[str], escapes: bool) -> None:
        scan, column, texts, numbers, columns, bad = _scan, self.column, self.texts, self.lines, self.columns, []
        n = self.line
        for text in lines:
            n += 1
            try:
                # The C scanner of json.loads, without its wrapper: a line that does not start with a value (blank,
                # leading whitespace) or has anything after it takes json.loads' own way below.
                obj, end = scan(text, 0)
                if end != len(text):
                    raise StopIteration(end)
            except StopIteration:
                if not text.strip(_JSON_SPACE):
                    continue  # a blank line is not a row
                try:
                    obj = json.loads(text)
                except (ValueError, RecursionError):
                    bad.append(BadRow("unparseable_json", self.file, n, text[:EXCERPT_CHARS]))
                    continue
            except (ValueError, RecursionError):
                bad.append(BadRow("unparseable_json", self.file, n, text[:EXCERPT_CHARS]))
                continue
            if type(obj) is not dict:
                bad.append(BadRow("not_an_object", self.file, n, text[:EXCERPT_CHARS]))
                continue
            if len(columns) < 100:  # the first keys seen are enough to name the columns
                columns.update(dict.fromkeys(obj))
            value = obj.get(column)
            if value is None or type(value) is str:
                if escapes and value is not None and not value.isascii():
                    # A JSON escape of a lone surrogate gives a str that UTF-8 cannot encode (pandas and pyarrow
                    # refuse it): U+FFFD takes its place, as for an invalid byte.
                    value = _SURROGATE.sub("\ufffd", value)
                texts.append(value)
                numbers.append(n)
            else:
                bad.append(BadRow("not_a_string", self.file, n, text[:EXCERPT_CHARS]))
        self.bad.extend(bad)
        self.rows += n - self.line
        self.line = n

    def take(self) -> Rows:
        rows = Rows(self.texts, self.lines, self.bad, self.bytes, list(self.columns), self.line)
        self._reset()
        return rows


def _read_txt(unit: Unit) -> Iterator[Rows]:
    with _open(unit.file) as fh:
        data = fh.read()
    yield Rows([data.decode("utf-8", errors="replace")], [1], [], len(data), ["text"])


def _read_parquet(unit: Unit, column: str, batch_rows: int) -> Iterator[Rows]:
    import pyarrow as pa

    with _parquet(unit.file) as pf:
        names = list(pf.schema_arrow.names)
        for rg in range(unit.start, unit.end if unit.end is not None else pf.metadata.num_row_groups):
            group = pf.metadata.row_group(rg)
            size = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
            if column not in names:  # no row has the text: None texts, and `columns` says which columns there are
                values: list[Any] = [None] * group.num_rows
            else:
                try:
                    # The whole row group at once: a corrupt page sets the group aside before any of its rows is used.
                    values = pf.read_row_group(rg, columns=[column]).column(0).to_pylist()
                except (pa.ArrowException, OSError, ValueError) as exc:
                    excerpt = f"{type(exc).__name__}: {exc}"[:EXCERPT_CHARS]
                    yield Rows([], [], [BadRow("corrupt_row_group", unit.file, rg + 1, excerpt)], size, names)
                    continue
            texts = [_as_text(v) for v in values]
            # The row group's bytes are shared out by rows, so that the batches add up to the unit's size.
            n = max(1, len(texts))
            for a, b in pairwise([*range(0, len(texts), batch_rows), len(texts)] if texts else [0, 0]):
                share = (size * b) // n - (size * a) // n if texts else size
                yield Rows(texts[a:b], [rg + 1] * (b - a), [], share, names)


def _read_hub(unit: Unit, cfg: DataConfig) -> Iterator[Rows]:
    import datasets
    from datasets.distributed import split_dataset_by_node

    from hlat.training.data.sources import _guarded, _open_hub

    dataset = _open_hub(cfg, datasets)
    if (unit.end or 1) > 1:
        dataset = split_dataset_by_node(dataset, rank=unit.start, world_size=unit.end)
    row = 0
    for batch in _guarded(dataset.iter(batch_size=cfg.batch_rows), cfg.source):
        names = list(batch)
        n = len(batch[names[0]]) if names else 0
        texts = [_as_text(v) for v in batch.get(cfg.text_column, [None] * n)]
        size = sum(len(t.encode("utf-8")) for t in texts if t is not None)
        yield Rows(texts, list(range(row + 1, row + n + 1)), [], size, names)
        row += n


def _as_text(value: Any) -> str | None:
    """A parquet or hub cell as text: bad bytes as U+FFFD, other types through str()."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    if type(value) is str:
        return value if value.isascii() or not _SURROGATE.search(value) else _SURROGATE.sub("\ufffd", value)
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)


# -- files ------------------------------------------------------------------------------------------------
@contextmanager
def _storage(file: str) -> Iterator[tuple[Any, str]]:
    """(fs, path) of a source file: missing is a SourceError; other faults keep their kind for retries."""
    store = Storage(file)
    try:
        with storage_errors(file):
            yield store.fs, store.root
    except StorageNotFound as exc:
        raise SourceError(f"data.source: {file} does not exist") from exc


def _size(file: str) -> int:
    with _storage(file) as (fs, path):
        return int(fs.size(path))


@contextmanager
def _open(file: str, block_size: int = READ_BYTES) -> Iterator[IO[bytes]]:
    """A source file for reading; `block_size` is each remote read's size."""
    with _storage(file) as (fs, path), fs.open(path, "rb", block_size=block_size) as fh:
        yield fh


@contextmanager
def _parquet(file: str) -> Iterator[Any]:
    """A pyarrow ParquetFile; an unreadable footer is a SourceError."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _open(file) as fh:
        try:
            pf = pq.ParquetFile(fh, page_checksum_verification=True)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise SourceError(f"data.source: cannot read {file}: {type(exc).__name__}: {exc}"[:400]) from exc
        yield pf
