"""S3's failures between the job and its storage (tests/s3_faults.py in front of a moto server): throttling and 5xx
are retried with back-off and the save succeeds; a failure that is not retried fails the rank at once, and the
job's failure names the rank, its host and the checkpoint; a multipart upload whose part fails is retried, or
aborted, never published half-written."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hlat.core.storage import Storage, StorageError
from hlat.infra.backends.emulator import namespaces_available
from hlat.infra.backends.protocol import Status
from tests.integration.conftest import S3Env
from tests.integration.test_local_jobs import log_text, wait
from tests.jobs import s3_job
from tests.s3_faults import Rule, S3Faults

RANK_1_FILE = r"checkpoints/step-000000002/rank-00001\.pt$"
MiB = 1 << 20


@pytest.fixture
def faults(s3_env: S3Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Faults]:
    """The proxy in front of the test's moto server; AWS_ENDPOINT_URL (the job's too) points at it."""
    with S3Faults(s3_env.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        yield proxy


def test_a_failed_part_is_retried_and_a_denied_one_aborts_the_upload(s3_env: S3Env, faults: S3Faults) -> None:
    storage = Storage(s3_env.url, default_block_size=5 * MiB)
    data = os.urandom(12 * MiB)  # three parts of 5, 5 and 2 MiB
    faults.add(Rule("UploadPart", None, "drop", times=1, after=1))
    faults.add(Rule("UploadPart", None, "internal", times=1, after=1))
    with storage.atomic_writer("retried.bin", part_size=5 * MiB) as fh:
        fh.write(data)
    assert storage.read_bytes("retried.bin") == data
    parts = [r.status for r in faults.requests if r.operation == "UploadPart"]
    assert "dropped" in parts and 500 in parts and parts.count(200) == 3, parts

    faults.clear()
    faults.add(Rule("UploadPart", r"denied\.bin$", "denied", times=None, after=1))
    started = time.monotonic()
    with pytest.raises(StorageError), storage.atomic_writer("denied.bin", part_size=5 * MiB) as fh:
        fh.write(data)
    assert time.monotonic() - started < 5
    assert not storage.exists("denied.bin")
    uploads = s3_env.client().list_multipart_uploads(Bucket=s3_env.bucket).get("Uploads", [])
    assert [u for u in uploads if u["Key"].endswith("denied.bin")] == []  # aborted, not left billed


pytestmark_emulator = pytest.mark.skipif(namespaces_available() is not None, reason=str(namespaces_available()))


@pytest.mark.slow
@pytest.mark.usefixtures("one_multi_host_job_at_a_time")
@pytestmark_emulator
def test_throttling_and_5xx_on_a_ranks_upload_are_retried_with_back_off(
    prepared: Path, tmp_path: Path, s3_env: S3Env, faults: S3Faults, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rule = faults.add(Rule("PutObject", RANK_1_FILE, "slowdown", times=2))
    more = faults.add(Rule("PutObject", RANK_1_FILE, "internal", times=1))
    backend, name = s3_job(prepared, tmp_path, s3_env.url, "throttled", max_steps=4)
    state = wait(backend, name, timeout=300)
    assert state.status == Status.COMPLETED, log_text(backend, name)[-3000:]
    puts = [r for r in faults.requests if r.operation == "PutObject" and re.search(RANK_1_FILE, r.key)]
    assert [r.status for r in puts] == [503, 503, 500, 200]
    assert len(rule.hits) == 2 and len(more.hits) == 1
    assert puts[-1].at - puts[0].at < 5  # backed off, and through within seconds
    print(f"\nrank 1's checkpoint PUT: 503, 503, 500, then 200 {puts[-1].at - puts[0].at:.2f} s after the first")


@pytest.mark.slow
@pytest.mark.usefixtures("one_multi_host_job_at_a_time")
@pytestmark_emulator
def test_a_refused_upload_fails_its_rank_at_once_and_the_failure_names_it(
    prepared: Path, tmp_path: Path, s3_env: S3Env, faults: S3Faults, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rule = faults.add(Rule("PutObject", RANK_1_FILE, "denied", times=None))
    backend, name = s3_job(prepared, tmp_path, s3_env.url, "refused", max_steps=100)
    deadline = time.monotonic() + 300
    while not rule.hits or "algo-2 failed" not in log_text(backend, name):
        state = backend.describe(name)
        assert state is not None and not state.terminal and time.monotonic() < deadline, log_text(backend, name)
        time.sleep(0.1)
    rank_failed_s = time.time() - rule.hits[0][0]
    state = wait(backend, name, timeout=120)
    log = log_text(backend, name)
    assert state.status == Status.FAILED, log[-3000:]
    # At once: the refused PUT was sent once, never retried, and the rank failed within seconds of it (not after a
    # back-off; 5.9 s under CI's load on 2026-12-07, so the bound is loose and the request count is the proof).
    assert len(rule.hits) == 1 and rank_failed_s < 30, (len(rule.hits), rank_failed_s, log[-3000:])
    reason = state.failure_reason or ""
    # What the checkpoint manager says of a failed background save: the checkpoint, the rank and its host.
    assert "failed (rank 1 on algo-2)" in reason and "access denied to " in reason, reason
    assert re.search(RANK_1_FILE.replace(r"\.pt$", r"\.pt"), reason) and '"rank": 1' in reason, reason
    print(f"\nrank 1's PUT refused: algo-2 failed {rank_failed_s:.2f} s later; FailureReason: {reason[:300]}")
