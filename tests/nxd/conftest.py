"""The NxD tier: the model-parallel path against the real neuronx-distributed source in its CPU mode.

Runs in a Neuron SDK's XLA environment (`scripts/install.sh xla`: torch 2.7 and torch-xla 2.7, as the 2.24.1 image
has them; `scripts/install.sh xla-2.28`: torch 2.9 and torch-xla 2.9, the 2.28 image's) with that SDK's NxD source
(0.13: ../shared/vendor/neuronx-distributed-2.24.0/src; 0.17: ../shared/vendor/neuronx-distributed-2.28.0/src; or
HLAT_NXD_SRC) on PYTHONPATH: never copied into the project. The SDK is HLAT_NEURON_SDK ("2.24.1" or "2.28.0"; the
jobs' configs get it as neuron.sdk, and it picks the vendored NxD release), by default the one whose torch-xla is
installed (2.24.1 without torch-xla).

Every scenario runs as torchrun ranks (gloo, NXD_CPU_MODE=1) of tests/nxd/worker.py, which installs stand-ins for
the Neuron-only binaries (tests/nxd/stubs.py) before importing NxD; each rank writes its results to a file the
test reads.

    .venv-xla/bin/python -m pytest --confcutdir=tests/nxd -p no:cacheprovider tests/nxd    (scripts/test.sh does,
    and the same with .venv-xla-2.28)
    HLAT_NEURON_SDK=2.28.0 .venv-xla-2.28/bin/python -m pytest --confcutdir=tests/nxd -p no:cacheprovider tests/nxd

Without NxD's source the tier is skipped, unless HLAT_REQUIRE_NXD=1 (CI).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.environment import NEURON_SDKS, NO_INDUCTOR_POOL, rehearsal_sdk, torch_xla_release

# The tier's jobs take their faults (HLAT_FAULT_*) from the test hooks, as the main suite's do (training/hooks.py).
os.environ.setdefault("HLAT_JOB_HOOKS", "hlat.training.faults")
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
SDK_VERSION = os.environ.get("HLAT_NEURON_SDK") or rehearsal_sdk().version
SDK = NEURON_SDKS.get(SDK_VERSION, rehearsal_sdk())
"""The Neuron SDK under test (HLAT_NEURON_SDK, else the one whose torch-xla this environment has): neuron.sdk of
the tier's configs, and it picks the vendored NxD release (`VENDORED_NXD`). An unknown one stops the session."""
VENDORED_NXD = {"2.24.1": "neuronx-distributed-2.24.0", "2.28.0": "neuronx-distributed-2.28.0"}
"""NxD's source folder in ../shared/vendor for each Neuron SDK release (NxD 0.13 and 0.17)."""
NXD_SRC = Path(os.environ.get("HLAT_NXD_SRC") or PROJECT.parent / "shared/vendor" / VENDORED_NXD[SDK.version] / "src")


def sdk_problem() -> str | None:
    """Why this environment cannot test the chosen SDK: an unknown release, or another release's torch-xla."""
    if SDK_VERSION not in NEURON_SDKS:
        return f"HLAT_NEURON_SDK={SDK_VERSION!r} is none of {', '.join(NEURON_SDKS)}"
    found = torch_xla_release()
    if found is not None and found != SDK.torch_xla:
        return (
            f"HLAT_NEURON_SDK={SDK.version} needs torch-xla {SDK.torch_xla} (its image's), but {sys.executable} has "
            f"{found}: run the tier with that SDK's Python ({SDK.local_python})"
        )
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if items and (problem := sdk_problem()) is not None:
        raise pytest.UsageError(problem)
    if (NXD_SRC / "neuronx_distributed").is_dir():
        return
    message = f"neuronx-distributed's source is not at {NXD_SRC} (set HLAT_NXD_SRC)"
    if os.environ.get("HLAT_REQUIRE_NXD") == "1":
        raise pytest.UsageError(f"HLAT_REQUIRE_NXD=1 but {message}")
    for item in items:
        item.add_marker(pytest.mark.skip(reason=message))


def cpu_mode_environment() -> dict[str, str]:
    """The environment of NxD's ranks in its CPU mode: this checkout and NxD's source importable, one thread each, and
    no Inductor compile-worker pool (torch_xla's import would start one that nothing here uses)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PROJECT), str(NXD_SRC)]),
        "NXD_CPU_MODE": "1",
        "PJRT_DEVICE": "CPU",
        "OMP_NUM_THREADS": "1",
        **NO_INDUCTOR_POOL,
    }


def run_ranks(
    processes: int, scenario: str, out: Path, timeout: float = 600, env: dict[str, str] | None = None, **args: Any
) -> list[dict[str, Any]]:
    """Run `scenario` of tests/nxd/worker.py on `processes` torchrun ranks (`env` added to their environment); each
    rank's result, in rank order."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**cpu_mode_environment(), **(env or {})}
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
    """A run folder of the worker's small model (`tests.nxd.worker.SMALL_MODEL`) on CPU with `overrides`, for the
    SDK under test (neuron.sdk)."""
    from benchmarks.bench_xla import make_run as make_xla_run

    changes = {**SMALL_MODEL, "model.vocab_size": 512, "neuron.sdk": SDK.version, **overrides}
    return make_xla_run(prepared, root, run_id, "cpu", **changes)


def run_job(run: Path, processes: int, program: str = "train", env: dict[str, str] | None = None) -> Any:
    """A job program (training.<program>) on `processes` torchrun ranks in NxD's CPU mode, as a job runs it."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "-m", "tests.nxd.job", program, "--config", str(run / "config.json"), "--device", "cpu",
    ]  # fmt: skip
    full_env = {**cpu_mode_environment(), **(env or {})}
    return subprocess.run(command, cwd=PROJECT, env=full_env, capture_output=True, text=True, timeout=900)


def first_errors(stderr: str, tail: int = 3000) -> str:
    """A failed job's stderr for an assertion: each rank's first error line (the rank that failed first is not the
    last to print: its peers' "connection closed" tracebacks follow it), then the tail."""
    firsts: dict[str, str] = {}
    for line in stderr.splitlines():
        match = re.match(r"\[(rank\d+)\]:\s*(\w+(Error|Exception)\b.*)", line)
        if match:
            firsts.setdefault(match.group(1), line)
    return "\n".join(firsts.values()) + "\n...\n" + stderr[-tail:]
