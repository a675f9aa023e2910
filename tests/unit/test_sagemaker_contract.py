"""Inside a SageMaker container the job follows its contract; elsewhere it uses run storage."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlat.core.contract import checkpoint_location, in_sagemaker, tensorboard_location
from hlat.core.run import Run


def test_outside_sagemaker_everything_is_in_run_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SM_TRAINING_ENV", "SM_CURRENT_HOST", "HLAT_CHECKPOINT_DIR"):
        monkeypatch.delenv(var, raising=False)
    run = Run.at(str(tmp_path / "run"))
    assert not in_sagemaker()
    assert checkpoint_location(run).url == str(tmp_path / "run" / "checkpoints")
    assert tensorboard_location(run) == str(tmp_path / "run" / "tensorboard")
    assert tensorboard_location(Run.at("s3://bucket/run")) is None


def test_inside_sagemaker_checkpoints_go_to_run_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not to /opt/ml/checkpoints: that folder is local to each instance, so rank 0 could not commit the files the
    other hosts write (tests/integration/test_emulator.py shows it)."""
    monkeypatch.delenv("HLAT_CHECKPOINT_DIR", raising=False)
    monkeypatch.setenv("SM_TRAINING_ENV", '{"current_host": "algo-1"}')
    run = Run.at("s3://bucket/runs/r1")
    assert in_sagemaker()
    assert checkpoint_location(run).url == "s3://bucket/runs/r1/checkpoints"
    assert tensorboard_location(run) == "/opt/ml/output/tensorboard"
    monkeypatch.setenv("HLAT_CHECKPOINT_DIR", str(tmp_path / "fsx"))  # e.g. a shared FSx file system
    assert checkpoint_location(run).url == str(tmp_path / "fsx")
