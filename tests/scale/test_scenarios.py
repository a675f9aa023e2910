"""Issue 50's scenarios 1-11 at full scale (hlat-70b: 256 hosts x 32 ranks; hlat-7b: 64 x 32) on the simulated
SageMaker: each in its "before" form (the old control plane: what the issue found, wasting what it said) and its
fixed form, ending with a bound on the dollars wasted and the steps lost. Dollars are the preset's catalog price x
hosts x billed seconds (tests/scale/model.py); "wasted" is what was billed beyond the training the run kept.

The "before" forms run with job.max_restarts=10 (scenarios.RESTARTS): the cap is what ends them, so 10 shows that
nothing else does, at a tenth of the CPU; `python -m tests.scale.report` runs the default 100.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scale import model, scenarios
from tests.scale.scenarios import RESTARTS, Outcome

PRESETS = [pytest.param(p, id=p) for p in model.PRESETS]


def run(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, preset: str, fixed: bool, **kw: object) -> Outcome:
    return scenarios.SCENARIOS[name](monkeypatch, tmp_path, preset, fixed, **kw)


def before_and_after(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, preset: str
) -> tuple[Outcome, Outcome]:
    """The scenario on the code before issue 50's fixes, then on the code as it is."""
    before = run(name, monkeypatch, tmp_path / "before", preset, fixed=False)
    monkeypatch.undo()
    return before, run(name, monkeypatch, tmp_path / "after", preset, fixed=True)


def per_attempt(preset: str) -> float:
    """Dollars of one start-up of the whole job (billed from Downloading to the first step)."""
    sc = model.scale(preset)
    return sc.usd(sc.downloading_s + sc.startup_s)


# -- 1 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_1_hung_job_without_supervisor_before_runs_to_max_runtime(monkeypatch, tmp_path, preset):
    o = run("1", monkeypatch, tmp_path, preset, fixed=False)
    sc = model.scale(preset)
    # MaxRuntimeInSeconds is the budget's time (hlat-7b: ~531 h) or SageMaker's 28 days (hlat-70b).
    assert o.notes["job_ended"] == "MaxRuntimeExceeded"
    assert o.notes["hung_s"] > 500 * 3600
    assert o.wasted_usd > {"hlat-70b": 4.0e6, "hlat-7b": 8.0e5}[preset], o
    assert o.notes["rule_fired"], "the stop rule fired (unsupervised) and changed nothing: the job was hung"
    assert o.steps_lost == 10 and sc.hosts == model.PRESETS[preset]


@pytest.mark.parametrize("preset", PRESETS)
def test_1_hung_job_without_supervisor_ends_at_the_watchdog_bound(monkeypatch, tmp_path, preset):
    o = run("1", monkeypatch, tmp_path, preset, fixed=True)
    sc = model.scale(preset)
    from hlat.training.watchdog import watchdog_bound_seconds

    bound = watchdog_bound_seconds(sc.step_s, sc.save_s) + model.FAILURE_SEEN_S
    assert o.notes["job_ended"] == "Failed" and o.notes["hung_s"] <= bound + 1
    assert o.wasted_usd <= sc.usd(bound + 1) < 2000, o
    assert o.steps_lost == 10


# -- 2 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reported", ["peer", "alternate"])
@pytest.mark.parametrize("preset", PRESETS)
def test_2_platform_class_repeats_before_relaunch_to_the_cap(monkeypatch, tmp_path, preset, reported):
    o = run("2", monkeypatch, tmp_path, preset, fixed=False, reported=reported)
    assert o.submissions == RESTARTS + 1 and o.ended.startswith("RestartsExhausted"), o.ended
    # At the default job.max_restarts=100 that is 101 jobs: ten times this (report.py runs it).
    assert o.wasted_usd >= (RESTARTS + 1) * per_attempt(preset), o


@pytest.mark.parametrize("reported", ["peer", "alternate"])
@pytest.mark.parametrize("preset", PRESETS)
def test_2_platform_class_repeats_stop_within_three_attempts(monkeypatch, tmp_path, preset, reported):
    o = run("2", monkeypatch, tmp_path, preset, fixed=True, reported=reported)
    assert o.submissions <= 3 and "IndexError" in o.ended, o.ended  # the failing rank's own record, not a peer's
    sc = model.scale(preset)
    assert o.wasted_usd <= 3 * (per_attempt(preset) + sc.usd(50 * sc.step_s + model.FAILURE_SEEN_S)) + 1, o
    assert o.steps_lost <= 3 * 50


# -- 3 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_3_nan_at_a_moving_step_before_relaunches_to_the_cap(monkeypatch, tmp_path, preset):
    o = run("3", monkeypatch, tmp_path, preset, fixed=False)
    assert o.submissions == RESTARTS + 1 and o.ended.startswith("RestartsExhausted"), o.ended
    assert o.wasted_usd >= (RESTARTS + 1) * per_attempt(preset)


@pytest.mark.parametrize("preset", PRESETS)
def test_3_nan_at_a_moving_step_stops_with_no_newer_checkpoint(monkeypatch, tmp_path, preset):
    o = run("3", monkeypatch, tmp_path, preset, fixed=True)
    assert o.submissions <= 3 and "nan" in o.ended, o.ended
    sc = model.scale(preset)
    assert o.wasted_usd <= 3 * (per_attempt(preset) + sc.usd(90 * sc.step_s + model.FAILURE_SEEN_S)) + 1


# -- 4 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_4_long_start_up_before_is_judged_hung_every_attempt(monkeypatch, tmp_path, preset):
    o = run("4", monkeypatch, tmp_path, preset, fixed=False)
    assert (
        o.submissions == RESTARTS + 1 and "hung" in o.ended and o.newest < model.scale(preset).config.training.max_steps
    )
    assert o.wasted_usd >= (RESTARTS + 1) * model.scale(preset).usd(45 * 60)  # >= 45 billed min a job, for nothing


@pytest.mark.parametrize("preset", PRESETS)
def test_4_long_start_up_is_timed_from_training_and_trains(monkeypatch, tmp_path, preset):
    o = run("4", monkeypatch, tmp_path, preset, fixed=True)
    assert o.reached and o.submissions == 1, o.ended
    # The only excess is the slow start itself (billed once), nothing relaunched.
    assert o.wasted_usd <= o.notes["slow_start_usd"] + 1 and o.steps_lost == 0


# -- 5 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_5_full_world_vote_before(monkeypatch, tmp_path, preset):
    o = run("5", monkeypatch, tmp_path, preset, fixed=False)
    sc = model.scale(preset)
    if sc.ranks == 8192:  # the full mesh does not form inside gloo's 30 min: every start-up fails, relaunched
        assert model.gloo_mesh_init_seconds(sc.ranks) > model.GLOO_TIMEOUT_S
        assert o.submissions == RESTARTS + 1 and o.ended.startswith("RestartsExhausted")
        assert o.wasted_usd >= (RESTARTS + 1) * sc.usd(model.GLOO_TIMEOUT_S)
    else:  # it forms, and every step pays 2(P-1) hops: 2% of hlat-7b's step
        assert o.reached
        vote = model.gloo_vote_seconds(sc.ranks)
        assert vote / sc.step_s > 0.02
        assert o.wasted_usd >= sc.usd(2 * sc.checkpoint_every * vote) * 0.99
    assert o.notes["sockets_per_rank"] == sc.ranks - 1


@pytest.mark.parametrize("preset", PRESETS)
def test_5_stop_vote_without_a_per_step_collective(monkeypatch, tmp_path, preset):
    o = run("5", monkeypatch, tmp_path, preset, fixed=True)
    # The real StopVote's step boundaries send nothing at this world's size, and the lazy group opens no socket.
    assert o.notes["vote_s"] == 0 and o.notes["sockets_per_rank"] == 0, o.notes
    assert o.reached and o.submissions == 1 and o.wasted_usd == 0 and o.steps_lost == 0, o


# -- 6 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_6_stop_with_a_save_in_flight(monkeypatch, tmp_path, preset):
    before, after = before_and_after("6", monkeypatch, tmp_path, preset)
    sc = model.scale(preset)
    assert after.notes["stop_s"] <= model.STOP_GRACE_S and after.notes["stops_killed"] == 0
    assert after.steps_lost == 0 and after.wasted_usd == 0
    if before.notes["stop_s"] > model.STOP_GRACE_S:  # hlat-70b at 256 hosts: SIGKILL, the interval since lost
        assert before.notes["stops_killed"] == 1 and before.steps_lost > sc.checkpoint_every // 2
        assert before.wasted_usd >= sc.usd(before.steps_lost * sc.step_s) * 0.99
    else:  # hlat-7b (SDK 2.28) fits even the old plan, with less room
        assert before.notes["stop_s"] > after.notes["stop_s"]


# -- 7 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_7_hlat_stop_during_backoff(monkeypatch, tmp_path, preset):
    before, after = before_and_after("7", monkeypatch, tmp_path, preset)
    assert "nothing to stop" in before.notes["said"][0] and before.submissions == 2
    assert before.wasted_usd >= model.scale(preset).ideal_usd(2 * model.scale(preset).checkpoint_every) * 0.99
    assert after.ended.startswith("StoppedByUser") and after.submissions == 1 and after.wasted_usd == 0


# -- 8 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_8_two_supervisors(monkeypatch, tmp_path, preset):
    before, after = before_and_after("8", monkeypatch, tmp_path, preset)
    assert before.submissions == 2 and before.wasted_usd > per_attempt(preset), before  # B relaunched A's stop
    assert after.ended.startswith("SupervisorBusy") and "pid" in after.ended  # B refused, naming A
    assert after.submissions == 1 and after.wasted_usd == 0


# -- 9 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_9_supervisor_clock_behind(monkeypatch, tmp_path, preset):
    before, after = before_and_after("9", monkeypatch, tmp_path, preset)
    # Every job stops itself as unsupervised at its first check and gains a step: only the cap ends it.
    assert before.submissions == RESTARTS + 1 and before.notes["rule_fired"] == RESTARTS + 1
    assert before.wasted_usd >= RESTARTS * per_attempt(preset)
    assert after.reached and after.submissions == 1 and after.notes["rule_fired"] == 0 and after.wasted_usd == 0


# -- 10 -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_10_failure_record_cut_by_failure_reason(monkeypatch, tmp_path, preset):
    before, after = before_and_after("10", monkeypatch, tmp_path, preset)
    assert before.ended.startswith("JobFailed") and "unknown" in before.ended and not before.reached
    assert after.reached and after.submissions == 3
    sc = model.scale(preset)
    # The two attempts the storage fault took, nothing more.
    assert after.wasted_usd <= 2 * (per_attempt(preset) + sc.usd(sc.interval_s + sc.save_s + 120)) + 1


# -- 11 -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_11a_deadline_in_a_backoff(monkeypatch, tmp_path, preset):
    before, after = before_and_after("11a", monkeypatch, tmp_path, preset)
    assert before.ended.startswith("ConfigError")  # a crash in the job's spec, not the supervisor's judgement
    assert after.ended.startswith("DeadlinePassed") and not after.notes["phantom"]
    assert "running" not in after.notes["status"].split("train", 1)[1].splitlines()[0]
    assert after.spent_usd == 0


@pytest.mark.parametrize("preset", PRESETS)
def test_11b_last_ten_dollars(monkeypatch, tmp_path, preset):
    before, after = before_and_after("11b", monkeypatch, tmp_path, preset)
    left_s = 10.0 / model.scale(preset).hourly * 3600  # $10 of the job's hours, then the stop's grace
    assert before.notes["max_runtimes"] == [pytest.approx(left_s + model.STOP_GRACE_S, abs=1)]
    assert before.wasted_usd > 10
    assert after.ended.startswith("BudgetExhausted") and after.submissions == 0 and after.wasted_usd == 0


@pytest.mark.parametrize("preset", PRESETS)
def test_11c_transient_resource_limit(monkeypatch, tmp_path, preset):
    before, after = before_and_after("11c", monkeypatch, tmp_path, preset)
    assert before.ended.startswith("JobFailed") and "ResourceLimitExceeded" in before.ended
    assert after.reached and after.submissions == 2 and after.wasted_usd == 0
