"""The stage flows and the parent flow `hlat` on a real (temporary) Prefect server."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import task_states
from training.config import ConfigError

pytestmark = pytest.mark.slow


def artifact_keys() -> set[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {a.key for a in client.read_artifacts(limit=200) if a.key}


def artifacts_of(key: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=50)


def test_hlat_runs_both_stages_then_a_rerun_skips_them(
    prefect_server: None, tmp_path: Path, small_run: dict[str, Any]
) -> None:
    from flows.pretrain import hlat

    first = hlat(preset="tiny", overrides=small_run, storage=str(tmp_path))
    run = tmp_path / first["run_id"]
    assert (run / "config.json").exists()
    assert first["data"]["rows_read"] == first["data"]["rows_kept"] + first["data"]["rows_quarantined"] == 300
    for rel in (
        "data/manifest.json",
        "data/report.json",
        "tokenizer/tokenizer.model",
        "tokenizer/report.json",
    ):
        assert (run / rel).is_file(), rel
    assert first["tokenizer"]["vocab_size"] == 512
    assert artifact_keys() >= {f"data-report-{first['run_id']}", f"tokenizer-report-{first['run_id']}"}
    # The parent run's progress: one artifact, updated in place through the six stages.
    progress = artifacts_of(f"pretrain-progress-{first['run_id']}")
    assert len(progress) == 1 and progress[0].data == 100.0
    assert progress[0].description == "6 of 6 stages done"
    shard_dirs = sorted(p.name for p in (run / "data").glob("shards-*"))
    model_bytes = (run / "tokenizer/tokenizer.model").read_bytes()

    second = hlat(preset="tiny", overrides=small_run, storage=str(tmp_path))
    assert second["run_id"] == first["run_id"] and second["data"] == first["data"]
    assert task_states("build-shards")[-1] == "Cached" and task_states("fit-tokenizer")[-1] == "Cached"
    # nothing was rewritten: a new attempt would have made a new shard folder
    assert sorted(p.name for p in (run / "data").glob("shards-*")) == shard_dirs
    assert (run / "tokenizer/tokenizer.model").read_bytes() == model_bytes

    # outputs deleted behind the cache's back are rebuilt, not trusted
    shutil.rmtree(run / "tokenizer")
    third = hlat(preset="tiny", overrides=small_run, storage=str(tmp_path))
    assert (run / "tokenizer/tokenizer.model").read_bytes() == model_bytes
    assert third["tokenizer"]["vocab_size"] == 512


def test_stages_run_alone_and_refuse_a_changed_config(
    prefect_server: None, tmp_path: Path, small_run: dict[str, Any]
) -> None:
    from flows.prepare_data import prepare_data
    from flows.train_tokenizer import train_tokenizer
    from infra.storage import StorageNotFound

    with pytest.raises(StorageNotFound, match="run the prepare-data stage for this run first"):
        train_tokenizer(preset="tiny", overrides=small_run, run_id="alone", storage=str(tmp_path))
    report = prepare_data(preset="tiny", overrides=small_run, run_id="alone", storage=str(tmp_path))
    assert report.rows_kept > 200
    tok = train_tokenizer(preset="tiny", overrides=small_run, run_id="alone", storage=str(tmp_path))
    assert tok["vocab_size"] == 512

    changed = {**small_run, "training.lr": 5e-3}
    with pytest.raises(ConfigError, match=r"run 'alone' .* different config \(training.lr: 0.002 -> 0.005\)"):
        prepare_data(preset="tiny", overrides=changed, run_id="alone", storage=str(tmp_path))
