"""A SageMaker job's source code and what its instances install before the program runs.

The source is the `hlat` package as the wheel holds it (only the layers a job imports), the entry script and the
container's init. The requirements file is a lock with hashes from deployments/. An account whose jobs reach AWS's
endpoints only (`EGRESS_ENV`) installs nothing: its image must hold the requirements.
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path

from hlat.core.environment import NEURON_SDKS
from hlat.core.stages import TRAINING, Instances, stage
from hlat.infra.backends.protocol import JobSpec

PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The project's checkout: deployments/ holds the requirements files the jobs install."""

JOB_LAYERS = ("core", "training")
"""The layers of `hlat` a job imports (hlat.core, hlat.training: the job programs import nothing else of the
project), shipped as the job's source code."""
ENTRY_SCRIPT = "hlat_job.py"
"""The script SageMaker's drivers run by path, at the top of the uploaded source (infra/backends/job_entry.py): it
runs the module HLAT_JOB_MODULE names."""
JOB_MODULE_ENV = "HLAT_JOB_MODULE"
SOURCE_DIR = "/opt/ml/input/data/code"
"""Where SageMaker puts the uploaded source on each instance (the SDK's code channel)."""

INIT_SCRIPT = "job_init.py"
"""The container's PID 1 (infra/backends/job_init.py), at the top of the uploaded source beside the entry script."""
JOB_INIT = ["python3", f"{SOURCE_DIR}/{INIT_SCRIPT}"]
"""Put in front of the SDK's ContainerEntrypoint (/bin/bash): the container's PID 1, run by path from the source code
channel, which SageMaker downloads before the container starts."""


def stage_source(folder: Path, requirements: str | None) -> None:
    """Lay out a job's source code in the empty `folder`, as SageMaker will run it: the `hlat` package as the wheel
    holds it (hlat/__init__.py, hlat/core/..., hlat/training/...: each module once, copied from where this
    installation imports it), the entry script and the container's init at the top (the entry script's folder is
    first on the program's sys.path, so the program imports the uploaded code and needs no path set-up of its own),
    and the requirements file."""
    import hlat

    package = folder / "hlat"
    package.mkdir(parents=True)
    shutil.copy2(Path(hlat.__file__), package / "__init__.py")
    for layer in JOB_LAYERS:
        source = Path(importlib.import_module(f"hlat.{layer}").__file__ or "").parent
        shutil.copytree(source, package / layer, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(Path(__file__).with_name("job_entry.py"), folder / ENTRY_SCRIPT)
    shutil.copy2(Path(__file__).with_name("job_init.py"), folder / INIT_SCRIPT)
    if requirements is not None:
        (folder / requirements).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PROJECT_ROOT / requirements, folder / requirements)


EGRESS_ENV = "HLAT_JOB_EGRESS"
"""`aws-endpoints` where the account stack's JobEgress keeps jobs off the internet (the ECS pool's environment)."""


def endpoints_only() -> bool:
    """Whether the jobs of this account reach AWS's endpoints only (no package index)."""
    return os.environ.get(EGRESS_ENV, "").strip() == "aws-endpoints"


def requirements_of(spec: JobSpec) -> str:
    """What the job's instances pip-install before its program runs: its instances' own lock (`Instances.requirements`:
    the evaluation's lm-eval and transformers, the data job's great-expectations and datasets), else the lock of
    its Neuron SDK's image (deployments/job-requirements-<release>.lock.txt). Every file a job installs is a lock
    with hashes (scripts/job_locks.py), made from the requirements file beside it."""
    own = instances_of(spec).requirements
    return own or f"deployments/{NEURON_SDKS[spec.neuron_sdk].job_requirements.removesuffix('.txt')}.lock.txt"


def instances_of(spec: JobSpec) -> Instances:
    """Where the job's stage runs (its row's `runs_on`)."""
    return stage(spec.stage).runs_on or TRAINING
