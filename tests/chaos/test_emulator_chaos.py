"""Chaos on two emulated SageMaker hosts: a 2-host x 2-process training on S3 (a moto server, behind the fault
injector tests/s3_faults.py) whose hosts, ranks and flow are SIGKILLed, whose job is stopped (StopTrainingJob) and
whose checkpoint writes meet S3's throttling, 5xx, dropped connections and latency at random moments must end
bitwise equal to an uninterrupted run (weights, optimizer state, every step's loss and samples), with one job alive
at a time, each recorded in the ledger, and nothing left running.

CI runs one event of each kind (`HLAT_CHAOS_EVENTS`, default 5); the long version is the same test with more:
`HLAT_CHAOS_EVENTS=16 .venv/bin/python -m pytest tests/chaos/test_emulator_chaos.py -s` (its figures are in
docs/multi-host.md)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.presets import load_config
from hlat.core.run import Run, open_run
from hlat.infra.backends.emulator import HOST_ENV
from hlat.infra.backends.local import LocalBackend
from hlat.infra.backends.local_daemon import job_processes
from hlat.infra.backends.protocol import TERMINAL, Status
from hlat.infra.stage_jobs import job_spec
from hlat.infra.supervision.ledger import Ledger
from hlat.training.checkpoint import CheckpointManager
from tests.chaos.test_train_stage import ROOT, cli, cli_env
from tests.conftest import SMALL_DATA
from tests.integration.conftest import S3Env
from tests.integration.test_local_jobs import log_text, wait
from tests.jobs import environ_of, require_emulator
from tests.s3_faults import Rule, S3Faults

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_multi_host_job_at_a_time")]

require_emulator()

KINDS = ("host", "rank", "flow", "stop", "storage")
EVENTS = int(os.environ.get("HLAT_CHAOS_EVENTS", str(len(KINDS))))
STEPS = 24 + 8 * EVENTS
SETS: dict[str, Any] = {
    **SMALL_DATA,
    "training.max_steps": STEPS,
    "training.checkpoint_every": 4,
    "training.keep_checkpoints": 2,
    "training.eval_every": 0,
    "training.warmup_steps": 5,
    "training.micro_batch_size": 2,
    "job.instance_count": 2,
    "job.processes_per_node": 2,
    "job.backoff_seconds": [1, 2],
    "job.stop_grace_seconds": 30,
    "job.max_restarts": 100,
}


def put_run(prepared: Path, root: str, run_id: str) -> Run:
    """A run on S3 over the prepared data and tokenizer."""
    run = open_run(load_config("tiny", SETS, run_id=run_id, storage=root))
    for stage in ("data", "tokenizer"):
        for path in sorted((prepared / stage).rglob("*")):
            if path.is_file():
                run.storage.put_file(str(path), f"{stage}/{path.relative_to(prepared / stage).as_posix()}")
    return run


def start_flow(tmp_path: Path, root: str, run_id: str) -> subprocess.Popen[bytes]:
    command = [*cli(tmp_path, run_id, SETS)]
    command[command.index("--storage") + 1] = root
    log = (tmp_path / f"{run_id}-flow.log").open("ab")
    return subprocess.Popen(command, cwd=ROOT, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)


def history(run: Run) -> list[tuple[int, float, int]]:
    rows = [json.loads(line) for line in run.storage.read_bytes("metrics.jsonl").decode().splitlines()]
    return [(r["step"], r["loss"], r["samples_crc32"]) for r in rows if "samples_crc32" in r]


def final_state(run: Run) -> tuple[int, dict[str, Any]]:
    manager = CheckpointManager(run.storage.child("checkpoints"), keep_last=1)
    step = manager.latest_step()
    assert step is not None
    return step, manager.load_shared(step)


def tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in tensors(value, f"{prefix}/{key}").items()}
    if isinstance(tree, list | tuple):
        return {k: v for i, value in enumerate(tree) for k, v in tensors(value, f"{prefix}/{i}").items()}
    return {}


def kill_host(job_dir: str, host: str) -> int:
    """SIGKILL an emulated instance's whole process tree (its namespace launcher, PID 1 and every child)."""
    pids = [p for p in job_processes(job_dir) if environ_of(p).get(HOST_ENV) == host]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # its PID 1 died first and took the namespace with it
            os.kill(pid, signal.SIGKILL)
    return len(pids)


CHECKPOINT_FILES = r"checkpoints/step-\d+/"


def storage_storm(proxy: S3Faults, rng: random.Random) -> list[Rule]:
    """S3 at its worst short of an outage, on the next checkpoint writes: a rank file's upload throttled (503
    SlowDown), failed (500 InternalError) and its connection dropped, every checkpoint request late. All of it is
    retried with back-off (core.storage.S3_CLIENT_CONFIG), so the training goes on as if nothing happened."""
    rank_file = rf"{CHECKPOINT_FILES}rank-\d+\.pt$"
    writes = ("PutObject", "UploadPart")
    return [
        proxy.add(Rule(writes, rank_file, "slowdown", times=rng.randint(1, 3))),
        proxy.add(Rule(writes, rank_file, "internal", times=rng.randint(1, 2))),
        proxy.add(Rule(writes, rank_file, "drop", times=1)),
        proxy.add(Rule(None, CHECKPOINT_FILES, "latency", times=20, seconds=rng.uniform(0.1, 0.5))),
    ]


def kill_rank(job_dir: str, rng: random.Random) -> int:
    ranks = [p for p in job_processes(job_dir) if "LOCAL_RANK" in environ_of(p)]
    if ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rng.choice(ranks), signal.SIGKILL)
    return len(ranks)


class Chaos:
    def __init__(self, tmp_path: Path, root: str, run: Run, run_id: str, proxy: S3Faults) -> None:
        self.tmp_path, self.root, self.run, self.run_id = tmp_path, root, run, run_id
        self.proxy = proxy
        self.storms: list[Rule] = []
        self.jobs = Path(os.environ["HLAT_JOBS_DIR"]) / run_id
        self.backend = LocalBackend(str(self.jobs))
        self.flow = start_flow(tmp_path, root, run_id)
        self.most_alive = 0
        self.seen: dict[str, int] = {}
        """Training steps each job had logged at the last event: the next event waits for a newer one."""

    def current_job(self) -> str | None:
        attempts = Ledger(self.run, "train").load() if self.run.storage.exists("jobs/train-attempts.json") else []
        return attempts[-1].job_name if attempts else None

    def alive_jobs(self) -> int:
        names = [p.name for p in self.jobs.iterdir() if p.is_dir()] if self.jobs.exists() else []
        states = [self.backend.describe(n) for n in names]
        alive = sum(1 for s in states if s is not None and s.status not in TERMINAL)
        self.most_alive = max(self.most_alive, alive)
        return alive

    def steps_logged(self, name: str) -> int:
        path = self.jobs / name / "output.log"
        return path.read_text(errors="replace").count(" loss ") if path.exists() else 0

    def wait_for_training(self, timeout: float = 300) -> str | None:
        """The current job, once it is running and has logged a training step since the last event (None: the flow
        ended first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.alive_jobs()
            name = self.current_job()
            state = self.backend.describe(name) if name else None
            running = name and state is not None and state.status not in TERMINAL
            if running and self.steps_logged(name) > self.seen.get(name, 0):
                return name
            if self.flow.poll() is not None:
                return None
            time.sleep(0.3)
        raise TimeoutError(f"no training step within {timeout}s")

    def act(self, kind: str, name: str, rng: random.Random) -> bool:
        """Do it; False when it found nothing to hit (the job had just ended)."""
        self.seen[name] = self.steps_logged(name)
        job_dir = str(self.jobs / name)
        if kind == "host":
            return kill_host(job_dir, rng.choice(["algo-1", "algo-2"])) > 0
        if kind == "rank":
            return kill_rank(job_dir, rng) > 0
        if kind == "storage":
            self.storms += storage_storm(self.proxy, rng)
            state = self.backend.describe(name)
            return state is not None and state.status not in TERMINAL
        if kind == "stop":
            state = self.backend.describe(name)
            self.backend.stop(name)
            return state is not None and state.status not in TERMINAL
        # the flow process: its job runs on, and the restarted flow re-attaches to it
        self.flow.kill()
        self.flow.wait()
        self.flow = start_flow(self.tmp_path, self.root, self.run_id)
        return True

    def finish(self, timeout: float = 900) -> int:
        deadline = time.monotonic() + timeout
        while self.flow.poll() is None:
            assert time.monotonic() < deadline, "the flow did not finish"
            self.alive_jobs()
            time.sleep(0.5)
        return self.flow.returncode


@pytest.fixture
def proxy(s3_env: S3Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Faults]:
    """Every request of the test, its flows and jobs to S3 goes through the fault injector."""
    with S3Faults(s3_env.endpoint) as injector:
        monkeypatch.setenv("AWS_ENDPOINT_URL", injector.url)
        yield injector


def test_two_hosts_under_random_kills_stops_and_storage_faults_end_bitwise_equal(
    prepared: Path,
    tmp_path: Path,
    prefect_server: None,
    s3_env: S3Env,
    proxy: S3Faults,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HLAT_JOBS_DIR", str(tmp_path / "jobs"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    # The uninterrupted run: the job the train stage would submit, run to the end on the same emulated hosts.
    reference = put_run(prepared, s3_env.url, "reference")
    config = load_config("tiny", SETS, run_id="reference", storage=s3_env.url)
    backend = LocalBackend(str(tmp_path / "jobs" / "reference"), job=config.job)
    spec = job_spec(reference.with_config(config), 1)
    backend.submit(spec)
    state = wait(backend, spec.name, timeout=900)
    assert state.status == Status.COMPLETED, log_text(backend, spec.name)[-3000:]
    reference_s = time.monotonic() - started

    run = put_run(prepared, s3_env.url, "chaos")
    rng = random.Random(20261125)
    plan = [KINDS[i % len(KINDS)] for i in range(EVENTS)]
    rng.shuffle(plan)
    chaos = Chaos(tmp_path, s3_env.url, run, "chaos", proxy)
    done: list[str] = []
    for kind in plan:
        name = chaos.wait_for_training()
        if name is None:
            break
        time.sleep(rng.uniform(0.5, 3.0))
        done.append(kind if chaos.act(kind, name, rng) else f"{kind} (missed: the job had ended)")
    assert chaos.finish() == 0, (tmp_path / "chaos-flow.log").read_text()[-3000:]

    attempts = Ledger(run, "train").load()
    names = [a.job_name for a in attempts]
    assert len(set(names)) == len(names) and sorted(names) == sorted(p.name for p in chaos.jobs.iterdir())
    assert chaos.most_alive == 1  # never two jobs of the run at once
    left = {n: pids for n in names if (pids := job_processes(str(chaos.jobs / n)))}
    assert not left, f"processes left running: {left}"  # nothing orphaned

    assert history(run) == history(reference)  # every step: same samples, same loss
    (step, ours), (their_step, theirs) = final_state(run), final_state(reference)
    assert step == their_step == STEPS
    ours_t = tensors({k: ours[k] for k in ("model", "optimizer")})
    theirs_t = tensors({k: theirs[k] for k in ("model", "optimizer")})
    assert ours_t.keys() == theirs_t.keys()
    mismatches = [k for k in ours_t if not torch.equal(ours_t[k], theirs_t[k])]
    assert mismatches == []
    faulted: dict[str, int] = {}
    for rule in chaos.storms:
        faulted[rule.fault] = faulted.get(rule.fault, 0) + len(rule.hits)
    if "storage" in done:
        assert sum(n for f, n in faulted.items() if f != "latency") > 0, "no storage fault reached a request"
    print(
        f"\nchaos on 2 emulated hosts: {len(done)} events ({', '.join(done)}), {len(attempts)} jobs "
        f"({len(attempts) - 1} relaunches: {[a.category for a in attempts[:-1]]}), {STEPS} steps, "
        f"{len(ours_t)} tensors compared, {len(mismatches)} mismatches; reference {reference_s:.0f} s, "
        f"chaos run {time.monotonic() - started - reference_s:.0f} s; storage faults injected: {faulted}, "
        f"{len(proxy.requests)} S3 requests through the injector"
    )
