"""The train stage's supervision loop, driven through the job-backend protocol by a scripted backend: each
submitted job plays a script of states (and checkpoint steps), on a fake clock. The same loop is driven by the
real local backend in tests/chaos and by the SageMaker backend under botocore's Stubber in
tests/unit/test_sagemaker_jobs.py (test_supervisor_relaunches_through_capacity_and_internal_errors_to_completion)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hlat.core.contract import FailureRecord
from hlat.core.run import Run
from hlat.infra.backends.protocol import (
    FAILURE_RULES,
    UNKNOWN,
    Action,
    FailureClass,
    FailureRule,
    JobSpec,
    JobState,
    Source,
    Status,
    SubmitError,
    classify,
    classify_reason,
    job_name,
)
from hlat.infra.supervision.errors import BudgetExhausted, JobFailed, RestartsExhausted
from hlat.infra.supervision.ledger import Ledger
from hlat.infra.supervision.supervisor import Supervisor

RUN_ID = "tiny-test"
TARGET = 100


@dataclass
class Play:
    """One job's script: states returned by successive describes (the last repeats), the checkpoint step when it
    ends, log lines per describe, or a submission error."""

    states: list[tuple[str, str | None]] = field(default_factory=lambda: [("InProgress", None), ("Completed", None)])
    reaches: int = TARGET
    refuse: SubmitError | None = None
    logs: list[list[str]] = field(default_factory=list)


class ScriptedBackend:
    kind = "scripted"

    def __init__(self, plays: list[Play], clock: list[float], billable_per_poll: float = 60.0) -> None:
        self.plays, self.clock, self.billable = plays, clock, billable_per_poll
        self.submitted: list[JobSpec] = []
        self.stopped: list[str] = []
        self.step = 0
        self.polls: dict[str, int] = {}
        self.jobs: dict[str, Play] = {}

    def submit(self, spec: JobSpec) -> None:
        play = self.plays.pop(0)
        if play.refuse:
            raise play.refuse
        self.submitted.append(spec)
        self.jobs[spec.name] = play
        self.polls[spec.name] = 0

    def describe(self, name: str) -> JobState | None:
        play = self.jobs.get(name)
        if play is None:
            return None
        i = min(self.polls[name], len(play.states) - 1)
        self.polls[name] += 1
        status, reason = play.states[i]
        if name in self.stopped and status == "InProgress":
            status, reason = "Stopped", None
        state = JobState(
            name, Status(status), failure_reason=reason, billable_seconds=self.billable * (i + 1), instance_count=2
        )
        if state.terminal:
            self.step = max(self.step, play.reaches)
        return state

    def stop(self, name: str) -> None:
        self.stopped.append(name)

    def logs(self, name: str, cursor: Any = None) -> tuple[list[str], Any]:
        play = self.jobs[name]
        i = cursor or 0
        return (play.logs[i] if i < len(play.logs) else []), i + 1

    def dry_run(self, spec: JobSpec) -> list[dict[str, Any]]:
        return []


def supervisor(tmp_path: Path, backend: ScriptedBackend, clock: list[float], **options: Any) -> Supervisor:
    def sleep(seconds: float) -> None:
        clock[0] += seconds

    def spec(attempt: int, name: str) -> JobSpec:
        return JobSpec(name, RUN_ID, attempt, str(tmp_path), f"{tmp_path}/config.json", "ml.trn1.32xlarge", 2, 32, 3600)

    defaults: dict[str, Any] = {
        "poll_seconds": 60.0,
        "hang_timeout_s": None,
        "backoff_seconds": [60.0, 600.0],
        "price_per_hour": 36.0,
        "max_restarts": 10,
    }
    return Supervisor(
        backend=backend,
        run=Run.at(str(tmp_path)),
        run_id=RUN_ID,
        make_spec=spec,
        current_step=lambda: backend.step or None,
        target_step=TARGET,
        tokens_per_step=1000,
        sleep=sleep,
        clock=lambda: clock[0],
        **{**defaults, **options},
    )


def test_completes_in_one_job_and_records_it(tmp_path: Path) -> None:
    clock = [0.0]
    backend = ScriptedBackend([Play()], clock)
    attempts = supervisor(tmp_path, backend, clock).run_to_completion()
    assert [a.job_name for a in attempts] == ["hlat-tiny-test-train-1"]
    assert attempts[0].status == "Completed" and attempts[0].steps_gained == TARGET
    # 2 polls x 60 s billable x 2 nodes at $36/h = $2.40
    assert attempts[0].cost_usd == pytest.approx(2 * 60 * 2 * 36 / 3600)
    assert Ledger(Run.at(str(tmp_path)), "train").load()[0].action == "done"


def test_resumable_failures_relaunch_from_checkpoint_until_done(tmp_path: Path) -> None:
    clock = [0.0]
    plays = [
        Play([("InProgress", None), ("Failed", "InternalServerError: We encountered an internal error.")], reaches=20),
        Play([("Failed", "AlgorithmError: NonFiniteLoss: the loss became NaN or inf")], reaches=45),
        Play([("InProgress", None), ("Stopped", None)], reaches=70),  # e.g. MaxRuntimeExceeded or spot
        Play(),
    ]
    backend = ScriptedBackend(plays, clock)
    attempts = supervisor(tmp_path, backend, clock).run_to_completion()
    assert [a.action for a in attempts] == ["resume", "resume", "resume", "done"]
    assert [a.steps_gained for a in attempts] == [20, 25, 25, 30]
    assert [s.name for s in backend.submitted] == [job_name(RUN_ID, n) for n in (1, 2, 3, 4)]


def test_capacity_backs_off_with_growing_delays(tmp_path: Path) -> None:
    clock = [0.0]
    capacity = ("Failed", "CapacityError: Unable to provision requested ML compute capacity.")
    plays = [Play([capacity], reaches=0), Play([capacity], reaches=0), Play([capacity], reaches=0), Play()]
    backend = ScriptedBackend(plays, clock)
    sup = supervisor(tmp_path, backend, clock, poll_seconds=1.0, max_attempts_without_progress=4)
    attempts = sup.run_to_completion()
    assert [a.action for a in attempts] == ["backoff", "backoff", "backoff", "done"]
    assert clock[0] >= 60 + 600 + 600  # the last delay repeats


def test_throttled_submission_backs_off_then_succeeds(tmp_path: Path) -> None:
    clock = [0.0]
    plays = [Play(refuse=SubmitError("ThrottlingException", "Rate exceeded")), Play()]
    attempts = supervisor(tmp_path, ScriptedBackend(plays, clock), clock).run_to_completion()
    assert [(a.status, a.action) for a in attempts] == [("NotSubmitted", "backoff"), ("Completed", "done")]


@pytest.mark.parametrize(
    ("refusal", "message"),
    [
        (SubmitError("ResourceInUse", "Resource being accessed is in use"), "in use"),
        (SubmitError("ValidationException", "Invalid RoleArn"), "Invalid RoleArn"),
        (SubmitError("AccessDeniedException", "not authorized to perform CreateTrainingJob"), "not authorized"),
    ],
)
def test_fatal_submission_errors_stop_at_once(tmp_path: Path, refusal: SubmitError, message: str) -> None:
    clock = [0.0]
    with pytest.raises(JobFailed, match=message) as info:
        supervisor(tmp_path, ScriptedBackend([Play(refuse=refusal)], clock), clock).run_to_completion()
    assert len(info.value.attempts) == 1


def test_client_error_in_job_is_fatal(tmp_path: Path) -> None:
    clock = [0.0]
    plays = [Play([("Failed", "ClientError: Please ensure the S3 path s3://b/data/ exists")], reaches=0)]
    with pytest.raises(JobFailed, match="ensure the S3 path"):
        supervisor(tmp_path, ScriptedBackend(plays, clock), clock).run_to_completion()


def test_same_failure_twice_with_no_step_gained_is_fatal(tmp_path: Path) -> None:
    clock = [0.0]
    crash = ("Failed", "AlgorithmError: ExecuteUserScriptError: exit code 1 ImportError: no module named x")
    plays = [Play([crash], reaches=0), Play([crash], reaches=0), Play()]
    backend = ScriptedBackend(plays, clock)
    with pytest.raises(JobFailed, match="same failure repeated with no newer checkpoint: unknown, 2 times"):
        supervisor(tmp_path, backend, clock).run_to_completion()
    assert len(backend.submitted) == 2


def test_a_nan_at_the_same_step_twice_is_fatal(tmp_path: Path) -> None:
    clock = [0.0]
    nan = ("Failed", "AlgorithmError: NonFiniteLoss: loss is nan at step 31")
    plays = [Play([nan], reaches=30), Play([nan], reaches=30), Play([nan], reaches=30)]
    with pytest.raises(JobFailed, match="same failure repeated with no newer checkpoint") as info:
        supervisor(tmp_path, ScriptedBackend(plays, clock), clock).run_to_completion()
    assert len(info.value.attempts) == 2  # the first one committed step 30, then failed as the second did


def test_platform_faults_keep_relaunching_with_growing_delays(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A dead host or daemon, again and again before the next checkpoint: relaunched until
    job.max_attempts_without_progress (here 10; see test_every_class_stops_after_attempts_without_progress),
    job.max_restarts or the budget; the first relaunch is at once, repeats wait longer and longer."""
    clock = [0.0]
    died = ("Failed", "InternalServerError: the job's daemon process died")
    killed = ("Failed", "AlgorithmError: training process killed by signal SIGKILL (exit code 137)")
    plays = [Play([died], reaches=0), Play([killed], reaches=0), Play([died], reaches=0), Play([died], reaches=0)]
    plays += [Play([killed], reaches=20), Play([died], reaches=20), Play()]
    backend = ScriptedBackend(plays, clock)
    sup = supervisor(tmp_path, backend, clock, backoff_seconds=[30.0, 600.0], max_attempts_without_progress=10)
    with caplog.at_level(logging.WARNING, "hlat.supervisor"):
        attempts = sup.run_to_completion()
    assert [a.action for a in attempts] == ["resume", "backoff", "backoff", "backoff", "resume", "resume", "done"]
    assert [a.failure_class for a in attempts] == ["platform"] * 6 + [None]
    # Back-offs sleep in poll-sized parts (a stop request is honoured between them): the log states each delay.
    delays = [
        r.getMessage().rsplit("relaunching in ", 1)[1] for r in caplog.records if "relaunching in" in r.getMessage()
    ]
    assert delays == ["30 s", "10 min", "10 min"]  # an attempt that gained steps resets them
    with pytest.raises(RestartsExhausted):
        plays = [Play([died], reaches=0) for _ in range(5)]
        supervisor(
            tmp_path / "again", ScriptedBackend(plays, clock), clock, max_restarts=3, max_attempts_without_progress=10
        ).run_to_completion()


@pytest.mark.parametrize("rule", [*FAILURE_RULES, UNKNOWN], ids=lambda r: r.category)
def test_each_failure_rule_takes_its_example(rule: FailureRule) -> None:
    decision = classify_reason(rule.example)
    assert (decision.category, decision.failure_class, decision.action) == (
        rule.category,
        rule.failure_class,
        rule.action,
    )


def test_the_docs_state_the_retry_rules_by_failure_class() -> None:
    """docs/jobs.md "When a job fails": a row per failure class, and a row per category naming its class and what
    each of its rules is judged from (record, status, text)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "jobs.md").read_text()
    section = page.split("## When a job fails", 1)[1].split("\n#", 1)[0]
    classes = {line.split("|")[1].strip().strip("*") for line in section.splitlines() if line.startswith("| **")}
    assert classes == {c.value for c in FailureClass}
    rows = [line.split("|")[1:4] for line in section.splitlines() if line.startswith("| `")]
    for rule in [*FAILURE_RULES, UNKNOWN]:
        row = next((r for r in rows if f"`{rule.category}`" in r[0]), None)
        assert row is not None, rule.category
        assert row[1].strip() == rule.failure_class.value, rule.category
        if rule is not UNKNOWN:
            assert rule.source.value in row[2], (rule.category, rule.source)


def test_restart_budget_runs_out(tmp_path: Path) -> None:
    clock = [0.0]
    plays = [Play([("Failed", "InternalServerError: boom")], reaches=10 * (i + 1)) for i in range(5)]
    with pytest.raises(RestartsExhausted, match=r"all 2 relaunches allowed by job.max_restarts") as info:
        supervisor(tmp_path, ScriptedBackend(plays, clock), clock, max_restarts=2).run_to_completion()
    assert len(info.value.attempts) == 3


def test_dollar_budget_stops_the_running_job(tmp_path: Path) -> None:
    clock = [0.0]
    long_job = Play([("InProgress", None)] * 50 + [("Completed", None)], reaches=40)
    backend = ScriptedBackend([long_job], clock)
    # 2 nodes x $36/h: each 60 s poll bills $2.40; a $10 budget is spent on the fifth poll
    with pytest.raises(BudgetExhausted, match=r"job.budget_usd=\$10.00 is spent") as info:
        supervisor(tmp_path, backend, clock, budget_usd=10.0).run_to_completion()
    assert backend.stopped == ["hlat-tiny-test-train-1"]
    assert "step 40 of 100" in str(info.value)
    assert info.value.attempts[0].stop_requested == "budget"


def test_budget_already_spent_launches_nothing(tmp_path: Path) -> None:
    clock = [0.0]
    plays = [Play([("InProgress", None), ("Failed", "InternalServerError: x")], reaches=30), Play()]
    backend = ScriptedBackend(plays, clock)
    with pytest.raises(BudgetExhausted):
        supervisor(tmp_path, backend, clock, budget_usd=2.0).run_to_completion()
    assert len(backend.submitted) == 1


def test_hung_job_is_stopped_and_relaunched(tmp_path: Path) -> None:
    clock = [0.0]
    progress = [[f"rank0 step {s} loss 5.0 grad_norm 1.0 lr 1.0e-03 1000 tok/s"] for s in (1, 2, 3)]
    hung = Play([("InProgress", None)] * 100, reaches=0, logs=progress)  # logs stop after step 3
    backend = ScriptedBackend([hung, Play()], clock)
    attempts = supervisor(tmp_path, backend, clock, hang_timeout_s=600.0).run_to_completion()
    assert backend.stopped == ["hlat-tiny-test-train-1"]
    assert attempts[0].stop_requested == "hung" and attempts[0].reason.startswith("hung")
    assert [a.action for a in attempts] == ["resume", "done"]


def test_restarted_supervisor_reattaches_instead_of_launching_again(tmp_path: Path) -> None:
    clock = [0.0]
    backend = ScriptedBackend([Play([("InProgress", None)] * 3 + [("Completed", None)])], clock)

    class Crash(Exception):
        pass

    polls = 0

    def crash_on_second_poll(progress: Any) -> None:
        nonlocal polls
        polls += 1
        if polls == 2:
            raise Crash

    first = supervisor(tmp_path, backend, clock)
    first.on_progress = crash_on_second_poll
    with pytest.raises(Crash):
        first.run_to_completion()
    assert backend.stopped == []  # a crash leaves the job running
    attempts = supervisor(tmp_path, backend, clock).run_to_completion()
    assert len(backend.submitted) == 1 and [a.attempt for a in attempts] == [1]
    assert attempts[0].status == "Completed"


def test_a_job_still_running_after_the_last_checkpoint_is_stopped_and_recorded(tmp_path: Path) -> None:
    """The supervisor died as its job committed the last checkpoint, and the job did not end (torchrun waiting out
    its exit barrier for a rank that died, as the emulator's chaos test once saw, for 5 minutes). The next
    supervisor finds the target reached: it stops that job, follows it to its end and records it, launching
    nothing, so that no job outlives the stage."""
    from hlat.infra.supervision.ledger import Attempt

    clock = [0.0]
    backend = ScriptedBackend([Play([("InProgress", None)])], clock)  # it would never end by itself
    spec = JobSpec(job_name(RUN_ID, 1), RUN_ID, 1, str(tmp_path), "c", "ml.trn1.32xlarge", 2, 32, 3600)
    backend.submit(spec)
    Ledger(Run.at(str(tmp_path)), "train").save([Attempt(1, spec.name, status="InProgress")])
    backend.step = TARGET  # the checkpoint of the last step is committed
    (attempt,) = supervisor(tmp_path, backend, clock).run_to_completion()
    assert backend.stopped == [spec.name] and len(backend.submitted) == 1
    assert attempt.status == "Stopped" and attempt.stop_requested == "target-reached" and attempt.action == "done"
    assert attempt.ended and attempt.end_step == TARGET and attempt.cost_usd > 0
    assert Ledger(Run.at(str(tmp_path)), "train").load() == [attempt]


def test_job_submitted_but_not_recorded_is_found_by_name(tmp_path: Path) -> None:
    """The supervisor died between submitting and recording the job as submitted: the ledger says
    'Submitting', the backend knows the job by its deterministic name, so it is watched, not resubmitted."""
    clock = [0.0]
    backend = ScriptedBackend([Play()], clock)
    spec = JobSpec(job_name(RUN_ID, 1), RUN_ID, 1, str(tmp_path), "c", "ml.trn1.32xlarge", 2, 32, 3600)
    backend.submit(spec)
    from hlat.infra.supervision.ledger import Attempt

    Ledger(Run.at(str(tmp_path)), "train").save([Attempt(1, spec.name)])
    attempts = supervisor(tmp_path, backend, clock).run_to_completion()
    assert len(backend.submitted) == 1 and attempts[0].status == "Completed"


def test_interruption_stops_the_job_and_a_later_run_resumes(tmp_path: Path) -> None:
    clock = [0.0]
    backend = ScriptedBackend([Play([("InProgress", None)] * 5, reaches=30), Play()], clock)
    sup = supervisor(tmp_path, backend, clock)

    def interrupt(progress: Any) -> None:
        raise KeyboardInterrupt

    sup.on_progress = interrupt
    with pytest.raises(KeyboardInterrupt):
        sup.run_to_completion()
    assert backend.stopped == ["hlat-tiny-test-train-1"]
    attempts = supervisor(tmp_path, backend, clock).run_to_completion()
    assert [a.action for a in attempts] == ["resume", "done"]


def test_progress_reports_step_loss_eta_and_dollars(tmp_path: Path) -> None:
    clock = [0.0]
    logs = [["rank0 step 40 loss 5.4321 grad_norm 0.812 lr 1.99e-03 500 tok/s"]]
    backend = ScriptedBackend([Play([("InProgress", None), ("Completed", None)], logs=logs)], clock)
    seen: list[str] = []
    sup = supervisor(tmp_path, backend, clock)
    sup.on_progress = lambda p: seen.append(p.line())
    sup.run_to_completion()
    # 60 steps left x 1000 tokens at 500 tok/s = 120 s; one poll billed 60 s x 2 nodes at $36/h
    assert "step 40/100, loss 5.4321, 500 tok/s, ETA 2 min, $1.20 spent" in seen[0]


@pytest.mark.parametrize(
    ("state", "action", "category"),
    [
        (JobState("j", Status.COMPLETED), Action.DONE, "completed"),
        (
            JobState("j", Status.FAILED, "CapacityError: Unable to provision requested ML compute capacity"),
            Action.BACKOFF,
            "capacity",
        ),
        (
            JobState("j", Status.FAILED, "InternalServerError: We encountered an internal error"),
            Action.RESUME,
            "internal",
        ),
        (JobState("j", Status.FAILED, "AlgorithmError: NonFiniteLoss: the loss became NaN"), Action.RESUME, "nan"),
        (
            JobState("j", Status.FAILED, "AlgorithmError: NRT error: NeuronCore 3 hardware failure"),
            Action.RESUME,
            "hardware",
        ),
        (JobState("j", Status.FAILED, "AlgorithmError: killed by signal SIGKILL"), Action.RESUME, "killed"),
        (JobState("j", Status.STOPPED, secondary_status="MaxRuntimeExceeded"), Action.RESUME, "max-runtime"),
        (JobState("j", Status.STOPPED, secondary_status="Interrupted"), Action.RESUME, "interrupted"),
        (JobState("j", Status.FAILED, "ClientError: Data download failed"), Action.FATAL, "validation"),
        (
            JobState("j", Status.FAILED, "AlgorithmError: UnhealthyCollective: all-reduce 0.2 GB/s"),
            Action.RESUME,
            "hardware",
        ),
        (JobState("j", Status.FAILED, "AlgorithmError: BurnInFailed: rank 3 matmul error"), Action.FATAL, "burn-in"),
        (
            JobState("j", Status.FAILED, "AlgorithmError: ConfigError: training.lr must be > 0"),
            Action.FATAL,
            "validation",
        ),
    ],
)
def test_classification(state: JobState, action: Action, category: str) -> None:
    decision = classify(state)
    assert (decision.action, decision.category) == (action, category)


def test_submission_error_codes_classify() -> None:
    assert classify_reason("ResourceLimitExceeded: quota").action == Action.BACKOFF
    assert classify_reason("ResourceInUse: in use").action == Action.FATAL
    assert classify_reason("ThrottlingException: Rate exceeded").action == Action.BACKOFF
    assert classify_reason("InsufficientCapacityError: no trn1").action == Action.BACKOFF
    assert classify_reason("AccessDeniedException: no").action == Action.FATAL


def test_job_names_are_deterministic_and_valid() -> None:
    import re

    assert job_name("tiny-63b61eb6b6", 3) == "hlat-tiny-63b61eb6b6-train-3"
    long = job_name("a_very/long run id " * 8, 12)
    assert len(long) <= 63 and re.fullmatch(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}", long)
    assert long == job_name("a_very/long run id " * 8, 12) != job_name("a_very/long run id " * 7, 12)


def test_throttled_describes_are_retried_with_growing_delays(tmp_path: Path) -> None:
    from botocore.exceptions import ClientError

    clock = [0.0]
    backend = ScriptedBackend([Play()], clock)
    real_describe, failures = backend.describe, [3]

    def flaky(name: str) -> JobState | None:
        if backend.submitted and failures[0] > 0:
            failures[0] -= 1
            raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, "Describe")
        return real_describe(name)

    backend.describe = flaky  # type: ignore[method-assign]
    attempts = supervisor(tmp_path, backend, clock, poll_seconds=10.0).run_to_completion()
    assert attempts[0].status == "Completed"
    assert clock[0] >= 10 + 20 + 40  # three throttled describes, the delay doubling


# -- repeats judged from structured causes (issue: a deterministic fault must not relaunch 256 nodes) ----------------
def record_reason(type_name: str, message: str, step: int | None, module: str | None = None) -> str:
    """SageMaker's FailureReason of a job whose rank wrote its failure record to the failure file."""
    record = FailureRecord(type_name, message, module=module, step=step, rank=5, host="algo-2")
    return f"AlgorithmError: {record.line()}"


def logged_steps(first: int, last: int) -> list[list[str]]:
    """A job's log while it trains, ten steps a poll."""
    lines = [f"rank0 step {s} loss 5.0000 grad_norm 1.000 lr 1.00e-04 1000 tok/s" for s in range(first, last + 1)]
    return [lines[i : i + 10] for i in range(0, len(lines), 10)]


def nan_at_41(reaches: int, start: int) -> Play:
    """A job that trains from `start`, logs every step up to 40, commits `reaches`, then hits a NaN at step 41."""
    reason = record_reason("NonFiniteLoss", "the loss became NaN or inf; relaunch from the last checkpoint", 41)
    return Play([("InProgress", None)] * 12 + [("Failed", reason)], reaches=reaches, logs=logged_steps(start + 1, 40))


@pytest.mark.parametrize("max_repeats", [2, 3])
def test_a_nan_at_step_41_after_a_checkpoint_at_30_stops_after_max_repeats(tmp_path: Path, max_repeats: int) -> None:
    """Each resume is bitwise, so the NaN comes back at step 41 every time; steps 31-40 are logged each time and
    lost each time. Only a newer committed checkpoint counts as progress: the stage stops after job.max_repeats
    attempts end with the same cause and the same newest checkpoint, not at job.max_restarts."""
    clock = [0.0]
    plays = [nan_at_41(reaches=30, start=0)] + [nan_at_41(reaches=30, start=30) for _ in range(10)]
    backend = ScriptedBackend(plays, clock)
    sup = supervisor(tmp_path, backend, clock, max_restarts=100, max_repeats=max_repeats)
    with pytest.raises(JobFailed, match=r"nan: NonFiniteLoss at step 41, \d times") as info:
        sup.run_to_completion()
    attempts = info.value.attempts
    assert len(attempts) == max_repeats == len(backend.submitted)
    assert all(a.last_logged_step == 40 for a in attempts)  # steps past the checkpoint were logged: not progress
    assert [a.cause for a in attempts] == ["nan: NonFiniteLoss at step 41"] * max_repeats
    assert attempts[-1].action == "fatal"
    assert f"job.max_repeats={max_repeats}" in str(info.value) and "newest checkpoint step 30" in str(info.value)


def test_the_same_type_at_another_step_is_another_cause(tmp_path: Path) -> None:
    """A crash at 41 then at 57 (a newer checkpoint in between, or not) is not a deterministic repeat (a NaN is:
    test_a_nan_whose_step_moves_is_still_the_same_failure)."""
    clock = [0.0]
    crash = [record_reason("RuntimeError", "index out of range", step) for step in (41, 57, 63)]
    plays = [Play([("Failed", crash[0])], reaches=30), Play([("Failed", crash[1])], reaches=30)]
    plays += [Play([("Failed", crash[2])], reaches=60), Play()]
    attempts = supervisor(tmp_path, ScriptedBackend(plays, clock), clock).run_to_completion()
    assert [a.action for a in attempts] == ["resume", "resume", "resume", "done"]


# Item 2 of the review: the messages that substring rules put in the wrong class, each now judged from its record.
RECORDED = [
    (("RuntimeError", "Expected all tensors to be on the same device, but found xla:0 and cpu!", None), "unknown"),
    (
        ("NeuronUnavailable", "neuronx-distributed exists only in the AWS Neuron training container", "hlat.training"),
        "image",
    ),
    (
        ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB; 79.10 GiB total capacity", "torch"),
        "out-of-memory",
    ),
    (
        ("RuntimeError", "nrt_tensor_allocate status=4 NRT_RESOURCE: Failed to allocate 512 MB of HBM", None),
        "out-of-memory",
    ),
    (
        ("ConfigError", "job.stop_grace_seconds: a stop sends SIGTERM then SIGKILL; killed by signal", None),
        "validation",
    ),
    (("RuntimeError", "nrt_execute status=1006 NRT_EXEC_HW_ERR_COLLECTIVES", None), "hardware"),
    (("DistNetworkError", "Connection reset by peer", "torch.distributed"), "lost-peer"),
    (("CheckpointError", "rank 5 (algo-2) s3://b/r/checkpoints/step-40/rank-00005.pt: SlowDown", None), "throttling"),
]
CLASS_OF = {rule.category: rule.failure_class for rule in FAILURE_RULES if rule.source == Source.RECORD}
CLASS_OF["unknown"] = FailureClass.JOB


@pytest.mark.parametrize(("fields", "category"), RECORDED, ids=[c for _, c in RECORDED])
def test_a_recorded_failure_is_judged_by_its_type_not_its_words(
    fields: tuple[str, str, str | None], category: str
) -> None:
    type_name, message, module = fields
    reason = record_reason(type_name, message, 12, module)
    decision = classify(JobState("j", Status.FAILED, reason))
    assert (decision.category, decision.failure_class) == (category, CLASS_OF[category])
    assert decision.record is not None and decision.record.type == type_name and decision.record.step == 12
    # The same record reaching the supervisor only through the job's log (another host's failure file was the one
    # SageMaker reported: the SDK driver's CalledProcessError) is judged the same.
    driver = "AlgorithmError: CalledProcessError: Command '['torchrun', ...]' returned non-zero exit status 1."
    log = f"[algo-2] rank5 step 11 loss 5.1\n[algo-2] rank5 {reason.removeprefix('AlgorithmError: ')}\n"
    assert classify(JobState("j", Status.FAILED, driver), log_tail=log).category == category


def test_sagemakers_own_reason_comes_before_what_a_rank_logged() -> None:
    """A host lost by the platform: SageMaker says InternalServerError; a surviving rank logged a lost peer."""
    log = (
        "[algo-1] rank0 "
        + FailureRecord("DistNetworkError", "Connection reset by peer", module="torch.distributed").line()
    )
    decision = classify(
        JobState("j", Status.FAILED, "InternalServerError: We encountered an internal error"), log_tail=log
    )
    assert (decision.category, decision.record) == ("internal", None)


def killed_before_its_first_step() -> Play:
    """A rank SIGKILLed while the job starts: no record (it could not write one); SageMaker's FailureReason is the SDK
    driver's CalledProcessError (it writes the failure file when torchrun exits non-zero); torchrun's own account of
    the signal is in the log."""
    driver = (
        "AlgorithmError: CalledProcessError: Command '['torchrun', '--nnodes', '2', ...]' returned non-zero exit "
        "status 1."
    )
    lines = [
        "[algo-1] torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "[algo-1] Root Cause (first observed failure):",
        "[algo-1]   exitcode  : -9 (pid: 4242)",
        "[algo-1]   traceback : Signal 9 (SIGKILL) received by PID 4242",
    ]
    return Play([("InProgress", None), ("Failed", driver)], reaches=0, logs=[[], lines])


def test_a_rank_killed_before_its_first_step_is_a_kill_each_time(tmp_path: Path) -> None:
    clock = [0.0]
    plays = [killed_before_its_first_step() for _ in range(3)] + [Play()]
    sup = supervisor(tmp_path, ScriptedBackend(plays, clock), clock, max_attempts_without_progress=4)
    attempts = sup.run_to_completion()
    assert [(a.category, a.failure_class) for a in attempts[:3]] == [("killed", "platform")] * 3
    assert [a.action for a in attempts] == ["resume", "backoff", "backoff", "done"]


def test_platform_faults_with_records_retry_to_max_restarts(tmp_path: Path) -> None:
    clock = [0.0]
    hw = record_reason("RuntimeError", "nrt_execute status=1006 NRT_EXEC_HW_ERR_COLLECTIVES", 41)
    plays = [Play([("Failed", hw)], reaches=30) for _ in range(8)]
    with pytest.raises(RestartsExhausted) as info:
        supervisor(
            tmp_path, ScriptedBackend(plays, clock), clock, max_restarts=5, max_attempts_without_progress=10
        ).run_to_completion()
    assert len(info.value.attempts) == 6
    assert {a.category for a in info.value.attempts} == {"hardware"}


@pytest.mark.slow
def test_a_sagemaker_run_always_has_a_budget() -> None:
    """job.budget_usd unset on SageMaker: 1.25 x the plan's estimate, stated in the dry run; no estimate: refused."""
    from hlat.core.config import ConfigError
    from hlat.core.presets import load_config
    from hlat.infra.cost.budget import BUDGET_MARGIN, budget
    from hlat.infra.cost.estimates import estimate
    from hlat.infra.dry_run import dry_run
    from hlat.infra.stage_jobs import supervisor_for

    role = {"job.role_arn": "arn:aws:iam::123456789012:role/hlat", "storage.root": "s3://bucket/runs"}
    config = load_config("hlat-7b", role)
    total = estimate(config)["total_usd"]
    assert total and budget(config).usd == pytest.approx(BUDGET_MARGIN * total)
    assert f"budget: ${BUDGET_MARGIN * total:,.2f} = 1.25 x the estimate" in dry_run(config)
    assert supervisor_for(Run.at("s3://bucket/runs/r", config), lambda: None).budget_usd == pytest.approx(1.25 * total)
    assert budget(load_config("hlat-7b", {**role, "job.budget_usd": 5000})).usd == 5000
    unknown = load_config("hlat-7b", {**role, "job.instance_type": "ml.c5.xlarge", "job.processes_per_node": 1})
    with pytest.raises(ConfigError, match=r"job\.budget_usd: no estimate"):
        budget(unknown)
    assert budget(load_config("tiny")).usd is None  # local: no bill, no default


def test_the_dry_run_says_whether_a_stop_fits_the_grace() -> None:
    from hlat.core.presets import load_config
    from hlat.infra.dry_run import dry_run

    role = {"job.role_arn": "arn:aws:iam::123456789012:role/hlat", "storage.root": "s3://bucket/runs"}
    line = next(x for x in dry_run(load_config("hlat-70b", role)).splitlines() if x.startswith("stop:"))
    assert "of the 120 s grace from SIGTERM, fits: to the vote 18.6 s" in line, line
    slow = load_config("hlat-7b", {**role, "job.instance_count": 1, "training.micro_batch_size": 1})
    line = next(x for x in dry_run(slow).splitlines() if x.startswith("stop:"))
    assert "does NOT fit" in line, line


def short_job(tmp_path: Path, backend: ScriptedBackend, clock: list[float], max_attempts: int = 3) -> Any:
    """`run_job` as the short jobs' stages call it (burn-in here), on the scripted backend and the fake clock."""
    from hlat.infra.supervision.supervisor import run_job

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    def spec(attempt: int, name: str) -> JobSpec:
        return JobSpec(name, RUN_ID, attempt, str(tmp_path), f"{tmp_path}/config.json", "ml.trn1.32xlarge", 2, 32, 3600)

    return run_job(
        backend, Run.at(str(tmp_path)), RUN_ID, "burn-in", spec, poll_seconds=60.0, max_attempts=max_attempts,
        backoff_seconds=[300.0], sleep=sleep, clock=lambda: clock[0],
    )  # fmt: skip


def test_a_short_job_is_relaunched_on_a_platform_fault_and_returns_its_last_job(tmp_path: Path) -> None:
    """The short jobs run through the train stage's loop: a resumable ending relaunches after one poll, the job's
    own success ends it, and the ledger of the stage holds both jobs, with no checkpoint steps."""
    clock = [0.0]
    plays = [Play([("InProgress", None), ("Failed", "InternalServerError: We encountered an internal error.")]), Play()]
    backend = ScriptedBackend(plays, clock)
    record, state = short_job(tmp_path, backend, clock)
    assert [s.name for s in backend.submitted] == ["hlat-tiny-test-burn-in-1", "hlat-tiny-test-burn-in-2"]
    assert record.job_name == "hlat-tiny-test-burn-in-2" and state is not None and state.status == Status.COMPLETED
    ledger = Ledger(Run.at(str(tmp_path)), "burn-in").load()
    assert [(a.status, a.action) for a in ledger] == [("Failed", "resume"), ("Completed", "done")]
    assert all(a.end_step is None for a in ledger)


def test_a_short_job_returns_after_its_attempts_or_a_refusal_without_raising(tmp_path: Path) -> None:
    """Its caller judges the job by its outputs: used attempts return the last failed job, a fatal refusal returns
    no state, and neither raises as the train stage's supervisor would."""
    clock = [0.0]
    failing = [Play([("Failed", "InternalServerError: We encountered an internal error.")]) for _ in range(3)]
    backend = ScriptedBackend(failing, clock)
    record, state = short_job(tmp_path / "used", backend, clock, max_attempts=2)
    assert len(backend.submitted) == 2 and record.attempt == 2
    assert state is not None and state.status == Status.FAILED

    refused = ScriptedBackend([Play(refuse=SubmitError("ValidationException", "bad request"))], clock)
    record, state = short_job(tmp_path / "refused", refused, clock)
    assert state is None and record.status == "NotSubmitted" and record.action == "fatal"
    assert not refused.submitted and not refused.plays
