"""Following one job: poll it, read its log, stop it when asked, and record how it ended.

A caller interrupted (Ctrl-C, a cancelled flow run) stops its job before it re-raises."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from hlat.core.storage import is_transient
from hlat.infra.backends.protocol import (
    JobBackend,
    JobState,
    Status,
)
from hlat.infra.supervision.errors import LeaseLost
from hlat.infra.supervision.lease import Heartbeat
from hlat.infra.supervision.ledger import Attempt
from hlat.infra.supervision.progress import duration

log = logging.getLogger("hlat.supervisor")


def ending_reason(state: JobState) -> str | None:
    """What a job's ending adds to its status: the failure reason, or a finer status (MaxRuntimeExceeded); None
    for a plain Completed or Stopped (a reason column that repeats the status says nothing)."""
    if state.failure_reason:
        return state.failure_reason
    if state.secondary_status and state.secondary_status != state.status.value:
        return state.secondary_status
    return None


def follow(
    backend: JobBackend,
    record: Attempt,
    save: Callable[[], None],
    poll_seconds: float,
    sleep: Callable[[float], None],
    on_poll: Callable[[list[str], JobState | None], str | None],
    reattached: bool = False,
    heartbeat: Heartbeat | None = None,
    stored_stop: Callable[[], str | None] | None = None,
    record_end: Callable[[JobState], None] | None = None,
    may_act: Callable[[], None] | None = None,
    on_earlier: Callable[[list[str]], None] | None = None,
) -> JobState:
    """Poll a job until it ends. Each poll beats the `heartbeat`, reads the job's new log lines, describes it, and
    hands both to `on_poll` (state None: not visible yet), which may return a reason to stop the job ('budget',
    'hung'). A job seen stopping that someone else stopped (`hlat stop`: the ledger's stop_requested, read through
    `stored_stop`) takes that reason. Interrupting the caller (Ctrl-C, a cancelled flow run: anything that is not an
    Exception) stops the job too: `save` records the stop in the ledger first, and once the job is seen ending
    (within STOP_WAIT_S) `record_end` records its end and `save` keeps it, so the ledger says when it stopped. A job
    `reattached` to (started by an earlier flow run) has its earlier output skipped, said in one line: replayed under
    today's timestamps it read as if the run had started again (`on_earlier` still reads it). `may_act` is asked
    before any stop: it raises (LeaseLost) when this supervisor may no longer stop the job."""

    def stop(why: str) -> None:
        if may_act is not None:
            may_act()
        record.stop_requested = why
        save()
        log.warning("stopping %s (%s)", record.job_name, why)
        backend.stop(record.job_name)

    def adopt_stop(state: JobState | None) -> None:
        """A stop requested from elsewhere (`hlat stop` writes it to the ledger before it stops the job)."""
        stopping = state is not None and (state.terminal or state.status == Status.STOPPING)
        if stopping and stored_stop is not None and record.stop_requested is None:
            with_reason = stored_stop()
            if with_reason:
                record.stop_requested = with_reason

    cursor: Any = None
    try:
        if reattached:
            earlier, cursor = read_logs(backend, record.job_name, cursor)
            if on_earlier is not None:
                on_earlier(earlier)
            if earlier:
                log.info(
                    "%s: its %d earlier log line(s) are in the job's own log, not repeated here; following its new "
                    "output", record.job_name, len(earlier),
                )  # fmt: skip
        while True:
            if heartbeat is not None:
                heartbeat.beat()
            lines, cursor = read_logs(backend, record.job_name, cursor)
            state = describe_patiently(backend, record.job_name, poll_seconds, sleep)
            adopt_stop(state)
            if state is not None and state.terminal:
                more, cursor = read_logs(backend, record.job_name, cursor)
                on_poll(lines + more, state)
                return state
            why = on_poll(lines, state)
            if why and record.stop_requested is None:
                stop(why)
            sleep(poll_seconds)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # the job must not outlive an interrupted supervisor
            log.warning("interrupted (%s)", type(exc).__name__)
            try:
                stop("cancelled")
            except LeaseLost as lost:  # another supervisor has the job now: its stop is not this one's to send
                log.warning("not stopping %s: %s", record.job_name, lost)
                raise exc from None
            final = wait_for_end(backend, record.job_name, STOP_WAIT_S, min(poll_seconds, 0.5))
            if final is not None and final.terminal and record_end is not None:
                try:  # the ledger says when the job stopped, not when the next command happens to look
                    record_end(final)
                    save()
                except Exception as err:  # what is recorded must not hide the interruption
                    log.warning("could not record the end of %s: %s", record.job_name, err)
        raise


def end_time(state: JobState, fallback: float) -> float:
    """When the job ended, as its backend recorded it (SageMaker's TrainingEndTime, the local job's status.json:
    `JobState.ended_at` where the backend reports it), else `fallback` (the time it was seen ended)."""
    return state.ended_at if state.ended_at is not None else fallback


STOP_WAIT_S = 30.0
"""How long an interrupted stage waits for its stopped job to end (it checkpoints on SIGTERM first), so that what
the user is told next (the run's newest checkpoint) is what a re-run resumes from. A second Ctrl-C stops waiting;
a SageMaker job that takes longer goes on stopping on its own."""


def wait_for_end(backend: JobBackend, name: str, timeout: float, poll_seconds: float) -> JobState | None:
    """Poll until the job is in a terminal state or `timeout` has passed; its last state (None: unknown)."""
    deadline = time.monotonic() + timeout
    state = None
    try:
        while time.monotonic() < deadline:
            state = backend.describe(name)
            if state is not None and state.terminal:
                break
            time.sleep(poll_seconds)
    except KeyboardInterrupt:  # a second Ctrl-C: stop waiting, the job goes on stopping
        log.warning("not waiting for %s to stop", name)
    except Exception as exc:  # the API is not answering: the stop was sent, the job ends on its own
        log.warning("could not follow %s to its end: %s", name, exc)
    if state is not None and state.terminal:
        log.warning("%s %s", name, state.status.value)
    return state


def describe_patiently(
    backend: JobBackend, name: str, poll_seconds: float, sleep: Callable[[float], None]
) -> JobState | None:
    """describe, riding out throttling and dropped connections with a doubling delay (up to 16 polls)."""
    delay = poll_seconds
    while True:
        try:
            return backend.describe(name)
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning("describe %s: %s; retrying in %s", name, exc, duration(delay))
            sleep(delay)
            delay = min(delay * 2, 16 * poll_seconds)


def read_logs(backend: JobBackend, name: str, cursor: Any) -> tuple[list[str], Any]:
    """New log lines, each as a terminal would leave it (see `as_displayed`); none this time when the log service
    has a transient fault."""
    try:
        lines, cursor = backend.logs(name, cursor)
        return [as_displayed(line) for line in lines], cursor
    except Exception as exc:
        if not is_transient(exc):
            raise
        log.warning("logs of %s: %s; will retry", name, exc)
        return [], cursor


def as_displayed(line: str) -> str:
    """A log line as a terminal shows it: a progress bar (tqdm's, which a library may force on even in a job whose
    output is a file) redraws itself after each carriage return, so only its last state is kept."""
    if "\r" not in line:
        return line
    drawn = [part for part in line.split("\r") if part.strip()]
    return drawn[-1].rstrip() if drawn else ""


def announce_resumed(record: Attempt, state: JobState | None) -> None:
    """Say what became of an unfinished attempt found in the ledger: its job is re-attached to, or, when the
    job was never created (the last supervisor stopped before its submission went through), submitted now."""
    if state is None:
        log.info("attempt %d (%s): recorded but never created; submitting it", record.attempt, record.job_name)
    else:
        log.info("re-attaching to attempt %d (%s, %s)", record.attempt, record.job_name, state.status.value)
