"""The XLA tier: the training job's XLA path on XLA:CPU, in the environment `scripts/install.sh xla` makes (the
default Neuron image's torch 2.7 and torch-xla 2.7, what a job installs on it, and pytest; no Prefect).

Run from the project root: `.venv-xla/bin/python -m pytest --confcutdir=tests/xla tests/xla` (scripts/test.sh does);
`--confcutdir` keeps the main suite's conftest (which needs Prefect) out. The prepared run is made without Prefect,
great-expectations or datasets (`benchmarks.bench_xla.prepare_offline_run`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("OMP_NUM_THREADS", "2")
# XLA:CPU's own code generator at its lowest optimisation level, for this tier and the jobs it starts. The tier checks
# what torch-xla builds and runs (the HLO graphs, their count and executions, the transfers, bitwise resumes), which
# this flag leaves as they are; it changes how XLA:CPU's LLVM backend compiles each graph for this CPU, which trn1
# never uses (neuronx-cc compiles there). The tier runs few steps of many graphs: measured alone on 2 cores, it takes
# 172 s of CPU instead of 234 (a long run is slower at it: 223 ms a step of the tiny model against 90, so the local
# rehearsal, training.device=xla, keeps XLA's default). https://openxla.org/xla/flags_guidance
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
# The tier's jobs take their faults (HLAT_FAULT_*) from the test hooks, as the main suite's do (training/hooks.py).
os.environ.setdefault("HLAT_JOB_HOOKS", "hlat.training.faults")

# torch-xla's device must exist before autograd first runs a backward (the CPU reference runs do): the engine
# sizes its device queues then, and an XLA backward afterwards fails an internal assert.
import torch_xla.core.xla_model as xm

from benchmarks.bench_xla import make_run, prepare_offline_run

xm.xla_device()

__all__ = ["make_run"]


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """data/ (parquet shards and their manifest) and tokenizer/ (sentencepiece BPE) of a small run."""
    return prepare_offline_run(tmp_path_factory.mktemp("xla-prepared"))
