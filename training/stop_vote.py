"""The stop vote: every rank stops after the same step, with no collective at any step boundary.

A stop (SageMaker's SIGTERM to every rank, the stop rule's `request_stop` on rank 0) must end every rank after the
same step, which every rank then checkpoints: a rank that steps on alone hangs in the next step's collectives, and
the commit waits for the files of a rank that never writes them. Nothing at a step boundary leaves the process (a
full-world vote at every boundary costs 2-6% of hlat-70b's step: docs/multi-host.md); the stop step is agreed once,
when a stop is asked for, through the job's TCPStore (torchrun's store:
https://pytorch.org/docs/stable/distributed.html#torch.distributed.TCPStore):

- Each rank keeps `passed`, the last boundary it went past. At a boundary the loop calls `at_boundary(step)`: a lock,
  two comparisons. Nothing else happens at a boundary until some rank has asked for a stop.
- A stop asked for on a rank (`request`, safe in a signal handler: it sets an Event) commits that rank at its next
  boundary (the step in progress) and a thread of its own sets the store's `request` key.
- Every rank's watcher thread waits on that key (`TCPStore.wait`: the store answers when the key is set, so the wait
  costs nothing while it lasts; renewed every WAIT_S). When it fires, the rank commits, unless it already has, to
  `passed + 1`, its next boundary, and posts it (`n/<rank>`). A committed rank never goes past its boundary before
  the decision: it waits there (`at_boundary` blocks).
- Rank 0's watcher waits for every rank's post, takes the largest (`decide_stop_step`) and sets `step`; every
  watcher reads it. Every rank is then at or before its own post, so at or before the decision, and goes on to it.

Why no rank passes the decision: it is at least every rank's post, and a rank posts a boundary it has not gone past
and will not go past without the decision. Why no deadlock: posts come from the watcher threads, not from the loop,
so a rank blocked inside a collective (waiting for a peer that waits at its boundary) still posts, its next boundary;
the decision then lets the waiting peer run the step both need. A rank that never posts (hung, dead) leaves the
others waiting at their boundaries: the watchdog (`training/watchdog.py`) ends that as a hang. A decision at or past
training.max_steps is no stop: the training ends there (a rank does not wait at the last boundary).

Per step: nothing on the network. Per stop: a few small store operations per rank, once (their count at 8,192 ranks,
and the connections the store's host holds: docs/multi-host.md, docs/trn1.md).

The stop step is the step in progress when the stop is asked for, or the next when a rank went past its boundary
before it heard (a race of milliseconds against a step): what the per-step vote gave, as the stop-grace tests check.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

log = logging.getLogger("hlat.train")

WAIT_S = 6 * 3600.0
"""How long one store wait lasts before it is renewed (its timeout): six hours, well inside the 5 days an AWS
security group tracks an idle TCP connection
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/security-group-connection-tracking.html). c10d logs two warning
lines at each renewal (a wait that timed out), so a shorter wait is log noise: at an hour, 64 lines an hour on each
32-rank host; at six hours, about 11."""
PREFIX = "hlat-stop/"
REQUEST, DECISION = "request", "step"


def decide_stop_step(posts: Iterable[int], max_steps: int) -> int | None:
    """The step every rank stops after, from every rank's post (the boundary it will not pass undecided): the
    largest. None when that is at or past `max_steps`: the training ends there anyway, with no stop."""
    step = max(posts)
    return step if step < max_steps else None


def post_key(rank: int) -> str:
    return f"n/{rank}"


class StopVote:
    """One rank's side of the vote. `connect` makes a new client of the job's store (None: a single process, where
    the vote is this rank's own request)."""

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
        """Whether every rank stops after `step` (the loop's main thread, at every boundary, in order). Blocks only
        when this rank is committed to `step` and the decision is not known yet (`wait()` is called each second
        while it waits: the loop's progress beat)."""
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
        """Training is over on this rank: post its next boundary if it has not (so a decision never waits for a rank
        that finished), and let the threads go."""
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
