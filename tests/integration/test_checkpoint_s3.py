"""Checkpoints (training/checkpoint.py) on a real moto S3 server over HTTP (fixtures in conftest.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from infra.storage import Storage
from training.checkpoint import MARKER, META, SHARED_FILE, CheckpointManager, rank_file, step_dir

# Fixture type (conftest's classes are not imported by name).
S3Env = Any


def object_keys(env: S3Env) -> list[str]:
    listed = env.client().list_objects_v2(Bucket=env.bucket)
    return sorted(obj["Key"] for obj in listed.get("Contents", []))


def test_checkpoints_round_trip_prune_and_skip_broken_ones_on_s3(
    s3_env: S3Env, caplog: pytest.LogCaptureFixture
) -> None:
    store = Storage(f"{s3_env.url}/run/checkpoints")
    rank0 = CheckpointManager(store, keep_last=2, keep_every=3, rank=0, world_size=2)
    rank1 = CheckpointManager(store, keep_last=2, keep_every=3, rank=1, world_size=2, async_save=True)
    model = nn.Linear(4, 3)
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.add_(1.0)
        rank1.save(step, None, {"rank": 1, "step": step})
        rank1.wait()
        rank0.save(step, {"model": model.state_dict(), "step": step}, {"rank": 0, "step": step})

    prefix = "prefix/run/checkpoints"
    keys = object_keys(s3_env)
    assert {k.split("/")[3] for k in keys} == {step_dir(s) for s in (3, 4, 5)}
    assert sorted(k.rsplit("/", 1)[1] for k in keys if step_dir(5) in k) == sorted(
        [SHARED_FILE, rank_file(0), rank_file(1), META, MARKER]
    )

    assert rank1.latest_step() == 5
    shared, mine = rank1.load(5)
    assert torch.equal(shared["model"]["weight"], model.state_dict()["weight"])
    assert mine == {"rank": 1, "step": 5}

    # Truncate a committed file in place: the checkpoint is skipped, the previous one is used.
    victim = f"{prefix}/{step_dir(5)}/{rank_file(1)}"
    body = s3_env.client().get_object(Bucket=s3_env.bucket, Key=victim)["Body"].read()
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=victim, Body=body[:-5])
    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        assert rank0.latest_step() == 4
    assert step_dir(5) in caplog.text and rank_file(1) in caplog.text
    assert rank0.load(4)[0]["step"] == 4
    rank1.close()
