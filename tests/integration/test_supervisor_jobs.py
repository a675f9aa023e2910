"""The supervisor's output against real local jobs: a job logging every step gives a few progress lines, not one
a poll; jobs that end Completed without their outputs (the local backend's `complete` fault: a job that exits
successfully without running) are named as such in train, precompile and burn-in; and the train stage publishes
one attempts table per flow run, its reason column adding to the status."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.infra.backends.local_faults import FAULTS_ENV
from hlat.infra.supervision.errors import JobFailed
from hlat.infra.supervision.ledger import Ledger
from hlat.training.checkpoint import CheckpointManager
from tests.conftest import SMALL_DATA
from tests.jobs import make_run, metrics, processes_mentioning

pytestmark = pytest.mark.slow

TRAINING = {"max_steps": 12, "checkpoint_every": 6, "eval_every": 0}
BURN_IN = {"burn_in.matmul_size": 128, "burn_in.matmul_repeats": 2, "burn_in.allreduce_mb": 1, "burn_in.write_mb": 2}


def overrides(**extra: Any) -> dict[str, Any]:
    return {**SMALL_DATA, **BURN_IN, **{f"training.{k}": v for k, v in TRAINING.items()}, **extra}


def latest(run: Path) -> int | None:
    return CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1).latest_step()


def test_a_job_logging_every_step_gives_a_few_progress_lines_and_its_average(
    prepared: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real tiny job logging each of its 80 steps, polled four times a second: the old supervisor printed a line
    per poll; now the first, each change of status, a new step at most every 10 polls, and the final average."""
    from hlat.infra.stage_jobs import supervisor_for

    training = {"max_steps": 80, "checkpoint_every": 40, "eval_every": 0, "log_every": 1}
    run = make_run(prepared, tmp_path, "quiet", **training)
    sets = {**SMALL_DATA, **{f"training.{k}": v for k, v in training.items()}, "job.poll_seconds": 0.25}
    config = load_config("tiny", sets, run_id="quiet", storage=str(tmp_path))
    polls = 0
    sup = supervisor_for(Run.at(str(run), config), current_step=lambda: latest(run))

    def count(_: Any) -> None:
        nonlocal polls
        polls += 1

    sup.on_progress = count
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="hlat"):
        attempts = sup.run_to_completion()
    elapsed = time.monotonic() - started
    assert [a.action for a in attempts] == ["done"]
    lines = [r.getMessage() for r in caplog.records if r.name == "hlat.supervisor" and "spent" in r.getMessage()]
    statuses = {line.split()[3].rstrip(",") for line in lines}  # Starting, Downloading, Training, Completed...
    assert polls >= 8 and len(lines) < polls, (polls, lines)
    assert len(lines) <= len(statuses) + elapsed / 2.5 + 2, lines
    final = lines[-1]
    assert final.startswith("attempt 1 hlat-quiet-train-1 Completed, step 80/80") and "ETA" not in final
    match = re.search(r"([\d,]+) tok/s average", final)
    assert match, final
    # The average is tokens over the time they took: of the order of the trainer's own step times' average (which
    # leaves out checkpoints and the supervisor's polling), not one step's reading.
    records = [r for r in metrics(run) if r.get("step_seconds")]
    trainer = config.tokens_per_step * len(records) / sum(r["step_seconds"] for r in records)
    assert 0.2 * trainer <= float(match[1].replace(",", "")) <= 1.5 * trainer, (final, trainer)
    # The ledger and the training report take that same average, with the start-up before the first step apart.
    (attempt,) = attempts
    assert attempt.tokens_per_s is not None and f"{attempt.tokens_per_s:,.0f} tok/s average" in final
    assert sup.tokens_per_s() == pytest.approx(attempt.tokens_per_s)
    assert attempt.startup_s is not None and sup.startup_s() == attempt.startup_s and ", start-up " in final
    assert attempt.training_s is not None and attempt.startup_s + attempt.training_s <= elapsed + 1
    # The supervisor beat its heartbeat while it watched: this process, on this host.
    beat = json.loads((run / "jobs" / "train-supervisor.json").read_text())
    assert beat["pid"] == os.getpid() and beat["host"] == socket.gethostname()
    assert 0 <= time.time() - beat["beat_at"] < elapsed and beat["command"] and beat["flow_run_id"] is None
    assert not [r for r in caplog.records if r.name == "hlat.job" and " step 40 loss" in r.getMessage()]
    assert processes_mentioning(str(run)) == []


def test_a_train_job_completed_without_its_checkpoint_is_relaunched_and_one_table_is_published(
    prefect_server: None,
    prepared: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from hlat.flows.train import train
    from hlat.tasks.caching import artifact_key

    run = make_run(prepared, tmp_path, "early", **TRAINING)
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"1": {"complete": True}}))
    with caplog.at_level(logging.INFO, logger="hlat"):
        summary = train(preset="tiny", overrides=overrides(), run_id="early", storage=str(tmp_path))
    assert summary["final_step"] == 12 and summary["jobs"] == 2
    cause = "completed without a checkpoint at step 12 (newest: none; the job logged no training step)"
    assert f"attempt 1 (hlat-early-train-1) ended Completed: {cause} -> resume" in caplog.text
    assert "re-attaching" not in caplog.text and "never created" not in caplog.text

    attempts = Ledger(Run.at(str(run)), "train").load()
    assert [(a.status, a.action, a.reason) for a in attempts] == [
        ("Completed", "resume", cause),
        ("Completed", "done", None),
    ]
    raw = json.loads((run / "jobs/train-attempts.json").read_text())["attempts"]
    for row in raw:  # ISO 8601 UTC, not epoch seconds
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", row["submitted_at"]), row
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", row["ended_at"]), row

    key = artifact_key("train-attempts", "early")
    with get_client(sync_client=True) as client:
        cards = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert len(cards) == 1, [c.created for c in cards]  # one card, updated in place, not a version per change
    data = cards[0].data
    rows: list[dict[str, Any]] = json.loads(data) if isinstance(data, str) else data  # type: ignore[assignment]
    assert [(r["attempt"], r["status"], r["reason"], r["action"]) for r in rows] == [
        (1, "Completed", cause, "resume"),
        (2, "Completed", "", "done"),
    ]


def test_burn_in_and_precompile_jobs_completed_without_their_outputs_name_the_missing_file(
    prefect_server: None, prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hlat.flows.burn_in import burn_in
    from hlat.flows.precompile import precompile

    monkeypatch.setenv(FAULTS_ENV, json.dumps({"1": {"complete": True}}))
    run = make_run(prepared, tmp_path, "hollow", **TRAINING, **BURN_IN, compile=True)
    sets = overrides(**{"training.compile": True})
    report = run / "burn-in/report.json"
    with pytest.raises(JobFailed) as info:
        burn_in(preset="tiny", overrides=sets, run_id="hollow", storage=str(tmp_path))
    message = str(info.value)
    assert f"burn-in: job hlat-hollow-burn-in-1 ended Completed but wrote no {report}" in message, message
    assert str(run / "jobs/hlat-hollow-burn-in-1/output.log") in message and "Completed: Completed" not in message
    (attempt,) = Ledger(Run.at(str(run)), "burn-in").load()
    assert (attempt.action, attempt.reason) == ("fatal", "completed without writing burn-in/report.json")

    latest_json = run / "compile-cache/latest.json"
    with pytest.raises(JobFailed, match=re.escape(f"ended Completed but wrote no {latest_json}")):
        precompile(preset="tiny", overrides=sets, run_id="hollow", storage=str(tmp_path))
    assert [a.action for a in Ledger(Run.at(str(run)), "precompile").load()] == ["fatal"]
