"""prepare-data of a mixture, as a job on the local backend: each source prepared once, into its own folder beside the
runs, whichever run asks for it; the run's manifest names the sources with their weights and the schedule."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from hlat.core.layout import REPORT_FILE, SOURCES_DIR
from hlat.core.presets import load_config
from hlat.core.run import open_run
from hlat.core.shards import MixtureManifest, read_mixture
from hlat.training.data.units import DataReport
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
    # Exact dedup alone unless a test says otherwise: its corpora are made up, not prose the quality rules would keep.
    given = {"data.sources": sources, "data.max_documents": None, "data.validation.min_chars": 8,
             "data.curation": {"exact_dedup": True}}  # fmt: skip
    overrides = {**given, **more}
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


def test_the_job_removes_planted_near_duplicates_and_an_evaluation_passage_and_counts_them_by_rule(
    tmp_path: Path,
) -> None:
    """A source with near duplicates (a few words changed in long documents) and a training document that quotes a
    held-out document (what the offline evaluation tasks are drawn from): the job's report counts each by its rule
    and keeps examples of both."""
    from hlat.training.data.units import assign_split

    rng = random.Random(3)
    # Letters only: datatrove's text normalisation before hashing folds digits (w12 and w34 would be one word).
    vocabulary = ["".join(rng.choice("abcdefghijklmnoprstuvw") for _ in range(rng.randint(3, 9))) for _ in range(3000)]

    def prose(n: int) -> str:
        return " ".join(rng.choice(vocabulary) for _ in range(n)) + "."

    fraction = 0.2
    docs = [prose(200) for _ in range(80)]
    # Near duplicates of training documents, themselves in training (a held-out original would make its copy a
    # contamination instead): 2 of 200 words changed, a 5-gram Jaccard similarity about 0.9, far above MinHash's 0.75.
    near: list[str] = []
    for text in (t for t in docs if assign_split(t, fraction) == "train"):
        words = text.split()
        words[40], words[140] = "changed", "altered"
        copy = " ".join(words)
        if assign_split(copy, fraction) == "train":
            near.append(copy)
        if len(near) == 5:
            break
    held_out = next(t for t in docs if assign_split(t, fraction) == "validation")
    quote = " ".join(held_out.split()[20:60])  # 40 words of a held-out document
    contaminated = next(
        c for c in (f"Preface {i}: {quote} {prose(30)}" for i in range(100)) if assign_split(c, fraction) == "train"
    )
    path = tmp_path / "planted.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in [*docs, *near, contaminated]))
    curation = {"exact_dedup": True, "minhash": True, "decontaminate": True, "gopher_quality": False,
                "gopher_repetition": False, "c4_quality": False, "fineweb_quality": False}  # fmt: skip
    run = open_run(
        config(
            tmp_path / "runs",
            "planted",
            [{"source": str(path), "name": "planted"}],
            **{"data.validation_fraction": fraction, "data.curation": curation},
        )
    )
    record, state = prepare_job(run)
    assert state is not None and state.status.value == "Completed", record
    report = DataReport.model_validate(run.stage("data").read_json(REPORT_FILE))
    (source,) = report.sources
    assert source.quarantined_by_reason.get("minhash") == len(near)
    assert source.quarantined_by_reason.get("decontamination") == 1
    assert source.rows_kept == len(docs) and report.rows_read == len(docs) + len(near) + 1
    rules = {e.reason for e in source.examples}
    assert {"minhash", "decontamination"} <= rules
    assert any(
        quote[:60] in e.excerpt or e.excerpt in contaminated for e in source.examples if e.reason == "decontamination"
    )
