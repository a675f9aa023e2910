"""prepare-data as a job on the local backend: data.workers worker processes under the job contract.

A generated corpus of four jsonl files with unparseable lines, empty documents and exact duplicates planted in
every file (so across workers) is prepared by 2 workers: the counts reconcile per reason, the duplicates across
workers are found, the manifest names every shard once and the training loader reads the result. A worker killed
mid-way is started again alone; a job that fails part-way is relaunched and redoes only unfinished units; both end
with the output of an uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hlat.core.config import HlatConfig
from hlat.core.layout import REPORT_FILE
from hlat.core.presets import load_config
from hlat.core.run import Run, open_run
from hlat.core.shards import iter_documents, read_manifest
from hlat.core.storage import Storage
from hlat.infra.backends.protocol import job_name
from hlat.infra.supervision.ledger import Ledger
from hlat.training.data.units import DataReport, UnitResult
from tests.jobs import prepare_job, source_data

pytestmark = pytest.mark.slow  # each test runs prepare-data jobs of 2 workers (5-11 s)

FILES = 4
DOCS_PER_FILE = 40
PLANTED = 3  # documents written into every file: 3 x (FILES - 1) duplicates across files
BAD_LINES = {"a.jsonl": [7, 19], "c.jsonl": [3]}  # 1-based line numbers of unparseable lines


def document(file: int, i: int) -> str:
    words = " ".join(f"w{(file * 7919 + i * 104729 + k * 31) % 9973}" for k in range(12 + (i * 13) % 40))
    return f"Document {i} of file {file}: {words}."


def make_corpus(folder: Path) -> dict[str, int]:
    """Four jsonl files; returns the expected counts."""
    folder.mkdir()
    for f, name in enumerate(sorted(f"{c}.jsonl" for c in "abcd")):
        lines = [json.dumps({"text": document(f, i)}) for i in range(DOCS_PER_FILE)]
        lines += [json.dumps({"text": f"A planted document, number {p}, that every file holds word for word."})
                  for p in range(PLANTED)]  # fmt: skip
        lines.append(json.dumps({"text": ""}))  # an empty document: too short
        for at in BAD_LINES.get(name, []):
            lines.insert(at - 1, '{"text": "a line cut short')
        (folder / name).write_text("\n".join(lines) + "\n")
    bad = sum(len(v) for v in BAD_LINES.values())
    return {
        "rows": FILES * (DOCS_PER_FILE + PLANTED + 1) + bad,
        "unparseable": bad,
        "too_short": FILES,
        "duplicate": PLANTED * (FILES - 1),
        "kept": FILES * DOCS_PER_FILE + PLANTED,
    }


def job_config(corpus: Path, storage: Path, run_id: str, **more: Any) -> HlatConfig:
    overrides = {
        "data.source": str(corpus),
        "data.max_documents": None,
        "data.workers": 2,
        "data.unit_mb": 1,
        "data.shard_rows": 25,
        "data.batch_rows": 16,
        "data.validation.min_chars": 8,
        # The exact duplicates across files are this test's subject (the other rules: tests/unit/test_curation.py).
        "data.curation": {"exact_dedup": True},
        **more,
    }
    return load_config("tiny", overrides, run_id=run_id, storage=str(storage))


def prepare(config: HlatConfig) -> tuple[DataReport | None, Any]:
    run = open_run(config)
    record, state = prepare_job(run)
    data = run.stage("data")
    if not data.exists(REPORT_FILE):
        return None, (record, state, data)
    report = DataReport.model_validate(data.read_json(REPORT_FILE))
    return report, (record, state, source_data(data))


def outputs(data: Storage) -> list[tuple[str, str, int]]:
    """The manifest's shards: path in the work folder (named by the run's key), checksum, rows."""
    return [(s.path.split("/", 1)[1], s.sha256, s.rows) for s in read_manifest(data).shards]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    folder = tmp_path_factory.mktemp("corpus") / "jsonl"
    return folder, make_corpus(folder)


@pytest.fixture(scope="module")
def uninterrupted(corpus: tuple[Path, dict[str, int]], tmp_path_factory: pytest.TempPathFactory) -> Any:
    report, (record, state, data) = prepare(job_config(corpus[0], tmp_path_factory.mktemp("runs"), "clean"))
    assert state is not None and state.status.value == "Completed", record
    return report, data


def test_two_workers_reconcile_find_duplicates_across_workers_and_feed_the_loader(
    corpus: tuple[Path, dict[str, int]], uninterrupted: Any, prepared: Path
) -> None:
    from hlat.training.data.loader import PackedLoader

    expected = corpus[1]
    report, data = uninterrupted
    assert report.rows_read == expected["rows"] == report.rows_kept + report.rows_quarantined
    assert report.quarantined_by_reason == {
        "duplicate": expected["duplicate"],
        "too_short": expected["too_short"],
        "unparseable_json": expected["unparseable"],
    }
    assert report.rows_kept == expected["kept"] and report.units == FILES
    assert report.cross_unit_duplicates == expected["duplicate"]
    # Both workers worked, and the planted documents sat in units of both.
    units = [UnitResult.model_validate(data.read_json(f"{p}/unit.json")) for p in _unit_dirs(data)]
    assert {u.worker for u in units} == {0, 1} and [w.worker for w in report.workers] == [0, 1]
    # The unparseable lines are named by file and 1-based line.
    named = {(Path(e.file).name, e.line) for e in report.examples if e.reason == "unparseable_json"}
    assert named == {(name, at) for name, lines in BAD_LINES.items() for at in lines}

    manifest = read_manifest(data)
    paths = [s.path for s in manifest.shards]
    assert len(paths) == len(set(paths)) and all(data.exists(p) for p in paths)
    texts = [t for split in ("train", "validation") for t in iter_documents(data, manifest, split)]
    assert len(texts) == len(set(texts)) == report.rows_kept == report.train_rows + report.validation_rows
    assert sum("planted document" in t for t in texts) == PLANTED
    with PackedLoader(data, str(prepared / "tokenizer" / "tokenizer.model"), 32, 2, seed=1) as loader:
        batch = next(loader)
    assert tuple(batch.inputs.shape) == (2, 32)


def _unit_dirs(data: Storage) -> list[str]:
    (work,) = [d for d in data.list() if d.startswith("work-")]
    return [f"{work}/units/{u}" for u in sorted(data.list(f"{work}/units"))]


def test_a_worker_killed_mid_way_is_started_again_alone_and_the_output_is_unchanged(
    corpus: tuple[Path, dict[str, int]], uninterrupted: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HLAT_PREPARE_FAULTS", json.dumps({"worker": 1, "life": 1, "after_rows": 16}))
    report, (record, state, data) = prepare(job_config(corpus[0], tmp_path, "clean"))
    assert state is not None and state.status.value == "Completed", record
    assert record.attempt == 1  # the job itself never failed: only the worker was started again
    log = (tmp_path / "clean" / "jobs" / record.job_name / "output.log").read_text()
    assert "worker 1 died (killed by SIGKILL): starting it again, alone (life 2 of 3)" in log
    assert outputs(data) == outputs(uninterrupted[1])
    assert report is not None and report.quarantined_by_reason == uninterrupted[0].quarantined_by_reason


def test_a_failed_job_is_relaunched_and_redoes_only_unfinished_units(
    corpus: tuple[Path, dict[str, int]], uninterrupted: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = job_config(corpus[0], tmp_path, "clean", **{"data.worker_retries": 0, "data.workers": 1})
    first = job_name("clean", 1, "prepare-data")
    # The only worker dies in its second unit, in the first job only: that job fails, the second finishes.
    fault = {"worker": 0, "job": first, "after_rows": 8, "unit_at_least": 1}
    monkeypatch.setenv("HLAT_PREPARE_FAULTS", json.dumps(fault))
    _report, (record, state, data) = prepare(config)
    assert state is not None and state.status.value == "Completed", record
    attempts = Ledger(Run.at(str(tmp_path / "clean")), "prepare-data").load()
    assert [(a.attempt, a.status) for a in attempts] == [(1, "Failed"), (2, "Completed")]
    assert "worker 0 died 1 times (killed by SIGKILL)" in (attempts[0].reason or "")
    units = [UnitResult.model_validate(data.read_json(f"{p}/unit.json")) for p in _unit_dirs(data)]
    assert [u.job for u in units][:1] == [first] and {u.job for u in units[1:]} == {record.job_name}
    assert outputs(data) == outputs(uninterrupted[1])


def test_policy_fail_names_the_file_and_line_and_is_not_relaunched(
    corpus: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    # One worker: the first bad row in plan order is the one named (with two, whichever worker meets one first).
    config = job_config(corpus[0], tmp_path, "strict", **{"data.validation.policy": "fail", "data.workers": 1})
    report, (record, _state, data) = prepare(config)
    assert report is None and record.attempt == 1 and record.action == "fatal"
    assert "DataValidationError" in (record.reason or "")
    assert f"{corpus[0] / 'a.jsonl'} line 7 is not valid JSON" in (record.reason or "")
    assert not data.exists("manifest.json")
