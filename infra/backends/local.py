"""The local job backend: a training job as detached processes on this machine, under SageMaker's contract.

The train stage's supervision runs against it for real, without AWS: kills, timeouts, capacity, lost hosts,
re-attaching. This module is the client: submit, describe, stop, logs. Each job's daemon
(`infra.backends.local_daemon`) plays
SageMaker's side. A job ended once status.json exists and its daemon has exited; a daemon gone without it is a crashed
host (Failed, InternalServerError). Each job lives in `<jobs_dir>/<job name>/`:

    job.json          spec, hook record, stop grace, created; an emulated job's CreateTrainingJob request
    daemon.json       the daemon's pid, /proc start time and wall-clock start
    phase.json        the running job's secondary status
    stop              a stop request (also sent as SIGTERM to the daemon)
    status.json       the final state, written last
    output.log        the daemon's messages and the job's output
    opt/ml/...        the container's /opt/ml; an emulated host's is hosts/algo-N/opt/ml (hosts.json: bytes received)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from hlat.core.config import JobConfig
from hlat.core.layout import JOB_LOG_FILE
from hlat.infra.backends.local_daemon import (
    PROJECT_ROOT,
    backend_hooks,
    kill_job,
    process_start,
    read_json,
    single_host_environment,
    training_command,
    write_json,
)
from hlat.infra.backends.protocol import JobSpec, JobState, Status, SubmitError

__all__ = ["PROJECT_ROOT", "LocalBackend"]

_LOG_CHUNK = 4 << 20  # bytes read by one logs() call
START_TIMEOUT_S = 60.0
"""A job folder with no daemon this long after submit is a submitter that died mid-submit."""
DAEMON_DIED = "InternalServerError: the job's daemon process died"
"""A crashed host's failure reason; it is billed up to its last logged line."""

_JOB_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")
_STOPPING = ("Stopping", "MaxRuntimeExceeded")  # the secondary statuses of a job being stopped
_CHILDREN: dict[str, subprocess.Popen[bytes]] = {}
"""Daemons started by this process, by job folder, until a describe() reaps them.

Module-wide, since a backend may be dropped while its job runs, and a collected Popen warns."""


def _alive(daemon: dict[str, Any]) -> bool:
    return daemon["process_start"] is not None and process_start(daemon["pid"]) == daemon["process_start"]


class LocalBackend:
    """Jobs as detached daemon processes, one folder each under `jobs_dir`."""

    kind = "local"

    def __init__(self, jobs_dir: str, stop_grace_seconds: float = 30.0, job: JobConfig | None = None) -> None:
        self.jobs_dir = os.path.abspath(os.path.expanduser(jobs_dir))
        self.stop_grace_seconds = stop_grace_seconds
        self.job = job or JobConfig()
        """The run's job settings, from which an emulated job's CreateTrainingJob request is built."""

    def job_dir(self, name: str) -> str:
        return os.path.join(self.jobs_dir, name)

    def submit(self, spec: JobSpec) -> None:
        if not _JOB_NAME.fullmatch(spec.name):
            raise SubmitError("ValidationException", f"job name {spec.name!r} must match {_JOB_NAME.pattern}")
        hook_record = backend_hooks().job_record(spec.attempt)
        request = self._emulated_request(spec, hook_record) if spec.instance_count > 1 else None
        job_dir = self.job_dir(spec.name)
        os.makedirs(self.jobs_dir, exist_ok=True)
        try:
            os.mkdir(job_dir)  # atomic: of two concurrent submits of one name, exactly one gets the folder
        except FileExistsError:
            raise SubmitError("ResourceInUse", f"a job named {spec.name} already exists ({job_dir})") from None
        record = {
            "spec": asdict(spec),
            "request": request,
            "hooks": hook_record,
            "stop_grace_seconds": self.stop_grace_seconds,
            "created": time.time(),
        }
        write_json(os.path.join(job_dir, "job.json"), record)
        started = time.time()
        with open(os.path.join(job_dir, JOB_LOG_FILE), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hlat.infra.backends.local_daemon", job_dir],
                cwd=PROJECT_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # not in our process group or session: it must outlive us
            )
        _CHILDREN[job_dir] = proc
        daemon = {"pid": proc.pid, "process_start": process_start(proc.pid), "started": started}
        write_json(os.path.join(job_dir, "daemon.json"), daemon)

    def _emulated_request(self, spec: JobSpec, hook_record: dict[str, Any], upload: bool = True) -> dict[str, Any]:
        """The request a job of several instances runs from on the emulator (`infra.backends.emulator`)."""
        from hlat.infra.backends import emulator

        if problem := emulator.namespaces_available():
            raise SubmitError(
                "ValidationException",
                f"job.instance_count={spec.instance_count}: the local backend runs several instances as emulated "
                f"SageMaker hosts, and {problem}; or set job.instance_count=1",
            )
        request = emulator.build_request(spec, self.job, upload=upload)
        return backend_hooks().emulated_request(request, hook_record)

    def describe(self, name: str) -> JobState | None:
        # The clock is read before looking for the job's end: a running job is billed up to a moment before its
        # status.json appeared, never past the final bill (`_final_state`), so the bill never falls between reads.
        now = time.time()
        job_dir = self.job_dir(name)
        if not os.path.isdir(job_dir):
            return None
        record = read_json(os.path.join(job_dir, "job.json"))
        count = int(record["spec"]["instance_count"]) if record else 1
        if job_dir in _CHILDREN and _CHILDREN[job_dir].poll() is not None:
            del _CHILDREN[job_dir]  # reaped: no zombie left in this process
        daemon = read_json(os.path.join(job_dir, "daemon.json"))
        # Ended once the daemon has exited too: a job reported over leaves no process of its own behind.
        if (ended := self._final_state(name, count)) and not (daemon and _alive(daemon)):
            return ended
        if daemon is None:
            if record is None or time.time() - record["created"] < START_TIMEOUT_S:
                return JobState(name, Status.IN_PROGRESS, secondary_status="Starting", instance_count=count)
            return JobState(
                name, Status.FAILED, "InternalServerError: the job's daemon never started", "Failed",
                instance_count=count,
            )  # fmt: skip
        # Billed up to now, or up to the end the job recorded while its daemon exits: never past the final bill.
        billed = ended.billable_seconds if ended else max(0.0, now - daemon["started"])
        if _alive(daemon):
            phase = (read_json(os.path.join(job_dir, "phase.json")) or {}).get("secondary_status", "Starting")
            if phase not in _STOPPING and os.path.exists(os.path.join(job_dir, "stop")):
                phase = "Stopping"
            status = Status.STOPPING if phase in _STOPPING else Status.IN_PROGRESS
            return JobState(name, status, None, phase, billed, count)
        if ended := self._final_state(name, count):  # it finished between our two looks
            return ended
        # A dead host takes its processes with it; here they would train on beside the next attempt.
        kill_job(job_dir)
        # The host "crashed": bill up to its last sign of life, the last line it logged.
        with contextlib.suppress(OSError):
            billed = max(0.0, os.path.getmtime(os.path.join(job_dir, JOB_LOG_FILE)) - daemon["started"])
        reason = DAEMON_DIED
        return JobState(name, Status.FAILED, reason, "Failed", billed, count)

    def _final_state(self, name: str, instance_count: int) -> JobState | None:
        final = read_json(os.path.join(self.job_dir(name), "status.json"))
        if final is None:
            return None
        # Billed from the launch to status.json's mtime: an earlier describe read its clock before the file existed,
        # so the bill never shrinks at the end.
        path = os.path.join(self.job_dir(name), "status.json")
        daemon = read_json(os.path.join(self.job_dir(name), "daemon.json")) or {}
        started = min(final["started"], daemon.get("started", final["started"]))
        with contextlib.suppress(OSError):
            final["ended"] = max(final["ended"], os.path.getmtime(path))
        return JobState(
            name=name,
            status=Status(final["status"]),
            failure_reason=final["failure_reason"],
            secondary_status=final["secondary_status"],
            billable_seconds=max(0.0, final["ended"] - started),
            instance_count=instance_count,
            ended_at=final["ended"],
        )

    def stop(self, name: str) -> None:
        job_dir = self.job_dir(name)
        if not os.path.isdir(job_dir) or os.path.exists(os.path.join(job_dir, "status.json")):
            return
        # The file reaches a daemon that is still starting (before its SIGTERM handler is installed).
        write_json(os.path.join(job_dir, "stop"), {"requested": time.time()})
        daemon = read_json(os.path.join(job_dir, "daemon.json"))
        # Before it writes phase.json the daemon may not handle SIGTERM yet (it would die of it): the file
        # is enough then.
        if daemon and _alive(daemon) and os.path.exists(os.path.join(job_dir, "phase.json")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(daemon["pid"], signal.SIGTERM)

    def logs(self, name: str, cursor: Any = None) -> tuple[list[str], Any]:
        """Complete lines of output.log after byte offset `cursor`; a line still being written waits."""
        offset = int(cursor or 0)
        try:
            with open(os.path.join(self.job_dir(name), JOB_LOG_FILE), "rb") as fh:
                fh.seek(offset)
                data = fh.read(_LOG_CHUNK)
        except FileNotFoundError:
            return [], offset
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) == _LOG_CHUNK:  # one enormous line: hand it over rather than stall
            end = len(data)
        if end == 0:
            return [], offset
        return data[:end].rstrip(b"\n").decode("utf-8", "replace").split("\n"), offset + end

    def dry_run(self, spec: JobSpec) -> list[dict[str, Any]]:
        job_dir = self.job_dir(spec.name)
        if spec.instance_count > 1:
            request = self._emulated_request(spec, {}, upload=False)
            return [
                {"backend": self.kind, "job_dir": job_dir, "emulated_hosts": spec.instance_count, "request": request}
            ]
        return [
            {
                "backend": self.kind,
                "job_dir": job_dir,
                "command": training_command(spec),
                "environment": single_host_environment(spec, job_dir),
            }
        ]
