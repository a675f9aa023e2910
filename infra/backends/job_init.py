"""PID 1 of a training container: run the container's command and pass a stop's SIGTERM on to the job's ranks.

SageMaker stops a job with SIGTERM to PID 1, then SIGKILL 120 s later
(https://docs.aws.amazon.com/sagemaker/latest/dg/your-algorithms-training-algo-running-container.html). The SDK's shell
ignores it, so this init runs in front of it. It signals ranks only: children may be compiling, and torchrun would
SIGKILL after 30 s. Before any rank exists, it signals every process. Standard library only (docs/multi-host.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

RANK_VARIABLE = "LOCAL_RANK"
POLL_S = 0.5
RESCAN_FOR_S = 30.0
"""Seconds after a stop during which late-starting ranks are signalled too."""


def processes_with(variable: str, value: str | None = None) -> list[int]:
    """Pids of other processes whose environment sets `variable` (to `value`, if given), even in other sessions."""
    wanted = f"{variable}={value}".encode() if value is not None else f"{variable}=".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
        except OSError:  # gone, a kernel thread, or not ours to read
            continue
        if any(item == wanted if value is not None else item.startswith(wanted) for item in environ):
            found.append(int(entry))
    return found


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of a live process (proc(5), /proc/<pid>/stat fields 4 and 6)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 (state) onwards
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[3])


def _has(pid: int, variable: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return any(item.startswith(f"{variable}=".encode()) for item in fh.read().split(b"\0"))
    except OSError:
        return False


def is_rank(pid: int) -> bool:
    """Whether a LOCAL_RANK process is a rank torchrun started: its parent lacks LOCAL_RANK.

    An orphan counts only if it leads its own session, as torchrun starts ranks (Popen(start_new_session=True))."""
    stat = _stat(pid)
    if stat is None:
        return False
    parent, session = stat
    if parent in (0, 1, os.getpid()):
        return session == pid
    return not _has(parent, RANK_VARIABLE)


def rank_processes(candidates: list[int] | None = None) -> list[int]:
    """Pids of the job's ranks here, not their children; `candidates` limits the search."""
    pids = processes_with(RANK_VARIABLE) if candidates is None else [p for p in candidates if _has(p, RANK_VARIABLE)]
    return [pid for pid in pids if is_rank(pid)]


class Init:
    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.stop_at: float | None = None
        self.signalled: set[int] = set()
        self.everyone = False

    def on_stop(self, signum: int, frame: object) -> None:
        if self.stop_at is None:
            self.stop_at = time.monotonic()
            print(f"job_init: {signal.Signals(signum).name}: stopping the job's ranks", flush=True)
        self.forward()

    def forward(self) -> None:
        ranks = [pid for pid in rank_processes() if pid not in self.signalled]
        if not ranks and not self.signalled and not self.everyone:
            self.everyone = True
            os.kill(-1, signal.SIGTERM)  # every process but this one: nothing is training yet
            return
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            self.signalled.add(pid)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_stop)
        signal.signal(signal.SIGINT, self.on_stop)
        child = subprocess.Popen(self.command)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)  # any child: orphans are re-parented to PID 1
            except ChildProcessError:
                return 0
            if pid == child.pid:
                return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
            if pid == 0:
                time.sleep(POLL_S)
                if self.stop_at is not None and time.monotonic() - self.stop_at < RESCAN_FOR_S:
                    self.forward()


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: job_init.py <command> [args...]", file=sys.stderr)
        return 2
    if os.getpid() != 1:
        # Not a container's init (a test, or a launcher that already forwards signals): just be the command.
        os.execvp(argv[0], argv)
    return Init(argv).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
