"""The scale tier's process settings while a scenario runs. Seen without them: scenario 2's 256-host form took 50-58 s
after other tests of the same pytest worker (an in-process CLI's log handler and Prefect's on the root logger, a
server's threads), against 1 s alone; with them, 1 s in either order.

- A simulated 8,192-rank failure forwards every rank's line through `hlat.job` (as the supervisor does for a real
  job), about 90,000 lines a test, and whatever an earlier test left on the root logger formats every one: the job's
  forwarded lines are kept to warnings while a scale test runs (the supervisor's own lines stay).
- The simulation hands its virtual clock from thread to thread (a supervisor's loop, `hlat stop`, the event loop: one
  runs at a time, tests/scale/sim.py), tens of thousands of hand-offs a scenario, each of which waits up to the switch
  interval for a thread another test left running (5 ms by default:
  https://docs.python.org/3/library/sys.html#sys.setswitchinterval): 0.1 ms while a scale test runs."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import pytest

SWITCH_INTERVAL_S = 1e-4


@pytest.fixture(autouse=True)
def quick_hand_offs_and_quiet_job_lines() -> Iterator[None]:
    interval = sys.getswitchinterval()
    job = logging.getLogger("hlat.job")
    level = job.level
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    job.setLevel(logging.WARNING)
    try:
        yield
    finally:
        job.setLevel(level)
        sys.setswitchinterval(interval)
