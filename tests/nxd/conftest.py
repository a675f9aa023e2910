"""The NxD tier: the model-parallel path against the real neuronx-distributed 0.13 source in its CPU mode.

Runs in the XLA environment (`scripts/install.sh xla`: torch 2.7, torch-xla 2.7, as the Neuron image has them)
with NxD's source from ../shared/vendor/neuronx-distributed-2.24.0/src (or HLAT_NXD_SRC) on PYTHONPATH: never
copied into the project. Every scenario runs as torchrun ranks (gloo, NXD_CPU_MODE=1) of tests/nxd/worker.py,
which installs stand-ins for the Neuron-only binaries (tests/nxd/stubs.py) before importing NxD; each rank writes
its results to a file the test reads.

    .venv-xla/bin/python -m pytest --confcutdir=tests/nxd -p no:cacheprovider tests/nxd    (scripts/test.sh does)

Without NxD's source the tier is skipped, unless HLAT_REQUIRE_NXD=1 (CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

PROJECT = Path(__file__).resolve().parents[2]
SMALL_MODEL = {
    "model.n_layers": 2,
    "model.d_model": 64,
    "model.n_heads": 4,
    "model.ffn_hidden": 96,
    "model.vocab_size": 320,
    "model.max_seq_len": 64,
    "training.seq_len": 32,
}
"""A model small enough for 4 ranks on 2 cores, with room for TP 4 (heads) and SP (sequence)."""
NXD_SRC = Path(os.environ.get("HLAT_NXD_SRC", PROJECT.parent / "shared/vendor/neuronx-distributed-2.24.0/src"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if (NXD_SRC / "neuronx_distributed").is_dir():
        return
    message = f"neuronx-distributed's source is not at {NXD_SRC} (set HLAT_NXD_SRC)"
    if os.environ.get("HLAT_REQUIRE_NXD") == "1":
        raise pytest.UsageError(f"HLAT_REQUIRE_NXD=1 but {message}")
    for item in items:
        item.add_marker(pytest.mark.skip(reason=message))


def run_ranks(processes: int, scenario: str, out: Path, timeout: float = 600, **args: Any) -> list[dict[str, Any]]:
    """Run `scenario` of tests/nxd/worker.py on `processes` torchrun ranks; each rank's result, in rank order."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PROJECT), str(NXD_SRC)]),
        "NXD_CPU_MODE": "1",
        "PJRT_DEVICE": "CPU",
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "-m", "tests.nxd.worker", scenario, str(out), json.dumps(args),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        output = f"{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
        raise AssertionError(f"{scenario} on {processes} ranks exited {done.returncode}:\n{output}")
    return [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in range(processes)]


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """data/ and tokenizer/ of a small run, made without Prefect (`benchmarks.bench_xla.prepare_offline_run`)."""
    from benchmarks.bench_xla import prepare_offline_run

    return prepare_offline_run(tmp_path_factory.mktemp("nxd-prepared"))


def make_run(prepared: Path, root: Path, run_id: str, **overrides: Any) -> Path:
    """A run folder of the worker's small model (`tests.nxd.worker.SMALL_MODEL`) on CPU with `overrides`."""
    from benchmarks.bench_xla import make_run as make_xla_run

    changes = {**SMALL_MODEL, "model.vocab_size": 512, **overrides}
    return make_xla_run(prepared, root, run_id, "cpu", **changes)


def run_job(run: Path, processes: int, program: str = "train", env: dict[str, str] | None = None) -> Any:
    """A job program (training.<program>) on `processes` torchrun ranks in NxD's CPU mode, as a job runs it."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "-m", "tests.nxd.job", program, "--config", str(run / "config.json"), "--device", "cpu",
    ]  # fmt: skip
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PROJECT), str(NXD_SRC)]),
        "NXD_CPU_MODE": "1",
        "PJRT_DEVICE": "CPU",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    return subprocess.run(command, cwd=PROJECT, env=full_env, capture_output=True, text=True, timeout=900)
