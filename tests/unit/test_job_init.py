"""A stop reaches the ranks, never their children: infra/backends/job_init.py as a container's PID 1 (in a PID
namespace of
its own) and the local job daemon's one-instance path both send SIGTERM to the processes torchrun started, so a
compile a rank is waiting for finishes and the rank stops at its next step boundary.

Run as a program, this module plays the processes of a job: `launcher` (torchrun: no LOCAL_RANK) starts `rank`
(LOCAL_RANK set, a session of its own, as torchrun starts ranks), which starts `compile` (a neuronx-cc stand-in
that inherits LOCAL_RANK and dies of SIGTERM, as any program without a handler does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hlat.infra.backends.job_init import rank_processes

ROOT = Path(__file__).resolve().parents[2]
JOB_INIT = ROOT / "infra" / "backends" / "job_init.py"
COMPILE_S = 3.0


def _child(role: str, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.unit.test_job_init", role], cwd=ROOT, env={**os.environ, **env},
        start_new_session=role == "rank",
    )  # fmt: skip


def _program(role: str) -> int:
    if role == "launcher":
        return _child("rank", LOCAL_RANK="0").wait()
    if role == "compile":
        time.sleep(COMPILE_S)
        print("compile: done", flush=True)
        return 0
    stopped: list[bool] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(True))
    compiler = _child("compile")
    print(f"rank: compiling (pid {os.getpid()}, compiler {compiler.pid})", flush=True)
    code = compiler.wait()
    print(f"rank: compile exited {code}; SIGTERM received: {bool(stopped)}", flush=True)
    return 0 if stopped else 3


def _wait_for(proc: subprocess.Popen[bytes], lines: list[str], text: str, timeout: float = 60) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        lines.append(line)
        if text in line:
            return
        assert line, f"ended before {text!r}: {''.join(lines)}"
    raise AssertionError(f"no {text!r} within {timeout}s: {''.join(lines)}")


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def test_a_ranks_children_are_not_ranks() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tests.unit.test_job_init", "launcher"], cwd=ROOT, stdout=subprocess.PIPE
    )
    lines: list[str] = []
    try:
        _wait_for(launcher, lines, "rank: compiling")
        tree = _descendants(launcher.pid)
        assert len(tree) == 2  # the rank and its compiler, both with LOCAL_RANK
        rank = int(lines[-1].split("pid ")[1].split(",")[0])
        assert rank_processes([launcher.pid, *tree]) == [rank]
    finally:
        for pid in [*_descendants(launcher.pid), launcher.pid]:
            os.kill(pid, signal.SIGKILL)
        launcher.wait()


def _pid_namespaces() -> str | None:
    from hlat.infra.backends.emulator import namespaces_available

    return namespaces_available()


def test_a_stop_through_the_init_reaches_the_rank_and_lets_its_compile_finish() -> None:
    """job_init as PID 1 of a PID namespace (as in a container): SIGTERM to it reaches the rank only; the compiler
    the rank waits for ends by itself, then the rank exits 0."""
    if problem := _pid_namespaces():
        pytest.skip(problem)
    command = [sys.executable, str(JOB_INIT), sys.executable, "-m", "tests.unit.test_job_init", "launcher"]
    unshare = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if os.geteuid() != 0:
        unshare[1:1] = ["--user", "--map-root-user"]
    proc = subprocess.Popen([*unshare, *command], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    try:
        _wait_for(proc, lines, "rank: compiling")
        init = _descendants(proc.pid)[0]  # unshare's one child: the namespace's PID 1
        stopped = time.monotonic()
        os.kill(init, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(lines) + out.decode()
    assert "job_init: SIGTERM: stopping the job's ranks" in log
    assert "compile: done" in log and "rank: compile exited 0; SIGTERM received: True" in log, log
    assert proc.returncode == 0, log
    assert time.monotonic() - stopped < COMPILE_S + 10


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_the_daemons_one_instance_stop_reaches_the_ranks_only(tmp_path: Path, processes: int) -> None:
    """The local daemon's one-instance job: under torchrun (2 ranks) and without it (the program itself is the
    rank), a stop during a compile lets the compile finish and the job ends Stopped."""
    from hlat.infra.backends.protocol import JobSpec, Status
    from tests.integration.test_local_jobs import log_text, wait, wait_for_line

    backend = __import__("hlat.infra.backends.local", fromlist=["LocalBackend"]).LocalBackend(str(tmp_path / "jobs"))
    spec = JobSpec(
        name=f"ranks-{processes}", run_id="ranks", attempt=1, run_uri=str(tmp_path / "run"),
        config_uri=str(tmp_path / "run" / "config.json"), instance_type="local", instance_count=1,
        processes_per_node=processes, max_runtime_s=600, entry="tests.unit.test_job_init", channels=(),
    )  # fmt: skip
    backend.submit(spec)
    for _ in range(processes):
        wait_for_line(backend, spec.name, "rank: compiling")
    while log_text(backend, spec.name).count("rank: compiling") < processes:
        time.sleep(0.1)
    backend.stop(spec.name)
    state = wait(backend, spec.name, timeout=120)
    log = log_text(backend, spec.name)
    assert state.status == Status.STOPPED, log
    assert log.count("compile: done") == processes, log
    assert log.count("rank: compile exited 0; SIGTERM received: True") == processes, log


if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else "rank"
    sys.exit(_program(role))
