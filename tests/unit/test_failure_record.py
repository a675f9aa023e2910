"""The failure record a job program leaves when it fails (core/contract.py): what the control plane judges a failure
by (infra/jobs.py `classify`). Written to the failure file (SageMaker's FailureReason) and the job's log."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hlat.core import contract
from hlat.core.contract import MAX_FAILURE_REASON, FailureRecord, parse_failure_record, reporting_failure
from hlat.infra.jobs import JobState, Status, classify


@pytest.fixture
def failure_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "opt" / "ml" / "output" / "failure"
    monkeypatch.setenv("HLAT_FAILURE_FILE", str(path))
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("SM_CURRENT_HOST", "algo-2")
    monkeypatch.setattr(contract, "_current_step", None)
    return path


def test_an_exception_becomes_a_record_with_its_step_rank_and_host(
    failure_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    contract.note_step(41)

    def program() -> int:
        raise RuntimeError("Expected all tensors to be on the same device, but found xla:0 and cpu!")

    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError):
        reporting_failure(program)
    text = failure_file.read_text()
    assert text.startswith("RuntimeError: Expected all tensors")
    record = parse_failure_record(f"AlgorithmError: {text}")
    assert record == FailureRecord(
        "RuntimeError", "Expected all tensors to be on the same device, but found xla:0 and cpu!", None, 41, 5, "algo-2"
    )
    assert [r.getMessage() for r in caplog.records] == [text]  # the same line in the job's log, once
    decision = classify(JobState("j", Status.FAILED, f"AlgorithmError: {text}"))
    assert (decision.category, decision.cause) == ("unknown", "unknown: RuntimeError at step 41")


def test_a_library_error_keeps_its_module_and_the_first_failure_stays(failure_file: Path) -> None:
    import torch

    with pytest.raises(torch.OutOfMemoryError):
        reporting_failure(lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory")))
    contract.write_failure("NonFiniteLoss: the loss became NaN or inf")  # a second rank of the host: not recorded
    record = parse_failure_record(failure_file.read_text())
    assert record is not None and (record.type, record.module) == ("OutOfMemoryError", "torch")
    assert classify(JobState("j", Status.FAILED, failure_file.read_text())).category == "out-of-memory"


def test_a_long_message_is_cut_so_the_record_survives_sagemakers_limit(failure_file: Path) -> None:
    contract.note_step(7)
    contract.write_failure("DataValidationError: " + "bad row; " * 500)
    text = failure_file.read_text()
    assert len(text) <= MAX_FAILURE_REASON
    # SageMaker prefixes the file's text and cuts the whole FailureReason at 1,024 characters too.
    record = parse_failure_record(("AlgorithmError: " + text)[: MAX_FAILURE_REASON + 16])
    assert record is not None and (record.type, record.step, record.rank) == ("DataValidationError", 7, 5)
    assert record.message.endswith("...")


def test_text_without_a_type_and_no_failure_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HLAT_FAILURE_FILE", raising=False)
    monkeypatch.delenv("SM_TRAINING_ENV", raising=False)
    monkeypatch.delenv("SM_CURRENT_HOST", raising=False)
    record = contract.write_failure("the data channel is empty")  # outside a job: logged only
    assert (record.type, record.message) == ("JobFailure", "the data channel is empty")
    assert parse_failure_record("no record here") is None
    assert parse_failure_record("x [hlat-failure {not json}]") is None
