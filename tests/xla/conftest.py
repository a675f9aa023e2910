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
