"""The stop vote: every rank stops after the same step, with no collective at any step boundary.

A rank that steps on alone would hang in the next collective, so a stop must be agreed. The stop step is agreed once,
when asked, through torchrun's TCPStore (https://pytorch.org/docs/stable/distributed.html#torch.distributed.TCPStore).
At each boundary the loop calls `at_boundary(step)`: a lock and two comparisons. A watcher thread per rank posts its
next boundary; rank 0 picks the largest post (`decide_stop_step`). No rank passes a boundary it posted before the
decision, so none passes the decision. docs/multi-host.md ("Watchdog and stop vote") has the protocol and why it cannot
deadlock."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

log = logging.getLogger("hlat.train")

WAIT_S = 6 * 3600.0
"""Seconds one store wait lasts before renewal: well inside AWS's 5-day idle TCP tracking, and few c10d warnings.
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/security-group-connection-tracking.html"""
PREFIX = "hlat-stop/"
REQUEST, DECISION = "request", "step"


def decide_stop_step(posts: Iterable[int], max_steps: int) -> int | None:
    """The step every rank stops after: the largest post. None when at or past `max_steps`."""
    step = max(posts)
    return step if step < max_steps else None


def post_key(rank: int) -> str:
    return f"n/{rank}"


class StopVote:
    """One rank's side of the vote. `connect` makes a store client (None: a single process)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        max_steps: int,
        passed: int,
        connect: Callable[[], Any] | None,
        wait_s: float = WAIT_S,
    ) -> None:
        self.rank, self.world_size, self.max_steps = rank, world_size, max_steps
        self.passed = passed
        """The last boundary this rank went past without stopping (the resumed step at first)."""
        self.connect, self.wait_s = connect if world_size > 1 else None, wait_s
        self.committed: int | None = None
        """The boundary this rank will not go past before the decision."""
        self.decision: int | None = None
        self._decided = threading.Event()
        self._asked = threading.Event()  # this rank asked (request)
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # -- the loop's side -------------------------------------------------------------------------------------------
    def request(self) -> None:
        """Ask for a stop (any thread, a signal handler included: no lock, no I/O)."""
        self._asked.set()

    @property
    def asked(self) -> bool:
        return self._asked.is_set()

    def at_boundary(self, step: int, wait: Callable[[], None] | None = None) -> bool:
        """Whether every rank stops after `step`. Blocks only while committed to `step` and undecided. `wait()` is
        called each second while blocked (the progress beat)."""
        if self.connect is None:
            return self.asked
        with self._lock:
            if self.committed is None and self.asked:
                self.committed = step
            if self.committed is None or step < self.committed or step >= self.max_steps:
                self.passed = step
                return False
        while not self._decided.wait(1.0):
            if wait is not None:
                wait()
        return self.decision == step

    def start(self) -> None:
        """The watcher (and the poster, idle until a request): on several ranks only."""
        if self.connect is None:
            return
        for target, name in ((self._watch, "hlat-stop-watch"), (self._post_request, "hlat-stop-post")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        """Training is over here: post the next boundary if not done, and let the threads go."""
        self._closing.set()
        self._asked.set()  # wakes the poster, which leaves (closing) without asking
        if self.connect is None or self.decision is not None:
            return
        with self._lock:
            if self.committed is None:
                self.committed = self.passed + 1
        try:
            store = self.connect()
            store.set(post_key(self.rank), str(self.committed))
        except Exception as exc:  # the store's host may be gone already (its rank finished first)
            log.debug("stop vote: no final post (%s)", exc)

    # -- the threads --------------------------------------------------------------------------------------------
    def _post_request(self) -> None:
        self._asked.wait()
        if self._closing.is_set():
            return
        try:
            self.connect_once().set(REQUEST, str(self.rank))
        except Exception as exc:
            log.warning("stop vote: could not ask the other ranks to stop (%s: %s)", type(exc).__name__, exc)

    def connect_once(self) -> Any:
        assert self.connect is not None
        return self.connect()

    def _wait_for(self, store: Any, keys: list[str]) -> bool:
        """Wait until every key of `keys` is set (renewing the wait every wait_s); False when closing."""
        while not self._closing.is_set():
            try:
                store.wait(keys, timedelta(seconds=self.wait_s))
                return True
            except Exception as exc:
                if self._closing.is_set():
                    return False
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise
        return False

    def _watch(self) -> None:
        try:
            store = self.connect_once()
            if not self._wait_for(store, [REQUEST]):
                return
            with self._lock:
                if self.committed is None:
                    self.committed = self.passed + 1
                mine = self.committed
            store.set(post_key(self.rank), str(mine))
            if self.rank == 0:
                keys = [post_key(r) for r in range(self.world_size)]
                if not self._wait_for(store, keys):
                    return
                values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
                step = max(int(v) for v in values)
                who = int(store.get(REQUEST))
                log.info(
                    "stop vote: rank %d asked; the ranks' next boundaries span steps %d-%d: every rank stops after "
                    "step %d%s", who, min(int(v) for v in values), step, step,
                    "" if step < self.max_steps else " (training.max_steps: the training ends there, no stop)",
                )  # fmt: skip
                store.set(DECISION, str(step))
            elif not self._wait_for(store, [DECISION]):
                return
            step = int(store.get(DECISION))
            self.decision = decide_stop_step([step], self.max_steps)
            self._decided.set()
        except Exception as exc:  # the loop then waits at its boundary, and the watchdog ends the job
            if not self._closing.is_set():
                log.error("stop vote: %s: %s; a stop cannot be agreed in this job", type(exc).__name__, exc)
