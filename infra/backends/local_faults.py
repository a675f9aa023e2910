"""Fault injection for the local backend's tests: the `BackendHooks` HLAT_BACKEND_HOOKS=hlat.infra.backends.local_faults
installs. No production module imports it (tests/unit/test_layers.py).

HLAT_LOCAL_FAULTS in the submitting process maps attempt numbers to faults, e.g. `{"1": {"kill_at_step": 8}}`. It is
read at submit, kept in job.json, and kept out of the job's environment:
- `{"kill_at_step": N}`: SIGKILL the training processes once step N or later is logged.
- `{"hang_at_step": N}`: SIGSTOP them instead; the job stays InProgress until stopped.
- `{"fail": "<reason>", "after_s": S}`: launch nothing; after S seconds end Failed with that reason.
- `{"complete": true, "after_s": S}`: launch nothing; end Completed without outputs, like a broken image.
- `{"sdk_entrypoint": true}` (emulated hosts): run the SDK's command without our init (infra/backends/job_init.py).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from hlat.infra.backends.local_daemon import POLL_S, BackendHooks, JobDaemon, signal_job
from hlat.infra.backends.protocol import Status

FAULTS_ENV = "HLAT_LOCAL_FAULTS"
FAULT_KEYS = {"kill_at_step", "hang_at_step", "fail", "complete", "after_s", "sdk_entrypoint"}


def faults_for_attempt(attempt: int) -> dict[str, Any]:
    """This attempt's entry of HLAT_LOCAL_FAULTS ({} if none); a malformed variable is a test-setup mistake."""
    raw = os.environ.get(FAULTS_ENV, "").strip()
    if not raw:
        return {}
    example = '\'{"1": {"kill_at_step": 8}}\''
    try:
        table = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{FAULTS_ENV} is not JSON ({exc}): set it like {example}") from exc
    if not isinstance(table, dict):
        raise ValueError(f"{FAULTS_ENV} must be an object keyed by attempt number, like {example}")
    fault = table.get(str(attempt)) or {}
    if not isinstance(fault, dict) or set(fault) - FAULT_KEYS:
        raise ValueError(f"{FAULTS_ENV} attempt {attempt}: {fault!r}: expected an object with keys {FAULT_KEYS}")
    return fault


class LocalFaults(BackendHooks):
    """The local backend's hook points, with the faults of HLAT_LOCAL_FAULTS."""

    def __init__(self) -> None:
        self.fired: set[str] = set()
        """The job folders whose step fault has fired (once per job)."""

    def job_record(self, attempt: int) -> dict[str, Any]:
        return faults_for_attempt(attempt)

    def emulated_request(self, request: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
        if record.get("sdk_entrypoint"):  # the SDK's container command alone, without our init in front of it
            from hlat.infra.backends.sagemaker_source import JOB_INIT

            algorithm = request["AlgorithmSpecification"]
            algorithm["ContainerEntrypoint"] = algorithm["ContainerEntrypoint"][len(JOB_INIT) :]
        return request

    def container_environment(self, env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k != FAULTS_ENV}

    def before_launch(self, daemon: JobDaemon) -> dict[str, Any] | None:
        faults = daemon.hook_record
        if "fail" not in faults and not faults.get("complete"):
            return None
        outcome = f"failing: {faults['fail']}" if "fail" in faults else "completing without running"
        daemon.say(f"fault: {outcome}, before launch, in {faults.get('after_s', 0)}s")
        deadline = time.monotonic() + float(faults.get("after_s", 0))
        while time.monotonic() < deadline and not daemon.stop_requested():
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        if daemon.stop_reason:
            return daemon.ending(Status.STOPPED, None, daemon.stop_reason, None)
        if "fail" in faults:
            return daemon.ending(Status.FAILED, str(faults["fail"]), "Failed", None)
        return daemon.ending(Status.COMPLETED, None, "Completed", 0)

    def step_logged(self, daemon: JobDaemon, step: int) -> None:
        if daemon.job_dir in self.fired:
            return
        for key, sig in (("kill_at_step", signal.SIGKILL), ("hang_at_step", signal.SIGSTOP)):
            if key in daemon.hook_record and step >= int(daemon.hook_record[key]):
                self.fired.add(daemon.job_dir)
                daemon.say(f"fault: {sig.name} to the training processes at step {step}")
                signal_job(daemon.job_dir, sig)
                return


def hooks() -> BackendHooks:
    """The hooks HLAT_BACKEND_HOOKS=hlat.infra.backends.local_faults installs (infra/backends/local_daemon.py)."""
    return LocalFaults()
