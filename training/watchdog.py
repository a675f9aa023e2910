"""The training job's own hang watchdog: a daemon thread per rank that ends the process when progress stops.

A hung job never reaches the step boundary where stops act, so it would bill to MaxRuntimeInSeconds.
Rules:
- progress is what the loop reports (`Progress.beat`).
- on a hang: dump every stack, write a HangDetected record, `os._exit(EXIT_HUNG)`.
- a new phase gets STARTUP_S (it may compile); otherwise the measured rule, at least FLOOR_S.
- job.watchdog=<seconds> replaces the rule; `off` disables it; never under graph extraction.
docs/multi-host.md ("Watchdog and stop vote") has the bounds.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hlat.core.contract import EXIT_HUNG, write_failure

log = logging.getLogger("hlat.train")

STARTUP_S = 60 * 60.0
"""A phase met for the first time (start-up included): it may compile graphs."""
STEP_FACTOR = 10.0
"""Steady state: this many measured steps..."""
SAVE_FACTOR = 3.0
"""... plus this many measured checkpoint saves..."""
FLOOR_S = 10 * 60.0
"""... and never less than this."""
TICK_S = 5.0
"""How often the thread looks at the clock."""

STEP = "step"
START_UP = "start-up"


def watchdog_bound_seconds(
    step_s: float | None,
    save_s: float | None,
    *,
    first_of_phase: bool = False,
    startup_s: float = STARTUP_S,
    step_factor: float = STEP_FACTOR,
    save_factor: float = SAVE_FACTOR,
    floor_s: float = FLOOR_S,
) -> float:
    """Seconds without progress after which a job is hung (job.watchdog=auto); pure.

    `startup_s` in a new phase; else step_factor x `step_s` + save_factor x `save_s`, at least `floor_s`.
    """
    if first_of_phase or step_s is None:
        return max(startup_s, floor_s)
    return max(floor_s, step_factor * step_s + save_factor * (save_s or 0.0))


@dataclass
class Progress:
    """What the loop tells the watchdog: last progress, its step and phase, phases seen."""

    clock: Callable[[], float] = time.monotonic
    at: float = field(default=0.0)
    step: int = 0
    phase: str = START_UP
    seen: set[str] = field(default_factory=set)
    step_s: float | None = None
    """The step time measured at the last sync point."""
    save_s: float | None = None
    """The last checkpoint save's time."""

    def __post_init__(self) -> None:
        self.at = self.clock()

    def beat(self, step: int, phase: str = STEP) -> None:
        """Progress: `step` last finished, `phase` what the loop does now."""
        self.seen.add(self.phase)
        self.at, self.step, self.phase = self.clock(), step, phase


def stack_dump() -> None:
    """Every thread's stack into the log, flushed."""
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()


def end_process(code: int) -> None:
    """Flush the log and leave at once; nothing can hold the exit up."""
    logging.shutdown()
    os._exit(code)


class Watchdog:
    """The thread: `check(now)` is pure; `start()` runs it; on a hang `fire` ends the process."""

    def __init__(
        self,
        progress: Progress,
        fixed_s: float | None = None,
        tick_s: float = TICK_S,
        dump: Callable[[], None] = stack_dump,
        exit: Callable[[int], None] = end_process,
    ) -> None:
        self.progress, self.fixed_s, self.tick_s = progress, fixed_s, tick_s
        self.dump, self.exit = dump, exit
        self.fired: str | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _first(self) -> bool:
        p = self.progress
        return p.phase not in p.seen or (self.fixed_s is None and p.step_s is None)

    def bound(self) -> float:
        """The bound now: the start-up allowance in a new phase, else the steady-state one."""
        p = self.progress
        if self.fixed_s is not None and not self._first():
            return self.fixed_s
        return watchdog_bound_seconds(p.step_s, p.save_s, first_of_phase=self._first())

    def describe_bound(self) -> str:
        p = self.progress
        if self._first():
            return f"bound {self.bound():.0f} s: the start-up allowance, {p.phase} not yet seen in this job"
        if self.fixed_s is not None:
            return f"bound {self.fixed_s:g} s, job.watchdog"
        save = f" + {SAVE_FACTOR:g} x {p.save_s:.1f} s save" if p.save_s else ""
        return f"bound {self.bound():.0f} s: {STEP_FACTOR:g} x {p.step_s:.2f} s step{save}, at least {FLOOR_S:.0f} s"

    def check(self, now: float | None = None) -> str | None:
        """The hang's description when progress is older than the bound, else None."""
        p = self.progress
        now = p.clock() if now is None else now
        idle = now - p.at
        if idle <= self.bound():
            return None
        doing = "" if p.phase == STEP else f" ({p.phase})"
        return f"no step for {idle:.0f} s after step {p.step}{doing} ({self.describe_bound()})"

    def fire(self, reason: str) -> None:
        """Stacks, record, exit: once."""
        if self.fired is not None:
            return
        self.fired = reason
        log.error("watchdog: %s; every thread's stack follows, then the process ends (exit %d)", reason, EXIT_HUNG)
        try:
            self.dump()
        finally:
            try:
                write_failure(f"HangDetected: {reason}")
            finally:
                self.exit(EXIT_HUNG)

    def start(self) -> None:
        log.info("watchdog: on (%s now); a hang ends the process with exit %d", self.describe_bound(), EXIT_HUNG)
        self._thread = threading.Thread(target=self._run, name="hlat-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.tick_s):
            try:
                reason = self.check()
            except Exception as exc:  # a bug here must not kill training: the supervisor's hang timer remains
                log.warning("watchdog: %s: %s; no longer watching", type(exc).__name__, exc)
                return
            if reason is not None:
                self.fire(reason)
                return

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=self.tick_s + 1)


def watchdog_setting(setting: str | float) -> tuple[bool, float | None]:
    """job.watchdog read: (on, fixed bound in seconds or None for the rule)."""
    if setting == "off":
        return False, None
    if setting == "auto":
        return True, None
    return True, float(setting)


def start_watchdog(progress: Progress, setting: str | float, extracting_graphs: bool) -> Watchdog | None:
    """The job's watchdog, started; None when off or extracting graphs."""
    on, fixed = watchdog_setting(setting)
    if not on or extracting_graphs:
        log.info("watchdog: off (%s)", "extracting graphs" if on else "job.watchdog=off")
        return None
    # A short fixed bound is looked at often enough to be kept to within a tenth of it.
    tick = TICK_S if fixed is None else min(TICK_S, max(0.1, fixed / 10))
    watchdog = Watchdog(progress, fixed_s=fixed, tick_s=tick)
    watchdog.start()
    return watchdog
