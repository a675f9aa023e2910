"""The local job daemon: one job's platform, SageMaker's part played on this machine.

`python -m hlat.infra.job_daemon <job dir>`, started by `infra.local_jobs.LocalBackend.submit` in a session of its own
(so it outlives whoever submitted it), is the job's `JobDaemon`: it mounts the input channels (a symlink to the
run's data/ and tokenizer/ when the run is local, a download when it is on S3), copies the run's checkpoint prefix
into opt/ml/checkpoints and mirrors that folder back every second (CheckpointConfig), runs the job's program
(`spec.entry`; under torchrun for several processes per node) with the SM_* variables, enforces stop requests and
max runtime (SIGTERM, then SIGKILL after the grace period; max runtime counts from the daemon's start, downloads
included), turns the exit into SageMaker's final status and FailureReason, and writes status.json last.

Every process of the job carries HLAT_LOCAL_JOB_DIR=<job dir> in its environment: torchrun starts each rank in a
session of its own, so neither the process group nor the parent chain finds them all, and the environment also
survives pid reuse and the death of the launcher (`job_processes`, `kill_job`). The folder's files are described in
`infra.local_jobs`, the backend that reads them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import posixpath
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from hlat.core.contract import EXIT_NAN
from hlat.core.contract import MAX_FAILURE_REASON as MAX_REASON
from hlat.core.layout import CHECKPOINT_MARKER
from hlat.core.storage import Storage
from hlat.infra.jobs import JobSpec, Status

FAULTS_ENV = "HLAT_LOCAL_FAULTS"
"""Faults for tests, read by the submitting process (see infra.local_jobs); kept out of the job's environment."""
JOB_DIR_ENV = "HLAT_LOCAL_JOB_DIR"
PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The folder holding training/: the training processes' working directory."""

POLL_S = 0.25
SYNC_EVERY_S = 1.0
_PROGRESS = re.compile(rb"\bstep (\d+) loss")
_TEMP_FILE = re.compile(r"\.tmp-[0-9a-f]{8}$")  # Storage.write_bytes's file before its rename
_SIGNALS = {int(sig) for sig in signal.Signals}


def write_json(path: str, obj: Any) -> None:
    """Replace a file atomically, so a describe() in another process never reads half of it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
    os.replace(tmp, path)


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None


def _tensorboard_dir(spec: JobSpec, ml: str) -> str:
    run = Storage(spec.run_uri)
    return run.path("tensorboard") if run.is_local else f"{ml}/output/tensorboard"


def job_environment(spec: JobSpec, job_dir: str) -> dict[str, str]:
    """What the job's processes get on top of the daemon's environment: the container contract."""
    ml = os.path.join(job_dir, "opt", "ml")
    env = {
        **spec.environment,
        "SM_MODEL_DIR": f"{ml}/model",
        "SM_OUTPUT_DIR": f"{ml}/output",
        "SM_OUTPUT_DATA_DIR": f"{ml}/output/data",
        # SageMaker uploads /opt/ml/output/tensorboard to the run's tensorboard/ (TensorBoardOutputConfig); a
        # local run gets the events there directly, an S3 run keeps them in the job folder.
        "SM_TENSORBOARD_DIR": _tensorboard_dir(spec, ml),
        "SM_CHANNEL_DATA": f"{ml}/input/data/data",
        "SM_CHANNEL_TOKENIZER": f"{ml}/input/data/tokenizer",
        "SM_CHECKPOINT_DIR": f"{ml}/checkpoints",
        "SM_HOSTS": '["algo-1"]',
        "SM_CURRENT_HOST": "algo-1",
        "SM_HOST_COUNT": "1",
        "SM_CURRENT_INSTANCE_TYPE": spec.instance_type,
        "TRAINING_JOB_NAME": spec.name,
        "HLAT_FAILURE_FILE": f"{ml}/output/failure",
        JOB_DIR_ENV: job_dir,
        "PYTHONUNBUFFERED": "1",  # progress lines as they happen, not when a buffer fills
    }
    if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.processes_per_node))
    return env


def training_command(spec: JobSpec) -> list[str]:
    python = spec.python or sys.executable
    entry = ["-m", spec.entry, *spec.arguments()]
    if spec.processes_per_node == 1:
        return [python, *entry]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec.processes_per_node}"]
    return [python, *launcher, *entry]


def job_processes(job_dir: str) -> list[int]:
    """Pids of the job's live training processes (all ranks, orphaned or not), found by their environment."""
    marker = f"{JOB_DIR_ENV}={job_dir}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if marker in fh.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return found


def signal_job(job_dir: str, sig: signal.Signals) -> list[int]:
    """Signal every training process of the job; scan again until no new one appears (a launcher may be
    starting ranks while we signal)."""
    done: set[int] = set()
    while new := [pid for pid in job_processes(job_dir) if pid not in done]:
        for pid in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        done.update(new)
    return sorted(done)


def kill_job(job_dir: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every training process of the job and wait until they are gone (the kill is asynchronous)."""
    killed = signal_job(job_dir, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while killed and job_processes(job_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def process_start(pid: int) -> int | None:
    """When a live (not zombie) process started, in clock ticks since boot: with the pid, an identity that a
    reused pid does not share. (Its command line is no such proof: it reads empty while the process execs.)"""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 (state) onwards
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])  # field 22: starttime


def failure_reason(exit_code: int, failure_file_text: str | None, last_lines: list[str]) -> str:
    """SageMaker's FailureReason for a failed training exit. The failure file comes first: torchrun exits 1
    whatever code a rank exited with, so the file is what keeps, say, a NaN loss recognisable."""
    signum = -exit_code if exit_code < 0 else exit_code - 128  # killed: -signal from Popen, 128+signal from a shell
    if failure_file_text and failure_file_text.strip():
        reason = f"AlgorithmError: {failure_file_text.strip()}"
    elif exit_code == EXIT_NAN:
        reason = f"AlgorithmError: NonFiniteLoss: the training exited on a non-finite loss (exit code {EXIT_NAN})"
    elif signum in _SIGNALS:
        name = signal.Signals(signum).name
        reason = f"AlgorithmError: training process killed by signal {name} (exit code {128 + signum})"
    else:
        reason = "\n".join([f"AlgorithmError: ExecuteUserScriptError: exit code {exit_code}", *last_lines])
    return reason[:MAX_REASON]


class CheckpointMirror:
    """SageMaker's CheckpointConfig: the local checkpoint folder starts as a copy of the URI and is mirrored back
    to it. Within a pass commit markers are uploaded last and deleted first, and a folder about to receive new
    files loses its remote marker first, so a reader of the URI never takes a half-synced checkpoint as whole."""

    def __init__(self, local_dir: str, remote: Storage) -> None:
        self.local_dir = local_dir
        self.remote = remote
        self.synced: dict[str, tuple[int, int]] = {}
        """(size, mtime_ns) of each local file when last copied to or from the URI, by relative path."""

    def download(self) -> int:
        os.makedirs(self.local_dir, exist_ok=True)
        files = self.remote.walk_files()
        for rel in files:
            target = os.path.join(self.local_dir, rel)
            self.remote.get_file(rel, target)
            self.synced[rel] = self._signature(target)
        return len(files)

    @staticmethod
    def _signature(path: str) -> tuple[int, int]:
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns

    def _local_files(self) -> dict[str, tuple[int, int]]:
        files = {}
        for root, _, names in os.walk(self.local_dir):
            for name in names:
                path = os.path.join(root, name)
                if _TEMP_FILE.search(name):
                    continue
                with contextlib.suppress(FileNotFoundError):  # deleted since the listing
                    files[os.path.relpath(path, self.local_dir).replace(os.sep, "/")] = self._signature(path)
        return files

    def sync(self) -> None:
        local = self._local_files()
        changed = {rel for rel, sig in local.items() if self.synced.get(rel) != sig}
        for folder in {posixpath.dirname(rel) for rel in changed if posixpath.basename(rel) != CHECKPOINT_MARKER}:
            marker = posixpath.join(folder, CHECKPOINT_MARKER)
            if marker in self.synced:
                self.remote.remove(marker)
                del self.synced[marker]
                if marker in local:
                    changed.add(marker)
        for rel in sorted(changed, key=lambda r: (posixpath.basename(r) == CHECKPOINT_MARKER, r)):
            try:
                self.remote.put_file(os.path.join(self.local_dir, rel), rel)
            except FileNotFoundError:  # deleted locally meanwhile: the next pass removes it remotely
                continue
            self.synced[rel] = local[rel]
        gone = sorted(
            (rel for rel in self.synced if rel not in local),
            key=lambda r: (posixpath.basename(r) != CHECKPOINT_MARKER, r),
        )
        for rel in gone:
            self.remote.remove(rel)
            del self.synced[rel]
        # A local URI keeps emptied folders, which would still look like (incomplete) checkpoints.
        for folder in {posixpath.dirname(rel) for rel in gone} - {""}:
            if not os.path.isdir(os.path.join(self.local_dir, folder)) and not self.remote.walk_files(folder):
                self.remote.remove(folder, recursive=True)


class JobDaemon:
    """The platform side of one job, run in its own process: see the module docstring."""

    def __init__(self, job_dir: str, stop_signalled: threading.Event) -> None:
        self.job_dir = job_dir
        record = read_json(os.path.join(job_dir, "job.json"))
        self.spec = JobSpec(**record["spec"])
        self.faults: dict[str, Any] = record["faults"] or {}
        self.grace = float(record["stop_grace_seconds"])
        self.stop_signalled = stop_signalled
        self.started = time.time()
        self.stop_reason: str | None = None
        """Why we are stopping the job: 'Stopped' (requested) or 'MaxRuntimeExceeded'."""
        self.last_lines: deque[str] = deque(maxlen=5)
        self.fault_fired = False
        self._out = threading.Lock()

    def say(self, message: str) -> None:
        self._emit(f"[local-jobs {time.strftime('%H:%M:%S')}] {message}\n".encode())

    def _emit(self, line: bytes) -> None:
        with self._out:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()

    def _ml(self, *parts: str) -> str:
        return os.path.join(self.job_dir, "opt", "ml", *parts)

    def _phase(self, secondary_status: str) -> None:
        write_json(os.path.join(self.job_dir, "phase.json"), {"secondary_status": secondary_status})

    def _stop_requested(self) -> bool:
        if self.stop_reason is None:
            if self.stop_signalled.is_set() or os.path.exists(os.path.join(self.job_dir, "stop")):
                self.stop_reason = "Stopped"
            elif time.time() - self.started >= self.spec.max_runtime_s:
                self.stop_reason = "MaxRuntimeExceeded"
        return self.stop_reason is not None

    def ending(self, status: Status, reason: str | None, secondary: str, exit_code: int | None) -> dict[str, Any]:
        return {
            "status": status.value,
            "failure_reason": reason,
            "secondary_status": secondary,
            "exit_code": exit_code,
            "started": self.started,
            "ended": time.time(),
        }

    def run(self) -> dict[str, Any]:
        self._phase("Starting")
        if self.spec.instance_count > 1:
            self.say(f"instance_count={self.spec.instance_count}: the local backend runs one instance (algo-1)")
        if "fail" in self.faults or self.faults.get("complete"):
            outcome = f"failing: {self.faults['fail']}" if "fail" in self.faults else "completing without running"
            self.say(f"fault: {outcome}, before launch, in {self.faults.get('after_s', 0)}s")
            deadline = time.monotonic() + float(self.faults.get("after_s", 0))
            while time.monotonic() < deadline and not self._stop_requested():
                time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
            if self.stop_reason:
                return self.ending(Status.STOPPED, None, self.stop_reason, None)
            if "fail" in self.faults:
                return self.ending(Status.FAILED, str(self.faults["fail"]), "Failed", None)
            return self.ending(Status.COMPLETED, None, "Completed", 0)

        self._phase("Downloading")
        for folder in ("model", "output/data", "input/data"):
            os.makedirs(self._ml(folder), exist_ok=True)
        run = Storage(self.spec.run_uri)
        for channel in self.spec.channels:
            if run.is_local:
                os.symlink(run.path(channel), self._ml("input", "data", channel))
            else:  # SageMaker's File mode
                source = run.child(channel)
                for rel in source.walk_files():
                    source.get_file(rel, self._ml("input", "data", channel, rel))
        mirror = CheckpointMirror(self._ml("checkpoints"), run.child(self.spec.checkpoint_prefix))
        self.say(f"copied {mirror.download()} checkpoint file(s) from {mirror.remote.url}")
        if self._stop_requested():
            return self.ending(Status.STOPPED, None, self.stop_reason or "Stopped", None)

        command = training_command(self.spec)
        env = {k: v for k, v in os.environ.items() if k != FAULTS_ENV}
        env.update(job_environment(self.spec, self.job_dir))
        self.say("launching: " + " ".join(command))
        proc = subprocess.Popen(
            command, cwd=PROJECT_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._phase("Training")
        assert proc.stdout is not None
        reader = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        reader.start()
        synced = threading.Event()
        syncer = threading.Thread(target=self._mirror_until, args=(mirror, synced), daemon=True)
        syncer.start()

        exit_code = self._supervise(proc)
        # Ranks orphaned by a dead launcher would run on and keep the output pipe open: the container is over.
        if leftovers := kill_job(self.job_dir):
            self.say(f"killed {len(leftovers)} leftover training process(es): {leftovers}")
        reader.join(timeout=10)
        if not self.stop_reason:
            self._phase("Uploading")
        synced.set()
        syncer.join()
        upload_error = self._final_sync(mirror)

        if self.stop_reason:
            return self.ending(Status.STOPPED, None, self.stop_reason, exit_code)
        if exit_code == 0:
            if upload_error:
                reason = f"InternalServerError: uploading checkpoints to {mirror.remote.url} failed: {upload_error}"
                return self.ending(Status.FAILED, reason, "Failed", exit_code)
            return self.ending(Status.COMPLETED, None, "Completed", exit_code)
        try:
            with open(self._ml("output", "failure"), encoding="utf-8", errors="replace") as fh:
                failure_text: str | None = fh.read()
        except FileNotFoundError:
            failure_text = None
        reason = failure_reason(exit_code, failure_text, list(self.last_lines))
        return self.ending(Status.FAILED, reason, "Failed", exit_code)

    def _supervise(self, proc: subprocess.Popen[bytes]) -> int:
        """Wait for the training to exit, stopping it on request or at max runtime: SIGTERM, then SIGKILL."""
        term_sent: float | None = None
        killed = False
        while proc.poll() is None:
            if term_sent is None and self._stop_requested():
                self.say(f"{self.stop_reason}: SIGTERM to the training processes (SIGKILL in {self.grace:g}s)")
                self._phase("MaxRuntimeExceeded" if self.stop_reason == "MaxRuntimeExceeded" else "Stopping")
                signal_job(self.job_dir, signal.SIGCONT)  # a hung (stopped) process cannot handle SIGTERM
                signal_job(self.job_dir, signal.SIGTERM)
                term_sent = time.monotonic()
            elif term_sent is not None and not killed and time.monotonic() - term_sent >= self.grace:
                self.say(f"still running {self.grace:g}s after SIGTERM: SIGKILL")
                signal_job(self.job_dir, signal.SIGKILL)
                killed = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=POLL_S)
        return proc.returncode

    def _pump(self, stream: IO[bytes]) -> None:
        """Copy the training output to output.log line by line, watching progress for the injected faults."""
        for line in stream:
            self._emit(line if line.endswith(b"\n") else line + b"\n")
            self.last_lines.append(line.decode("utf-8", "replace").rstrip("\n"))
            if (match := _PROGRESS.search(line)) and not self.fault_fired:
                self._inject(int(match.group(1)))

    def _inject(self, step: int) -> None:
        for key, sig in (("kill_at_step", signal.SIGKILL), ("hang_at_step", signal.SIGSTOP)):
            if key in self.faults and step >= int(self.faults[key]):
                self.fault_fired = True
                self.say(f"fault: {sig.name} to the training processes at step {step}")
                signal_job(self.job_dir, sig)
                return

    def _mirror_until(self, mirror: CheckpointMirror, done: threading.Event) -> None:
        while not done.wait(SYNC_EVERY_S):
            self._try(mirror.sync, "checkpoint sync failed (retrying in 1 s)")

    def _final_sync(self, mirror: CheckpointMirror) -> str | None:
        error: str | None = None
        for _ in range(3):
            if (error := self._try(mirror.sync, "final checkpoint sync failed")) is None:
                return None
            time.sleep(SYNC_EVERY_S)
        return error

    def _try(self, action: Callable[[], None], what: str) -> str | None:
        try:
            action()
        except Exception as exc:
            self.say(f"{what}: {type(exc).__name__}: {exc}")
            return f"{type(exc).__name__}: {exc}"
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlat.infra.job_daemon", description="Run one local job.")
    parser.add_argument("job_dir", help="the job's folder, holding job.json")
    job_dir = os.path.abspath(parser.parse_args(argv).job_dir)
    stop_signalled = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_signalled.set())
    daemon = JobDaemon(job_dir, stop_signalled)
    try:
        ending = daemon.run()
    except BaseException as exc:
        kill_job(job_dir)
        reason = f"InternalServerError: the job's supervisor failed: {type(exc).__name__}: {exc}"[:MAX_REASON]
        daemon.say(reason)
        ending = daemon.ending(Status.FAILED, reason, "Failed", None)
    daemon.say(f"job ended: {ending['status']} {ending['failure_reason'] or ending['secondary_status']}")
    write_json(os.path.join(job_dir, "status.json"), ending)
    return 0


if __name__ == "__main__":
    sys.exit(main())
