"""What the train stage's supervisor says and records: a progress line printed when it changes (not every poll),
a smoothed ETA and an attempt's average throughput, an attempt that completed without its final checkpoint,
're-attaching' only to a job that exists, and the ledger's ISO 8601 timestamps. Driven by the scripted backend
of test_supervisor on a fake clock."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hlat.core.run import Run
from hlat.infra.backends.protocol import JobSpec, JobState, Status, job_name
from hlat.infra.supervision.errors import JobFailed
from hlat.infra.supervision.ledger import Attempt, Ledger
from hlat.infra.supervision.progress import Progress, ProgressGate, Throughput
from hlat.infra.supervision.watch import ending_reason
from tests.unit.test_supervisor import RUN_ID, TARGET, Play, ScriptedBackend, supervisor

TOKENS_PER_STEP = 1000  # test_supervisor's supervisor()


def progress_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hlat.supervisor" and "spent" in r.getMessage()]


def step_line(step: int, tps: float) -> str:
    return f"rank0 step {step} loss 5.0 grad_norm 1.0 lr 1.0e-03 {tps:.0f} tok/s"


def test_the_rate_is_steps_over_a_window_not_the_last_reading() -> None:
    """One step a second (1,000 tok/s), while the trainer's readings swing by 100x (a checkpoint step, a fast
    step): the rate and the average stay at the steps' real pace."""
    meter = Throughput(TOKENS_PER_STEP, window_s=30)
    assert meter.rate() is None and meter.average() is None
    meter.observe(0.0, 10, 50.0)  # the first step, slowed by compilation
    assert meter.rate() == 50.0  # nothing else to go on yet
    for t in range(1, 100):
        meter.observe(float(t), 10 + t, 100.0 if t % 2 else 10_000.0)
    assert meter.rate() == pytest.approx(1000.0)
    assert meter.average() == pytest.approx(1000.0)
    # The pace halves: the window follows within its span; the average moves by the tokens, not the last reading.
    for t in range(100, 160):
        meter.observe(float(t), 109 + (t - 99) // 2, 100.0)
    assert meter.rate() == pytest.approx(500.0, rel=0.05)
    assert meter.average() == pytest.approx((139 - 10) * TOKENS_PER_STEP / 159, rel=1e-6)
    assert len(meter.recent) <= 32  # a window of observations, not the whole history


def test_the_gate_prints_changes_at_most_every_interval_and_repeats_only_as_a_heartbeat() -> None:
    gate = ProgressGate(every_s=10, quiet_s=60)
    p = Progress(1, "j", "Starting", target_step=100)
    printed = []
    for t in range(0, 200):
        p.status = "Starting" if t < 5 else "Training"
        p.step = None if t < 5 else min(100, t)  # a new step every second from t=5
        if t == 120:
            p.final = True
        if gate.due(p, float(t)):
            printed.append(t)
        if p.final:
            break
    # the first line, the change to Training at once, then a new step every 10 s (none after step 100 at t=100:
    # nothing until the final line), the final one at once
    assert printed == [0, 5, *range(15, 110, 10), 120]
    quiet = ProgressGate(every_s=10, quiet_s=60)
    same = Progress(1, "j", "Training", step=7, target_step=100)
    assert [t for t in range(0, 200) if quiet.due(same, float(t))] == [0, 60, 120, 180]


def test_a_job_logging_every_step_prints_few_progress_lines_with_a_steady_eta(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """60 polls of 1 s, a step each, the trainer's readings alternating 100 and 10,000 tok/s: a handful of lines
    instead of 60, each ETA within 10% of the truth (one step a second), the final one the average."""
    clock = [0.0]
    logs = [[step_line(s + 1, 100 if s % 2 else 10_000)] for s in range(60)]
    play = Play([("InProgress", None)] * 61 + [("Completed", None)], reaches=TARGET, logs=logs)
    backend = ScriptedBackend([play], clock, billable_per_poll=1.0)
    seen: list[Progress] = []
    sup = supervisor(tmp_path, backend, clock, poll_seconds=1.0)
    sup.on_progress = lambda p: seen.append(Progress(**vars(p)))
    with caplog.at_level(logging.INFO, logger="hlat"):
        sup.run_to_completion()
    lines = progress_lines(caplog)
    assert len(seen) == 62  # the artifact still follows every poll
    assert 6 <= len(lines) <= 9, lines  # 60 s at one line per 10 s, plus the first and the final line
    assert len(set(lines)) == len(lines)  # never the same line twice in a row
    for p in seen[5:61]:
        assert p.eta_s is not None and p.step is not None
        assert p.eta_s == pytest.approx(TARGET - p.step, rel=0.1), p.line()
    # 62 polls billed 1 s each x 2 nodes at $36/h = $1.24
    assert lines[-1].endswith("$1.24 spent") and "Completed, step 60/100" in lines[-1]
    assert "1,000 tok/s average" in lines[-1] and "ETA" not in lines[-1]
    # the trainer's step lines are summed up by the progress line, not forwarded to the log
    assert not [r for r in caplog.records if r.name == "hlat.job" and r.levelno >= logging.INFO]


def test_completed_without_the_last_checkpoint_is_resumed_then_stopped_naming_the_cause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = [0.0]
    early = Play([("InProgress", None), ("Completed", None)], reaches=0)
    backend = ScriptedBackend([early, Play([("Completed", None)], reaches=0), Play()], clock)
    with caplog.at_level(logging.INFO, logger="hlat"), pytest.raises(JobFailed) as info:
        supervisor(tmp_path, backend, clock).run_to_completion()
    cause = f"completed without a checkpoint at step {TARGET} (newest: none; the job logged no training step)"
    assert cause in str(info.value) and "same failure repeated" in str(info.value)
    assert len(backend.submitted) == 2
    attempts = Ledger(Run.at(str(tmp_path)), "train").load()
    assert [(a.status, a.action, a.category) for a in attempts] == [
        ("Completed", "resume", "completed-early"),
        ("Completed", "fatal", "completed-early"),
    ]
    assert [a.row()["reason"] for a in attempts] == [cause, cause]
    assert "-> done" not in caplog.text
    assert f"attempt 1 ({job_name(RUN_ID, 1)}) ended Completed: {cause} -> resume" in caplog.text


def test_completed_early_after_progress_is_resumed_to_the_end(tmp_path: Path) -> None:
    clock = [0.0]
    stopped_itself = Play([("InProgress", None), ("Completed", None)], reaches=40, logs=[[step_line(40, 500)]])
    backend = ScriptedBackend([stopped_itself, Play()], clock)
    attempts = supervisor(tmp_path, backend, clock).run_to_completion()
    assert [(a.action, a.row()["reason"]) for a in attempts] == [
        ("resume", f"completed without a checkpoint at step {TARGET} (newest: step 40; the job logged step 40)"),
        ("done", ""),
    ]


def test_re_attaching_is_said_only_of_a_job_that_exists(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = [0.0]
    backend = ScriptedBackend([Play(), Play()], clock)
    with caplog.at_level(logging.INFO, logger="hlat"):
        supervisor(tmp_path, backend, clock).run_to_completion()
    assert "re-attaching" not in caplog.text and "never created" not in caplog.text  # a first run

    # A supervisor that stopped between recording attempt 1 and submitting it: the job was never created.
    other = tmp_path / "other"
    Ledger(Run.at(str(other)), "train").save([Attempt(1, job_name(RUN_ID, 1))])
    backend = ScriptedBackend([Play()], clock)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hlat"):
        supervisor(other, backend, clock).run_to_completion()
    assert "re-attaching" not in caplog.text
    assert f"attempt 1 ({job_name(RUN_ID, 1)}): recorded but never created; submitting it" in caplog.text

    # ... and one whose job was created: that one is re-attached to.
    third = tmp_path / "third"
    # What the job logged before this flow run (its first read), then what it logs while followed.
    earlier = ["no complete checkpoint under /x: starting from scratch", "training tiny: 920192 params"]
    backend = ScriptedBackend([Play(logs=[earlier, ["after re-attaching"]])], clock)
    name = job_name(RUN_ID, 1)
    backend.submit(JobSpec(name, RUN_ID, 1, str(third), "c", "ml.trn1.32xlarge", 2, 32, 3600))
    Ledger(Run.at(str(third)), "train").save([Attempt(1, name, status="InProgress")])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hlat"):
        supervisor(third, backend, clock).run_to_completion()
    assert f"re-attaching to attempt 1 ({name}, InProgress)" in caplog.text
    # The earlier output is not replayed under today's timestamps (it read as if the run restarted): one line
    # says where it is; the new output is forwarded.
    assert "starting from scratch" not in caplog.text and "training tiny" not in caplog.text
    assert f"{name}: its 2 earlier log line(s) are in the job's own log, not repeated here" in caplog.text
    assert "after re-attaching" in caplog.text


def test_the_ledger_writes_iso_timestamps_and_reads_old_epoch_seconds(tmp_path: Path) -> None:
    run = Run.at(str(tmp_path))
    ledger = Ledger(run, "train")
    ledger.save([Attempt(1, "j-1", submitted_at=1_795_000_000.25, ended_at=1_795_003_600.5)])
    raw = json.loads((tmp_path / "jobs/train-attempts.json").read_text())["attempts"][0]
    assert raw["submitted_at"] == "2026-11-18T11:06:40.250Z" and raw["ended_at"] == "2026-11-18T12:06:40.500Z"
    loaded = ledger.load()[0]
    assert (loaded.submitted_at, loaded.ended_at) == (1_795_000_000.25, 1_795_003_600.5)
    # a ledger written before: epoch floats, no category
    old = {"attempts": [{"attempt": 1, "job_name": "j-1", "status": "Completed", "submitted_at": 1_795_000_000.0,
                         "ended_at": None}]}  # fmt: skip
    (tmp_path / "jobs/train-attempts.json").write_text(json.dumps(old))
    loaded = ledger.load()[0]
    assert loaded.submitted_at == 1_795_000_000.0 and loaded.ended_at is None and loaded.category is None


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        (JobState("j", Status.COMPLETED, secondary_status="Completed"), None),
        (JobState("j", Status.STOPPED, secondary_status="Stopped"), None),
        (JobState("j", Status.STOPPED, secondary_status="MaxRuntimeExceeded"), "MaxRuntimeExceeded"),
        (JobState("j", Status.FAILED, "CapacityError: no trn1", "Failed"), "CapacityError: no trn1"),
    ],
)
def test_the_reason_column_adds_to_the_status_or_is_empty(state: JobState, reason: str | None) -> None:
    assert ending_reason(state) == reason
    row = Attempt(1, "j", status=state.status.value, reason=ending_reason(state)).row()
    assert row["reason"] == (reason or "")
    assert Attempt(1, "j", status="Completed", reason="Completed").row()["reason"] == ""  # an older ledger's row


def test_a_progress_bar_in_a_jobs_log_is_followed_as_the_terminal_shows_it() -> None:
    from hlat.infra.supervision.watch import as_displayed, read_logs

    bar = "Running requests:   0%|  | 0/250 [00:00<?, ?it/s]\rRunning requests:  4%|▎ | 9/250\r" + (
        "Running requests: 100%|██████████| 250/250 [00:01<00:00, 243.02it/s]\r"
    )
    assert as_displayed(bar) == "Running requests: 100%|██████████| 250/250 [00:01<00:00, 243.02it/s]"
    assert as_displayed("plain line") == "plain line" and as_displayed("\r\r") == ""

    class Logs:
        def logs(self, name: str, cursor: object) -> tuple[list[str], object]:
            return [f"rank0 {bar}", "rank0 wrote results.json"], 2

    lines, cursor = read_logs(Logs(), "job", None)  # type: ignore[arg-type]
    assert cursor == 2 and lines[1] == "rank0 wrote results.json"
    assert lines[0].endswith("250/250 [00:01<00:00, 243.02it/s]") and len(lines[0]) < 100
