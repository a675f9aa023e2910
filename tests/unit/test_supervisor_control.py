"""The supervisor's control-plane rules of issue 50, on the scripted backend and a fake clock (no sleeps): repeats
judged for every class (job.max_attempts_without_progress), a NaN judged by 'no newer checkpoint', a lost peer
attributed to the rank that failed first, the hang timer from SageMaker's Training status and the start-up bound,
`hlat stop` during a back-off or a submission, one supervisor per run and stage (the lease and its fencing), and
the deadline and budget asked before an attempt is recorded."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from hlat.core.contract import FailureRecord
from hlat.core.layout import lease_path, stop_request_path
from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.core.storage import Storage, StorageClock
from hlat.infra.backends.protocol import JobState, Status, SubmitError, classify, first_failure
from hlat.infra.supervision.errors import (
    BudgetExhausted,
    DeadlinePassed,
    JobFailed,
    LeaseLost,
    NoProgress,
    StoppedByUser,
    SupervisorBusy,
)
from hlat.infra.supervision.lease import read_lease, request_stop
from hlat.infra.supervision.ledger import Ledger
from hlat.infra.supervision.status import render, run_status, stop_run, stop_summary
from tests.unit.test_supervisor import Play, ScriptedBackend, logged_steps, record_reason, supervisor

T = 1_800_000_000.0


class VirtualStore(StorageClock):
    """Run storage's clock on the test's fake clock (the lease's times)."""

    def __init__(self, run: Run, clock: list[float]) -> None:
        super().__init__(run)
        self.clock = clock

    def now(self) -> float:
        return self.clock[0]


def sup(tmp_path: Path, backend: ScriptedBackend, clock: list[float], **options: Any) -> Any:
    return supervisor(tmp_path, backend, clock, storage_clock=VirtualStore(Storage(str(tmp_path)), clock), **options)


# -- 1. repeats judged for every class -------------------------------------------------------------------------------
LOST_PEER = record_reason("RuntimeError", "[gloo] Connection closed by peer [10.0.1.7]:41230", 31)
INTERNAL = "InternalServerError: We encountered an internal error."


def test_every_class_stops_after_attempts_without_progress(tmp_path: Path) -> None:
    """Platform faults of three kinds in a row, none committing a newer checkpoint than step 30: the stage stops
    after job.max_attempts_without_progress (3) with one line naming the field, the causes and the checkpoint; an
    attempt that commits one in between starts the count again."""
    clock = [T]
    hang = record_reason("HangDetected", "no step for 1,530 s (bound 1,500 s)", 31)
    plays = [Play([("Failed", INTERNAL)], reaches=30), Play([("Failed", LOST_PEER)], reaches=30)]
    plays += [Play([("Failed", hang)], reaches=30), Play([("Failed", INTERNAL)], reaches=30), Play()]
    backend = ScriptedBackend(plays, clock)
    with pytest.raises(NoProgress) as info:
        sup(tmp_path, backend, clock).run_to_completion()
    message = str(info.value)
    assert len(backend.submitted) == 4  # the first committed step 30; three more gained nothing
    assert "3 attempts in a row committed no newer checkpoint (attempts 2-4" in message
    assert "lost-peer: RuntimeError at step 31, hung: HangDetected at step 31, internal" in message
    assert "newest checkpoint step 30" in message and "job.max_attempts_without_progress=3" in message
    assert "\n" not in message
    assert Ledger(Run.at(str(tmp_path)), "train").load()[-1].action == "fatal"


def test_a_transient_quota_refusal_backs_off_and_is_bounded(tmp_path: Path) -> None:
    """ResourceLimitExceeded at CreateTrainingJob (instances still held by a stopping job) is capacity: backed off,
    then submitted; refused again and again it stops the stage by job.max_attempts_without_progress."""
    clock = [T]
    limit = SubmitError("ResourceLimitExceeded", "The account-level service limit 'ml.trn1.32xlarge' is 16")
    backend = ScriptedBackend([Play(refuse=limit), Play()], clock)
    attempts = sup(tmp_path / "clears", backend, clock).run_to_completion()
    assert [(a.status, a.action, a.category) for a in attempts] == [
        ("NotSubmitted", "backoff", "resource-limit"), ("Completed", "done", "completed"),
    ]  # fmt: skip
    backend = ScriptedBackend([Play(refuse=limit) for _ in range(5)], clock)
    with pytest.raises(NoProgress, match=r"resource-limit.*job\.max_attempts_without_progress=3"):
        sup(tmp_path / "never", backend, clock).run_to_completion()
    assert not backend.submitted and len(backend.plays) == 2


def test_a_nan_whose_step_moves_is_still_the_same_failure(tmp_path: Path) -> None:
    """bf16 stochastic rounding or deterministic=False: the NaN comes back at 41, then 57, from the same checkpoint.
    Judged by 'no newer checkpoint', not by the step: job.max_repeats (2) stops it."""
    clock = [T]
    nan = [record_reason("NonFiniteLoss", "loss is nan", step) for step in (41, 57, 44)]
    plays = [Play([("Failed", reason)], reaches=30) for reason in nan]
    with pytest.raises(JobFailed, match=r"nan: NonFiniteLoss at step 41, then NonFiniteLoss at step 57, 2 times"):
        sup(tmp_path, ScriptedBackend(plays, clock), clock).run_to_completion()


# -- 2. a lost peer is attributed to the rank that failed first --------------------------------------------------------
def record_line(rank: int, type_name: str, message: str, at: float, host: str) -> str:
    record = FailureRecord(type_name, message, step=31, rank=rank, host=host, time=at)
    return f"[{host}] rank{rank} {record.line()}"


def rank_17_bug(start: float) -> Play:
    """Rank 17's deterministic bug: its record first, then 600 other ranks' lost-peer records (past the 400-line
    tail); SageMaker reports another host's failure file, a lost peer."""
    bug = record_line(17, "IndexError", "index 8192 is out of bounds for dimension 0", start, "algo-1")
    peers = [
        record_line(r, "RuntimeError", "[gloo] Connection closed by peer", start + 0.5 + r / 1e4, f"algo-{r // 32 + 1}")
        for r in range(32, 632)
    ]
    reported = FailureRecord(
        "RuntimeError", "[gloo] Connection closed by peer", step=31, rank=4000, host="algo-126", time=start + 0.9
    )
    return Play(
        [("InProgress", None)] * 3 + [("Failed", f"AlgorithmError: {reported.line()}")],
        reaches=30,
        logs=[[bug], peers[:300], peers[300:]],
    )


def test_a_bug_on_one_rank_is_judged_by_its_record_not_by_the_lost_peers(tmp_path: Path) -> None:
    clock = [T]
    plays = [rank_17_bug(T + 100 * i) for i in range(4)]
    backend = ScriptedBackend(plays, clock)
    with pytest.raises(JobFailed, match=r"unknown: IndexError at step 31, 2 times") as info:
        sup(tmp_path, backend, clock).run_to_completion()
    attempts = info.value.attempts
    assert [(a.category, a.failure_class) for a in attempts] == [("unknown", "job")] * 2
    assert len(backend.submitted) == 2  # job.max_repeats, not 100 relaunches of a platform fault


def test_the_first_failure_of_several_records() -> None:
    bug = FailureRecord("IndexError", "out of bounds", rank=17, time=10.0)
    peer = FailureRecord("RuntimeError", "Connection closed by peer", rank=40, time=9.9)  # a skewed host clock
    late = FailureRecord("ValueError", "x", rank=3, time=11.0)
    untimed = FailureRecord("KeyError", "y", rank=5)
    assert first_failure([peer, late, bug]) is bug  # the earliest that is not a lost peer
    assert first_failure([peer]) is peer  # a lost host writes nothing: its peers' records are all there is
    assert first_failure([untimed, late]) is late and first_failure([]) is None
    state = JobState("j", Status.FAILED, f"AlgorithmError: {peer.line()}")
    assert classify(state).category == "lost-peer"
    assert (classify(state, first_record=bug).category, classify(state, first_record=bug).record) == ("unknown", bug)


# -- 3. the hang timer starts at Training; the start-up is bounded apart --------------------------------------------
class PhasedBackend(ScriptedBackend):
    """SageMaker's SecondaryStatus: Starting, Downloading, then Training, for `phase_polls` polls each."""

    def __init__(self, plays: list[Play], clock: list[float], phase_polls: int) -> None:
        super().__init__(plays, clock)
        self.phase_polls = phase_polls

    def describe(self, name: str) -> JobState | None:
        state = super().describe(name)
        if state is None or state.terminal:
            return state
        polls = self.polls[name]
        phase = "Starting" if polls <= self.phase_polls else "Downloading" if polls <= 2 * self.phase_polls else None
        return JobState(name, state.status, secondary_status=phase or "Training", billable_seconds=60.0)


def test_the_hang_timer_starts_at_training_and_a_slow_start_up_is_not_a_hang(tmp_path: Path) -> None:
    """40 polls (of 60 s) in Starting and Downloading, 15 more in Training before the first step: 55 min past
    a 10-minute hang timeout, inside the 20-minute start-up bound; then its steps stop, and the hang timer stops
    the job 10 minutes later."""
    clock = [T]
    logs: list[list[str]] = [[] for _ in range(20 + 20 + 15)] + logged_steps(1, 30)
    play = Play([("InProgress", None)] * 200, reaches=30, logs=logs)
    backend = PhasedBackend([play, Play()], clock, phase_polls=20)
    attempts = sup(tmp_path, backend, clock, hang_timeout_s=600.0, startup_timeout_s=1200.0).run_to_completion()
    first = attempts[0]
    assert first.stop_requested == "hung" and first.last_logged_step == 30
    assert first.reason == "hung: no step logged for 10 min (job.hang_timeout_minutes)"
    assert backend.polls[first.job_name] > 55 + 3 + 10


def test_a_start_up_that_overruns_its_bound_is_hung_and_says_so(tmp_path: Path) -> None:
    clock = [T]
    play = Play([("InProgress", None)] * 200, reaches=0)
    backend = PhasedBackend([play, Play()], clock, phase_polls=5)
    attempts = sup(tmp_path, backend, clock, hang_timeout_s=600.0, startup_timeout_s=1200.0).run_to_completion()
    assert attempts[0].stop_requested == "hung"
    assert attempts[0].reason == (
        "hung: start-up overran: no first step 20 min after the job reached Training (job.startup_timeout_minutes)"
    )
    # Stopped 20 minutes after Training began (10 polls of Starting and Downloading before it), not 10 after submission.
    assert 10 + 20 <= backend.polls[attempts[0].job_name] <= 10 + 20 + 3


# -- 5. hlat stop at any moment -------------------------------------------------------------------------------------
def stored_run(tmp_path: Path) -> Storage:
    """A run folder `hlat stop` can read (its config.json: the local backend)."""
    run = Run.at(str(tmp_path))
    run.storage.write_json("config.json", load_config("tiny").model_dump(mode="json"))
    return run


def test_hlat_stop_during_a_back_off_ends_the_stage_before_the_next_job(tmp_path: Path) -> None:
    clock = [T]
    run = stored_run(tmp_path)
    capacity = ("Failed", "CapacityError: Unable to provision requested ML compute capacity.")
    backend = ScriptedBackend([Play([capacity], reaches=0), Play()], clock)
    said: list[str] = []
    made = sup(tmp_path, backend, clock, backoff_seconds=[600.0])

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        if len(backend.submitted) == 1 and not said:  # the first part of the back-off: `hlat stop` from a terminal
            results = stop_run(run, wait_s=0, clock=lambda: clock[0])
            said.append(stop_summary(results, "tiny-test"))

    made.sleep = sleep
    with pytest.raises(StoppedByUser, match=r"stopped by hlat stop between attempts \(no job was running\)"):
        made.run_to_completion()
    assert len(backend.submitted) == 1 and len(Ledger(run, "train").load()) == 1
    assert "the stage will not relaunch" in said[0] and "nothing to stop" not in said[0]
    assert "pid" in said[0] and socket.gethostname() in said[0]  # names the supervisor it told
    # The same command again clears the request and goes on.
    attempts = sup(tmp_path, backend, clock).run_to_completion()
    assert [a.status for a in attempts] == ["Failed", "Completed"] and not run.storage.exists(
        stop_request_path("train")
    )


def test_hlat_stop_while_the_job_is_being_created_stops_it_once_it_exists(tmp_path: Path) -> None:
    """The request lands between the attempt's record and its job: the first poll that sees the job stops it."""
    clock = [T]
    run = stored_run(tmp_path)
    backend = ScriptedBackend([Play([("InProgress", None)] * 20)], clock)
    made = sup(tmp_path, backend, clock)
    real_submit = backend.submit

    def submit(spec: Any) -> None:
        request_stop(run, "train")  # `hlat stop` while CreateTrainingJob is in flight
        real_submit(spec)

    backend.submit = submit  # type: ignore[method-assign]
    with pytest.raises(StoppedByUser):
        made.run_to_completion()
    assert backend.stopped == ["hlat-tiny-test-train-1"]
    (only,) = Ledger(run, "train").load()
    assert only.stop_requested == "user" and only.ended


# -- 6. one supervisor per run and stage ----------------------------------------------------------------------------
def test_a_second_supervisor_is_refused_then_takes_over_an_expired_lease(tmp_path: Path) -> None:
    clock = [T]
    backend = ScriptedBackend([Play()], clock)
    first = sup(tmp_path, backend, clock)
    token = first.lease.acquire()  # the first supervisor, alive, between two polls
    second = sup(tmp_path, backend, clock)
    with pytest.raises(SupervisorBusy) as info:
        second.run_to_completion()
    message = str(info.value)
    assert f"pid {os.getpid()} on {socket.gethostname()}" in message and "since" in message
    assert not backend.submitted and backend.stopped == []  # the refused one touched nothing
    # The first falls silent past the lease's life: the next one takes over, with a greater token.
    clock[0] += first.lease.ttl_s + 1
    attempts = second.run_to_completion()
    assert attempts[0].status == "Completed"
    assert (read_lease(Run.at(str(tmp_path)), "train") or {}).get("token") == token + 1
    with pytest.raises(LeaseLost, match="taken over by"):
        first.lease.check()


def test_a_supervisor_whose_lease_was_taken_neither_stops_nor_relaunches(tmp_path: Path) -> None:
    """Another supervisor took the lease over while this one watched: interrupted, it does not stop the shared job
    (Ctrl-C here must not end the other's job), and it submits nothing more."""
    clock = [T]
    backend = ScriptedBackend([Play([("InProgress", None)] * 20)], clock)
    made = sup(tmp_path, backend, clock)
    run = Run.at(str(tmp_path))

    def taken_then_interrupted(progress: Any) -> None:
        lease = read_lease(run, "train")
        assert lease is not None
        run.storage.write_json(lease_path("train"), {**lease, "token": lease["token"] + 1, "nonce": "other", "pid": 1})
        raise KeyboardInterrupt

    made.on_progress = taken_then_interrupted
    with pytest.raises(KeyboardInterrupt):
        made.run_to_completion()
    assert backend.stopped == [] and len(backend.submitted) == 1
    assert (read_lease(run, "train") or {}).get("nonce") == "other"  # not released: not its own


def test_hlat_status_names_the_lease_holder(tmp_path: Path) -> None:
    clock = [T]
    run = stored_run(tmp_path)
    capacity = ("Failed", "CapacityError: Unable to provision requested ML compute capacity.")
    backend = ScriptedBackend([Play([capacity], reaches=0), Play()], clock)
    made = supervisor(tmp_path, backend, clock, backoff_seconds=[600.0])  # the real store's clock
    seen: list[Any] = []

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        if not seen:
            seen.append(run_status(run))

    made.sleep = sleep
    made.run_to_completion()
    status = seen[0]
    assert dict(status.stages)["train"].startswith("between attempts")
    assert [stage for stage, _ in status.leases] == ["train"]
    line = next(x for x in render(status).splitlines() if "lease" in x)
    assert line.startswith("  train lease 1: held by ") and f"pid {os.getpid()} on {socket.gethostname()}" in line


# -- 10. deadline and budget, asked before an attempt is recorded -------------------------------------------------
def test_a_deadline_passed_between_attempts_records_no_phantom_attempt(tmp_path: Path) -> None:
    clock = [T]
    backend = ScriptedBackend([Play([("InProgress", None), ("Failed", INTERNAL)], reaches=20), Play()], clock)
    with pytest.raises(DeadlinePassed, match=r"job\.deadline=.* has passed; set a later job\.deadline"):
        sup(tmp_path, backend, clock, deadline=T + 30).run_to_completion()
    attempts = Ledger(Run.at(str(tmp_path)), "train").load()
    assert [a.status for a in attempts] == ["Failed"] and len(backend.submitted) == 1


def test_a_make_spec_refusal_records_nothing(tmp_path: Path) -> None:
    """The train stage's spec refuses a deadline past or a budget spent (ConfigError): nothing is recorded, so
    `hlat status` says no job runs."""
    from hlat.core.config import ConfigError

    clock = [T]
    backend = ScriptedBackend([Play()], clock)
    made = sup(tmp_path, backend, clock)

    def refuse(attempt: int, name: str) -> Any:
        raise ConfigError("job.deadline=2027-01-01T00:00:00+00:00 has passed: set a later job.deadline to go on")

    made.make_spec = refuse
    with pytest.raises(ConfigError):
        made.run_to_completion()
    assert Ledger(Run.at(str(tmp_path)), "train").load() == []


def test_a_budget_that_cannot_buy_a_checkpoint_submits_nothing(tmp_path: Path) -> None:
    """2 nodes at $36/h: $72/h. A start-up of 10 min and a checkpoint every 30 min need $48; after the first
    job's $60 of a $100 budget, $40 is left: refused with one line naming job.budget_usd, nothing recorded."""
    clock = [T]
    first = Play([("InProgress", None)] * 49 + [("Failed", INTERNAL)], reaches=20)  # 50 polls: $60
    backend = ScriptedBackend([first, Play()], clock, billable_per_poll=60.0)
    made = sup(tmp_path, backend, clock, budget_usd=100.0, startup_floor_s=600.0, checkpoint_interval_s=1800.0)
    with pytest.raises(BudgetExhausted) as info:
        made.run_to_completion()
    message = str(info.value)
    assert "job.budget_usd=$100.00 has $40.00 left" in message and "needs $48.00" in message, message
    assert "\n" not in message and len(backend.submitted) == 1
    assert len(Ledger(Run.at(str(tmp_path)), "train").load()) == 1


def test_the_stop_request_file_is_json_with_who_asked(tmp_path: Path) -> None:
    run = Run.at(str(tmp_path))
    request_stop(run, "train", 123.0)
    body = json.loads((tmp_path / stop_request_path("train")).read_text())
    assert body["requested_at"] == 123.0 and body["pid"] == os.getpid()
