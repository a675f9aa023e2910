"""The reading layer of prepare-data: deterministic units, and rows read from them without failing on a bad one."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hlat.core.config import DataConfig
from hlat.training.data.reader import BadRow, Rows, Unit, absolute_line, plan_units, read_unit
from hlat.training.data.sources import SourceError
from tests.integration.conftest import S3Env, s3_env, s3_server  # noqa: F401 (fixtures: a moto S3 server)


def cfg_for(source: Path | str, **overrides: Any) -> DataConfig:
    return DataConfig(source=str(source), **overrides)


def doc(i: int) -> str:
    # Varied lengths, so that cuts land anywhere in a line; some non-ASCII, so that bytes and characters differ.
    return f"document {i}: " + "naïve café " * (i % 7) + "x" * (i * 37 % 300)


def write_lines(path: Path, lines: list[bytes], newline_at_end: bool = True) -> Path:
    path.write_bytes(b"\n".join(lines) + (b"\n" if newline_at_end else b""))
    return path


def jsonl(rows: list[Any]) -> list[bytes]:
    return [json.dumps(r, ensure_ascii=False).encode() for r in rows]


def read_all(units: list[Unit], cfg: DataConfig) -> list[tuple[Unit, Rows]]:
    return [(u, rows) for u in units for rows in read_unit(u, cfg)]


# -- plan_units -----------------------------------------------------------------------------------------------
def test_a_large_jsonl_file_is_cut_at_line_starts_and_every_line_is_read_once(tmp_path: Path) -> None:
    texts = [doc(i) for i in range(300)]
    src = write_lines(tmp_path / "c.jsonl", jsonl([{"text": t, "id": i} for i, t in enumerate(texts)]))
    data = src.read_bytes()
    cfg = cfg_for(src, batch_rows=16)
    units = plan_units(cfg, unit_bytes=2000)
    assert len(units) > 10 and [u.index for u in units] == list(range(len(units)))
    assert units[0].start == 0 and units[-1].end is None
    for before, after in pairwise(units):
        assert before.end == after.start and data[after.start - 1 : after.start] == b"\n"  # a line start
        assert before.size == before.end - before.start >= 2000
    assert sum(u.size for u in units) == len(data)
    assert units[1].label() == f"{src} bytes {units[1].start}-{units[1].end}"
    assert units[-1].label() == f"{src} bytes {units[-1].start}-end"

    read = read_all(units, cfg)
    assert [t for _, rows in read for t in rows.texts] == texts
    assert all(len(rows.texts) <= 16 and not rows.bad for _, rows in read)
    assert sum(rows.bytes for _, rows in read) == len(data)
    lines = [absolute_line(u, n) for u, rows in read for n in rows.lines]
    assert lines == list(range(1, 301))
    # The plan of files does not depend on the number of workers, and survives a round trip as a dict.
    assert plan_units(cfg, 2000, workers=7) == units
    assert [Unit(**asdict(u)) for u in units] == units


def test_cuts_inside_a_line_longer_than_a_unit_and_a_small_file(tmp_path: Path) -> None:
    long = "y" * 5000
    src = write_lines(tmp_path / "c.jsonl", jsonl([{"text": "first"}, {"text": long}, {"text": "last"}]), False)
    cfg = cfg_for(src)
    units = plan_units(cfg, unit_bytes=1000)
    assert [t for _, rows in read_all(units, cfg) for t in rows.texts] == ["first", long, "last"]
    assert all(u.size > 0 for u in units) and len(units) == 2  # no empty unit from the cuts inside the long line
    whole = plan_units(cfg, unit_bytes=10**6)
    assert whole == [Unit(0, "jsonl", str(src), 0, None, src.stat().st_size)] and whole[0].label() == str(src)


def test_a_bad_line_is_set_aside_with_its_line_in_the_first_and_in_a_later_unit(tmp_path: Path) -> None:
    lines = jsonl([{"text": doc(i)} for i in range(60)])
    lines[4] = b'{"text": "unterminated'
    lines[50] = b'{"text": "ok"} trailing'
    src = write_lines(tmp_path / "c.jsonl", lines)
    cfg = cfg_for(src, batch_rows=7)
    units = plan_units(cfg, unit_bytes=3000)
    found = [(u, b) for u, rows in read_all(units, cfg) for b in rows.bad]
    assert [b.reason for _, b in found] == ["unparseable_json", "unparseable_json"]
    (first_unit, first), (later_unit, later) = found
    assert first_unit.index == 0 and first.line == 5 and first.excerpt == '{"text": "unterminated'
    assert later_unit.index > 0 and later.line < 51 and absolute_line(later_unit, later.line) == 51
    assert later.file == str(src) and later.excerpt == '{"text": "ok"} trailing'
    kept = [t for _, rows in read_all(units, cfg) for t in rows.texts]
    assert len(kept) == 58 and doc(4) not in kept


def test_row_level_oddities_keep_the_semantics_of_the_datasets_reader(tmp_path: Path) -> None:
    lines = [
        b'\xef\xbb\xbf{"text": "after a byte order mark"}',
        b'{"text": "bad \xff\xfe bytes"}',
        b'{"other": "no text key"}',
        b"",
        b"   \r",
        b'{"text": null}',
        b'{"text": "a lone \\udc80 surrogate", "x": 1}',
        b'{"text": "a real pair \\ud83d\\ude00"}',
        b'["not", "an object"]',
        b'{"text": 42}',
        b'{"text": "windows line end"}\r',
        b'  {"text": "leading blanks"}',
        b'{"text": "no newline at the end"}',
    ]
    src = write_lines(tmp_path / "c.jsonl", lines, newline_at_end=False)
    (rows,) = list(read_unit(plan_units(cfg_for(src), 1 << 20)[0], cfg_for(src)))
    assert rows.texts == [
        "after a byte order mark",
        "bad \ufffd\ufffd bytes",
        None,
        None,
        "a lone \ufffd surrogate",
        "a real pair \U0001f600",
        "windows line end",
        "leading blanks",
        "no newline at the end",
    ]
    assert rows.lines == [1, 2, 3, 6, 7, 8, 11, 12, 13]  # blank lines 4 and 5 are not rows, but are lines
    assert [(b.reason, b.line) for b in rows.bad] == [("not_an_object", 9), ("not_a_string", 10)]
    assert rows.bytes == src.stat().st_size and rows.columns == ["text", "other", "x"]


def test_batches_hold_at_most_batch_rows_lines_and_number_lines_on(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "c.jsonl", jsonl([{"text": doc(i)} for i in range(25)]))
    batches = list(read_unit(plan_units(cfg_for(src), 1 << 20)[0], cfg_for(src, batch_rows=10)))
    assert [len(b.texts) for b in batches] == [10, 10, 5]
    assert batches[2].lines == [21, 22, 23, 24, 25]
    assert sum(b.bytes for b in batches) == src.stat().st_size


# -- parquet --------------------------------------------------------------------------------------------------
def write_parquet(path: Path, texts: Sequence[str | None], group_rows: int) -> Path:
    table = pa.table({"id": list(range(len(texts))), "text": pa.array(texts, pa.string())})
    # Plain pages without statistics: a page is then a small header and its compressed values, which the test below
    # corrupts (a checksum of each page lets the reader tell).
    pq.write_table(
        table,
        path,
        row_group_size=group_rows,
        compression="zstd",
        use_dictionary=False,
        write_statistics=False,
        write_page_checksum=True,
    )
    return path


def test_parquet_units_are_runs_of_whole_row_groups(tmp_path: Path) -> None:
    texts = [doc(i) for i in range(100)]
    src = write_parquet(tmp_path / "d.parquet", texts, group_rows=10)
    groups = pq.ParquetFile(src).metadata.num_row_groups
    cfg = cfg_for(src, batch_rows=4)
    units = plan_units(cfg, unit_bytes=1)
    assert [(u.start, u.end) for u in units] == [(i, i + 1) for i in range(groups)]
    assert units[3].label() == f"{src} row groups 4-4"
    whole = plan_units(cfg, unit_bytes=1 << 30)
    assert [(u.start, u.end) for u in whole] == [(0, groups)] and whole[0].label() == f"{src} row groups 1-{groups}"
    read = read_all(units, cfg)
    assert [t for _, rows in read for t in rows.texts] == texts
    assert [n for _, rows in read for n in rows.lines] == [i // 10 + 1 for i in range(100)]
    assert sum(rows.bytes for _, rows in read) == sum(u.size for u in units) and all(u.size > 0 for u in units)
    assert read[0][1].columns == ["id", "text"]


def test_a_corrupt_row_group_is_one_bad_row_and_the_others_are_read(tmp_path: Path) -> None:
    texts = [doc(i) for i in range(40)]
    src = write_parquet(tmp_path / "d.parquet", texts, group_rows=10)
    chunk = pq.ParquetFile(src).metadata.row_group(2).column(1)  # the text column of the third row group
    values = chunk.data_page_offset + chunk.total_compressed_size - 24  # inside the page's compressed values
    data = bytearray(src.read_bytes())
    data[values : values + 16] = bytes(b ^ 0xFF for b in data[values : values + 16])
    src.write_bytes(bytes(data))
    cfg = cfg_for(src)
    read = read_all(plan_units(cfg, unit_bytes=1 << 30), cfg)
    bad = [b for _, rows in read for b in rows.bad]
    assert [(b.reason, b.line, b.file) for b in bad] == [("corrupt_row_group", 3, str(src))] and bad[0].excerpt
    assert [t for _, rows in read for t in rows.texts] == texts[:20] + texts[30:]


def test_an_unreadable_parquet_file_or_a_missing_column(tmp_path: Path) -> None:
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(SourceError, match=r"cannot read .*junk.parquet"):
        plan_units(cfg_for(tmp_path / "junk.parquet"), 1 << 20)
    src = write_parquet(tmp_path / "d.parquet", [doc(i) for i in range(5)], group_rows=10)
    cfg = cfg_for(src, text_column="content")
    (rows,) = [rows for _, rows in read_all(plan_units(cfg, 1 << 20), cfg)]
    assert rows.texts == [None] * 5 and rows.columns == ["id", "text"]  # the caller names the columns there are


# -- txt, missing files, s3 -----------------------------------------------------------------------------------
def test_each_txt_file_is_one_document(tmp_path: Path) -> None:
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("first document\nwith two lines\n", encoding="utf-8")
    (folder / "b.txt").write_bytes(b"second \xc3\x28 document")
    cfg = cfg_for(folder)
    units = plan_units(cfg, unit_bytes=1)
    assert [(u.kind, Path(u.file).name, u.size) for u in units] == [("txt", "a.txt", 30), ("txt", "b.txt", 18)]
    read = read_all(units, cfg)
    assert [rows.texts for _, rows in read] == [["first document\nwith two lines\n"], ["second \ufffd( document"]]
    assert [rows.lines for _, rows in read] == [[1], [1]] and units[0].label() == units[0].file


def test_a_file_gone_since_the_plan_is_a_source_error_naming_it(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "c.jsonl", jsonl([{"text": doc(1)}]))
    cfg = cfg_for(src)
    (unit,) = plan_units(cfg, 1 << 20)
    src.unlink()
    with pytest.raises(SourceError, match=f"data.source: {src} does not exist"):
        list(read_unit(unit, cfg))
    with pytest.raises(SourceError, match="does not exist"):
        plan_units(cfg, 1 << 20)


def test_hub_units_are_worker_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    import hlat.training.data.sources

    dataset = datasets.Dataset.from_dict({"text": [doc(i) for i in range(10)], "n": list(range(10))})
    monkeypatch.setattr(hlat.training.data.sources, "_open_hub", lambda cfg, module: dataset)
    cfg = cfg_for("someorg/corpus", batch_rows=3)
    units = plan_units(cfg, 1 << 20, workers=3)
    assert [(u.kind, u.file, u.start, u.end) for u in units] == [("hub", "someorg/corpus", i, 3) for i in range(3)]
    assert units[1].label() == "someorg/corpus shard 2 of 3"
    read = read_all(units, cfg)
    assert sorted(t for _, rows in read for t in rows.texts if t) == sorted(doc(i) for i in range(10))
    first = [rows for u, rows in read if u.index == 0]
    assert [n for rows in first for n in rows.lines] == list(range(1, 5)) and first[0].columns == ["text", "n"]


def test_s3_files_are_planned_and_read_like_local_ones(request: pytest.FixtureRequest) -> None:
    env: S3Env = request.getfixturevalue("s3_env")
    lines = jsonl([{"text": doc(i)} for i in range(40)])
    lines[30] = b"{broken"
    env.client().put_object(Bucket=env.bucket, Key="corpus/part-0.jsonl", Body=b"\n".join(lines) + b"\n")
    cfg = cfg_for(f"s3://{env.bucket}/corpus", batch_rows=8)
    units = plan_units(cfg, unit_bytes=3000)
    assert len(units) == 3 and all(u.file == f"s3://{env.bucket}/corpus/part-0.jsonl" for u in units)
    read = read_all(units, cfg)
    assert [t for _, rows in read for t in rows.texts] == [doc(i) for i in range(40) if i != 30]
    ((unit, bad),) = [(u, b) for u, rows in read for b in rows.bad]
    assert isinstance(bad, BadRow) and absolute_line(unit, bad.line) == 31


# -- what the reader hands the validator ----------------------------------------------------------------------
def test_rows_validate_with_their_reasons_and_digests_across_batches(tmp_path: Path) -> None:
    import hashlib

    import pandas as pd

    from hlat.training.data.validation import DataValidationError, DocumentValidator

    texts = [doc(i + 10) for i in range(8)]
    lines = jsonl([{"text": t} for t in texts])
    lines[1] = b'{"text": "invalid \xff byte in an otherwise long enough document"}'
    lines[2] = b'{"text": "a lone \\udc80 surrogate in a long enough document"}'
    lines[3] = b'{"text": null}'
    lines[5] = b'{"text": "short"}'
    lines.append(json.dumps({"text": texts[0]}, ensure_ascii=False).encode())  # line 1 again, in the next batch
    src = write_lines(tmp_path / "c.jsonl", lines)
    cfg = cfg_for(src, batch_rows=5)
    validator = DocumentValidator(cfg.validation, cfg.text_column)
    outcomes = []
    for rows in read_unit(plan_units(cfg, 1 << 20)[0], cfg):
        outcomes.append(validator.validate(pd.DataFrame({"text": pd.Series(rows.texts, dtype=object)})))
    first, second = outcomes
    assert [r for _, r in first.quarantined] == ["invalid_utf8", "invalid_utf8", "null"]
    assert (
        first.quarantined_index == [1, 2, 3]
        and first.quarantined[1][0] == "a lone \ufffd surrogate in a long enough document"
    )
    assert [r for _, r in second.quarantined] == ["too_short", "duplicate"] and second.quarantined_index == [0, 3]
    kept = [*first.kept, *second.kept]
    assert kept == [texts[0], texts[4], texts[6], texts[7]]
    assert [*first.kept_digests, *second.kept_digests] == [hashlib.sha256(t.encode()).digest() for t in kept]
    assert validator.tally.rows_read == 9 and validator.tally.rows_kept == 4
    with pytest.raises(DataValidationError, match=r"its columns are \['content', 'id'\]"):
        validator.check_columns(pd.DataFrame(columns=["content", "id"]))
