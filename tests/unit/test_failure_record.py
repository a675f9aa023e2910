"""The failure record a job program leaves when it fails (core/contract.py): what the control plane judges a failure
by (infra/backends/protocol.py `classify`). Written to the failure file (SageMaker's FailureReason) and the job's
log."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from hlat.core import contract
from hlat.core.contract import (
    FAILURE_FILE_BUDGET,
    MAX_FAILURE_REASON,
    FailureRecord,
    parse_failure_record,
    reporting_failure,
)
from hlat.infra.backends.local_daemon import failure_reason
from hlat.infra.backends.protocol import FailureClass, JobState, Status, classify


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
    assert text.startswith("[hlat-failure {") and "] RuntimeError: Expected all tensors" in text  # its fields first
    record = parse_failure_record(f"AlgorithmError: {text}")
    assert record is not None and record.time is not None and abs(record.time - time.time()) < 60
    message = "Expected all tensors to be on the same device, but found xla:0 and cpu!"
    assert record == FailureRecord("RuntimeError", message, None, 41, 5, "algo-2", record.time)
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


def sagemakers_reason(failure_file_text: str) -> str:
    """SageMaker's FailureReason of a job whose failure file holds `failure_file_text`: its prefix, then the whole
    cut at 1,024 characters (the emulator's daemon does the same: infra/backends/local_daemon.py `failure_reason`)."""
    return ("AlgorithmError: " + failure_file_text.strip())[:MAX_FAILURE_REASON]


def test_a_long_message_is_cut_so_the_record_survives_sagemakers_limit(failure_file: Path) -> None:
    contract.note_step(7)
    contract.write_failure("DataValidationError: " + "bad row; " * 500)
    text = failure_file.read_text()
    assert len(text) <= FAILURE_FILE_BUDGET < MAX_FAILURE_REASON - len("AlgorithmError: ")
    record = parse_failure_record(sagemakers_reason(text))
    assert record is not None and (record.type, record.step, record.rank) == ("DataValidationError", 7, 5)
    assert record.message.endswith("...")


def test_a_5000_character_storage_fault_is_still_a_storage_fault_after_sagemakers_prefix_and_cut(
    failure_file: Path,
) -> None:
    """The record written fields first, within the budget, survives SageMaker's prefix and cut: a commit that
    timed out is class platform ('storage'), relaunched, not 'unknown' (which stopped the stage after two)."""
    contract.note_step(40)
    long = "not committing step-40: " + "rank-00005.pt (algo-2) missing after 600s; " * 120
    assert len(long) > 5000
    contract.write_failure(f"CheckpointError: {long}")
    reason = sagemakers_reason(failure_file.read_text())
    assert len(reason) <= MAX_FAILURE_REASON
    decision = classify(JobState("j", Status.FAILED, reason))
    assert (decision.category, decision.failure_class) == ("storage", FailureClass.PLATFORM)
    assert decision.record is not None and decision.record.step == 40
    # The emulator's daemon reports the failure file the same way.
    assert failure_reason(1, failure_file.read_text(), []) == reason
    # Written the older way (fields last, cut to 1,024 before the prefix) the same fault read as unknown.
    old = FailureRecord("CheckpointError", long, step=40, rank=5, host="algo-2").line(limit=MAX_FAILURE_REASON)
    old_tail = old[old.index("]") + 2 :] + " " + old[: old.index("]") + 1]  # the same text, fields at the end
    assert classify(JobState("j", Status.FAILED, sagemakers_reason(old_tail[:MAX_FAILURE_REASON]))).category == (
        "unknown"
    )


def test_records_of_the_older_form_still_parse() -> None:
    """Records written before this version put their fields last: a ledger or a log of then still reads."""
    line = 'NonFiniteLoss: the loss became NaN [hlat-failure {"rank": 3, "step": 41, "type": "NonFiniteLoss"}]'
    record = parse_failure_record(f"AlgorithmError: {line}")
    assert record == FailureRecord("NonFiniteLoss", "the loss became NaN", None, 41, 3, None, None)


def test_text_without_a_type_and_no_failure_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HLAT_FAILURE_FILE", raising=False)
    monkeypatch.delenv("SM_TRAINING_ENV", raising=False)
    monkeypatch.delenv("SM_CURRENT_HOST", raising=False)
    record = contract.write_failure("the data channel is empty")  # outside a job: logged only
    assert (record.type, record.message) == ("JobFailure", "the data channel is empty")
    assert parse_failure_record("no record here") is None
    assert parse_failure_record("x [hlat-failure {not json}]") is None
