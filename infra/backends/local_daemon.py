"""The local job daemon: one job's platform, SageMaker's part played on this machine.

`LocalBackend.submit` starts it in its own session. It runs one instance as local processes, several on emulated hosts.
It enforces stops and max runtime and writes status.json last. HLAT_LOCAL_JOB_DIR in every job process's environment
finds them all.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlat.core.contract import EXIT_LOSS_SPIKES, EXIT_NAN
from hlat.core.contract import MAX_FAILURE_REASON as MAX_REASON
from hlat.core.hooks import load_hooks
from hlat.core.layout import CHECKPOINT_MARKER
from hlat.core.storage import Storage
from hlat.infra.backends import emulator
from hlat.infra.backends.job_init import processes_with, rank_processes
from hlat.infra.backends.protocol import JobSpec, Status

HOOKS_ENV = "HLAT_BACKEND_HOOKS"
"""The module whose `hooks()` the local backend's processes use (unset: the no-op `BackendHooks`)."""
JOB_DIR_ENV = "HLAT_LOCAL_JOB_DIR"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The training processes' working directory."""

POLL_S = 0.25
SYNC_EVERY_S = 1.0
_PROGRESS = re.compile(rb"\bstep (\d+) loss")
_TEMP_FILE = re.compile(r"\.tmp-[0-9a-f]{8}$")  # Storage.write_bytes's file before its rename
_SIGNALS = {int(sig) for sig in signal.Signals}


def write_json(path: str, obj: Any) -> None:
    """Replace a file atomically, so a describe() elsewhere never reads half of it."""
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


def single_host_environment(spec: JobSpec, job_dir: str) -> dict[str, str]:
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
        "SM_HOSTS": '["algo-1"]',
        "SM_CURRENT_HOST": "algo-1",
        "SM_HOST_COUNT": "1",
        "SM_CURRENT_INSTANCE_TYPE": spec.instance_type,
        "TRAINING_JOB_NAME": spec.name,
        "HLAT_FAILURE_FILE": f"{ml}/output/failure",
        JOB_DIR_ENV: job_dir,
        "PYTHONUNBUFFERED": "1",  # progress lines as they happen, not when a buffer fills
    }
    if spec.checkpoint_prefix is not None:
        env["HLAT_CHECKPOINT_DIR"] = f"{ml}/checkpoints"  # the program writes where CheckpointConfig syncs
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
    """Pids of the job's live training processes, orphaned or not, found by their environment."""
    return processes_with(JOB_DIR_ENV, job_dir)


def signal_job(job_dir: str, sig: signal.Signals) -> list[int]:
    """Signal every training process of the job, rescanning until no new one appears."""
    done: set[int] = set()
    while new := [pid for pid in job_processes(job_dir) if pid not in done]:
        for pid in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        done.update(new)
    return sorted(done)


def kill_job(job_dir: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every training process of the job and wait until they are gone."""
    killed = signal_job(job_dir, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while killed and job_processes(job_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def process_start(pid: int) -> int | None:
    """When a live process started, in clock ticks since boot: with the pid, an identity a reused pid lacks.

    Its command line is no such proof: it reads empty while the process execs."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 (state) onwards
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])  # field 22: starttime


def failure_reason(exit_code: int, failure_file_text: str | None, last_lines: list[str]) -> str:
    """SageMaker's FailureReason for a failed training exit, from the failure file first.

    torchrun exits 1 whatever a rank exited with, so only the file keeps, say, a NaN loss recognisable."""
    signum = -exit_code if exit_code < 0 else exit_code - 128  # killed: -signal from Popen, 128+signal from a shell
    if failure_file_text and failure_file_text.strip():
        reason = f"AlgorithmError: {failure_file_text.strip()}"
    elif exit_code == EXIT_NAN:
        reason = f"AlgorithmError: NonFiniteLoss: the training exited on a non-finite loss (exit code {EXIT_NAN})"
    elif exit_code == EXIT_LOSS_SPIKES:
        reason = (
            "AlgorithmError: LossSpikes: the training exited on training.spike_max_consecutive loss spikes in a row "
            f"(exit code {EXIT_LOSS_SPIKES})"
        )
    elif signum in _SIGNALS:
        name = signal.Signals(signum).name
        reason = f"AlgorithmError: training process killed by signal {name} (exit code {128 + signum})"
    else:
        reason = "\n".join([f"AlgorithmError: ExecuteUserScriptError: exit code {exit_code}", *last_lines])
    return reason[:MAX_REASON]


class CheckpointMirror:
    """SageMaker's CheckpointConfig: the local folder starts as a copy of the URI and is mirrored back.

    Commit markers go up last and are deleted first, so a reader of the URI never takes a half-synced checkpoint."""

    def __init__(self, local_dir: str, remote: Storage) -> None:
        self.local_dir = local_dir
        self.remote = remote
        self.synced: dict[str, tuple[int, int]] = {}
        """(size, mtime_ns) of each local file when last synced with the URI, by relative path."""

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


@dataclass
class ContainerProcess:
    """One running container: the whole job on the one-instance path, else one emulated host."""

    name: str
    proc: subprocess.Popen[bytes]
    ml: str
    mirror: CheckpointMirror | None
    emulated: bool
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=5))
    exited_at: float | None = None
    signalled: set[int] = field(default_factory=set)
    """Ranks a stop's SIGTERM was sent to (the one-instance path)."""
    pid_signalled: bool = False
    """Whether the stop went to the program itself, or to every process before any rank existed."""

    def init_pid(self) -> int | None:
        """Its PID 1 (root namespace pid): what SageMaker signals."""
        return emulator.init_pid(self.proc.pid) if self.emulated else self.proc.pid

    def failure_text(self) -> str | None:
        try:
            with open(os.path.join(self.ml, "output", "failure"), encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except FileNotFoundError:
            return None


Launch = tuple[str, list[str], dict[str, str], str, CheckpointMirror | None]
"""An instance about to start: name, command, environment, /opt/ml and checkpoint mirror."""

HOST_FAILURE_WAIT_S = 5.0
"""Seconds the other instances get to end by themselves after one fails, before they are killed."""


class BackendHooks:
    """The local backend's hook points, each a no-op; a test's subclass overrides what it needs.

    Named for what they change, not for any fault."""

    def job_record(self, attempt: int) -> dict[str, Any]:
        """At submit, in the submitter: what this attempt's job carries to its daemon (job.json's "hooks")."""
        return {}

    def emulated_request(self, request: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
        """The CreateTrainingJob request an emulated multi-host job runs from, given its `record`."""
        return request

    def container_environment(self, env: dict[str, str]) -> dict[str, str]:
        return env

    def before_launch(self, daemon: JobDaemon) -> dict[str, Any] | None:
        """In the daemon before launch: the job's ending (`JobDaemon.ending`) instead of launching it, or None."""
        return None

    def step_logged(self, daemon: JobDaemon, step: int) -> None:
        """In the daemon, on each `step <n> loss` line the job's processes log."""


@functools.cache
def backend_hooks() -> BackendHooks:
    """This process's backend hooks: the no-op defaults, or those HLAT_BACKEND_HOOKS names (read once)."""
    return load_hooks(HOOKS_ENV, BackendHooks)


class JobDaemon:
    def __init__(self, job_dir: str, stop_signalled: threading.Event) -> None:
        self.job_dir = job_dir
        record = read_json(os.path.join(job_dir, "job.json"))
        self.spec = JobSpec(**record["spec"])
        self.request: dict[str, Any] | None = record.get("request")
        """An emulated multi-host job's request (None: the one-instance path)."""
        self.hook_record: dict[str, Any] = record.get("hooks") or {}
        self.grace = float(record["stop_grace_seconds"])
        self.stop_signalled = stop_signalled
        self.started = time.time()
        self.stop_reason: str | None = None
        """Why we are stopping the job: 'Stopped' (requested) or 'MaxRuntimeExceeded'."""
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

    def stop_requested(self) -> bool:
        """Whether the job is to stop (requested or past max runtime); `stop_reason` says which."""
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
        }

    def run(self) -> dict[str, Any]:
        self._phase("Starting")
        if (ended := backend_hooks().before_launch(self)) is not None:
            return ended

        self._phase("Downloading")
        if self.request is not None and not emulator.master_port_free():
            reason = (
                f"CapacityError: port {emulator.MASTER_PORT} (SageMaker's master port) is in use on this "
                "machine: the local backend runs one multi-host job at a time"
            )
            return self.ending(Status.FAILED, reason, "Failed", None)
        launches = self._prepare_hosts(self.request) if self.request is not None else [self._prepare_process()]
        if self.stop_requested():
            return self.ending(Status.STOPPED, None, self.stop_reason or "Stopped", None)

        instances = []
        for name, command, env, ml, mirror in launches:
            self.say(f"{name}: launching: " + " ".join(command))
            proc = subprocess.Popen(
                command, cwd=PROJECT_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            instances.append(ContainerProcess(name, proc, ml, mirror, emulated=self.request is not None))
        self._phase("Training")
        readers = [threading.Thread(target=self._pump, args=(i,), daemon=True) for i in instances]
        for reader in readers:
            reader.start()
        synced = threading.Event()
        mirrors = [i.mirror for i in instances if i.mirror is not None]
        syncers = [threading.Thread(target=self._mirror_until, args=(m, synced), daemon=True) for m in mirrors]
        for syncer in syncers:
            syncer.start()

        failed = self._supervise(instances)
        # Ranks orphaned by a dead launcher would run on and keep the output pipe open: the container is over.
        if leftovers := kill_job(self.job_dir):
            self.say(f"killed {len(leftovers)} leftover training process(es): {leftovers}")
        for reader in readers:
            reader.join(timeout=10)
        if not self.stop_reason:
            self._phase("Uploading")
        synced.set()
        for syncer in syncers:
            syncer.join()
        upload_error = next((e for m in mirrors if (e := self._final_sync(m))), None)

        exit_code = failed.proc.returncode if failed is not None else 0
        if self.stop_reason:
            return self.ending(Status.STOPPED, None, self.stop_reason, exit_code)
        if failed is None:
            if upload_error:
                remote = mirrors[0].remote.url if mirrors else "S3"
                reason = f"InternalServerError: uploading checkpoints to {remote} failed: {upload_error}"
                return self.ending(Status.FAILED, reason, "Failed", exit_code)
            return self.ending(Status.COMPLETED, None, "Completed", exit_code)
        reason = failure_reason(exit_code, failed.failure_text(), list(failed.last_lines))
        return self.ending(Status.FAILED, reason, "Failed", exit_code)

    def _prepare_process(self) -> Launch:
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
        mirror = None
        if self.spec.checkpoint_prefix is not None:
            mirror = CheckpointMirror(self._ml("checkpoints"), run.child(self.spec.checkpoint_prefix))
            self.say(f"copied {mirror.download()} checkpoint file(s) from {mirror.remote.url}")
        env = backend_hooks().container_environment(dict(os.environ))
        env.update(single_host_environment(self.spec, self.job_dir))
        return "algo-1", training_command(self.spec), env, self._ml(), mirror

    def _prepare_hosts(self, request: dict[str, Any]) -> list[Launch]:
        names = emulator.host_names(request)
        hosts_path = emulator.hosts_file(self.job_dir, names)
        command = emulator.container_command(request)
        base = backend_hooks().container_environment(dict(os.environ))
        base[JOB_DIR_ENV] = self.job_dir
        python = self.spec.python or sys.executable
        per_node = self.spec.processes_per_node * len(names)
        credentials, source = emulator.role_credentials(request, base)
        self.say(f"container credentials: {source}")
        keep = emulator.reachable(request, python)
        received: dict[str, dict[str, int]] = {}
        launches: list[Launch] = []
        for name in names:
            host = emulator.HostTree(name, os.path.join(self.job_dir, "hosts", name))
            channel_bytes = emulator.prepare_host(request, host, names)
            mirror = None
            checkpoint_bytes = 0
            if checkpoint := request.get("CheckpointConfig"):
                local = host.path(*checkpoint.get("LocalPath", "/opt/ml/checkpoints").split("/")[3:])
                mirror = CheckpointMirror(local, emulator.storage_of(checkpoint["S3Uri"]))
                files = mirror.download()
                checkpoint_bytes = sum(size for size, _ in mirror.synced.values())
                self.say(
                    f"{name}: copied {files} checkpoint file(s), {checkpoint_bytes:,} bytes, from {mirror.remote.url}"
                )
            received[name] = {"channels": channel_bytes, "checkpoints": checkpoint_bytes}
            env = emulator.container_environment(request, base, name, python, per_node, credentials)
            launches.append((name, emulator.host_command(host, hosts_path, command, keep), env, host.ml, mirror))
        write_json(os.path.join(self.job_dir, "hosts.json"), {"received_bytes": received})
        return launches

    def _supervise(self, instances: list[ContainerProcess]) -> ContainerProcess | None:
        """Wait for every container to exit, stopping them on request or at max runtime; return the first failed."""
        term_sent: float | None = None
        killed = False
        failed: ContainerProcess | None = None
        # Every container is polled on every pass (not just the first still running): a host that fails while
        # another is stuck (its ranks waiting for the failed host's at start-up) must end the job at once.
        while [i for i in instances if i.proc.poll() is None]:
            now = time.monotonic()
            for instance in instances:
                if instance.proc.returncode is not None and instance.exited_at is None:
                    instance.exited_at = now
                    if instance.proc.returncode != 0 and failed is None:
                        failed = instance
                        if len(instances) > 1 and not self.stop_reason:
                            self.say(f"{instance.name} failed (exit code {instance.proc.returncode}): ending the job")
            if term_sent is None and self.stop_requested():
                self.say(f"{self.stop_reason}: SIGTERM to each instance (SIGKILL in {self.grace:g}s)")
                self._phase("MaxRuntimeExceeded" if self.stop_reason == "MaxRuntimeExceeded" else "Stopping")
                signal_job(self.job_dir, signal.SIGCONT)  # a hung (stopped) process cannot handle SIGTERM
                self._signal_instances(instances, signal.SIGTERM)
                term_sent = now
            elif term_sent is not None and not killed and now - term_sent < self.grace and not instances[0].emulated:
                self._stop_ranks(instances[0], signal.SIGTERM)  # ranks torchrun started after the stop
            if term_sent is not None and not killed and now - term_sent >= self.grace:
                self.say(f"still running {self.grace:g}s after SIGTERM: SIGKILL")
                self._signal_instances(instances, signal.SIGKILL)
                killed = True
            elif (
                failed and failed.exited_at is not None and not killed and now - failed.exited_at >= HOST_FAILURE_WAIT_S
            ):
                self._signal_instances(instances, signal.SIGKILL)  # SageMaker ends a job one of whose hosts failed
                killed = True
            if len(instances) == 1:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    instances[0].proc.wait(timeout=POLL_S)
            else:
                time.sleep(POLL_S)
        for instance in instances:
            if instance.proc.returncode != 0 and failed is None:
                failed = instance
        return failed

    def _signal_instances(self, instances: list[ContainerProcess], sig: signal.Signals) -> None:
        """Send `sig` as SageMaker does: to each container's PID 1.

        On the one-instance path SIGTERM goes to the ranks only, as infra/backends/job_init.py does."""
        if sig == signal.SIGKILL:
            signal_job(self.job_dir, sig)
        elif not instances[0].emulated:
            self._stop_ranks(instances[0], sig)
            return
        for instance in instances:
            pid = instance.init_pid()
            if pid is not None and instance.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def _stop_ranks(self, instance: ContainerProcess, sig: signal.Signals) -> None:
        """The one-instance path's stop: `sig` to each rank not yet signalled.

        Before any rank exists it goes to every job process; without torchrun, to the program itself."""
        if self.spec.processes_per_node == 1:
            targets = [] if instance.pid_signalled else [instance.proc.pid]
        else:
            ranks = rank_processes(job_processes(self.job_dir))
            if not ranks and not instance.signalled and not instance.pid_signalled:
                instance.pid_signalled = True
                signal_job(self.job_dir, sig)
                return
            targets = [pid for pid in ranks if pid not in instance.signalled]
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            instance.signalled.add(pid)
        instance.pid_signalled = instance.pid_signalled or instance.proc.pid in targets

    def _pump(self, instance: ContainerProcess) -> None:
        """Copy a container's output to output.log line by line, host-prefixed when there are several.

        Each logged step is reported to the backend's hooks."""
        assert instance.proc.stdout is not None
        prefix = f"[{instance.name}] ".encode() if instance.emulated else b""
        for line in instance.proc.stdout:
            self._emit(prefix + (line if line.endswith(b"\n") else line + b"\n"))
            instance.last_lines.append(line.decode("utf-8", "replace").rstrip("\n"))
            if match := _PROGRESS.search(line):
                backend_hooks().step_logged(self, int(match.group(1)))

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
    parser = argparse.ArgumentParser(
        prog="python -m hlat.infra.backends.local_daemon", description="Run one local job."
    )
    parser.add_argument("job_dir", help="the job's folder, holding job.json")
    job_dir = os.path.abspath(parser.parse_args(argv).job_dir)
    stop_signalled = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_signalled.set())
    daemon = JobDaemon(job_dir, stop_signalled)
    try:
        ending = daemon.run()
    except BaseException as exc:
        kill_job(job_dir)
        reason = f"InternalServerError: the job's daemon failed: {type(exc).__name__}: {exc}"[:MAX_REASON]
        daemon.say(reason)
        ending = daemon.ending(Status.FAILED, reason, "Failed", None)
    daemon.say(f"job ended: {ending['status']} {ending['failure_reason'] or ending['secondary_status']}")
    # The end is when the job is reported over, after its clean-up (the last uploads, the hosts torn down): until
    # then `describe` bills it as running, and the final bill must not be less than what was billed so far.
    ending["ended"] = time.time()
    write_json(os.path.join(job_dir, "status.json"), ending)
    return 0


if __name__ == "__main__":
    # The importable module's main, not this __main__ copy's: a hooks module subclasses
    # hlat.infra.backends.local_daemon's
    # BackendHooks, which backend_hooks() must recognise.
    from hlat.infra.backends.local_daemon import main as module_main

    sys.exit(module_main())
