"""Running training jobs in tests: runs over shared prepared data, launched as the job backend would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from hlat.core.presets import load_config
from hlat.core.run import Run, open_run
from hlat.core.storage import Storage
from hlat.infra.backends.local import LocalBackend
from hlat.infra.stage_jobs import job_spec
from hlat.training.checkpoint import CheckpointManager
from tests.sizes import SMALL_DATA


def make_run(prepared: Path, root: Path, run_id: str, **training: Any) -> Path:
    """A new run (config.json) over the prepared data and tokenizer, with training overrides."""
    overrides = {**SMALL_DATA, **{f"training.{k}" if "." not in k else k: v for k, v in training.items()}}
    open_run(load_config("tiny", overrides, run_id=run_id, storage=str(root)))
    for stage in ("data", "tokenizer"):
        shutil.copytree(prepared / stage, root / run_id / stage)
    return root / run_id


def prepare_job(run: Run) -> tuple[Any, Any]:
    """The prepare-data job of a run on its backend, with the keys the stage would give it: (record, state)."""
    from hlat.infra.stage_jobs import run_stage_job
    from hlat.tasks.prepare_data import data_cache_key, source_keys
    from hlat.training.data.sources import source_fingerprint

    prints = {
        s.resolved_name: source_fingerprint(run.config.data.source_data_config(s)) for s in run.config.data.mixture
    }
    args = {"key": data_cache_key(run, prints), "sources": json.dumps(source_keys(run, prints))}
    return run_stage_job(run, "prepare-data", args=args)


def source_data(data: Storage, name: str | None = None) -> Storage:
    """The folder of a prepared source of a run's data (the only one, or the one named)."""
    from hlat.core.shards import read_mixture

    _, sources = read_mixture(data)
    return next(s.data for s in sources if name is None or s.name == name)


def launch(run: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "hlat.training.train", "--config", str(run / "config.json")],
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def train(run: Path, env: dict[str, str] | None = None, timeout: float = 300) -> tuple[int, str]:
    proc = launch(run, env)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    manager = CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1)
    step = manager.latest_step()
    assert step is not None
    shared, _ = manager.load(step)
    return shared["model"]


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line mentions `text` (the run's folder: job supervisors, training ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def task_states(name: str) -> list[str]:
    """State names of the newest 200 task runs called `name`, oldest first. (The newest: a session's server holds
    more than 200 task runs by the time late test files run, and the oldest 200 would miss this test's.)"""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=f"{name}-")),
            sort=TaskRunSort.EXPECTED_START_TIME_DESC,
            limit=200,
        )
    return [r.state.name for r in reversed(runs) if r.name.startswith(f"{name}-") and r.state is not None]


def default_sigint() -> None:
    """preexec_fn for children that must react to SIGINT: a test run started in the background (`cmd &`, as CI
    may do) ignores SIGINT, children inherit that, and Python then installs no KeyboardInterrupt handler."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def as_from_a_terminal() -> None:
    """preexec_fn for a command started as a terminal's shell starts it: SIGINT and SIGHUP at their defaults. A test
    run under `nohup` (as a CI runner may start it) ignores SIGHUP, children inherit that, and a command that the
    test's closed terminal should end would train on (seen: `hlat run train` outliving its SIGHUP by 60 s)."""
    import signal

    default_sigint()
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def environ_of(pid: int) -> dict[str, str]:
    """A process's environment ({} once it is gone): how tests find a job's ranks and hosts."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


class ThreadShare:
    """A broadcast from rank 0 over threads: what the trainer's host-side broadcast does for CheckpointManager's
    `share`."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.value: Any = None

    def of(self, rank: int) -> Any:
        def share(value: Any) -> Any:
            if rank == 0:
                self.value = json.loads(json.dumps(value))  # a copy, as a broadcast delivers
            self.barrier.wait()
            out = self.value
            self.barrier.wait()
            return out

        return share


def run_ranks(world_size: int, work: Any) -> list[Any]:
    """work(rank) on `world_size` threads; each rank's result, or the exception it raised."""
    results: list[Any] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def s3_job(prepared: Path, tmp_path: Path, s3_url: str, run_id: str, max_steps: int) -> tuple[LocalBackend, str]:
    """A 2-host x 1-process tiny training on S3 (`s3_url`: a moto server) over the prepared data, submitted to the
    local backend; the backend and the job's name."""
    sets = {
        **SMALL_DATA, "training.max_steps": max_steps, "training.checkpoint_every": 2, "training.eval_every": 0,
        "training.micro_batch_size": 4, "job.instance_count": 2, "job.processes_per_node": 1,
    }  # fmt: skip
    config = load_config("tiny", sets, run_id=run_id, storage=s3_url)
    run = open_run(config).storage
    for stage in ("data", "tokenizer"):
        for path in sorted((prepared / stage).rglob("*")):
            if path.is_file():
                run.put_file(str(path), f"{stage}/{path.relative_to(prepared / stage).as_posix()}")
    backend = LocalBackend(str(tmp_path / "jobs"), job=config.job)
    spec = job_spec(Run.at(run.url, config, run_id), 1)
    backend.submit(spec)
    return backend, spec.name


def wait_for(condition: Any, timeout: float, what: str) -> None:
    """Poll `condition` every 0.2 s until it holds; TimeoutError(what) after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def require_emulator() -> None:
    """Skip the calling test module where the SageMaker emulator's hosts cannot run (no Linux namespaces: not root),
    or fail it where the run requires them (HLAT_REQUIRE_EMULATOR=1, as CI sets)."""
    import pytest

    from hlat.infra.backends.emulator import namespaces_available

    if problem := namespaces_available():
        if os.environ.get("HLAT_REQUIRE_EMULATOR") == "1":
            raise RuntimeError(f"HLAT_REQUIRE_EMULATOR=1 but {problem}")
        pytest.skip(problem, allow_module_level=True)
