"""Sharded checkpoints of a tensor-parallel training job (the training program itself, on gloo ranks in NxD's CPU
mode): one shard per TP rank under one commit marker, a job killed while committing resumes bitwise, and the
shards consolidate into the dense model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hlat.core.storage import Storage
from hlat.training.checkpoint import CheckpointManager
from hlat.training.checkpoint.hf_export import CheckpointRef, read_checkpoint
from hlat.training.parallel.tensor_slices import dense_parameters
from tests.nxd.conftest import first_errors, make_run, run_job

JOB = {
    "parallelism.tensor": 2,
    "job.processes_per_node": 2,
    "training.max_steps": 8,
    "training.checkpoint_every": 4,
    "training.log_every": 2,
}


def shards(run: Path, step: int) -> dict[str, Any]:
    return CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1).load_shards(step)


def test_a_tp2_job_killed_while_committing_resumes_bitwise_and_its_shards_consolidate(
    prepared: Path, tmp_path: Path
) -> None:
    straight = make_run(prepared, tmp_path, "straight", **JOB)
    done = run_job(straight, 2)
    assert done.returncode == 0, first_errors(done.stderr)

    broken = make_run(prepared, tmp_path, "broken", **JOB)
    killed = run_job(broken, 2, env={"HLAT_FAULT_KILL_BEFORE_COMMIT": "8"})  # rank 0 dies writing step 8's marker
    assert killed.returncode != 0
    resumed = run_job(broken, 2)
    assert resumed.returncode == 0, first_errors(resumed.stderr)
    assert "resumed from step 4" in resumed.stdout + resumed.stderr

    a, b = shards(straight, 8), shards(broken, 8)
    assert sorted(a) == sorted(b) == ["tp00-pp00", "tp01-pp00"]
    for name in a:
        for key, tensor in a[name]["model"].items():
            assert torch.equal(tensor, b[name]["model"][key]), (name, key)
        for index, state in a[name]["optimizer"]["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, b[name]["optimizer"]["state"][index][key]), (name, index, key)

    shared, config = read_checkpoint(
        CheckpointRef(checkpoints=Storage(str(broken / "checkpoints")), step=8, run_folder=None)
    )
    dense = shared["model"]
    assert {p.name: p.shape for p in dense_parameters(config.model)} == {k: tuple(v.shape) for k, v in dense.items()}
