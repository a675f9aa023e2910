"""The job's stop rule: its terms' arithmetic (budget, deadline, supervision), what the train stage puts in a job's
environment and max runtime, and how a job that stopped itself is classified. On a fake clock, over real storage."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hlat.core.config import ConfigError
from hlat.core.contract import (
    BUDGET_ENV,
    DEADLINE_ENV,
    PRICE_ENV,
    SPENT_ENV,
    STOP_BUDGET,
    STOP_DEADLINE,
    STOP_UNSUPERVISED,
    SUBMITTED_ENV,
    UNSUPERVISED_ENV,
    StopRecord,
    StopTerms,
    parse_stop_record,
)
from hlat.core.layout import heartbeat_path, stop_record_path
from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.core.storage import Storage, StorageClock
from hlat.infra.backends.protocol import Action, FailureClass, JobState, Status, classify, stored_self_stop
from hlat.infra.backends.sagemaker import SageMakerBackend
from hlat.infra.backends.sagemaker_validation import request_problems, sagemaker_service_model
from hlat.infra.stage_jobs import billed_usd, job_spec, runtime_cap, stop_terms, supervisor_for
from hlat.infra.supervision.errors import JobFailed
from hlat.infra.supervision.ledger import Attempt, Ledger
from hlat.training.stop_rule import StopRule, stop_rule
from tests.unit.test_supervisor import Play, ScriptedBackend, supervisor

T0 = 1_800_000_000.0  # the job's submission, epoch seconds
ROLE = "arn:aws:iam::111122223333:role/hlat-training"


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def rule(terms: StopTerms, run: Run | None = None, margin: float = 10.0, clock: Clock | None = None) -> StopRule:
    requests: list[str] = []
    made = StopRule(terms, requests.append, lambda: margin, run, clock=clock or Clock())
    made.requests = requests  # type: ignore[attr-defined]
    return made


# -- the terms ----------------------------------------------------------------------------------------------------
def test_the_terms_travel_in_the_environment_and_come_back_whole() -> None:
    terms = StopTerms(
        budget_usd=1000.0, spent_usd=250.5, price_per_hour_usd=1582.4, deadline=T0 + 7200, submitted_at=T0,
        unsupervised_stop_s=1800.0,
    )  # fmt: skip
    env = terms.environment()
    assert set(env) == {BUDGET_ENV, SPENT_ENV, PRICE_ENV, DEADLINE_ENV, SUBMITTED_ENV, UNSUPERVISED_ENV}
    assert env[DEADLINE_ENV] == "2027-01-15T10:00:00+00:00"  # ISO 8601, readable in the job's description
    assert StopTerms.from_environment(env) == terms
    assert StopTerms.from_environment({}) == StopTerms() and not StopTerms().any


def test_the_budget_lasts_what_is_left_of_it_at_the_jobs_price() -> None:
    # $1,000 budget, $250 spent by earlier jobs, $1,500/h: 30 minutes from the submission.
    terms = StopTerms(budget_usd=1000.0, spent_usd=250.0, price_per_hour_usd=1500.0)
    assert terms.budget_end(T0) == pytest.approx(T0 + 1800)
    assert terms.limit_at(T0) == (pytest.approx(T0 + 1800), STOP_BUDGET)
    # The earlier of budget and deadline decides.
    assert StopTerms(1000.0, 250.0, 1500.0, deadline=T0 + 600).limit_at(T0) == (T0 + 600, STOP_DEADLINE)
    # A job that costs nothing the catalog knows of never runs out of budget.
    assert StopTerms(budget_usd=1000.0, price_per_hour_usd=0.0).limit_at(T0) is None


def test_budget_and_deadline_stop_a_margin_before_they_run_out() -> None:
    clock = Clock()
    budget = rule(StopTerms(1000.0, 250.0, 1500.0, submitted_at=T0), margin=40.0, clock=clock)
    assert budget.billed_from == T0 and budget.check(T0 + 1759) is None and budget.requests == []  # type: ignore[attr-defined]
    assert budget.check(T0 + 1760) == STOP_BUDGET and budget.requests == [STOP_BUDGET]  # type: ignore[attr-defined]
    assert budget.check(T0 + 1800) == STOP_BUDGET and budget.requests == [STOP_BUDGET]  # type: ignore[attr-defined]
    record = budget.record(41)
    assert "job.budget_usd" in record.message and "$250.00 by earlier jobs" in record.message
    assert record.message.endswith("stopped at step 41, checkpointed; raise job.budget_usd to go on")

    deadline = rule(StopTerms(deadline=T0 + 600), margin=5.0, clock=clock)
    assert deadline.check(T0 + 594) is None and deadline.check(T0 + 595) == STOP_DEADLINE
    assert "set a later job.deadline" in deadline.record(7).message


def test_without_a_submission_time_the_bill_counts_from_the_jobs_start() -> None:
    made = rule(StopTerms(budget_usd=10.0, price_per_hour_usd=3600.0), margin=0.0, clock=Clock(T0 + 50))
    assert made.billed_from == T0 + 50 and made.check(T0 + 59) is None and made.check(T0 + 60) == STOP_BUDGET


# -- supervision ---------------------------------------------------------------------------------------------------
def beat(run: Run, at: float) -> None:
    run.storage.write_json(heartbeat_path("train"), {"beat_at": at, "pid": 1, "host": "h", "flow_run_id": None,
                                                   "command": "hlat pretrain"})  # fmt: skip


def test_a_job_with_no_heartbeat_counts_from_its_start(tmp_path: Path) -> None:
    run = Run.at(str(tmp_path))
    made = rule(StopTerms(submitted_at=T0, unsupervised_stop_s=600), run)
    assert made.read_every == 60  # at most one read a minute
    assert made.check(T0 + 599) is None and made.check(T0 + 600) == STOP_UNSUPERVISED
    assert "no supervisor heartbeat (jobs/train-supervisor.json)" in made.record(3).message


class StoreClock(StorageClock):
    """Run storage's clock for a test on a fake clock: an object's time is the time its writer put in it (as a
    simulation's store would stamp it), the store's now the fake clock's."""

    def __init__(self, storage: Storage, clock: Clock, skew: float = 0.0) -> None:
        super().__init__(storage)
        self.clock, self.skew, self.failing = clock, skew, False

    def modified(self, rel: str) -> float | None:
        if self.failing:
            raise OSError("storage away")
        return float(self.storage.read_json(rel)["beat_at"]) if self.storage.exists(rel) else None

    def now(self) -> float:
        return self.clock.now + self.skew


def supervised(run: Run, clock: Clock, skew: float = 0.0) -> StopRule:
    """A rule of 10 minutes without a heartbeat, on `clock`; the store's clock is `skew` ahead of the job's."""
    made = StopRule(StopTerms(submitted_at=T0, unsupervised_stop_s=600), lambda why: None, lambda: 0.0, run,
                    clock=clock, storage_clock=StoreClock(run.storage, clock, skew))  # fmt: skip
    return made


def test_beats_keep_the_job_going_and_their_end_stops_it(tmp_path: Path) -> None:
    run, clock = Run.at(str(tmp_path)), Clock()
    made = supervised(run, clock)
    for t in range(0, 3000, 60):  # a supervisor beating each minute for 50 minutes
        beat(run, T0 + t)
        clock.now = T0 + t + 1
        assert made.check() is None
    last = T0 + 2940
    assert made.last_beat == last
    # It dies: the job stops 10 minutes after its last beat (read at most a minute late).
    clock.now = last + 599
    assert made.check() is None
    clock.now = last + 600
    assert made.check() == STOP_UNSUPERVISED


def test_a_stale_heartbeat_at_start_is_older_than_the_jobs_start(tmp_path: Path) -> None:
    """A heartbeat left by an earlier supervisor does not stop a job just started: its start is a beat."""
    run, clock = Run.at(str(tmp_path)), Clock()
    beat(run, T0 - 86400)
    made = supervised(run, clock)
    clock.now = T0 + 1
    assert made.check() is None and made.last_beat == T0
    clock.now = T0 + 600
    assert made.check() == STOP_UNSUPERVISED


@pytest.mark.parametrize("skew", [-2700.0, 2700.0])
def test_only_the_stores_clock_judges_a_heartbeat(tmp_path: Path, skew: float) -> None:
    """The store's clock 45 minutes off the job's (the supervisor's clock behind or ahead of the hosts, as the store
    stamps the supervisor's writes): the heartbeat's age is what counts, so beats keep the job going and their end
    stops it 10 minutes later, as with one clock."""
    run, clock = Run.at(str(tmp_path)), Clock()
    made = supervised(run, clock, skew)
    for t in range(0, 600, 60):
        beat(run, T0 + t + skew)  # the store stamps the beat by its own clock
        clock.now = T0 + t + 1
        assert made.check() is None
    clock.now = T0 + 540 + 599
    assert made.check() is None
    clock.now = T0 + 540 + 600
    assert made.check() == STOP_UNSUPERVISED


def test_a_supervisor_clock_behind_the_hosts_does_not_stop_the_job(tmp_path: Path) -> None:
    """Real storage, real clocks: the supervisor's clock 45 minutes behind writes beat_at 45 minutes ago; the
    heartbeat object's own time (its mtime, a probe's for now) says it is fresh, and the job goes on."""
    run = Run.at(str(tmp_path))
    beat(run, time.time() - 2700)
    made = StopRule(StopTerms(unsupervised_stop_s=1800), lambda why: None, lambda: 0.0, run)
    assert made.check() is None and abs(made.last_beat - time.time()) < 30
    assert (tmp_path / "jobs" / "train-clock-job").exists()  # the store's 'now' is a probe it wrote


def test_an_unreadable_heartbeat_warns_once_and_the_last_beat_stands(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run, clock = Run.at(str(tmp_path)), Clock()
    made = supervised(run, clock)
    beat(run, T0 + 100)
    clock.now = T0 + 120
    assert made.check() is None and made.last_beat == T0 + 100
    assert isinstance(made.storage_clock, StoreClock)
    made.storage_clock.failing = True
    with caplog.at_level(logging.WARNING, "hlat.train"):
        for t in (200, 300, 400):
            clock.now = T0 + t
            assert made.check() is None
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "cannot read" in caplog.records[0].message and made.last_beat == T0 + 100
    clock.now = T0 + 700
    assert made.check() == STOP_UNSUPERVISED


def test_the_record_is_kept_in_run_storage_for_a_supervisor_that_missed_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINING_JOB_NAME", "r-train-2")
    run = Run.at(str(tmp_path))
    made = rule(StopTerms(deadline=T0), run, margin=0.0)
    assert made.check(T0) == STOP_DEADLINE
    record = made.save_record(12)
    kept = json.loads((tmp_path / stop_record_path("train")).read_text())
    assert kept["why"] == "deadline" and kept["step"] == 12 and kept["message"] == record.message
    assert kept["job"] == "r-train-2"
    decision = stored_self_stop(run, "r-train-2")
    assert decision is not None and (decision.action, decision.category) == (Action.FATAL, "deadline")
    assert decision.reason == record.message
    assert stored_self_stop(run, "r-train-1") is None  # an earlier attempt's ending is its own


# -- the record and its classification -----------------------------------------------------------------------------
def test_a_stop_record_reads_back_from_a_log_line_with_any_prefix() -> None:
    record = StopRecord(STOP_BUDGET, 41, "the run's budget of $10.00 (job.budget_usd) is spent: raise it")
    line = record.line()
    assert line.startswith("StoppedItself: the run's budget") and line.endswith(
        '[hlat-stop {"step": 41, "why": "budget"}]'
    )
    assert parse_stop_record(f"rank0 step 40 loss 5.1\n[algo-1] rank0 {line}\nrank0 stop: saved") == record
    assert parse_stop_record("StoppedItself: no tag") is None and parse_stop_record(None) is None


COMPLETED = JobState("r-train-1", Status.COMPLETED, secondary_status="Completed")


@pytest.mark.parametrize(
    ("why", "action", "failure_class"),
    [
        (STOP_BUDGET, Action.FATAL, FailureClass.FATAL),
        (STOP_DEADLINE, Action.FATAL, FailureClass.FATAL),
        (STOP_UNSUPERVISED, Action.RESUME, FailureClass.PLATFORM),
    ],
)
def test_a_job_that_stopped_itself_is_a_deliberate_stop(why: str, action: Action, failure_class: FailureClass) -> None:
    tail = "\n".join(["rank0 step 7 loss 6.0", StopRecord(why, 7, f"{why} reached: raise it").line()])
    decision = classify(COMPLETED, log_tail=tail)
    assert (decision.action, decision.category, decision.failure_class) == (action, why, failure_class)
    assert decision.reason == f"{why} reached: raise it"
    assert classify(COMPLETED, log_tail="rank0 step 7 loss 6.0").action == Action.DONE  # no record: completed


def test_the_supervisor_does_not_relaunch_a_job_that_stopped_for_its_budget(tmp_path: Path) -> None:
    clock = [0.0]
    line = StopRecord(STOP_BUDGET, 40, "the run's budget ... is spent: raise job.budget_usd to go on").line()
    plays = [Play([("InProgress", None), ("Completed", None)], reaches=40, logs=[[f"rank0 {line}"]]), Play()]
    backend = ScriptedBackend(plays, clock)
    with pytest.raises(JobFailed, match=r"raise job\.budget_usd to go on"):
        supervisor(tmp_path, backend, clock).run_to_completion()
    assert len(backend.submitted) == 1  # not relaunched
    (only,) = Ledger(Run.at(str(tmp_path)), "train").load()
    assert (only.action, only.category, only.end_step) == ("fatal", "budget", 40)


def test_a_supervisor_that_missed_the_jobs_log_reads_its_stored_stop_record(tmp_path: Path) -> None:
    """Re-attached after the job ended (its earlier log is skipped), the supervisor judges it by the record the job
    left in run storage: a deadline stop ends the stage, no short relaunch."""
    clock = [0.0]
    plays = [Play([("InProgress", None), ("Completed", None)], reaches=40), Play()]
    backend = ScriptedBackend(plays, clock)
    record = {
        "job": "hlat-tiny-test-train-1",
        "why": STOP_DEADLINE,
        "step": 40,
        "message": "job.deadline ... is reached",
    }
    (tmp_path / stop_record_path("train")).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / stop_record_path("train")).write_text(json.dumps(record))
    with pytest.raises(JobFailed, match=r"job\.deadline"):
        supervisor(tmp_path, backend, clock).run_to_completion()
    assert len(backend.submitted) == 1  # not relaunched


# -- what the train stage gives the job ----------------------------------------------------------------------------
def test_the_training_job_carries_the_runs_terms_and_what_earlier_jobs_cost(tmp_path: Path) -> None:
    config = load_config(
        "tiny",
        {"job.budget_usd": 100, "job.price_per_hour_usd": 30, "job.instance_count": 2,
         "job.deadline": "2030-01-01T00:00:00+01:00", "job.unsupervised_stop_minutes": 5},
        storage=str(tmp_path),
    )  # fmt: skip
    run_uri = str(tmp_path / "r")
    Ledger(Run.at(run_uri), "train").save(
        [Attempt(1, "r-train-1", cost_usd=12.5, ended_at=T0), Attempt(2, "r-train-2", cost_usd=7.5, ended_at=T0 + 9),
         Attempt(3, "r-train-3", cost_usd=99.0)]  # not ended: the one being submitted
    )  # fmt: skip
    assert billed_usd(Run.at(run_uri)) == 20.0
    run = Run.at(run_uri, config)
    # The supervisor's make_spec: read at each submission.
    spec = supervisor_for(run, current_step=lambda: None).make_spec(3, "r-train-3")
    terms = StopTerms.from_environment(spec.environment)
    assert (terms.budget_usd, terms.spent_usd, terms.price_per_hour_usd) == (100.0, 20.0, 60.0)  # $30 x 2 nodes
    assert terms.deadline == 1893452400.0 and terms.unsupervised_stop_s == 300.0
    assert terms.submitted_at is not None
    # The $80 left at $60/h last 80 min; the platform's own stop comes job.stop_grace_seconds (20 s: tiny) later.
    assert spec.max_runtime_s == pytest.approx(80 * 60 + 20, abs=2)
    # Only the training job carries them.
    assert BUDGET_ENV not in job_spec(run, 1, "burn-in").environment


def test_a_spent_budget_or_a_past_deadline_is_refused_before_submitting() -> None:
    config = load_config("tiny", {"job.budget_usd": 10, "job.price_per_hour_usd": 36})
    spent = stop_terms(config, spent_usd=10.0, submitted_at=T0)
    with pytest.raises(ConfigError, match=r"job.budget_usd: the run's budget of \$10.00 is spent"):
        runtime_cap(config, spent, 3600, now=T0)
    late = load_config("tiny", {"job.deadline": "2027-01-01T00:00:00Z"})
    with pytest.raises(ConfigError, match=r"job\.deadline=2027-01-01T00:00:00\+00:00 has passed: set a later"):
        runtime_cap(late, stop_terms(late), 3600, now=T0)
    # Neither: job.max_runtime_hours alone; one far off: still capped by it.
    assert runtime_cap(load_config("tiny"), stop_terms(load_config("tiny")), 3600, now=T0) == 3600
    far = load_config("tiny", {"job.deadline": "2099-01-01T00:00:00Z"})
    assert runtime_cap(far, stop_terms(far), 3600, now=T0) == 3600


def test_a_deadline_needs_a_time_zone() -> None:
    with pytest.raises(ConfigError, match=r"job\.deadline=2030-01-01T00:00:00 has no time zone: add one"):
        load_config("tiny", {"job.deadline": "2030-01-01T00:00:00"})


def test_max_runtime_in_the_sagemaker_request_ends_with_the_budget() -> None:
    """hlat-7b, 64 nodes at ~$1,582/h with a $5,000 budget: MaxRuntimeInSeconds is the 3.16 h it lasts plus the
    120 s grace, not 28 days; the request stays valid for the service model."""
    config = load_config(
        "hlat-7b", {"job.role_arn": ROLE, "job.budget_usd": 5000, "job.max_runtime_hours": 240}, storage="s3://b/p"
    )
    submitted = time.time() - 600  # 10 minutes ago
    spec = job_spec(Run.at("s3://b/p/r", config), 1, submitted_at=submitted)
    request: dict[str, Any] = SageMakerBackend(config.job).config_request(spec)
    terms = stop_terms(config)
    left = 5000 / terms.price_per_hour_usd * 3600
    runtime = request["StoppingCondition"]["MaxRuntimeInSeconds"]
    assert abs(runtime - math.ceil(left - 600 + 120)) <= 60  # the test's own clock runs between
    assert request_problems("CreateTrainingJob", request, partial=True) == []
    shape = sagemaker_service_model().operation_model("CreateTrainingJob").input_shape.members["StoppingCondition"]
    assert runtime >= shape.members["MaxRuntimeInSeconds"].metadata["min"]
    assert request["Environment"][BUDGET_ENV] == "5000.0" and request["Environment"][SUBMITTED_ENV] == repr(submitted)
    # Without a budget it would not stop: job.max_runtime_hours caps it (an estimate's 1.25 x budget outlasts it).
    unbounded = load_config("hlat-7b", {"job.role_arn": ROLE, "job.max_runtime_hours": 240}, storage="s3://b/p")
    assert job_spec(Run.at("s3://b/p/r", unbounded), 1).max_runtime_s == 240 * 3600


class FakeTrainer:
    """What `stop_rule` needs of the Trainer (training/loop.py): its world, its stop request and margin, and the
    step a stop checkpointed."""

    def __init__(self, is_main: bool = True, max_steps: int = 100) -> None:
        self.world = SimpleNamespace(is_main=is_main)
        self.cfg = SimpleNamespace(training=SimpleNamespace(max_steps=max_steps))
        self.extracting_graphs = False
        self.stop_requested, self.stop_why = threading.Event(), None
        self.stopped_at: int | None = None

    def request_stop(self, why: str) -> None:
        self.stop_why = why
        self.stop_requested.set()

    def stop_margin_seconds(self) -> float:
        return 0.0


@pytest.mark.parametrize(("stopped_at", "recorded"), [(40, True), (100, False)])
def test_the_thread_requests_the_stop_and_a_stop_short_of_the_end_is_recorded(
    tmp_path: Path, stopped_at: int, recorded: bool
) -> None:
    """On the main rank the thread stops a job past its deadline; a stop at the last step is the training's end."""
    run = Run.at(str(tmp_path))
    trainer = FakeTrainer()
    with stop_rule(trainer, run, StopTerms(deadline=time.time() - 1)) as made:
        assert made is not None and trainer.stop_requested.wait(10) and trainer.stop_why == STOP_DEADLINE
        trainer.stopped_at = stopped_at  # what the Trainer's stop does (StopProtocol.stop)
    assert (tmp_path / stop_record_path("train")).exists() == recorded
    # No terms, or not the main rank: no thread.
    with stop_rule(FakeTrainer(), run, StopTerms()) as none, stop_rule(FakeTrainer(False), run, made.terms) as other:
        assert none is None and other is None
