"""Checkpoints (training/checkpoint/) on a real moto S3 server over HTTP (fixtures in conftest.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator
from typing import IO, Any, cast

import pytest
import torch
from torch import nn

from hlat.core.storage import Storage, TransientStorageError
from hlat.training.checkpoint import (
    MARKER,
    META,
    SHARED_FILE,
    CheckpointError,
    CheckpointManager,
    manifest_file,
    rank_file,
    shard_file,
    step_dir,
)

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
        [SHARED_FILE, rank_file(0), rank_file(1), manifest_file(1), META, MARKER]
    )

    assert rank1.latest_step() == 5
    shared, mine = rank1.load(5)
    assert torch.equal(shared["model"]["weight"], model.state_dict()["weight"])
    assert mine == {"rank": 1, "step": 5}

    # Truncate a committed file in place: the checkpoint is skipped, the previous one is used.
    victim = f"{prefix}/{step_dir(5)}/{rank_file(1)}"
    body = s3_env.client().get_object(Bucket=s3_env.bucket, Key=victim)["Body"].read()
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=victim, Body=body[:-5])
    with caplog.at_level(logging.WARNING, logger="hlat.training.checkpoint"):
        assert rank0.latest_step() == 4
    assert step_dir(5) in caplog.text and rank_file(1) in caplog.text
    assert rank0.load(4)[0]["step"] == 4
    rank1.close()


def test_a_sharded_checkpoint_round_trips_and_prunes_on_s3(s3_env: S3Env) -> None:
    """TP 2 x DP 2: ranks 0 and 1 write shards tp00 and tp01; the replicas (2, 3) save asynchronously."""
    store = Storage(f"{s3_env.url}/run/checkpoints")
    shards = ("tp00", "tp01")
    ranks = [
        CheckpointManager(
            store,
            keep_last=1,
            rank=rank,
            world_size=4,
            shard=shards[rank % 2],
            shard_writer=rank < 2,
            shards=shards,
            async_save=rank >= 2,
        )
        for rank in range(4)
    ]

    def shard_state(rank: int, step: int) -> dict[str, Any]:
        return {"step": step, "model": {"w": torch.full((8, 4), float(10 * (rank % 2) + step))}}

    for step in (1, 2):
        for rank in (3, 2, 1, 0):
            ranks[rank].save(step, shard_state(rank, step), {"rank": rank, "step": step})
            if rank >= 2:
                ranks[rank].wait()

    keys = object_keys(s3_env)
    assert sorted(k.split("/", 3)[3] for k in keys) == sorted(
        f"{step_dir(2)}/{name}"
        for name in [
            shard_file("tp00"),
            shard_file("tp01"),
            *(rank_file(r) for r in range(4)),
            *(manifest_file(r) for r in (1, 2, 3)),
            META,
            MARKER,
        ]
    )  # step 1, its shard files included, was pruned
    for rank, manager in enumerate(ranks):
        shared, mine = manager.load(2)
        assert torch.equal(shared["model"]["w"], shard_state(rank, 2)["model"]["w"])
        assert mine == {"rank": rank, "step": 2}
    assert list(ranks[0].load_shards(2)) == ["tp00", "tp01"]
    with pytest.raises(CheckpointError, match="load_shards"):
        ranks[0].load_shared(2)
    for manager in ranks:
        manager.close()


class FailingUpload:
    """An upload that fails like a dropped connection once `budget` bytes have gone into it."""

    def __init__(self, inner: IO[bytes], budget: int) -> None:
        self.inner, self.budget, self.written = inner, budget, 0

    def write(self, data: Any) -> int:
        self.written += memoryview(data).nbytes
        if self.written > self.budget:
            raise ConnectionError("connection reset (injected)")
        return self.inner.write(data)

    def flush(self) -> None:
        self.inner.flush()


class WrappedUploads(Storage):
    """Storage whose atomic writers pass through `wrap`: a fault in every upload."""

    def wrap(self, fh: IO[bytes]) -> IO[bytes]:
        raise NotImplementedError

    @contextlib.contextmanager
    def atomic_writer(self, rel: str, part_size: int | None = None) -> Iterator[IO[bytes]]:
        with super().atomic_writer(rel, part_size) as fh:
            yield self.wrap(fh)


class FlakyStorage(WrappedUploads):
    def __init__(self, url: str, budget: int, **options: Any) -> None:
        super().__init__(url, **options)
        self.budget = budget

    def wrap(self, fh: IO[bytes]) -> IO[bytes]:
        return cast(IO[bytes], FailingUpload(fh, self.budget))


def test_a_checkpoint_streams_to_s3_as_a_multipart_upload_that_appears_only_when_complete(s3_env: S3Env) -> None:
    # 5 MiB parts (S3's smallest): a 12 MB tensor is uploaded in three, a part at a time.
    url, part = f"{s3_env.url}/run/checkpoints", 5 * 2**20
    state: dict[str, Any] = {"w": torch.randn(3_000_000), "step": 1}
    manager = CheckpointManager(Storage(url, default_block_size=part), keep_last=2)
    manager.save(1, state, {"rank": 0})
    key = f"prefix/run/checkpoints/{step_dir(1)}/{SHARED_FILE}"
    etag = s3_env.client().head_object(Bucket=s3_env.bucket, Key=key)["ETag"]
    assert etag.strip('"').endswith("-3")  # the ETag of a multipart upload of 3 parts, not of one PUT
    body = s3_env.client().get_object(Bucket=s3_env.bucket, Key=key)["Body"].read()
    meta = json.loads(
        s3_env.client().get_object(Bucket=s3_env.bucket, Key=key.replace(SHARED_FILE, META))["Body"].read()
    )
    assert meta["files"][SHARED_FILE] == {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    assert torch.equal(manager.load(1)[0]["w"], state["w"])

    # The connection drops after two parts are uploaded: the upload is aborted, nothing appears.
    flaky = CheckpointManager(FlakyStorage(url, budget=2 * part + 1000, default_block_size=part), keep_last=2)
    with pytest.raises(TransientStorageError, match=r"step-000000002/train_state\.pt: ConnectionError.*injected"):
        flaky.save(2, state, {"rank": 0})
    assert not [k for k in object_keys(s3_env) if step_dir(2) in k]
    assert not s3_env.client().list_multipart_uploads(Bucket=s3_env.bucket).get("Uploads")
    assert flaky.latest_step() == 1


def test_a_distributed_fsdp2_checkpoint_round_trips_on_s3(s3_env: S3Env) -> None:
    """torch.distributed.checkpoint's files (FSDP2) written through fsspec to S3 with the storage's options, committed
    under the marker, read back into a fresh sharded model, and consolidated for export (fetched to a temp folder)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        store = Storage(f"{s3_env.url}/run/checkpoints")
        manager = CheckpointManager(store, keep_last=2, distributed=True)
        msd, osd = get_state_dict(model, optimizer)
        manager.save(7, {"step": 7}, {"rank": 0}, distributed_state={"model": msd, "optimizer": osd})
        names = {k.rsplit("/", 1)[1] for k in object_keys(s3_env) if step_dir(7) in k}
        assert {".metadata", "__0_0.distcp", SHARED_FILE, rank_file(0), META, MARKER} <= names
        assert manager.latest_step() == 7 and manager.read_meta(7)["distributed"] is True

        fresh = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
        fully_shard(fresh, mesh=mesh)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        fresh_msd, fresh_osd = get_state_dict(fresh, fresh_optimizer)
        state = {"model": fresh_msd, "optimizer": fresh_osd}
        manager.load_distributed(7, state)
        set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        for (name, ours), theirs in zip(fresh.state_dict().items(), model.state_dict().values(), strict=True):
            assert torch.equal(ours.full_tensor(), theirs.full_tensor()), name
        full = manager.load_distributed_full(7)
        assert torch.equal(full["model"]["0.weight"], model.state_dict()["0.weight"].full_tensor())
    finally:
        dist.destroy_process_group()


class SlowUpload(WrappedUploads):
    """Each large write of a checkpoint file takes `delay` seconds: a save stays in flight long enough to supersede."""

    def __init__(self, url: str, delay: float, **options: Any) -> None:
        super().__init__(url, **options)
        self.delay = delay

    def wrap(self, fh: IO[bytes]) -> IO[bytes]:
        import time

        real = fh.write

        def write(data: Any) -> int:
            if memoryview(data).nbytes >= 1 << 20:
                time.sleep(self.delay)
            return real(data)

        fh.write = write  # type: ignore[method-assign]
        return fh


def test_a_superseded_async_save_aborts_its_multipart_upload_and_commits_nothing_on_s3(s3_env: S3Env) -> None:
    """A stop supersedes an async save mid-upload (5 MiB parts, 5 tensors of 4 MB, each write 0.4 s): the upload
    stops at its next write and is aborted, so no object, no marker and no incomplete upload is left; the stop's
    save then commits."""
    import time

    url, part = f"{s3_env.url}/run/checkpoints", 5 * 2**20
    state: dict[str, Any] = {f"w{i}": torch.randn(1_000_000) for i in range(5)}
    manager = CheckpointManager(SlowUpload(url, 0.4, default_block_size=part), keep_last=2, async_save=True)
    manager.save(1, {**state, "step": 1}, {"rank": 0})
    time.sleep(0.6)
    started = time.monotonic()
    assert manager.supersede() == 1
    assert time.monotonic() - started < 3
    assert not [k for k in object_keys(s3_env) if step_dir(1) in k]
    assert not s3_env.client().list_multipart_uploads(Bucket=s3_env.bucket).get("Uploads")
    manager.save(2, {**state, "step": 2}, {"rank": 0})
    manager.wait()
    assert manager.latest_step() == 2 and torch.equal(manager.load(2)[0]["w4"], state["w4"])
    manager.close()
