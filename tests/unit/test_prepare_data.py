"""prepare-data on real files through `datasets` and great-expectations: every bad input has its outcome."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hlat.core.config import ConfigError, DataConfig, stable_hash
from hlat.core.presets import load_config
from hlat.core.shards import iter_documents, read_manifest
from hlat.core.storage import Storage
from hlat.training.data.sources import SourceError, source_fingerprint, stdlib_documents
from hlat.training.data.units import assign_split, prepare_dataset
from hlat.training.data.validation import DataValidationError

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "judge",
    "boxing",
    "matches",
]


def doc(i: int, words: int = 12) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words)) + f" document {i}."


def data_cfg(source: Path | str, **overrides: Any) -> DataConfig:
    """The tiny preset's data settings on `source`, curated by exact dedup alone: these tests are about reading and
    great-expectations' row checks (every curation rule: tests/unit/test_curation.py)."""
    given = {"data.source": str(source), "data.curation": {"exact_dedup": True}}
    return load_config("tiny", {**given, **{f"data.{k}": v for k, v in overrides.items()}}).data


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def run_stage(tmp_path: Path, cfg: DataConfig) -> tuple[Any, Storage]:
    """The stage in this process, keyed as the flow keys it: by the data settings and the source's content."""
    out = Storage(str(tmp_path / "run" / "data"))
    key = stable_hash([cfg.model_dump(mode="json"), source_fingerprint(cfg)])
    return prepare_dataset(cfg, out, fingerprint=key), out


def reconciles(report: Any) -> bool:
    return (
        report.rows_read == report.rows_kept + report.rows_quarantined
        and sum(report.quarantined_by_reason.values()) == report.rows_quarantined
        and report.train_rows + report.validation_rows == report.rows_kept
    )


def test_clean_jsonl_is_sharded_with_manifest_and_held_out_split(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": doc(i), "id": i} for i in range(400)])
    report, out = run_stage(tmp_path, data_cfg(src, shard_rows=100, batch_rows=64, validation_fraction=0.1))
    assert (report.rows_read, report.rows_kept, report.rows_quarantined) == (400, 400, 0)
    assert reconciles(report) and 10 < report.validation_rows < 80
    manifest = read_manifest(out)
    assert manifest.rows("train") == report.train_rows and report.shards == len(manifest.shards) >= 4
    train = list(iter_documents(out, manifest, "train"))
    valid = list(iter_documents(out, manifest, "validation"))
    assert sorted(train + valid) == sorted(doc(i) for i in range(400))
    assert all(assign_split(t, 0.1) == "validation" for t in valid)
    assert json.loads((tmp_path / "run/data/report.json").read_text())["rows_kept"] == 400


def test_manifest_checksums_catch_a_changed_shard(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": doc(i)} for i in range(50)])
    _, out = run_stage(tmp_path, data_cfg(src, validation_fraction=0.0, shard_format="jsonl"))
    manifest = read_manifest(out)
    shard = Path(out.path(manifest.shards[0].path))
    shard.write_text(shard.read_text().replace("fox", "cat"))
    with pytest.raises(ValueError, match="does not match its checksum"):
        list(iter_documents(out, manifest, "train"))


def test_empty_dataset_fails_the_stage(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataValidationError, match=r"the data set is empty \(0 rows read\)"):
        run_stage(tmp_path, data_cfg(tmp_path / "empty.jsonl"))
    assert not (tmp_path / "run/data/manifest.json").exists()


def test_missing_text_column_names_the_columns_and_the_fix(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", [{"content": doc(i)} for i in range(10)])
    with pytest.raises(DataValidationError, match=r"column 'text' is not in the source; its columns are \['content'\]"):
        run_stage(tmp_path, data_cfg(src))
    report, _ = run_stage(tmp_path, data_cfg(src, text_column="content"))
    assert report.rows_kept == 10


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_invalid_utf8_rows_are_quarantined_and_counted(tmp_path: Path, kind: str) -> None:
    if kind == "jsonl":
        lines = [json.dumps({"text": doc(i)}).encode() for i in range(20)]
        lines[3] = b'{"text": "broken \xff\xfe bytes in an otherwise fine document"}'
        lines[7] = b'{"text": "more \xc3\x28 bad bytes"}'
        (tmp_path / "c.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        src: Path = tmp_path / "c.jsonl"
        bad = 2
    else:
        src = tmp_path / "txt"
        src.mkdir()
        for i in range(20):
            (src / f"{i:02d}.txt").write_text(doc(i))
        (src / "05.txt").write_bytes(b"a text file with \xc3\x28 an invalid sequence inside it")
        bad = 1
    report, out = run_stage(tmp_path, data_cfg(src))
    assert report.quarantined_by_reason == {"invalid_utf8": bad} and reconciles(report)
    quarantine = [s for s in out.walk_files() if "quarantine" in s]
    reasons = pq.read_table(out.path(quarantine[0])).column("reason").to_pylist()
    assert reasons == ["invalid_utf8"] * bad
    where = "c.jsonl line 4" if kind == "jsonl" else "05.txt"  # the first bad row's file and 1-based line
    with pytest.raises(DataValidationError, match=f"policy='fail': .*/{where} is not valid UTF-8; fix the source"):
        run_stage(tmp_path, data_cfg(src, **{"validation.policy": "fail"}))


def test_an_unparseable_line_costs_one_row_or_names_its_file_and_line(tmp_path: Path) -> None:
    src = tmp_path / "c.jsonl"
    src.write_text(f'{{"text": "{doc(1)}"}}\n{{"text": "unterminated\n{{"text": "{doc(2)}"}}\n')
    report, out = run_stage(tmp_path, data_cfg(src))
    assert report.quarantined_by_reason == {"unparseable_json": 1} and report.rows_kept == 2 and reconciles(report)
    assert [(e.reason, e.file, e.line) for e in report.examples] == [("unparseable_json", str(src), 2)]
    (quarantine,) = [s for s in out.walk_files() if "quarantine" in s]
    table = pq.read_table(out.path(quarantine)).to_pylist()
    assert [(r["reason"], r["file"], r["line"]) for r in table] == [("unparseable_json", str(src), 2)]
    with pytest.raises(DataValidationError, match=rf"policy='fail': {src} line 2 is not valid JSON"):
        run_stage(tmp_path, data_cfg(src, **{"validation.policy": "fail"}))


def test_null_and_short_rows(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = [{"text": doc(i)} for i in range(30)]
    rows[2] = {"text": None}
    rows[4] = {"text": None}
    rows[9] = {"text": "tiny"}
    report, _ = run_stage(tmp_path, data_cfg(write_jsonl(tmp_path / "c.jsonl", rows)))
    assert report.quarantined_by_reason == {"null": 2, "too_short": 1} and reconciles(report)


def test_a_single_10mb_document(tmp_path: Path) -> None:
    big = ("All work and no play makes a dull model. " * 250_000)[:10_000_000]
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": big}, *({"text": doc(i)} for i in range(10))])
    report, _ = run_stage(tmp_path, data_cfg(src))
    assert report.quarantined_by_reason == {"too_long": 1} and report.rows_kept == 10
    report, out = run_stage(tmp_path, data_cfg(src, **{"validation.max_chars": 20_000_000}))
    assert report.rows_kept == 11
    texts = list(iter_documents(out, read_manifest(out), "train")) + list(
        iter_documents(out, read_manifest(out), "validation")
    )
    assert big in texts


def test_ninety_percent_duplicates_fail_the_stage(tmp_path: Path) -> None:
    rows = [{"text": doc(0)}] * 90 + [{"text": doc(i)} for i in range(1, 11)]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(
        DataValidationError, match=r"duplicate rate 89\.0% exceeds data\.validation\.max_duplicate_rate"
    ):
        run_stage(tmp_path, data_cfg(src, **{"validation.max_duplicate_rate": 0.5}))
    with pytest.raises(DataValidationError, match=r"c\.jsonl line 2 is an exact duplicate of an earlier document"):
        run_stage(tmp_path, data_cfg(src, **{"validation.policy": "fail"}))
    report, _ = run_stage(tmp_path, data_cfg(src, **{"validation.max_duplicate_rate": 0.95}))
    assert report.quarantined_by_reason == {"duplicate": 89} and report.rows_kept == 11 and reconciles(report)


def test_duplicates_are_found_across_batches(tmp_path: Path) -> None:
    rows = [{"text": doc(i % 40)} for i in range(60)]
    cfg = data_cfg(write_jsonl(tmp_path / "c.jsonl", rows), batch_rows=16, **{"validation.max_duplicate_rate": 0.5})
    report, _ = run_stage(tmp_path, cfg)
    assert report.quarantined_by_reason == {"duplicate": 20} and report.rows_kept == 40


def test_unknown_local_path(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"local path .*nowhere' does not exist"):
        run_stage(tmp_path, data_cfg(tmp_path / "nowhere"))


def test_folder_of_parquet_and_mixed_folder(tmp_path: Path) -> None:
    folder = tmp_path / "pq"
    (folder / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"text": [doc(i) for i in range(30)]}), folder / "a.parquet")
    pq.write_table(pa.table({"text": [doc(i) for i in range(30, 50)]}), folder / "sub" / "b.parquet")
    report, _ = run_stage(tmp_path, data_cfg(folder))
    assert report.rows_kept == 50
    write_jsonl(folder / "c.jsonl", [{"text": "x" * 40}])
    with pytest.raises(ConfigError, match=r"set data\.file_format to jsonl, parquet or txt"):
        run_stage(tmp_path, data_cfg(folder))


def test_user_expectations_quarantine_rows(tmp_path: Path) -> None:
    rows = [{"text": doc(i)} for i in range(20)] + [{"text": "BUY NOW!!! cheap pills, click this link today"}]
    extra = [{"type": "expect_column_values_to_not_match_regex", "kwargs": {"column": "text", "regex": "BUY NOW"}}]
    report, _ = run_stage(
        tmp_path, data_cfg(write_jsonl(tmp_path / "c.jsonl", rows), **{"validation.expectations": extra})
    )
    assert report.quarantined_by_reason == {"expect_column_values_to_not_match_regex": 1} and reconciles(report)
    bogus = [{"type": "expect_text_to_be_nice", "kwargs": {}}]
    with pytest.raises(ConfigError, match="'expect_text_to_be_nice' is not a great-expectations expectation"):
        run_stage(tmp_path, data_cfg(tmp_path / "c.jsonl", **{"validation.expectations": bogus}))


def test_a_failed_rerun_leaves_earlier_outputs_intact(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": doc(i)} for i in range(40)])
    first, out = run_stage(tmp_path, data_cfg(src))
    before = {p: Path(out.path(p)).read_bytes() for p in out.walk_files()}
    write_jsonl(src, [{"text": doc(0)}] * 40)  # now 97% duplicates: the re-run fails
    with pytest.raises(DataValidationError):
        run_stage(tmp_path, data_cfg(src))
    manifest = read_manifest(out)
    assert len(list(iter_documents(out, manifest, "train"))) + manifest.rows("validation") == first.rows_kept
    assert all(Path(out.path(p)).read_bytes() == b for p, b in before.items())


def read_source(cfg: DataConfig) -> list[Any]:
    """Every batch of rows of the source, unit after unit, as the workers read it."""
    from hlat.training.data.reader import plan_units, read_unit

    return [rows for unit in plan_units(cfg, 1 << 30) for rows in read_unit(unit, cfg)]


def test_hub_source_without_network_gives_a_clear_error(tmp_path: Path) -> None:
    # HF_HUB_OFFLINE=1 is set for the test session (tests/conftest.py), as on a machine without the hub.
    with pytest.raises(SourceError, match="cannot reach the Hugging Face hub for 'someorg/some-corpus'"):
        read_source(data_cfg("someorg/some-corpus"))


@pytest.mark.slow
def test_builtin_corpus_is_deterministic_real_text() -> None:
    first = [d["origin"] for d, _ in zip(stdlib_documents(), range(50), strict=False)]
    again = [d["origin"] for d, _ in zip(stdlib_documents(), range(50), strict=False)]
    assert first == again and any(o.endswith("#docstrings") for o in first)
    batches = read_source(load_config("tiny", {"data.batch_rows": 50}).data)
    assert [len(b.texts) for b in batches[:3]] == [50, 50, 50] and sum(len(b.texts) for b in batches) > 1000
    assert "def " in " ".join(batches[0].texts)


def test_hub_code_path_with_config_split_and_streaming(tmp_path: Path) -> None:
    """The hub loader (name, config, split, streaming) on a dataset repo laid out here, as the hub lays them out."""
    import datasets

    from hlat.training.data.sources import _open_hub, resolve_source

    repo = tmp_path / "org-corpus"
    for config, n in (("small", 5), ("large", 40)):
        (repo / config).mkdir(parents=True)
        write_jsonl(repo / config / "train.jsonl", [{"text": doc(i)} for i in range(n)])
        write_jsonl(repo / config / "test.jsonl", [{"text": doc(100 + i)} for i in range(3)])
    (repo / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.jsonl\n"
            f"  - split: test\n    path: {c}/test.jsonl\n"
            for c in ("small", "large")
        )
        + "---\n"
    )
    assert resolve_source(data_cfg("someorg/corpus")).kind == "hub"
    # A hub name and a local repo folder go through the same datasets.load_dataset call.
    for streaming in (True, False):
        cfg = data_cfg(repo, hf_config="large", split="test", streaming=streaming)
        texts = [t for batch in _open_hub(cfg, datasets).iter(batch_size=2) for t in batch["text"]]
        assert texts == [doc(100 + i) for i in range(3)], f"streaming={streaming}"
    with pytest.raises(SourceError, match=r"cannot load .*org-corpus"):
        _open_hub(data_cfg(repo, hf_config="nope"), datasets)


def test_bad_lines_in_later_units_of_a_large_file_are_named_by_their_line_in_the_file(tmp_path: Path) -> None:
    """A jsonl file over data.unit_mb is read as byte ranges (units); the report numbers lines in the whole file."""
    lines = [json.dumps({"text": doc(i, words=40) + " " + "pad " * 50}) for i in range(9000)]
    bad_at = [3, 4500, 8999]  # 1-based lines in the file: in the first, a middle and the last unit
    for at in bad_at:
        lines[at - 1] = '{"text": "cut short'
    src = tmp_path / "big.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert src.stat().st_size > 3 * 2**20
    report, _ = run_stage(tmp_path, data_cfg(src, unit_mb=1, max_documents=None))
    assert report.units >= 3 and report.quarantined_by_reason == {"unparseable_json": 3}
    assert [e.line for e in report.examples] == bad_at
    assert report.rows_read == 9000 and reconciles(report)


@pytest.mark.parametrize(
    "source", ["builtin:python-stdlib", "wikitext", "HuggingFaceFW/fineweb-edu", "s3://my-bucket.v2/corpus/"]
)
def test_sources_of_every_kind_pass_the_check_before_the_run(source: str) -> None:
    from hlat.training.data.sources import check_source

    check_source(DataConfig(source=source))  # nothing is read: shapes only (and local paths' existence)
