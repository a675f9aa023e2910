"""The job's hang watchdog on a fake clock (training/watchdog.py): its bound, what counts as progress, and what it
does when it fires (the stacks, the HangDetected record, the exit code), with no real wait over a second."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from hlat.core.contract import EXIT_HUNG, parse_failure_record
from hlat.training.watchdog import (
    FLOOR_S,
    STARTUP_S,
    Progress,
    Watchdog,
    stack_dump,
    start_watchdog,
    watchdog_bound_seconds,
    watchdog_setting,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_bound_is_the_start_up_allowance_first_then_steps_and_saves_with_a_floor() -> None:
    assert watchdog_bound_seconds(None, None) == STARTUP_S
    assert watchdog_bound_seconds(9.28, 60.0, first_of_phase=True) == STARTUP_S
    # hlat-70b: 10 x 9.28 s + 3 x 60 s = 272.8 s, under the 10-minute floor.
    assert watchdog_bound_seconds(9.28, 60.0) == FLOOR_S
    # A slow job: 10 x 37 s + 3 x 200 s.
    assert watchdog_bound_seconds(37.0, 200.0) == pytest.approx(970.0)
    assert watchdog_bound_seconds(37.0, None) == FLOOR_S
    assert watchdog_bound_seconds(100.0, None, floor_s=0) == 1000.0


def test_no_progress_past_the_bound_is_a_hang_that_names_the_step_and_the_bound() -> None:
    clock = Clock()
    progress = Progress(clock=clock)
    dog = Watchdog(progress, dump=lambda: None, exit=lambda code: None)
    clock.now += STARTUP_S  # start-up: the allowance, to the second
    assert dog.check() is None
    progress.beat(1)
    progress.beat(2)  # 'step' seen: the rule holds from here
    progress.step_s, progress.save_s = 40.0, 100.0  # 10 x 40 + 3 x 100 = 700 s
    clock.now += 700
    assert dog.check() is None
    clock.now += 1
    reason = dog.check()
    assert reason == (
        "no step for 701 s after step 2 (bound 700 s: 10 x 40.00 s step + 3 x 100.0 s save, at least 600 s)"
    )


def test_a_hook_met_for_the_first_time_gets_the_start_up_allowance_and_its_beats_are_progress() -> None:
    clock = Clock()
    progress = Progress(clock=clock)
    dog = Watchdog(progress, fixed_s=30.0, dump=lambda: None, exit=lambda code: None)
    progress.beat(1)
    progress.beat(2)
    progress.beat(2, "save_checkpoint")  # the first save: it may compile, and may take long
    clock.now += 30 * 60
    assert dog.check() is None
    progress.beat(2)
    progress.beat(3)
    progress.beat(4, "evaluate")  # first evaluation: long, but every batch beats
    for _ in range(100):
        clock.now += 29
        progress.beat(4, "evaluate")
        assert dog.check() is None
    progress.beat(4)
    progress.beat(6, "save_checkpoint")  # a save seen before: the job's bound
    clock.now += 31
    assert dog.check() == "no step for 31 s after step 6 (save_checkpoint) (bound 30 s, job.watchdog)"


def test_firing_dumps_every_threads_stack_writes_the_record_and_exits_hung(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failure = tmp_path / "failure"
    monkeypatch.setenv("HLAT_FAILURE_FILE", str(failure))
    monkeypatch.setenv("RANK", "3")
    clock = Clock()
    progress = Progress(clock=clock)
    events: list[object] = []
    dog = Watchdog(progress, fixed_s=5.0, dump=lambda: events.append("dump"), exit=events.append)
    progress.beat(6)
    progress.beat(7)
    clock.now += 6
    reason = dog.check()
    assert reason is not None
    dog.fire(reason)
    dog.fire(reason)  # once
    assert events == ["dump", EXIT_HUNG]
    record = parse_failure_record(failure.read_text())
    assert record is not None and record.type == "HangDetected" and record.rank == 3
    assert record.message.startswith("no step for 6 s after step 7 (bound 5 s")


def test_the_stack_dump_holds_every_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "stderr"
    release = threading.Event()

    def stuck_in_a_named_function() -> None:
        release.wait()

    thread = threading.Thread(target=stuck_in_a_named_function, name="stuck")
    thread.start()
    try:
        with out.open("w+") as sink:
            monkeypatch.setattr("sys.stderr", sink)
            stack_dump()
        text = out.read_text()
    finally:
        release.set()
        thread.join()
    assert "stuck_in_a_named_function" in text and "test_the_stack_dump_holds_every_thread" in text
    assert text.count("Current thread 0x") == 1 and text.count("Thread 0x") >= 1


def test_the_thread_fires_on_a_real_clock_within_a_tick(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hlat")
    fired = threading.Event()
    progress = Progress()
    progress.beat(1)
    progress.beat(2)
    dog = Watchdog(progress, fixed_s=0.2, tick_s=0.05, dump=lambda: None, exit=lambda code: fired.set())
    dog.start()
    try:
        assert fired.wait(2.0)
    finally:
        dog.close()
    assert dog.fired is not None and dog.fired.startswith("no step for 0 s after step 2")
    assert "every thread's stack follows" in caplog.text


def test_the_setting_off_auto_or_seconds_and_never_while_extracting_graphs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hlat")
    assert watchdog_setting("off") == (False, None)
    assert watchdog_setting("auto") == (True, None)
    assert watchdog_setting(90.0) == (True, 90.0)
    assert start_watchdog(Progress(), "off", extracting_graphs=False) is None
    assert start_watchdog(Progress(), "auto", extracting_graphs=True) is None
    assert "watchdog: off (job.watchdog=off)" in caplog.text and "watchdog: off (extracting graphs)" in caplog.text
    dog = start_watchdog(Progress(), 90.0, extracting_graphs=False)
    assert dog is not None
    dog.close()
    assert "watchdog: on (bound 3600 s: the start-up allowance" in caplog.text
