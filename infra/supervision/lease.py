"""Who supervises a stage: its identity, heartbeat, lease and the stop requests of `hlat stop`.

All live in run storage under `jobs/<stage>-*.json`. One supervisor holds a stage's lease at a time.
It renews the lease every poll and checks it before every submission and stop.
A cancelled flow stops its stage's live job only when no other supervisor holds the lease (`stop_live_job`)."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from hlat.core.layout import clock_probe_path, heartbeat_path, lease_path, stop_request_path
from hlat.core.run import Run
from hlat.core.storage import StorageClock
from hlat.infra.backends.protocol import (
    JobBackend,
)
from hlat.infra.supervision.errors import LeaseLost, SupervisorBusy
from hlat.infra.supervision.ledger import Attempt, Ledger, iso_time
from hlat.infra.supervision.progress import duration

log = logging.getLogger("hlat.supervisor")


def _no_identity() -> tuple[str | None, str | None]:
    return None, None


_identity: Callable[[], tuple[str | None, str | None]] = _no_identity


def set_identity(provider: Callable[[], tuple[str | None, str | None]]) -> None:
    """Who supervises, as the heartbeat names it: `provider()` -> (flow run id, command), e.g. the CLI's
    ('<uuid>', 'hlat pretrain') or a deployment's name. infra/ has no Prefect: the caller that has it sets this."""
    global _identity
    _identity = provider


def supervisor_identity() -> tuple[str | None, str]:
    """(flow run id or None, a short command) of this process: the provider's, else the environment's
    (a Prefect worker's flow run sets PREFECT__FLOW_RUN_ID) and this program's name."""
    try:
        flow_run_id, command = _identity()
    except Exception:  # a provider that cannot answer (no flow run context) must not stop a stage
        flow_run_id, command = None, None
    flow_run_id = flow_run_id or os.environ.get("PREFECT__FLOW_RUN_ID") or None
    return flow_run_id, command or _program()


def _program() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


class Heartbeat:
    """`jobs/<stage>-supervisor.json` in run storage, rewritten (atomically) once per poll while a supervisor
    watches the stage's job: {"beat_at": epoch seconds, "pid", "host", "flow_run_id", "command"}. A job whose
    supervisor's beat grows older than job.unsupervised_stop_minutes stops itself; `hlat status` shows it. A failed
    write is a warning (once until one succeeds again), never a reason to stop the stage."""

    def __init__(
        self,
        run: Run,
        stage: str,
        clock: Callable[[], float] = time.time,
        before: Callable[[], None] | None = None,
    ) -> None:
        self.run, self.rel, self.clock, self.before = run, heartbeat_path(stage), clock, before
        self.failing = False

    def beat(self) -> None:
        if self.before is not None:
            self.before()  # the supervisor's lease: a supervisor that lost it stops here (LeaseLost), unbeaten
        flow_run_id, command = supervisor_identity()
        body = {
            "beat_at": self.clock(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "flow_run_id": flow_run_id,
            "command": command,
        }
        try:
            self.run.storage.write_json(self.rel, body)
        except Exception as exc:
            if not self.failing:
                log.warning("could not write the supervisor heartbeat %s: %s", self.run.storage.uri(self.rel), exc)
            self.failing = True
        else:
            self.failing = False


def read_heartbeat(run: Run, stage: str) -> dict[str, Any] | None:
    """The stage's last heartbeat (None: none, or unreadable)."""
    try:
        beat = run.storage.read_json(heartbeat_path(stage))
    except Exception:
        return None
    return beat if isinstance(beat, dict) and isinstance(beat.get("beat_at"), int | float) else None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host lives (signal 0: exists, and ours or not ours to signal)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- one supervisor per run and stage: a lease in run storage ---------------------------------------------------------
LEASE_POLLS = 5
"""A lease lasts this many of the run's polls past its last renewal (and at least LEASE_MIN_S): a supervisor renews it
every poll while it watches a job and through every back-off, so only one that is gone (or stuck for that long) loses
it."""
LEASE_MIN_S = 300.0


def read_lease(run: Run, stage: str) -> dict[str, Any] | None:
    """The stage's lease as stored (None: none, or unreadable)."""
    try:
        lease = run.storage.read_json(lease_path(stage)) if run.storage.exists(lease_path(stage)) else None
    except Exception:
        return None
    return lease if isinstance(lease, dict) and isinstance(lease.get("token"), int) else None


def lease_live(lease: dict[str, Any] | None, now: float) -> bool:
    """Whether a stored lease still holds at `now` (the store's time): not released, not expired, and not held by a
    process of this host that has died (it can be seen at once, without waiting out the expiry)."""
    if lease is None or lease.get("released") or float(lease.get("expires_at") or 0) <= now:
        return False
    return not (lease.get("host") == socket.gethostname() and not pid_alive(int(lease.get("pid") or 0)))


def describe_holder(lease: dict[str, Any]) -> str:
    """'hlat pretrain, pid 4242 on ip-10-0-0-5, flow run <id>, since 2026-...Z': who holds a lease."""
    who = f"{lease.get('command') or 'a supervisor'}, pid {lease.get('pid')} on {lease.get('host')}"
    if lease.get("flow_run_id"):
        who += f", flow run {lease['flow_run_id']}"
    since = iso_time(lease.get("since")) if isinstance(lease.get("since"), int | float) else None
    return who + (f", since {since}" if since else "")


class SupervisorLease:
    """`jobs/<stage>-lease.json`: which supervisor may submit and stop the stage's jobs. {"token", "nonce", "pid",
    "host", "flow_run_id", "command", "since", "renewed_at", "expires_at", "released"}, times by run storage's clock
    (`now`: `StorageClock.now`, so two machines' clocks never meet).

    `acquire` takes it when there is none, it was released, or it expired (the token grows with each holder), and
    refuses (`SupervisorBusy`, naming the holder) while another holds it. The holder renews it every poll; before
    each submission and stop it checks that the stored lease is still its own (token and nonce: fencing), and a
    holder whose lease was taken over stops with `LeaseLost`, submitting and stopping nothing more. The store has no
    compare-and-swap here: two supervisors starting in the same instant both write, and the one whose write is read
    back keeps it (the other is refused on reading back), so the window is one write-and-read."""

    def __init__(self, run: Run, stage: str, now: Callable[[], float], ttl_s: float) -> None:
        self.run, self.stage, self.now, self.ttl_s = run, stage, now, ttl_s
        self.rel = lease_path(stage)
        self.mine: dict[str, Any] | None = None

    @property
    def token(self) -> int | None:
        return None if self.mine is None else int(self.mine["token"])

    def acquire(self, attempts: list[Attempt] | None = None) -> int:
        """Take the lease (its token), or raise SupervisorBusy naming its holder."""
        now = self.now()
        held = read_lease(self.run, self.stage)
        if lease_live(held, now):
            assert held is not None
            raise SupervisorBusy(self._busy(held, now), attempts or [])
        flow_run_id, command = supervisor_identity()
        token = int(held["token"]) + 1 if held else 1
        mine: dict[str, Any] = {
            "token": token, "nonce": uuid.uuid4().hex, "pid": os.getpid(),
            "host": socket.gethostname(), "flow_run_id": flow_run_id, "command": command, "since": now,
            "renewed_at": now, "expires_at": now + self.ttl_s, "released": False,
        }  # fmt: skip
        self.run.storage.write_json(self.rel, mine)
        back = read_lease(self.run, self.stage)
        if back is None or back.get("nonce") != mine["nonce"]:  # another supervisor wrote in the same instant
            raise SupervisorBusy(self._busy(back or mine, now), attempts or [])
        self.mine = mine
        if held and not held.get("released"):
            log.warning("%s: took over the supervisor lease of %s (expired)", self.stage, describe_holder(held))
        return token

    def _busy(self, held: dict[str, Any], now: float) -> str:
        left = float(held.get("expires_at") or now) - now
        return (
            f"{self.stage}: another supervisor runs this run's {self.stage} stage ({describe_holder(held)}; lease "
            f"{held.get('token')}, renewed every poll, expires {duration(left)} after its last renewal): this one "
            "touches nothing. `hlat status` shows it; `hlat stop` stops the run; this command may run again once "
            "that one has ended"
        )

    def check(self, attempts: list[Attempt] | None = None) -> None:
        """Raise LeaseLost unless the stored lease is still this supervisor's (before any submission or stop)."""
        if self.mine is None:
            return
        try:
            held = self.run.storage.read_json(self.rel) if self.run.storage.exists(self.rel) else None
        except Exception as exc:  # storage away for a moment: only a lease read as another's is lost
            log.warning("could not read %s: %s", self.run.storage.uri(self.rel), exc)
            return
        if not isinstance(held, dict) or held.get("nonce") == self.mine["nonce"]:
            return  # ours (or removed by hand: nobody else holds it)
        other = describe_holder(held)
        raise LeaseLost(
            f"{self.stage}: this supervisor's lease {self.mine['token']} was taken over by {other} after it went "
            "silent past the lease's expiry; it submits and stops nothing more (the other one goes on with the job)",
            attempts or [],
        )

    def renew(self, attempts: list[Attempt] | None = None) -> None:
        if self.mine is None:
            return
        self.check(attempts)
        now = self.now()
        self.mine = {**self.mine, "renewed_at": now, "expires_at": now + self.ttl_s}
        self.run.storage.write_json(self.rel, self.mine)

    def release(self) -> None:
        """Give the lease up (the stage ended, or this supervisor stops): the next supervisor takes it at once."""
        if self.mine is None:
            return
        try:
            held = read_lease(self.run, self.stage)
            if held is not None and held.get("nonce") == self.mine["nonce"]:
                self.run.storage.write_json(self.rel, {**self.mine, "released": True, "expires_at": self.now()})
        except Exception as exc:  # it expires by itself
            log.warning("could not release %s: %s", self.run.storage.uri(self.rel), exc)
        self.mine = None


# -- hlat stop at any moment: a stop request in run storage -----------------------------------------------------------
def request_stop(run: Run, stage: str, requested_at: float | None = None) -> None:
    """Record that the stage must not relaunch (`hlat stop`): its supervisor checks it before every submission,
    through every back-off and at every poll, and ends the stage (StoppedByUser). Running the stage's command again
    clears it."""
    _, command = supervisor_identity()
    run.storage.write_json(
        stop_request_path(stage),
        {"requested_at": time.time() if requested_at is None else requested_at, "pid": os.getpid(),
         "host": socket.gethostname(), "command": command},
    )  # fmt: skip


def stop_requested(run: Run, stage: str) -> bool:
    """Whether a stop request stands for the stage (a read that fails counts as none: the next poll reads again)."""
    try:
        return run.storage.exists(stop_request_path(stage))
    except Exception as exc:
        log.warning("could not read %s: %s", run.storage.uri(stop_request_path(stage)), exc)
        return False


def clear_stop_request(run: Run, stage: str) -> None:
    if run.storage.exists(stop_request_path(stage)):
        run.storage.remove(stop_request_path(stage))


def stop_live_job(backend: JobBackend, run: Run, stage: str = "train") -> str | None:
    """Stop the stage's unfinished job, if any (the flow's cancellation hook); returns its name."""
    attempts = Ledger(run, stage).load()
    if not attempts or attempts[-1].ended:
        return None
    lease = read_lease(run, stage)
    try:
        now = StorageClock(run.storage, probe=clock_probe_path(stage)).now()
    except Exception:  # a store that cannot be written: judged by this machine's clock
        now = time.time()
    holder = None if lease is None else (lease.get("pid"), lease.get("host"))
    if lease_live(lease, now) and lease is not None and holder != (os.getpid(), socket.gethostname()):
        # Another supervisor (another terminal, a deployment) watches this job: a cancellation here is not its end.
        log.warning("not stopping the %s job: %s supervises it", stage, describe_holder(lease))
        return None
    record = attempts[-1]
    state = backend.describe(record.job_name)
    if state is None or state.terminal:
        return None
    record.stop_requested = "cancelled"
    Ledger(run, stage).save(attempts)
    backend.stop(record.job_name)
    return record.job_name
