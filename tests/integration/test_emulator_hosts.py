"""The SageMaker emulator's hosts as SageMaker's are: any host's failure ends the job within seconds, whichever host
it is (2 hosts, and 10, where `algo-10` sorts before `algo-2` as text); hosts share nothing but the network (not
/tmp, /dev/shm or the home folder); and the containers run with their job's role's credentials, not the caller's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hlat.core.storage import Storage
from hlat.infra.backends import emulator
from hlat.infra.backends.emulator import HOST_ENV, HostTree, host_command, hosts_file
from hlat.infra.backends.local import LocalBackend
from hlat.infra.backends.local_daemon import job_processes
from hlat.infra.backends.protocol import Status
from hlat.training.checkpoint.manager import host_of
from tests.integration.conftest import S3Env
from tests.integration.test_local_jobs import log_text, spec_for, wait
from tests.jobs import environ_of, make_run, require_emulator, s3_job

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_multi_host_job_at_a_time")]

require_emulator()

ENDS_WITHIN_S = 15.0
CALLER_KEY = "caller-key-AKIA0000"


def host_processes(job_dir: str, host: str) -> list[int]:
    return [p for p in job_processes(job_dir) if environ_of(p).get(HOST_ENV) == host]


def init_running(job_dir: str, host: str) -> list[int]:
    """The pids of `host`'s container init (its PID 1, job_init.py), once it runs."""
    pids = host_processes(job_dir, host)
    return [p for p in pids if b"job_init.py" in Path(f"/proc/{p}/cmdline").read_bytes()]


def kill_host_once_started(
    backend: LocalBackend, name: str, host: str, hosts: int = 1, timeout: float = 120
) -> dict[str, str]:
    """SIGKILL every process of `host` as soon as every one of the job's `hosts` has its container's PID 1 running
    (the hosts are launched one after another: the others' ranks are then starting up, waiting for this host's at
    the rendezvous); the container environment it had."""
    job_dir = backend.job_dir(name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = host_processes(job_dir, host)
        inits = init_running(job_dir, host)
        if inits and all(init_running(job_dir, f"algo-{i}") for i in range(1, hosts + 1)):
            env = environ_of(inits[0])
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):  # its PID 1 died first, taking the namespace along
                    os.kill(pid, 9)
            return env
        state = backend.describe(name)
        assert state is not None and not state.terminal, log_text(backend, name)
        time.sleep(0.1)
    raise AssertionError(f"{host} never started:\n{log_text(backend, name)}")


def host_failure_ends_the_job(prepared: Path, tmp_path: Path, hosts: int, victim: str) -> tuple[float, str]:
    run = make_run(
        prepared, tmp_path, f"fail-{victim}", eval_every=0, max_steps=100_000, checkpoint_every=1000,
        **{"job.instance_count": hosts, "job.processes_per_node": 1, "micro_batch_size": 1, "global_batch_size": hosts},
    )  # fmt: skip
    backend = LocalBackend(str(run / "jobs"), stop_grace_seconds=5)
    spec = spec_for(run, instance_count=hosts)
    backend.submit(spec)
    env = kill_host_once_started(backend, spec.name, victim, hosts)
    killed = time.monotonic()
    others = [f"algo-{i}" for i in range(1, hosts + 1) if f"algo-{i}" != victim]
    assert all(host_processes(backend.job_dir(spec.name), h) for h in others)  # the others were alive
    state = wait(backend, spec.name, timeout=120)
    seconds = time.monotonic() - killed
    log = log_text(backend, spec.name)
    assert state.status == Status.FAILED, log
    assert f"{victim} failed (exit code -9): ending the job" in log
    assert state.failure_reason is not None and "SIGKILL" in state.failure_reason
    assert seconds < ENDS_WITHIN_S, log
    assert job_processes(backend.job_dir(spec.name)) == []
    # A local run's containers get no AWS credentials at all (the caller's stay out).
    assert not {k for k in env if k in emulator.CREDENTIALS}
    return seconds, log


def test_a_failed_second_host_ends_the_job_within_seconds(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """algo-2 dies while algo-1's ranks wait for it at start-up: the job ends at once (it used to hang until
    algo-1 gave up by itself, minutes later)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", CALLER_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "caller-secret")
    seconds, _ = host_failure_ends_the_job(prepared, tmp_path, 2, "algo-2")
    print(f"\nalgo-2 of 2 killed: the job ended {seconds:.1f} s later")


def test_a_failed_seventh_host_of_ten_ends_the_job_within_seconds(prepared: Path, tmp_path: Path) -> None:
    seconds, _ = host_failure_ends_the_job(prepared, tmp_path, 10, "algo-7")
    print(f"\nalgo-7 of 10 killed: the job ended {seconds:.1f} s later")


def test_ten_hosts_train_with_node_ranks_in_the_sdks_host_order(prepared: Path, tmp_path: Path) -> None:
    """10 hosts x 1 process: `algo-10` is a host like the others. The SDK's environment.py numbers nodes by its
    sorted host list, as text (algo-1, algo-10, algo-2, ...), and the checkpoint manager's host_of names a rank's
    host from the same order."""
    hosts = 10
    run = make_run(
        prepared, tmp_path, "ten", eval_every=0, max_steps=2, checkpoint_every=2,
        **{"job.instance_count": hosts, "job.processes_per_node": 1, "micro_batch_size": 1, "global_batch_size": hosts},
    )  # fmt: skip
    backend = LocalBackend(str(run / "jobs"), stop_grace_seconds=5)
    spec = spec_for(run, instance_count=hosts)
    started = time.monotonic()
    backend.submit(spec)
    state = wait(backend, spec.name, timeout=600)
    seconds = time.monotonic() - started
    log = log_text(backend, spec.name)
    assert state.status == Status.COMPLETED, log[-5000:]
    names = [f"algo-{i}" for i in range(1, hosts + 1)]
    ranks = {
        host: int(rank)
        for host, rank in re.findall(r"\[(algo-\d+)\] Executing command: torchrun --nnodes=10 .*--node_rank=(\d+)", log)
    }
    assert ranks == {host: sorted(names).index(host) for host in names}
    assert ranks["algo-10"] == 1 and ranks["algo-2"] == 2
    env = {"LOCAL_WORLD_SIZE": "1", "SM_HOSTS": json.dumps(names)}
    assert {host_of(rank, env): rank for rank in range(hosts)} == ranks
    meta = json.loads((run / "checkpoints" / "step-000000002" / "meta.json").read_text())
    assert meta["world_size"] == hosts
    print(f"\n10 emulated hosts x 1 process, 2 steps: {seconds:.0f} s from submit to Completed")


def test_hosts_share_no_tmp_shm_or_home(tmp_path: Path) -> None:
    """Two emulated hosts at once: what algo-1 writes to /tmp, /dev/shm and ~ is not there on algo-2, nor on this
    machine; what the emulator keeps reachable (a local run's folder under /tmp) is there on both."""
    kept = tmp_path / "run"
    kept.mkdir()
    (kept / "config.json").write_text("{}")
    names = ["algo-1", "algo-2"]
    hosts_path = hosts_file(str(tmp_path), names)
    places = ["/tmp/mark", "/dev/shm/mark", "/root/mark"]
    write = (
        f"import os, time\nfor p in {places!r}: open(p, 'w').write(os.environ['{HOST_ENV}'])\n"
        "open('/opt/ml/written', 'w').close()\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists('/opt/ml/done') and time.monotonic() < deadline: time.sleep(0.05)\n"
    )
    look = (
        f"import json, os\nseen = {{p: open(p).read() if os.path.exists(p) else None for p in {places!r}}}\n"
        f"seen['kept'] = os.path.exists({str(kept / 'config.json')!r})\n"
        "seen['home'] = os.path.expanduser('~')\n"
        "json.dump(seen, open('/opt/ml/seen.json', 'w'))\n"
    )
    procs: dict[str, subprocess.Popen[bytes]] = {}
    trees = {name: HostTree(name, str(tmp_path / "hosts" / name)) for name in names}
    try:
        for name, script in zip(names, [write, look], strict=True):
            os.makedirs(trees[name].ml)
            env = {"PATH": os.environ["PATH"], "HOME": "/root", HOST_ENV: name}
            keep = [*emulator.reachable({}, sys.executable), str(kept)]
            command = host_command(trees[name], hosts_path, [sys.executable, "-c", script], keep=keep)
            procs[name] = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if name == "algo-1":
                deadline = time.monotonic() + 30
                while not os.path.exists(trees[name].path("written")):
                    assert procs[name].poll() is None, procs[name].communicate()[0].decode()
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
        out, _ = procs["algo-2"].communicate(timeout=30)
        assert procs["algo-2"].returncode == 0, out.decode()
        seen: dict[str, Any] = json.loads(Path(trees["algo-2"].path("seen.json")).read_text())
    finally:
        Path(trees["algo-1"].path("done")).touch()
        for proc in procs.values():
            proc.communicate(timeout=30)
    assert procs["algo-1"].returncode == 0
    assert seen == {"/tmp/mark": None, "/dev/shm/mark": None, "/root/mark": None, "kept": True, "home": "/root"}
    # algo-1's files are in its own folders (/tmp and home are folders of the host; /dev/shm was a tmpfs, gone).
    private = Path(trees["algo-1"].private)
    assert (private / "tmp" / "mark").read_text() == "algo-1" and (private / "home" / "mark").read_text() == "algo-1"
    for place in places:
        assert not Path(place).exists() or Path(place).read_text() != "algo-1"


def test_the_containers_get_the_roles_credentials_and_still_use_s3(
    prepared: Path, tmp_path: Path, s3_env: S3Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run on S3 (a moto server): the containers' AWS credentials are STS AssumeRole's of the request's RoleArn,
    not the caller's, and with them the job reads its data and writes its checkpoints."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    backend, name = s3_job(prepared, tmp_path, s3_env.url, "role", max_steps=4)
    run = Storage(f"{s3_env.url}/role")
    deadline = time.monotonic() + 120
    env: dict[str, str] = {}
    while not env and time.monotonic() < deadline:
        for pid in host_processes(backend.job_dir(name), "algo-2"):
            if "AWS_ENDPOINT_URL" in (found := environ_of(pid)):
                env = found
                break
        time.sleep(0.1)
    state = wait(backend, name, timeout=300)
    log = log_text(backend, name)
    assert state.status == Status.COMPLETED, log[-3000:]
    assert env, "no container process seen"
    assert env["AWS_ACCESS_KEY_ID"] != os.environ["AWS_ACCESS_KEY_ID"]
    assert env["AWS_SECRET_ACCESS_KEY"] != os.environ["AWS_SECRET_ACCESS_KEY"] and env["AWS_SESSION_TOKEN"]
    role = emulator.LOCAL_ROLE
    assert f"container credentials: STS AssumeRole of {role}" in log and f"(key {env['AWS_ACCESS_KEY_ID']})" in log
    assert run.exists("checkpoints/step-000000004/meta.json")
