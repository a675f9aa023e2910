"""The seam of test fault injection: the job's and the local backend's hook points are no-ops unless a test session
names a hooks module (HLAT_JOB_HOOKS, HLAT_BACKEND_HOOKS), which then installs its faults; a wrong name fails in one
line."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.infra.backends import local_daemon
from hlat.infra.backends.local_faults import FAULTS_ENV, LocalFaults
from hlat.training import faults
from hlat.training import hooks as job_hooks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh() -> Iterator[None]:
    """Both hook loaders read their variable again (each reads it once per process), and again after the test."""
    job_hooks.hooks.cache_clear()
    local_daemon.backend_hooks.cache_clear()
    yield
    job_hooks.hooks.cache_clear()
    local_daemon.backend_hooks.cache_clear()


def test_the_default_hooks_change_nothing_even_with_faults_asked_for(
    fresh: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(job_hooks.HOOKS_ENV, raising=False)
    monkeypatch.delenv(local_daemon.HOOKS_ENV, raising=False)
    for name, value in {
        faults.NAN_AT_STEP: "1", faults.STEP_SECONDS: "5", faults.ALLREDUCE_SECONDS: "5",
        faults.BURN_IN_WRONG_RANK: "0", faults.SAVE_SECONDS: "5", faults.PREPARE_FAULTS: '{"worker": 0}',
        FAULTS_ENV: '{"1": {"fail": "CapacityError: x"}}',
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    run = Storage(str(tmp_path))
    loss = torch.tensor(2.0)
    hooks = job_hooks.hooks()
    assert type(hooks) is job_hooks.JobHooks
    assert hooks.checkpoint_storage(run, 0) is run
    assert hooks.loss_of_step(loss, Run.of(run), 1) is loss
    assert hooks.step_seconds() is None
    assert hooks.collective_delay() == 0.0
    assert not hooks.matmul_corrupted(0)
    assert hooks.prepared_batch(0, 1, "job") is None
    backend = local_daemon.backend_hooks()
    assert type(backend) is local_daemon.BackendHooks
    assert backend.job_record(1) == {}
    env = {FAULTS_ENV: "x", "PATH": "/bin"}
    assert backend.container_environment(env) == env
    assert backend.emulated_request({"a": 1}, {"sdk_entrypoint": True}) == {"a": 1}


def test_the_named_modules_install_their_faults(fresh: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(job_hooks.HOOKS_ENV, "hlat.training.faults")
    monkeypatch.setenv(local_daemon.HOOKS_ENV, "hlat.infra.backends.local_faults")
    monkeypatch.setenv(faults.NAN_AT_STEP, "3")
    monkeypatch.setenv(faults.STEP_SECONDS, "0.5")
    monkeypatch.setenv(faults.BURN_IN_WRONG_RANK, "1")
    monkeypatch.setenv(faults.PREPARE_FAULTS, '{"worker": 2, "after_rows": 10}')
    monkeypatch.setenv(FAULTS_ENV, '{"2": {"kill_at_step": 4}}')
    run = Run.at(str(tmp_path))
    hooks = job_hooks.hooks()
    assert isinstance(hooks, faults.FaultHooks)
    assert job_hooks.hooks() is hooks  # read once per process
    assert hooks.loss_of_step(torch.tensor(2.0), run, 2).item() == 2.0
    assert torch.isnan(hooks.loss_of_step(torch.tensor(2.0), run, 3))
    assert hooks.loss_of_step(torch.tensor(2.0), run, 3).item() == 2.0  # once per run
    assert hooks.step_seconds() == 0.5
    assert [hooks.matmul_corrupted(rank) for rank in range(3)] == [False, True, False]
    assert hooks.prepared_batch(1, 1, "job") is None
    assert callable(hooks.prepared_batch(2, 1, "job"))
    backend = local_daemon.backend_hooks()
    assert isinstance(backend, LocalFaults)
    assert backend.job_record(1) == {}
    assert backend.job_record(2) == {"kill_at_step": 4}
    assert backend.container_environment({FAULTS_ENV: "x", "PATH": "/bin"}) == {"PATH": "/bin"}


@pytest.mark.parametrize(
    ("variable", "loader"),
    [
        (job_hooks.HOOKS_ENV, "hlat.training.hooks:hooks"),
        (local_daemon.HOOKS_ENV, "hlat.infra.backends.local_daemon:backend_hooks"),
    ],
)
@pytest.mark.parametrize("module", ["hlat.training.no_such_hooks", "hlat.core.layout"])
def test_a_wrong_hooks_module_fails_in_one_line(variable: str, loader: str, module: str) -> None:
    """A module that does not exist, or one without hooks(): the job stops at once, saying which variable is wrong."""
    where, name = loader.split(":")
    code = f"import {where} as m; m.{name}()"
    env = {"PATH": "/usr/bin:/bin", variable: module}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: {variable}={module}: "), done.stderr
    assert "Traceback" in done.stderr and "During handling" not in done.stderr  # one error, not a chain
