"""Atomic per-rank checkpoints (training/checkpoint/) on a local `Storage`; tests/integration has the S3 ones."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import pytest
import torch
from torch import nn

from hlat.core.config import TrainingConfig
from hlat.core.storage import Storage
from hlat.training.checkpoint import (
    MARKER,
    META,
    SHARED_FILE,
    CheckpointError,
    CheckpointManager,
    StagingBuffers,
    capture_rng_state,
    host_of,
    manifest_file,
    rank_file,
    restore_rng_state,
    retention,
    shard_file,
    stage_to_cpu,
    step_dir,
)
from hlat.training.optim import build_optimizer, build_scheduler
from tests.jobs import ThreadShare, run_ranks


class SpyStorage(Storage):
    """A local Storage that records writes and removes, and can fail the Nth write or block every write."""

    def __init__(self, url: str, fail_on_write: int | None = None) -> None:
        super().__init__(url)
        self.fail_on_write = fail_on_write
        self.writes: list[str] = []
        self.removes: list[tuple[str, bool]] = []
        self.gate: threading.Event | None = None

    def _before_write(self, rel: str) -> None:
        if self.gate is not None:
            self.gate.wait(timeout=30)
        if self.fail_on_write is not None and len(self.writes) + 1 == self.fail_on_write:
            self.writes.append(f"FAILED {rel}")
            raise OSError(f"injected failure writing {rel}")

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._before_write(rel)
        super().write_bytes(rel, data)
        self.writes.append(rel)

    @contextlib.contextmanager
    def atomic_writer(self, rel: str) -> Iterator[IO[bytes]]:
        # The state files stream through here: they count as writes like the small files above.
        self._before_write(rel)
        with super().atomic_writer(rel) as fh:
            yield fh
        self.writes.append(rel)

    def remove(self, rel: str, recursive: bool = False) -> None:
        self.removes.append((rel, recursive))
        super().remove(rel, recursive=recursive)


def tiny_training(steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.ReLU(), nn.Linear(12, 3))
    cfg = TrainingConfig(lr=1e-2, warmup_steps=2, max_steps=20)
    opt = build_optimizer(model, cfg, "fp32")
    sched = build_scheduler(opt, cfg)
    for _ in range(steps):
        loss = model(torch.randn(5, 6)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model, opt, sched


def shared_of(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> dict[str, Any]:
    return {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Bitwise equality of two state trees (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        raw_a = a.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
        raw_b = b.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
        assert torch.equal(raw_a, raw_b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def committed(store: Storage) -> list[int]:
    return CheckpointManager(store, keep_last=1).committed_steps()


# -- round trip --------------------------------------------------------------------------------------------


def test_round_trip_is_bitwise_and_training_continues_identically(tmp_path: Path) -> None:
    store = Storage(str(tmp_path / "checkpoints"))
    manager = CheckpointManager(store, keep_last=3, fingerprint="abc123")
    model, opt, sched = tiny_training()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    rank_state = {"loader": {"epoch": 1, "offset": 12345, "order": [3, 1, 2]}, "rng": capture_rng_state()}
    shared = shared_of(model, opt, sched, 3)
    manager.save(3, shared, rank_state)

    names = sorted(p.name for p in (tmp_path / "checkpoints" / "step-000000003").iterdir())
    assert names == sorted([MARKER, META, SHARED_FILE, rank_file(0)])
    meta = json.loads((tmp_path / "checkpoints" / "step-000000003" / META).read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1 and meta["fingerprint"] == "abc123"
    assert set(meta["files"]) == {SHARED_FILE, rank_file(0)}

    assert manager.latest_step() == 3
    loaded_shared, loaded_rank = manager.load(3)
    assert_same(shared, loaded_shared)
    assert_same(rank_state, loaded_rank)

    # The loaded state continues training exactly like the original.
    expected = [random.random(), np.random.rand(), torch.rand(3)]
    model2, opt2, sched2 = tiny_training(steps=0)
    model2.load_state_dict(loaded_shared["model"])
    opt2.load_state_dict(loaded_shared["optimizer"])
    sched2.load_state_dict(loaded_shared["scheduler"])
    restore_rng_state(loaded_rank["rng"])
    assert_same(expected, [random.random(), np.random.rand(), torch.rand(3)])
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        torch.manual_seed(9)
        for _ in range(3):
            loss = m(torch.randn(5, 6)).pow(2).mean()
            o.zero_grad()
            loss.backward()
            o.step()
            s.step()
    assert_same(model.state_dict(), model2.state_dict())
    assert_same(opt.state_dict(), opt2.state_dict())


def test_state_that_weights_only_load_would_refuse_is_rejected_before_writing(tmp_path: Path) -> None:
    manager = CheckpointManager(Storage(str(tmp_path)), keep_last=2)
    with pytest.raises(CheckpointError, match=r"shared_state\['opt'\]\['lr'\]: a numpy.float64"):
        manager.save(1, {"opt": {"lr": np.float64(0.1)}}, {})
    with pytest.raises(CheckpointError, match=r"rank_state\['rng'\]\[0\]: a numpy.ndarray"):
        manager.save(1, {}, {"rng": [np.zeros(3)]})
    assert list(tmp_path.iterdir()) == []


def test_capture_rng_state_survives_weights_only_load() -> None:
    state = capture_rng_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    before = (random.random(), np.random.randn(4).tolist(), torch.randn(4))
    restore_rng_state(loaded)
    after = (random.random(), np.random.randn(4).tolist(), torch.randn(4))
    assert_same(before, after)


# -- atomicity ---------------------------------------------------------------------------------------------


def test_marker_is_written_last(tmp_path: Path) -> None:
    store = SpyStorage(str(tmp_path))
    CheckpointManager(store, keep_last=2).save(7, {"w": torch.ones(2)}, {"r": 0})
    folder = step_dir(7)
    assert store.writes == [
        f"{folder}/{SHARED_FILE}",
        f"{folder}/{rank_file(0)}",
        f"{folder}/{META}",
        f"{folder}/{MARKER}",
    ]


@pytest.mark.parametrize("fail_on", [1, 2, 3, 4])
def test_a_save_failing_midway_is_skipped_and_the_previous_one_loads(
    tmp_path: Path, fail_on: int, caplog: pytest.LogCaptureFixture
) -> None:
    good = CheckpointManager(Storage(str(tmp_path)), keep_last=5)
    good.save(1, {"w": torch.full((3,), 1.0)}, {"r": 1})
    store = SpyStorage(str(tmp_path), fail_on_write=fail_on)
    failing = CheckpointManager(store, keep_last=5)
    with pytest.raises(OSError, match="injected"):
        failing.save(2, {"w": torch.full((3,), 2.0)}, {"r": 2})
    assert not (tmp_path / step_dir(2) / MARKER).exists()
    with caplog.at_level(logging.WARNING, logger="hlat.training.checkpoint"):
        assert good.latest_step() == 1
    if (tmp_path / step_dir(2)).exists():
        assert step_dir(2) in caplog.text and "no COMMITTED marker" in caplog.text
    shared, mine = good.load(1)
    assert shared["w"].tolist() == [1.0, 1.0, 1.0] and mine == {"r": 1}
    with pytest.raises(CheckpointError, match="not usable"):
        good.load(2)


@pytest.mark.parametrize("victim", [SHARED_FILE, rank_file(0)])
def test_a_truncated_file_in_a_committed_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, victim: str, caplog: pytest.LogCaptureFixture
) -> None:
    manager = CheckpointManager(Storage(str(tmp_path)), keep_last=5)
    manager.save(1, {"w": torch.zeros(100)}, {"r": 1})
    manager.save(2, {"w": torch.ones(100)}, {"r": 2})
    path = tmp_path / step_dir(2) / victim
    path.write_bytes(path.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, logger="hlat.training.checkpoint"):
        assert manager.latest_step() == 1
    assert step_dir(2) in caplog.text and victim in caplog.text and "truncated" in caplog.text
    with pytest.raises(CheckpointError, match=victim):
        manager.load(2)
    assert manager.load(1)[1] == {"r": 1}


def test_tampered_meta_and_corrupted_content_are_detected(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(Storage(str(tmp_path)), keep_last=5)
    manager.save(1, {"w": torch.zeros(100)}, {"r": 1})
    manager.save(2, {"w": torch.zeros(100)}, {"r": 2})
    manager.save(3, {"w": torch.zeros(100)}, {"r": 3})
    # Same size, different bytes: caught by the sha256 when loading.
    shared = tmp_path / step_dir(3) / SHARED_FILE
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shared.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        manager.load(3)
    # meta.json edited after the commit: no longer matches the marker.
    meta = tmp_path / step_dir(3) / META
    meta.write_text(meta.read_text().replace('"world_size": 1', '"world_size": 1 '))
    (tmp_path / step_dir(2) / MARKER).write_text("not json")
    with caplog.at_level(logging.WARNING, logger="hlat.training.checkpoint"):
        assert manager.latest_step() == 1
    assert "does not match" in caplog.text and "unreadable" in caplog.text


def test_resaving_a_step_drops_its_stale_marker_first(tmp_path: Path) -> None:
    CheckpointManager(Storage(str(tmp_path)), keep_last=5).save(4, {"w": torch.zeros(2)}, {"r": 0})
    store = SpyStorage(str(tmp_path), fail_on_write=2)  # train_state.pt is rewritten, then the rank file fails
    with pytest.raises(OSError):
        CheckpointManager(store, keep_last=5).save(4, {"w": torch.ones(2)}, {"r": 0})
    assert store.removes[0] == (f"{step_dir(4)}/{MARKER}", False)
    assert CheckpointManager(Storage(str(tmp_path)), keep_last=5).latest_step() is None


# -- retention ---------------------------------------------------------------------------------------------


def test_retention_keeps_the_last_n_and_every_kth(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    manager = CheckpointManager(store, keep_last=2, keep_every=4)
    for step in range(1, 11):
        manager.save(step, {"w": torch.tensor(step)}, {})
    assert committed(store) == [4, 8, 9, 10]
    assert store.list() == [step_dir(s) for s in (4, 8, 9, 10)]

    plain = CheckpointManager(Storage(str(tmp_path / "plain")), keep_last=3)
    for step in range(0, 50, 10):
        plain.save(step, {}, {})
    assert committed(plain.storage) == [20, 30, 40]


def test_incomplete_older_folders_are_garbage_collected_newer_ones_are_not(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    manager = CheckpointManager(store, keep_last=2)
    manager.save(1, {}, {})
    for step, fail_on in ((2, 2), (9, 1 + 2)):  # step 9: only its train_state.pt and rank file are written
        with pytest.raises(OSError):
            CheckpointManager(SpyStorage(str(tmp_path), fail_on_write=fail_on), keep_last=2).save(step, {}, {})
    assert store.list() == [step_dir(1), step_dir(2), step_dir(9)]
    manager.save(3, {}, {})
    # step 2 (older than the new commit, marker-less) is gone; step 9 may be another rank's save in progress.
    assert store.list() == [step_dir(1), step_dir(3), step_dir(9)]
    assert manager.latest_step() == 3


def test_deletion_removes_the_marker_first(tmp_path: Path) -> None:
    store = SpyStorage(str(tmp_path))
    manager = CheckpointManager(store, keep_last=1)
    for step in (1, 2, 3):
        manager.save(step, {}, {})
    deletions = [r for r in store.removes if r[1]]
    assert deletions == [(step_dir(1), True), (step_dir(2), True)]
    for folder, _ in deletions:
        marker_at = store.removes.index((f"{folder}/{MARKER}", False))
        assert marker_at < store.removes.index((folder, True))
    assert store.list() == [step_dir(3)]


# -- async -------------------------------------------------------------------------------------------------


def test_async_save_writes_what_sync_save_writes(tmp_path: Path) -> None:
    model, opt, sched = tiny_training()
    rank_state = {"rng": capture_rng_state(), "loader": {"pos": 3}}
    sync = CheckpointManager(Storage(str(tmp_path / "sync")), keep_last=2)
    sync.save(3, shared_of(model, opt, sched, 3), rank_state)
    background = CheckpointManager(Storage(str(tmp_path / "async")), keep_last=2, async_save=True)
    background.save(3, shared_of(model, opt, sched, 3), rank_state)
    # The state was staged before save() returned: changing it now does not change the checkpoint.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    background.wait()
    expected = sync.load(3)
    got = background.load(3)
    assert_same(expected, got)
    assert not torch.equal(got[0]["model"]["0.weight"], model.state_dict()["0.weight"])
    background.close()


def test_async_save_returns_before_writing_and_the_next_save_waits(tmp_path: Path) -> None:
    store = SpyStorage(str(tmp_path))
    store.gate = threading.Event()
    manager = CheckpointManager(store, keep_last=5, async_save=True)
    manager.save(1, {"w": torch.zeros(3)}, {})  # returns although every write is blocked
    assert store.writes == []
    second_done = threading.Event()

    def second() -> None:
        manager.save(2, {"w": torch.ones(3)}, {})
        second_done.set()

    thread = threading.Thread(target=second)
    thread.start()
    time.sleep(0.2)
    assert not second_done.is_set()  # waiting for save 1
    store.gate.set()
    thread.join(timeout=30)
    assert second_done.is_set()
    manager.wait()
    assert committed(store) == [1, 2]
    manager.close()


def test_async_errors_surface_on_wait_and_on_the_next_save(tmp_path: Path) -> None:
    store = SpyStorage(str(tmp_path), fail_on_write=1)
    manager = CheckpointManager(store, keep_last=5, async_save=True)
    manager.save(1, {"w": torch.zeros(3)}, {})
    with pytest.raises(CheckpointError, match=r"background save of .*step-000000001.* failed.*injected"):
        manager.wait()
    manager.wait()  # reported once
    store.fail_on_write = len(store.writes) + 1
    manager.save(2, {}, {})
    with pytest.raises(CheckpointError, match="step-000000002"):
        manager.save(3, {}, {})
    manager.save(4, {}, {})
    manager.close()
    assert committed(store) == [4]


# -- several ranks -----------------------------------------------------------------------------------------


def test_two_ranks_write_one_checkpoint(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    rank0 = CheckpointManager(store, keep_last=2, rank=0, world_size=2)
    rank1 = CheckpointManager(store, keep_last=2, rank=1, world_size=2)
    for step in (10, 20, 30):
        rank1.save(step, None, {"rank": 1, "pos": step + 1})  # rank 1 first: the barrier is a no-op here
        assert rank0.latest_step() == (step - 10 or None)
        rank0.save(step, {"w": torch.tensor(float(step))}, {"rank": 0, "pos": step})
    assert rank0.latest_step() == rank1.latest_step() == 30
    assert sorted(p.name for p in (tmp_path / step_dir(30)).iterdir()) == sorted(
        [SHARED_FILE, rank_file(0), rank_file(1), manifest_file(1), META, MARKER]
    )
    assert store.list() == [step_dir(20), step_dir(30)]
    shared0, mine0 = rank0.load(30)
    shared1, mine1 = rank1.load(30)
    assert shared0["w"].item() == shared1["w"].item() == 30.0
    assert mine0 == {"rank": 0, "pos": 30} and mine1 == {"rank": 1, "pos": 31}
    # A job with another world size cannot take over the per-rank state.
    with pytest.raises(CheckpointError, match="2 ranks"):
        CheckpointManager(store, keep_last=2).load(30)


def test_rank_zero_does_not_commit_without_every_rank_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SageMaker's environment: one rank per host here; its driver numbers nodes in the sorted host list's order.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("SM_HOSTS", '["algo-3", "algo-1", "algo-2"]')
    store = Storage(str(tmp_path))
    rank0 = CheckpointManager(store, keep_last=2, rank=0, world_size=3, commit_timeout_s=0.2)
    CheckpointManager(store, keep_last=2, rank=2, world_size=3).save(5, None, {})
    with pytest.raises(CheckpointError, match=r"rank-00001\.pt, manifest-00001\.json missing .*algo-2: rank 1\)"):
        rank0.save(5, {}, {})
    assert rank0.latest_step() is None


def test_barrier_runs_between_the_rank_files_and_the_commit(tmp_path: Path) -> None:
    store = SpyStorage(str(tmp_path))
    seen: list[list[str]] = []
    rank1 = CheckpointManager(store, keep_last=2, rank=1, world_size=2)

    def barrier() -> None:
        # The "other rank" writes its file while rank 0 waits in the barrier, as a real barrier would allow.
        seen.append(list(store.writes))
        rank1.save(1, None, {"r": 1})

    rank0 = CheckpointManager(store, keep_last=2, rank=0, world_size=2, barrier=barrier)
    rank0.save(1, {}, {"r": 0})
    assert seen == [[f"{step_dir(1)}/{SHARED_FILE}", f"{step_dir(1)}/{rank_file(0)}"]]
    assert store.writes[-2:] == [f"{step_dir(1)}/{META}", f"{step_dir(1)}/{MARKER}"]
    assert rank0.latest_step() == 1


def test_async_rank_zero_waits_for_the_other_ranks_files(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    rank0 = CheckpointManager(store, keep_last=2, rank=0, world_size=2, async_save=True, commit_timeout_s=30)
    rank1 = CheckpointManager(store, keep_last=2, rank=1, world_size=2, async_save=True)
    rank0.save(1, {"w": torch.ones(2)}, {"r": 0})  # rank 0 first: its background thread polls for rank 1
    time.sleep(0.2)
    assert rank0.latest_step() is None
    rank1.save(1, None, {"r": 1})
    rank1.wait()
    rank0.wait()
    assert rank1.load(1)[1] == {"r": 1}
    rank0.close()
    rank1.close()


def test_the_async_writer_runs_its_torch_ops_on_one_thread(tmp_path: Path) -> None:
    """A second OpenMP team as large as the loop's would slow every later training step (see
    one_intra_op_thread); the loop's own thread count is left alone."""
    seen: list[int] = []

    class Watching(SpyStorage):
        def _before_write(self, rel: str) -> None:
            seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    manager = CheckpointManager(Watching(str(tmp_path)), keep_last=1, async_save=True)
    manager.save(1, {"w": torch.ones(2)}, {})
    manager.close()
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == before


def test_a_resumed_job_discards_what_an_earlier_attempt_left_past_its_step(tmp_path: Path) -> None:
    """An attempt reached step 8's files and died before the commit; the next resumes from 4. Without the
    discard, rank 0's async save of step 8 would see the old rank-00001.pt, commit its size, and leave a
    checkpoint whose file rank 1 then replaces (what CI once caught as 'N bytes, M were written')."""
    store = Storage(str(tmp_path))
    first = [CheckpointManager(store, keep_last=3, rank=r, world_size=2) for r in (1, 0)]
    for manager in first:  # rank 1 first: the barrier is a no-op here
        manager.save(4, {"w": torch.ones(2)} if manager.rank == 0 else None, {"r": manager.rank})
    first[0].save(8, None, {"r": 1, "old": "x" * 100})  # rank 1 of the dead attempt; rank 0 never committed
    (tmp_path / step_dir(9)).mkdir()  # and a folder of a later step (an async save under way when it died)
    rank0 = CheckpointManager(store, keep_last=3, rank=0, world_size=2, async_save=True, commit_timeout_s=30)
    rank1 = CheckpointManager(store, keep_last=3, rank=1, world_size=2, async_save=True)
    assert rank0.latest_step() == 4
    assert rank1.discard_after(4) == []  # only rank 0 deletes
    assert rank0.discard_after(4) == [8, 9]
    assert store.list() == [step_dir(4)]
    rank0.save(8, {"w": torch.zeros(2)}, {"r": 0})
    time.sleep(0.3)
    assert rank0.latest_step() == 4  # waiting for rank 1's new file, not taking the old one
    rank1.save(8, None, {"r": 1})
    rank1.wait()
    rank0.wait()
    assert rank0.latest_step() == 8 and rank1.load(8)[1] == {"r": 1}
    assert rank0.discard_after(None) == [4, 8] and store.list() == []  # started from scratch: everything goes
    rank0.close()
    rank1.close()


def test_arguments_are_checked(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(store, keep_last=0)
    with pytest.raises(ValueError, match="rank"):
        CheckpointManager(store, keep_last=1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="shared state"):
        CheckpointManager(store, keep_last=1).save(1, None, {})
    assert CheckpointManager(store, keep_last=1).latest_step() is None
    with pytest.raises(ValueError, match="shard name"):
        CheckpointManager(store, keep_last=1, world_size=2, shard="tp/0", shards=["tp/0", "tp1"])
    with pytest.raises(ValueError, match="distinct"):
        CheckpointManager(store, keep_last=1, world_size=2, shard="tp0", shards=["tp0", "tp0"])
    with pytest.raises(ValueError, match="not among"):
        CheckpointManager(store, keep_last=1, world_size=2, shard="tp2", shards=["tp0", "tp1"])
    with pytest.raises(ValueError, match="also pass this rank's shard"):
        CheckpointManager(store, keep_last=1, shards=["tp0"])
    with pytest.raises(ValueError, match="at least as many ranks"):
        CheckpointManager(store, keep_last=1, shard="tp0", shards=["tp0", "tp1"])
    writer = CheckpointManager(
        store, keep_last=1, world_size=2, rank=1, shard="tp1", shard_writer=True, shards=["tp0", "tp1"]
    )
    with pytest.raises(ValueError, match=r"rank 1 writes model-tp1\.pt: .*shared state"):
        writer.save(1, None, {})


# -- streaming -----------------------------------------------------------------------------------------------


class FailingSink:
    """A file that takes `budget` bytes, then fails like a full disk."""

    def __init__(self, inner: IO[bytes], budget: int) -> None:
        self.inner, self.budget, self.sizes = inner, budget, list[int]()

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if sum(self.sizes) + n > self.budget:
            raise OSError(28, "No space left on device (injected)")
        self.sizes.append(n)
        return self.inner.write(data)

    def flush(self) -> None:
        self.inner.flush()


class SinkStorage(Storage):
    """Hands torch.save a FailingSink: records the size of every write it streams, fails past `budget`."""

    def __init__(self, url: str, budget: int = 1 << 40) -> None:
        super().__init__(url)
        self.budget = budget
        self.streams: dict[str, list[int]] = {}

    @contextlib.contextmanager
    def atomic_writer(self, rel: str) -> Iterator[IO[bytes]]:
        with super().atomic_writer(rel) as fh:
            sink = FailingSink(fh, self.budget)
            self.streams[rel] = sink.sizes
            yield cast(IO[bytes], sink)


def awkward_state() -> dict[str, Any]:
    """Big and small tensors, a tied pair, a transposed and a sliced view, and a pickle over 64 KiB (memory torch
    frees as soon as it is written): every path through the streaming writer's hashing."""
    torch.manual_seed(5)
    big = torch.randn(300, 400)
    return {
        "big": big,
        "tied": big,
        "transposed": torch.randn(200, 300).t(),
        "slice": torch.randn(1000, 100)[10:20],
        "small": torch.arange(10),
        "bf16": torch.randn(256, 256).to(torch.bfloat16),
        "long_list": list(range(30_000)),
    }


def test_a_streamed_file_is_what_its_meta_says_and_is_never_whole_in_memory(tmp_path: Path) -> None:
    store = SinkStorage(str(tmp_path))
    manager = CheckpointManager(store, keep_last=2)
    state = awkward_state()
    manager.save(1, state, {"rng": capture_rng_state()})
    meta = json.loads((tmp_path / step_dir(1) / META).read_text())
    for name in (SHARED_FILE, rank_file(0)):
        data = (tmp_path / step_dir(1) / name).read_bytes()
        assert meta["files"][name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # torch.save wrote into the storage piece by piece: no write holds more than the biggest tensor.
    writes = store.streams[f"{step_dir(1)}/{SHARED_FILE}"]
    assert len(writes) > 10 and max(writes) <= 300 * 400 * 4
    loaded, _ = manager.load(1)
    assert_same(state, loaded)
    assert loaded["tied"] is loaded["big"]


def test_a_stream_failing_midway_leaves_no_file(tmp_path: Path) -> None:
    CheckpointManager(Storage(str(tmp_path)), keep_last=5).save(1, {"w": torch.zeros(10)}, {})
    failing = CheckpointManager(SinkStorage(str(tmp_path), budget=200_000), keep_last=5)
    with pytest.raises(OSError, match="No space left"):
        failing.save(2, awkward_state(), {})
    assert sorted(p.name for p in (tmp_path / step_dir(2)).iterdir()) == []  # no train_state.pt, no .tmp
    assert failing.latest_step() == 1


def test_staging_buffers_are_refilled_by_the_next_copy() -> None:
    model = nn.Linear(64, 64)
    weights = model.state_dict()
    state = {"model": weights, "step": torch.tensor(1), "tied": weights["weight"]}
    buffers = StagingBuffers()
    first = stage_to_cpu(state, reuse=buffers)
    assert first["tied"] is first["model"]["weight"]
    kept = first["model"]["weight"]
    with torch.no_grad():
        model.weight.add_(1.0)
    second = stage_to_cpu(state, reuse=buffers)
    assert second["model"]["weight"] is kept and torch.equal(kept, model.weight.detach())  # same memory, new values
    assert second["tied"] is second["model"]["weight"]
    third = stage_to_cpu({"model": nn.Linear(64, 32).state_dict()}, reuse=buffers)  # another shape: fresh buffers
    assert third["model"]["weight"] is not kept and third["model"]["weight"].shape == (32, 64)
    with pytest.raises(ValueError, match="copy=True"):
        stage_to_cpu(state, copy=False, reuse=buffers)


def test_async_saves_refill_their_buffers_only_after_the_previous_write(tmp_path: Path) -> None:
    manager = CheckpointManager(Storage(str(tmp_path)), keep_last=5, async_save=True)
    w = torch.zeros(1000)
    for step in (1, 2, 3):
        w.fill_(float(step))
        manager.save(step, {"w": w}, {"step": torch.tensor(step)})
    manager.close()
    for step in (1, 2, 3):
        shared, mine = manager.load(step)
        assert shared["w"].eq(float(step)).all() and mine["step"].item() == step


def test_staging_in_the_background_copies_before_wait_staged_returns(tmp_path: Path) -> None:
    store = SpyStorage(str(tmp_path))
    store.gate = threading.Event()  # the writes wait: the copy alone is between save() and wait_staged()
    manager = CheckpointManager(store, keep_last=5, async_save=True, stage_in_background=True)
    w = torch.zeros(1 << 16)
    manager.save(1, {"w": w}, {"pos": torch.tensor(1)})
    manager.wait_staged()  # the trainer's wait before its optimizer step
    w.fill_(7.0)  # the optimizer step: after the copy, so not in the checkpoint
    assert store.writes == []
    store.gate.set()
    manager.wait()
    manager.save(2, {"w": w}, {"pos": torch.tensor(2)})  # the previous buffers, refilled
    manager.close()
    assert manager.load(1)[0]["w"].eq(0.0).all() and manager.load(2)[0]["w"].eq(7.0).all()
    with pytest.raises(ValueError, match="needs reuse"):
        stage_to_cpu({"w": w}, defer=True)


def test_checkpoint_files_carry_no_record_crc32_and_the_setting_is_put_back(tmp_path: Path) -> None:
    import zipfile

    import torch.utils.serialization

    manager = CheckpointManager(Storage(str(tmp_path)), keep_last=1)
    manager.save(1, {"w": torch.arange(1000.0)}, {})
    with zipfile.ZipFile(tmp_path / step_dir(1) / SHARED_FILE) as archive:
        assert {info.CRC for info in archive.infolist()} == {0}  # torch skipped the pass; sha256 covers the bytes
    assert torch.utils.serialization.config.save.compute_crc32 is True
    assert torch.equal(manager.load(1)[0]["w"], torch.arange(1000.0))


def test_formats_put_the_model_and_optimizer_where_their_layout_says(tmp_path: Path) -> None:
    from hlat.training.checkpoint import ModelParallel, Unsharded, Zero1

    model, opt, _ = tiny_training()
    shared, mine = {"step": 3}, {"pos": 1}
    unsharded = CheckpointManager(Storage(str(tmp_path / "u")), keep_last=1)
    Unsharded(model, opt).save(unsharded, 3, shared, mine)
    full, own = unsharded.load(3)
    assert set(full) == {"step", "model", "optimizer"} and own == mine
    layout = {"shard": "tp00-pp00", "shard_writer": True, "shards": ["tp00-pp00"]}
    for kind, optimizer_in in ((ModelParallel, "shared"), (Zero1, "rank")):
        fmt = kind(model, opt, layout, model.state_dict, model.load_state_dict)
        manager = CheckpointManager(Storage(str(tmp_path / kind.__name__)), keep_last=1, **fmt.layout)
        fmt.save(manager, 3, shared, mine)
        got_shared, got_mine = manager.load(3)
        where = ("optimizer" in got_shared, "optimizer" in got_mine)
        assert where == (optimizer_in == "shared", optimizer_in == "rank")
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        fmt.load(manager, 3)  # the model comes back from the shard file
        assert_same(full["model"], model.state_dict())


# -- sharded checkpoints (tensor/pipeline parallel) -----------------------------------------------------------

TP_SHARDS = ("tp00", "tp01")


def tp2_dp2(store: Storage, **kwargs: Any) -> list[CheckpointManager]:
    """Four ranks as TP 2 x DP 2: rank r holds TP slice r % 2 of data-parallel replica r // 2; the first replica
    (ranks 0 and 1) writes the shards."""
    return [
        CheckpointManager(
            store,
            rank=rank,
            world_size=4,
            shard=TP_SHARDS[rank % 2],
            shard_writer=rank < 2,
            shards=TP_SHARDS,
            **{"keep_last": 2, **kwargs},
        )
        for rank in range(4)
    ]


def tp_state(rank: int, step: int) -> dict[str, Any]:
    """What a rank of TP slice rank % 2 holds at `step` (replicas hold the same)."""
    tp = rank % 2
    return {"step": step, "model": {"w": torch.full((4, 3), float(10 * tp + step))}, "tp": tp}


def save_tp2_dp2(ranks: list[CheckpointManager], step: int, skip: tuple[int, ...] = ()) -> None:
    for rank in (3, 2, 1, 0):  # rank 0 last: here the barrier is a no-op, so it must find the others' files
        if rank not in skip:
            ranks[rank].save(step, tp_state(rank, step), {"rank": rank, "pos": step * 100 + rank})


def test_tp2_dp2_ranks_save_one_sharded_checkpoint_and_each_loads_its_own_shard(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    ranks = tp2_dp2(store)
    save_tp2_dp2(ranks, 5)
    folder = tmp_path / step_dir(5)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [
            shard_file("tp00"),
            shard_file("tp01"),
            *(rank_file(r) for r in range(4)),
            *(manifest_file(r) for r in (1, 2, 3)),
            META,
            MARKER,
        ]
    )
    meta = json.loads((folder / META).read_text())
    assert meta["shards"] == ["tp00", "tp01"] and meta["world_size"] == 4
    assert set(meta["files"]) == {shard_file("tp00"), shard_file("tp01"), *(rank_file(r) for r in range(4))}
    for name, info in meta["files"].items():
        assert info["size"] == (folder / name).stat().st_size
    assert meta["files"][shard_file("tp00")]["sha256"]  # rank 0 wrote it, so its hash is known

    for rank, manager in enumerate(ranks):
        assert manager.latest_step() == 5
        shared, mine = manager.load(5)
        assert_same(shared, tp_state(rank, 5))  # replicas (ranks 2, 3) read their writer's shard
        assert mine == {"rank": rank, "pos": 500 + rank}
    assert ranks[2].shard_names(5) == ["tp00", "tp01"]
    every = ranks[3].load_shards(5)
    assert list(every) == ["tp00", "tp01"]
    assert_same(every["tp01"], tp_state(1, 5))
    with pytest.raises(CheckpointError, match=r"is sharded \(2 shards \(tp00, tp01\)\).*load_shards\(5\)"):
        ranks[0].load_shared(5)


def test_a_missing_shard_file_prevents_the_commit(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    ranks = tp2_dp2(store)
    save_tp2_dp2(ranks, 1)
    # Misconfigured: no rank writes tp01 (every rank file is there, the shard file never comes).
    ranks[1] = CheckpointManager(store, keep_last=2, rank=1, world_size=4, shard="tp01", shards=TP_SHARDS)
    ranks[0].commit_timeout_s = 0.2
    with pytest.raises(CheckpointError, match=r": model-tp01\.pt missing after 0\.2s.*shard_writer=True"):
        save_tp2_dp2(ranks, 2)
    assert not (tmp_path / step_dir(2) / MARKER).exists()
    assert ranks[0].latest_step() == 1


def test_a_truncated_shard_file_skips_the_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Storage(str(tmp_path))
    ranks = tp2_dp2(store, keep_last=5)
    save_tp2_dp2(ranks, 1)
    save_tp2_dp2(ranks, 2)
    victim = tmp_path / step_dir(2) / shard_file("tp01")
    victim.write_bytes(victim.read_bytes()[:-7])
    with caplog.at_level(logging.WARNING, logger="hlat.training.checkpoint"):
        assert ranks[3].latest_step() == 1
    assert step_dir(2) in caplog.text and shard_file("tp01") in caplog.text and "truncated" in caplog.text
    with pytest.raises(CheckpointError, match=r"model-tp01\.pt"):
        ranks[1].load(2)
    assert ranks[1].load(1)[0]["model"]["w"][0, 0].item() == 11.0


def test_a_checkpoint_of_another_layout_is_refused_naming_both(tmp_path: Path) -> None:
    sharded = Storage(str(tmp_path / "sharded"))
    save_tp2_dp2(tp2_dp2(sharded), 1)
    unsharded = Storage(str(tmp_path / "unsharded"))
    for rank in (3, 2, 1, 0):
        CheckpointManager(unsharded, keep_last=1, rank=rank, world_size=4).save(1, {"w": torch.ones(1)}, {})

    plain = CheckpointManager(sharded, keep_last=1, rank=0, world_size=4)
    with pytest.raises(
        CheckpointError,
        match=r"written by 4 ranks with 2 shards \(tp00, tp01\), this job has 4 ranks "
        r"with one shared train_state\.pt: .*model-parallel layout",
    ):
        plain.load(1)
    tp4 = CheckpointManager(sharded, keep_last=1, world_size=4, shard="tp00", shards=["tp00", "tp01", "tp02", "tp03"])
    with pytest.raises(CheckpointError, match=r"2 shards \(tp00, tp01\), this job has 4 ranks with 4 shards"):
        tp4.load(1)
    tp2_on_8 = CheckpointManager(sharded, keep_last=1, world_size=8, shard="tp00", shards=TP_SHARDS)
    with pytest.raises(CheckpointError, match=r"this job has 8 ranks .*per-rank state .* cannot be reassigned"):
        tp2_on_8.load(1)
    with pytest.raises(CheckpointError, match=r"one shared train_state\.pt, this job has 4 ranks with 2 shards"):
        tp2_dp2(unsharded)[0].load(1)
    with pytest.raises(CheckpointError, match=r"not sharded: read its shared state with load_shared\(1\)"):
        CheckpointManager(unsharded, keep_last=1).load_shards(1)
    assert CheckpointManager(unsharded, keep_last=1).shard_names(1) == []
    assert CheckpointManager(unsharded, keep_last=1).load_shared(1)["w"].item() == 1.0
    # An exporter reads every shard whatever its own layout.
    assert list(plain.load_shards(1)) == ["tp00", "tp01"]


def test_async_sharded_saves_commit_and_load(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    ranks = tp2_dp2(store, async_save=True, commit_timeout_s=30)
    states = {rank: tp_state(rank, 3) for rank in range(4)}
    for rank in (0, 1, 2, 3):  # rank 0 first: its background thread polls for the others' files
        ranks[rank].save(3, states[rank], {"rank": rank})
    for rank in range(4):
        states[rank]["model"]["w"].add_(100.0)  # the state was staged before save() returned
    for manager in ranks:
        manager.close()
    assert ranks[0].latest_step() == 3
    for rank, manager in enumerate(ranks):
        shared, mine = manager.load(3)
        assert_same(shared, tp_state(rank, 3))
        assert mine == {"rank": rank}


def test_pruning_and_deleting_remove_shard_files(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    ranks = tp2_dp2(store, keep_last=1)
    for step in (1, 2, 3):
        save_tp2_dp2(ranks, step)
    assert store.list() == [step_dir(3)]
    ranks[0].delete(3)
    assert store.list() == []


def test_seeding_the_world_sets_every_state_a_checkpoint_saves() -> None:
    """A resumed run restores these states from its rank file; an uninterrupted one must have started from the
    same ones, or the two differ in whatever draws from them."""
    from hlat.training.parallel.distributed import World

    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    random.seed(99)
    np.random.seed(99)
    world.seed(7)
    first = capture_rng_state()
    random.random(), np.random.rand(), torch.rand(1)
    world.seed(7)
    assert_same(first, capture_rng_state())


# -- at the scale of thousands of ranks: sha256 of every file, errors at once, one reader at resume, pins -----------
def test_every_ranks_files_get_a_sha256_in_meta_json_and_a_corrupted_one_is_refused(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    ranks = tp2_dp2(store)
    save_tp2_dp2(ranks, 5)
    folder = tmp_path / step_dir(5)
    files = json.loads((folder / META).read_text())["files"]
    written = [shard_file("tp00"), shard_file("tp01"), *(rank_file(r) for r in range(4))]
    for name in written:  # rank 1 wrote tp01's file, ranks 1-3 their rank files: all vouched for by a sha256
        assert files[name]["sha256"] == hashlib.sha256((folder / name).read_bytes()).hexdigest(), name
    assert json.loads((folder / manifest_file(3)).read_text())["files"][rank_file(3)] == files[rank_file(3)]
    # Same size, other bytes: only the sha256 can tell.
    body = bytearray((folder / shard_file("tp01")).read_bytes())
    body[-100] ^= 0xFF
    (folder / shard_file("tp01")).write_bytes(bytes(body))
    assert ranks[2].load(5)[1]["rank"] == 2  # tp00's ranks are unaffected
    with pytest.raises(CheckpointError, match=r"model-tp01\.pt does not match its sha256"):
        ranks[3].load(5)


def test_a_checkpoint_written_before_manifests_still_loads(tmp_path: Path) -> None:
    """Older checkpoints: no manifests, and a sha256 only for rank 0's files."""
    store = Storage(str(tmp_path))
    ranks = tp2_dp2(store)
    save_tp2_dp2(ranks, 5)
    folder = tmp_path / step_dir(5)
    meta = json.loads((folder / META).read_text())
    for rank in (1, 2, 3):
        (folder / manifest_file(rank)).unlink()
        meta["files"][rank_file(rank)]["sha256"] = None
    meta["files"][shard_file("tp01")]["sha256"] = None
    meta_bytes = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
    (folder / META).write_bytes(meta_bytes)
    (folder / MARKER).write_text(json.dumps({"step": 5, "meta_sha256": hashlib.sha256(meta_bytes).hexdigest()}))
    for rank, manager in enumerate(ranks):
        assert manager.latest_step() == 5
        shared, mine = manager.load(5)
        assert torch.equal(shared["model"]["w"], tp_state(rank, 5)["model"]["w"]) and mine["rank"] == rank


class GatedStorage(Storage):
    """Its state files wait for `gate` before being written, then fail (`fail`) or not; counts every write."""

    def __init__(self, url: str, fail: bool) -> None:
        super().__init__(url)
        self.gate = threading.Event()
        self.fail = fail
        self.calls = 0

    @contextlib.contextmanager
    def atomic_writer(self, rel: str) -> Iterator[IO[bytes]]:
        self.calls += 1
        if not self.gate.wait(timeout=30):
            raise AssertionError("the test never opened the gate")
        if self.fail:
            raise OSError(f"injected: no space left writing {rel}")
        with super().atomic_writer(rel) as fh:
            yield fh


def test_check_raises_a_failed_background_save_at_once_naming_rank_host_and_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    monkeypatch.setenv("SM_HOSTS", '["algo-1", "algo-2"]')
    store = GatedStorage(str(tmp_path), fail=True)
    manager = CheckpointManager(store, keep_last=2, rank=33, world_size=64, async_save=True)
    manager.check()  # nothing pending
    manager.save(7, None, {"rank": 33})
    started = time.monotonic()
    for _ in range(1000):
        manager.check()  # pending, still writing: returns at once, touching nothing
    assert time.monotonic() - started < 1.0 and store.calls <= 1
    store.gate.set()
    deadline = time.monotonic() + 30
    with pytest.raises(CheckpointError) as raised:
        while time.monotonic() < deadline:
            manager.check()
            time.sleep(0.01)
    message = str(raised.value)
    assert "rank 33 on algo-2" in message and f"{step_dir(7)}/{rank_file(33)}" in message and "injected" in message
    manager.check()  # raised once: the failed save is no longer pending
    manager.close()


def test_check_stays_quiet_for_a_background_save_that_succeeds(tmp_path: Path) -> None:
    store = GatedStorage(str(tmp_path), fail=False)
    manager = CheckpointManager(store, keep_last=2, async_save=True)
    manager.save(3, {"w": torch.ones(3)}, {"rank": 0})
    manager.check()
    store.gate.set()
    manager.wait()
    manager.check()
    assert manager.latest_step() == 3
    manager.close()


def test_hosts_of_ranks_come_from_torchrun_and_sagemaker_environments() -> None:
    sagemaker = {"LOCAL_WORLD_SIZE": "32", "SM_HOSTS": '["algo-10", "algo-2", "algo-1"]', "RANK": "0"}
    assert [host_of(r, sagemaker) for r in (0, 31, 32, 95)] == ["algo-1", "algo-1", "algo-10", "algo-2"]
    assert host_of(96, sagemaker) == "node 3"  # past the hosts SageMaker lists: the node rank still says which
    assert host_of(70, {"LOCAL_WORLD_SIZE": "32", "GROUP_RANK": "1"}) == "node 2"
    outside = {"SM_CURRENT_HOST": "algo-4"}  # no LOCAL_WORLD_SIZE: only this process's own host is known
    assert host_of(0, outside) == "algo-4" and host_of(1, {"RANK": "0"}) == "host unknown"


class Recording:
    """A filesystem that records each call (method and path) and passes it on."""

    def __init__(self, fs: Any, calls: list[tuple[str, str]]) -> None:
        self._fs, self._calls = fs, calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls.append((name, str(args[0]) if args else ""))
            return attr(*args, **kwargs)

        return call


def test_resume_point_is_found_by_rank_0_alone_and_shared_with_every_rank(tmp_path: Path) -> None:
    save_tp2_dp2(tp2_dp2(Storage(str(tmp_path))), 5)
    save_tp2_dp2(tp2_dp2(Storage(str(tmp_path))), 6)
    (tmp_path / step_dir(6) / MARKER).unlink()  # the newest is incomplete: 5 is the one to resume from
    share = ThreadShare(4)
    calls: list[list[tuple[str, str]]] = [[] for _ in range(4)]
    ranks = []
    for rank in range(4):
        store = Storage(str(tmp_path))
        store.fs = Recording(store.fs, calls[rank])
        ranks.append(tp2_dp2(store, share=share.of(rank))[rank])

    def resume(rank: int) -> Any:
        found = ranks[rank].resume_point()
        assert found is not None
        return found[0], ranks[rank].load(found[0])

    results = run_ranks(4, resume)
    for rank, result in enumerate(results):
        assert not isinstance(result, BaseException), result
        step, (shared, mine) = result
        assert step == 5 and mine == {"rank": rank, "pos": 500 + rank}
        assert torch.equal(shared["model"]["w"], tp_state(rank, 5)["model"]["w"])
    assert any(name == "ls" for name, _ in calls[0])  # rank 0 listed the checkpoints
    for rank in (1, 2, 3):  # the others read their own two files, and nothing else
        assert sorted(calls[rank]) == sorted(
            ("cat_file", str(tmp_path / step_dir(5) / name))
            for name in (shard_file(TP_SHARDS[rank % 2]), rank_file(rank))
        ), calls[rank]


def test_resume_point_is_none_everywhere_without_a_checkpoint_and_rank_0s_error_reaches_every_rank(
    tmp_path: Path,
) -> None:
    share = ThreadShare(2)
    ranks = [
        CheckpointManager(Storage(str(tmp_path)), keep_last=1, rank=r, world_size=2, share=share.of(r)) for r in (0, 1)
    ]
    assert run_ranks(2, lambda r: ranks[r].resume_point()) == [None, None]

    broken = Storage(str(tmp_path))
    broken.fs = Recording(broken.fs, [])
    broken.fs.ls = None  # type: ignore[method-assign]  # calling it raises TypeError on rank 0 only
    (tmp_path / step_dir(1)).mkdir()
    ranks[0] = CheckpointManager(broken, keep_last=1, rank=0, world_size=2, share=share.of(0))
    results = run_ranks(2, lambda r: ranks[r].resume_point())
    for result in results:
        assert isinstance(result, CheckpointError) and "rank 0 could not find" in str(result), result


def test_resume_point_without_a_share_has_every_rank_look_for_itself(tmp_path: Path) -> None:
    save_tp2_dp2(tp2_dp2(Storage(str(tmp_path))), 5)
    ranks = tp2_dp2(Storage(str(tmp_path)))
    for rank in (3, 0):
        found = ranks[rank].resume_point()
        assert found is not None and found[0] == 5 and found[1]["world_size"] == 4


def test_a_pinned_checkpoint_survives_retention_until_unpinned(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    manager = CheckpointManager(store, keep_last=1)
    manager.save(1, {"w": torch.ones(2)}, {})
    manager.pin(1, why="queued for evaluation")
    assert manager.pinned_steps() == [1]
    for step in (2, 3):
        manager.save(step, {"w": torch.ones(2) * step}, {})
    assert manager.all_steps() == [1, 3]  # the pin is no step folder, and step 1 outlived keep_last=1
    assert manager.committed_steps() == [1, 3]
    assert torch.equal(manager.load_shared(1)["w"], torch.ones(2))
    manager.unpin(1)
    assert manager.pinned_steps() == [] and sorted(p.name for p in tmp_path.iterdir()) == [step_dir(1), step_dir(3)]
    manager.save(4, {"w": torch.ones(2)}, {})
    assert manager.all_steps() == [4]


def test_retention_never_deletes_a_pinned_step() -> None:
    steps = [1, 2, 3, 4, 5]
    assert retention(steps, [1, 2, 4, 5], keep_last=1, keep_every=None, newest=5) == [1, 2, 3, 4]
    assert retention(steps, [1, 2, 4, 5], keep_last=1, keep_every=None, newest=5, pinned={2, 3}) == [1, 4]


def test_a_job_start_removes_the_temporary_files_a_killed_attempt_left(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    manager = CheckpointManager(store, keep_last=2)
    manager.save(1, {"w": torch.ones(2)}, {})
    stray = tmp_path / step_dir(1) / f"{rank_file(0)}.tmp-0badc0de"
    stray.write_bytes(b"half a file")
    later = tmp_path / step_dir(2) / f"{SHARED_FILE}.tmp-12345678"
    later.parent.mkdir()
    later.write_bytes(b"half")
    assert manager.discard_after(1) == [2]
    assert not stray.exists() and not later.parent.exists()
    assert manager.latest_step() == 1
    stray.write_bytes(b"again")
    assert manager.abort_incomplete_uploads() == 1 and not stray.exists()
    assert CheckpointManager(store, keep_last=2, rank=1, world_size=2).abort_incomplete_uploads() == 0


def test_a_stop_supersedes_an_async_save_in_flight_which_commits_nothing(tmp_path: Path) -> None:
    """Rank 0's async save of step 1 waits for rank 1's files, which never come (the stop came first): supersede()
    cuts it within a poll instead of the commit timeout, nothing of step 1 is committed, and the stop's save of step
    3 commits; retention then deletes the superseded folder. A save already committed is left alone."""
    storage = Storage(str(tmp_path / "two"))
    rank0 = CheckpointManager(storage, keep_last=2, world_size=2, async_save=True, commit_timeout_s=60)
    rank1 = CheckpointManager(storage, keep_last=2, rank=1, world_size=2, async_save=True, commit_timeout_s=60)
    rank0.save(1, {"w": torch.ones(4)}, {"r": 0})
    time.sleep(0.3)
    started = time.monotonic()
    assert rank0.supersede() == 1 and time.monotonic() - started < 2
    assert not (tmp_path / "two" / step_dir(1) / MARKER).exists()
    assert rank0.supersede() is None  # nothing pending
    rank0.check()  # the superseded save is no error
    rank1.save(3, None, {"r": 1})
    rank1.wait()
    rank0.save(3, {"w": torch.full((4,), 3.0)}, {"r": 0})
    rank0.wait()
    assert rank0.latest_step() == 3 and rank0.all_steps() == [3]
    assert torch.equal(rank0.load(3)[0]["w"], torch.full((4,), 3.0))

    solo = CheckpointManager(Storage(str(tmp_path / "one")), keep_last=2, async_save=True)
    solo.save(5, {"w": torch.ones(4)}, {"r": 0})
    deadline = time.monotonic() + 30
    while not (tmp_path / "one" / step_dir(5) / MARKER).exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.2)  # its thread returns (retention) after the marker
    assert solo.supersede() is None and solo.latest_step() == 5
    solo.close()
    rank0.close()
    rank1.close()


def test_a_superseded_write_stops_at_its_next_write_and_leaves_no_file(tmp_path: Path) -> None:
    from hlat.training.checkpoint.serialization import SaveSuperseded, write_state

    abort = threading.Event()
    abort.set()
    with pytest.raises(SaveSuperseded, match="superseded"):
        write_state(Storage(str(tmp_path)), "step/f.pt", {"w": torch.ones(1000)}, abort=abort)
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []


def test_the_shard_writers_are_paced_before_every_other_rank() -> None:
    """core.stop_timeline.write_start_seconds: the writers of the big files first (in shard order), then every rank
    in rank order, at write_rate requests a second (two each)."""
    shards = [f"tp{t:02d}-pp00" for t in range(4)]
    root = Storage("s3://bucket/x")

    def offset(rank: int, shard: str | None, writer: bool) -> float:
        layout: dict[str, Any] = {"shard": shard, "shard_writer": writer, "shards": shards} if shard else {}
        return CheckpointManager(root, keep_last=1, rank=rank, world_size=8, **layout)._write_offset()

    assert offset(6, "tp02-pp00", True) == pytest.approx(2 * 2 / 2000)
    assert offset(6, "tp02-pp00", False) == pytest.approx((4 + 6) * 2 / 2000)
    assert offset(0, None, False) == 0.0 and offset(3, None, False) == pytest.approx((1 + 3) * 2 / 2000)


def test_planted_folders_that_look_committed_neither_push_out_nor_get_deleted(tmp_path: Path) -> None:
    """Issue 51: three folders past the run's checkpoints, each with a marker (empty; a valid-looking one whose meta
    does not match; one whose listed file is missing), made a run's own retention delete every real checkpoint.
    Retention counts and deletes verified checkpoints only."""
    store = Storage(str(tmp_path))
    manager = CheckpointManager(store, keep_last=2)
    manager.save(1, {"w": torch.tensor(1)}, {})
    store.write_bytes(f"{step_dir(97)}/{MARKER}", b"")
    store.write_bytes(f"{step_dir(98)}/{META}", b'{"step": 98, "files": {}}\n')
    store.write_bytes(f"{step_dir(98)}/{MARKER}", b'{"step": 98, "meta_sha256": "0"}\n')
    meta = b'{"step": 99, "files": {"train_state.pt": {"size": 10}}}\n'
    store.write_bytes(f"{step_dir(99)}/{META}", meta)
    marker = {"step": 99, "meta_sha256": hashlib.sha256(meta).hexdigest()}
    store.write_bytes(f"{step_dir(99)}/{MARKER}", json.dumps(marker).encode())
    for step in (2, 3):
        manager.save(step, {"w": torch.tensor(step)}, {})
    assert store.list() == [step_dir(s) for s in (2, 3, 97, 98, 99)]  # step 1 aged out; the planted ones stay
    assert manager.latest_step() == 3
