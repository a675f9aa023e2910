"""prepare-data of a mixture, as a job on the local backend: each source prepared once, into its own folder beside the
runs, whichever run asks for it; the run's manifest names the sources with their weights and the schedule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hlat.core.layout import SOURCES_DIR
from hlat.core.presets import load_config
from hlat.core.shards import MixtureManifest, read_mixture
from hlat.infra.runs import open_run
from hlat.training.data.units import REPORT_FILE, DataReport
from tests.jobs import prepare_job

pytestmark = pytest.mark.slow  # three prepare-data jobs of one worker (3-5 s each)


def corpus(folder: Path, name: str, docs: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    lines = [json.dumps({"text": f"{name} document {i}: " + " ".join(f"{name}{(i * 7 + k) % 97}" for k in range(30))})
             for i in range(docs)]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def config(storage: Path, run_id: str, sources: list[dict[str, Any]], **more: Any) -> Any:
    overrides = {"data.sources": sources, "data.max_documents": None, "data.validation.min_chars": 8, **more}
    return load_config("tiny", overrides, run_id=run_id, storage=str(storage))


def prepared_log(storage: Path, run_id: str) -> str:
    return "\n".join(p.read_text() for p in sorted((storage / run_id / "jobs").rglob("output.log")))


def test_sources_are_prepared_once_for_every_run_and_the_manifest_names_them(tmp_path: Path) -> None:
    files = tmp_path / "corpora"
    a, b, c = corpus(files, "alpha", 60), corpus(files, "beta", 40), corpus(files, "gamma", 30)
    storage = tmp_path / "runs"
    two = [{"source": a, "weight": 0.75}, {"source": b, "weight": 0.25, "max_epochs": 2}]
    first = open_run(config(storage, "first", two))
    record, state = prepare_job(first)
    assert state is not None and state.status.value == "Completed", record
    mixture, sources = read_mixture(first.stage("data"))
    assert [(s.name, s.weight, s.max_epochs) for s in mixture.sources] == [("alpha", 0.75, 4.0), ("beta", 0.25, 2.0)]
    assert all(s.data.uri().startswith(str(storage / SOURCES_DIR)) for s in sources)
    report = DataReport.model_validate(first.stage("data").read_json(REPORT_FILE))
    assert [r.name for r in report.sources] == ["alpha", "beta"] and report.rows_kept == 100
    assert report.rows_read == sum(r.rows_read for r in report.sources)

    # Another run: new weights, a third source and a schedule. Only the third source is prepared.
    three = [{"source": a, "weight": 0.6}, {"source": b, "weight": 0.3}, {"source": c, "weight": 0.1}]
    schedule = [{"step": 100, "weights": {"alpha": 1, "gamma": 1}}]
    second = open_run(config(storage, "second", three, **{"data.schedule": schedule}))
    record, state = prepare_job(second)
    assert state is not None and state.status.value == "Completed", record
    log = prepared_log(storage, "second")
    assert "source alpha: prepared before" in log and "source beta: prepared before" in log
    assert "source gamma: 1 units" in log and "source alpha: 1 units" not in log
    mixture2, sources2 = read_mixture(second.stage("data"))
    assert [s.data.uri() for s in sources2[:2]] == [s.data.uri() for s in sources]
    assert mixture2.weights_at(0) == pytest.approx([0.6, 0.3, 0.1])
    assert mixture2.weights_at(100) == pytest.approx([0.5, 0.0, 0.5])
    assert mixture2.checksum != mixture.checksum
    assert len(list((storage / SOURCES_DIR).iterdir())) == 3


def test_a_source_with_other_settings_is_prepared_again_beside_the_first(tmp_path: Path) -> None:
    a = corpus(tmp_path / "corpora", "alpha", 40)
    storage = tmp_path / "runs"
    for run_id, rows in (("small", 25), ("large", 50)):
        run = open_run(config(storage, run_id, [{"source": a, "name": "web"}], **{"data.shard_rows": rows}))
        record, state = prepare_job(run)
        assert state is not None and state.status.value == "Completed", record
    folders = sorted(p.name for p in (storage / SOURCES_DIR).iterdir())
    assert len(folders) == 2 and all(f.startswith("web-") for f in folders)
    body = json.loads((storage / "large" / "data" / "manifest.json").read_text())
    assert MixtureManifest.model_validate(body).sources[0].name == "web"
