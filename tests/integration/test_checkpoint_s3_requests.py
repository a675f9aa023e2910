"""The S3 requests of checkpoints at scale, on a real moto S3 server (fixtures in conftest.py): every request a 2 x 2
job's ranks send is counted through a botocore `before-send` hook on their s3fs clients, by operation and prefix,
and checked against the arithmetic that benchmarks/bench_checkpoint.py scales to HLAT's 64 and 256 hosts
(`checkpoint_requests`, `read_requests`); resuming reads the listing once; killed uploads are aborted; the clients
retry throttling with back-off and time out."""

from __future__ import annotations

import json
import threading
from collections import Counter
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import torch

from hlat.core.storage import Storage
from hlat.training.checkpoint import (
    CHECKPOINT_PART_SIZE,
    META,
    CheckpointManager,
    checkpoint_requests,
    manifest_file,
    rank_file,
    read_requests,
    shard_file,
    step_dir,
)
from tests.jobs import ThreadShare
from tests.jobs import run_ranks as threaded_ranks

S3Env = Any  # conftest's fixture type
PART = 5 << 20  # S3's smallest part: the shard files below are multipart uploads of 3 parts
SHARDS = ("tp00", "tp01")


def operation(method: str, url: str) -> tuple[str, str]:
    """(S3 operation, the prefix it touches: a key's folder, a listing's Prefix) of one HTTP request."""
    parts = urlsplit(url)
    query = parse_qs(parts.query, keep_blank_values=True)
    path = unquote(parts.path).lstrip("/")
    key = path.split("/", 1)[1] if "/" in path else ""
    folder = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
    if method == "GET" and "list-type" in query:
        return "ListObjectsV2", query.get("prefix", [""])[0]
    if method == "GET" and "uploads" in query:
        return "ListMultipartUploads", query.get("prefix", [""])[0]
    if method == "POST" and "delete" in query:
        return "DeleteObjects", ""
    if method == "POST" and "uploads" in query:
        return "CreateMultipartUpload", folder
    if method == "POST" and "uploadId" in query:
        return "CompleteMultipartUpload", folder
    if method == "PUT" and "partNumber" in query:
        return "UploadPart", folder
    if method == "DELETE" and "uploadId" in query:
        return "AbortMultipartUpload", folder
    names = {"PUT": "PutObject", "GET": "GetObject", "HEAD": "HeadObject", "DELETE": "DeleteObject"}
    return names.get(method, method), folder


class RequestLog:
    """Every HTTP request (retries included) the s3fs clients of some storages send, by rank."""

    def __init__(self) -> None:
        self.requests: list[tuple[int, str, str]] = []  # rank, operation, prefix
        self._lock = threading.Lock()

    def watch(self, storage: Storage, rank: int) -> Storage:
        storage.fs.connect()

        def before_send(request: Any, **_: Any) -> None:
            with self._lock:
                self.requests.append((rank, *operation(request.method, request.url)))

        storage.fs.s3.meta.events.register("before-send.s3", before_send)
        return storage

    def counts(self, rank: int | None = None, prefix: str | None = None) -> Counter[str]:
        return Counter(
            op for r, op, p in self.requests if (rank is None or r == rank) and (prefix is None or p == prefix)
        )

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()


def run_ranks(work: Any, world_size: int = 4) -> list[Any]:
    """Every rank's result; the first rank's exception raised."""
    results = threaded_ranks(world_size, work)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def tp2_dp2(url: str, log: RequestLog, barrier: threading.Barrier, share: ThreadShare) -> list[CheckpointManager]:
    return [
        CheckpointManager(
            log.watch(Storage(url, default_block_size=PART), rank),
            keep_last=2,
            rank=rank,
            world_size=4,
            barrier=lambda: barrier.wait(),
            shard=SHARDS[rank % 2],
            shard_writer=rank < 2,
            shards=SHARDS,
            share=share.of(rank),
        )
        for rank in range(4)
    ]


def shard_state(rank: int, step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(rank % 2)  # not the global one: ranks run on threads
    return {"step": step, "model": {"w": torch.randn(3_000_000, generator=generator)}}  # 12 MB: three 5 MiB parts


def test_a_2x2_checkpoint_sends_the_requests_the_scaling_arithmetic_counts(
    s3_env: S3Env, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{s3_env.url}/run/checkpoints"
    log = RequestLog()
    ranks = tp2_dp2(url, log, threading.Barrier(4, timeout=60), ThreadShare(4))
    run_ranks(lambda r: ranks[r].save(1, shard_state(r, 1), {"rank": r}))
    step_prefix = f"prefix/run/checkpoints/{step_dir(1)}/"
    meta = json.loads(s3_env.client().get_object(Bucket=s3_env.bucket, Key=f"{step_prefix}{META}")["Body"].read())
    sizes = {name: info["size"] for name, info in meta["files"].items()}
    assert sizes[shard_file("tp00")] > 2 * PART and sizes[rank_file(3)] < PART

    # Writes: exactly what checkpoint_requests says, every one into the step's prefix.
    expected = checkpoint_requests(sizes, PART, manifests=3)
    writes = ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload")
    measured = {op: n for op, n in log.counts().items() if op in writes}
    assert measured == {op: n for op, n in expected.items() if n}
    assert {op: n for op, n in log.counts(prefix=step_prefix).items() if op in writes} == measured
    assert expected == {
        "PutObject": 4 + 3 + 2,  # rank files, manifests, meta.json, COMMITTED
        "CreateMultipartUpload": 2,
        "UploadPart": 6,
        "CompleteMultipartUpload": 2,
    }
    # Rank 0 reads the three manifests (a HEAD and a GET each: s3fs asks the size first); others read nothing.
    assert log.counts(prefix=step_prefix)["GetObject"] == 3
    for rank in (1, 2, 3):
        assert not {op for op in log.counts(rank=rank) if op not in writes}, log.counts(rank=rank)
    save_counts = log.counts()
    by_prefix = Counter((op, p) for _, op, p in log.requests)

    # Resume: rank 0 finds the checkpoint, the others only read their own two files.
    log.clear()

    def resume(rank: int) -> int:
        found = ranks[rank].resume_point()
        assert found is not None
        shared, mine = ranks[rank].load(found[0])
        assert mine == {"rank": rank} and torch.equal(shared["model"]["w"], shard_state(rank, 1)["model"]["w"])
        return found[0]

    assert run_ranks(resume) == [1, 1, 1, 1]
    for rank in (1, 2, 3):
        own = read_requests(sizes[shard_file(SHARDS[rank % 2])], PART) + read_requests(sizes[rank_file(rank)], PART)
        assert sum(log.counts(rank=rank).values()) == own, log.counts(rank=rank)
        assert set(log.counts(rank=rank)) == {"HeadObject", "GetObject"}
    finding = log.counts(rank=0)
    with capsys.disabled():  # the measured numbers, for the table in docs/multi-host.md
        print(f"\n2x2 checkpoint (5 MiB parts): {dict(save_counts)}")
        print(f"by (operation, prefix): {dict(by_prefix)}")
        print(f"resume, rank 0: {dict(finding)}; ranks 1-3: {[sum(log.counts(rank=r).values()) for r in (1, 2, 3)]}")


def test_default_checkpoint_parts_make_small_files_one_put(s3_env: S3Env) -> None:
    store = Storage(f"{s3_env.url}/run/checkpoints")
    assert store.block_size is None and CHECKPOINT_PART_SIZE == 512 << 20
    manager = CheckpointManager(store, keep_last=1)
    manager.save(1, {"w": torch.randn(3_000_000)}, {"rank": 0})  # 12 MB: one part of 512 MiB
    key = f"prefix/run/checkpoints/{step_dir(1)}/train_state.pt"
    etag = s3_env.client().head_object(Bucket=s3_env.bucket, Key=key)["ETag"]
    assert "-" not in etag.strip('"')  # a single PutObject's ETag, not a multipart upload's (<md5>-<parts>)


def test_s3_clients_retry_throttling_adaptively_and_time_out(s3_env: S3Env) -> None:
    store = Storage(s3_env.url)
    store.fs.connect()
    config = store.fs.s3.meta.config
    assert config.retries == {"mode": "adaptive", "total_max_attempts": 10}
    assert (config.connect_timeout, config.read_timeout) == (10, 120)
    # A caller's own client settings win, key by key.
    mine = Storage(s3_env.url, config_kwargs={"read_timeout": 5})
    mine.fs.connect()
    assert mine.fs.s3.meta.config.read_timeout == 5 and mine.fs.s3.meta.config.retries["mode"] == "adaptive"


def test_a_job_start_aborts_the_uploads_a_killed_attempt_left(s3_env: S3Env) -> None:
    client = s3_env.client()
    inside = f"prefix/run/checkpoints/{step_dir(3)}/{rank_file(5)}"
    outside = "prefix/run/data/shard-00000.parquet"  # another stage's upload: not the checkpoints' to abort
    for key in (inside, f"prefix/run/checkpoints/{step_dir(4)}/{manifest_file(2)}", outside):
        upload = client.create_multipart_upload(Bucket=s3_env.bucket, Key=key)
        client.upload_part(Bucket=s3_env.bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 100)
    manager = CheckpointManager(Storage(f"{s3_env.url}/run/checkpoints"), keep_last=1)
    assert CheckpointManager(manager.storage, keep_last=1, rank=1, world_size=2).abort_incomplete_uploads() == 0
    assert manager.discard_after(None) == []  # rank 0 at a job's start: no step folder, two uploads
    left = client.list_multipart_uploads(Bucket=s3_env.bucket).get("Uploads", [])
    assert [u["Key"] for u in left] == [outside]
    assert manager.abort_incomplete_uploads() == 0


def test_the_scaled_estimate_keeps_every_hlat_job_under_s3s_per_prefix_rates() -> None:
    from benchmarks.bench_checkpoint import S3_GET_PER_PREFIX_S, S3_PUT_PER_PREFIX_S, hlat_jobs, s3_requests

    jobs = {(job.name, job.hosts): job for job in hlat_jobs()}
    assert set(jobs) == {("7B", 64), ("70B", 64), ("7B", 256), ("70B", 256)}
    big = jobs[("70B", 256)]
    assert big.world_size == 8192 and big.files()["model-0.pt"] > CHECKPOINT_PART_SIZE  # a shard: 2 parts
    before = s3_requests(big, 50 << 20, spread=False, manifests=False)
    assert before["writes"] > 30_000 and before["write_peak_per_s"] > S3_PUT_PER_PREFIX_S  # the review's finding
    for job in jobs.values():
        now = s3_requests(job, CHECKPOINT_PART_SIZE, spread=True, manifests=True)
        assert now["write_peak_per_s"] < S3_PUT_PER_PREFIX_S and now["resume_peak_per_s"] < S3_GET_PER_PREFIX_S
