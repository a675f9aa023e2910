"""Atomic training checkpoints under a `Storage` (the run's `checkpoints/` folder), unsharded or sharded by
model-parallel position.

Layout of one checkpoint (`step-000001000/` for step 1000, 9 digits so names sort by step):

    train_state.pt   unsharded (the default): the shared state, written by rank 0 only: model, optimizer,
                     scheduler, step... (torch.save)
    model-tp00.pt    sharded (tensor/pipeline parallel), instead of train_state.pt: one file per model-parallel
    model-tp01.pt    shard, with whatever that shard's writer passes as its shared state (its slices of the model,
                     its optimizer shard, step, config...), written by one data-parallel replica of the shard
    rank-00000.pt    one per rank: what differs between ranks (data-loader position, RNG states)
    rank-00001.pt
    meta.json        step, world_size, the shard names (sharded only), time, config fingerprint, and every file's
                     size (sha256 where known: the files rank 0 wrote itself)
    COMMITTED        the commit marker: {"step", "meta_sha256"}, written last

Sharding: each rank is given its shard's name (`shard`, e.g. "tp01-pp00"), whether it writes that shard
(`shard_writer`: one data-parallel replica per shard does) and every shard name (`shards`). Data-parallel replicas
hold the same weights, so they share one shard file; on resume every rank reads its own shard's file and its own
rank file. A checkpoint is loaded only by a job with the same layout (shard names and world size): the message
names both. `load_shards` reads every shard (what an exporter consolidates: `training.sharding.consolidate`);
`load_shared` reads the single shared state of an unsharded checkpoint.

Protocol: every rank writes its rank file (the shared state's writer, its train_state.pt or shard file first),
then rank 0 waits for the others (the `barrier`, and then polling the storage until every expected file is
visible, up to `commit_timeout_s`), lists the folder to record the sizes in meta.json, and writes COMMITTED. Each
file is written whole and atomically (`Storage.atomic_writer`: torch.save streams into a temporary file that is
fsynced and renamed, or into an S3 multipart upload that appears only when completed), with its size and sha256
taken on the way through: no second pass over the data and no copy of it in memory. So a crash at any point leaves
either a folder without the marker or a complete checkpoint; only folders with the marker count, and
`latest_step` also checks the marker against meta.json and every listed file's size (a truncated or missing file
skips the checkpoint with a warning). Deleting removes the marker first, so a half-deleted folder never looks
complete. Rank 0 re-saving a step whose folder already exists (a previous attempt reached it, then the job
resumed from an earlier step) first removes that stale marker and meta.json.

Everything is saved with torch.save and loaded with `torch.load(weights_only=True)` only: states must be made
of tensors, plain containers, and ints/floats/strs/bools/None (RNG states included: see `capture_rng_state`). `save`
checks this (`check_loadable`) before writing anything, so a bad state fails the first save, not the resume. A
synchronous save reads the caller's tensors while it writes: they must not change until `save` returns.

Retention (rank 0, after each commit): the newest `keep_last` complete checkpoints, plus every complete one
whose step is a multiple of `keep_every`, forever; older complete ones and marker-less folders older than the
newest complete checkpoint are deleted, whatever files they hold. Newer marker-less folders are left alone: with
async saves another rank may already be writing the next checkpoint.

Distributed state (`distributed=True`, FSDP2): the sharded model and optimizer states are written by
torch.distributed.checkpoint (`save(..., distributed_state=...)`, a collective every rank enters) into the same
step folder (`__<rank>_0.distcp` per rank, `.metadata` by rank 0), before the rank files and rank 0's
train_state.pt (step, scheduler, config); meta.json lists and sizes them like every other file, and the commit
marker still comes last. `load_distributed` reads them back into the caller's (sharded) state dict;
`load_distributed_full` consolidates them into plain tensors for export.

Async saves (`async_save=True`): `save` copies the state to CPU tensors (the only part that blocks the training
loop) and a background thread writes it. The copies go into the buffers of the previous save when the shapes
match (refilling memory already touched is several times faster than allocating it afresh), so an async manager
keeps one CPU copy of its state between saves; `close()` frees it. A later `save` or `wait()` first waits for the
pending one and re-raises its error as `CheckpointError`. The background thread never calls `barrier`: a
collective issued from a second thread can deadlock against the loop's own (NCCL, gloo); rank 0 relies on
polling the storage for the other ranks' files instead, so give it a generous `commit_timeout_s`.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import logging
import os
import random
import re
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from typing import IO, Any, cast

import torch
from torch import nn

from hlat.core.layout import (
    CHECKPOINT_MARKER as MARKER,
)
from hlat.core.layout import (
    CHECKPOINT_META as META,
)
from hlat.core.layout import (
    CheckpointError,
    CheckpointIndex,
    shard_file,
    step_dir,
)
from hlat.core.storage import Storage, storage_errors

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SHARED_FILE = "train_state.pt"
DCP_METADATA = ".metadata"
"""torch.distributed.checkpoint's index of a distributed checkpoint (written last of its files, by rank 0)."""
# Shard names become file names (model-<shard>.pt) and must not look like anything else in the folder.
_SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")

State = dict[str, Any]


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _deserialize(data: bytes, what: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{what} cannot be loaded: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc


# Exactly these types (not subclasses: numpy.float64 is a float, an IntEnum an int, and neither loads).
_PLAIN_LEAVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_CONTAINERS = (dict, OrderedDict, list, tuple, set, frozenset)


def check_loadable(obj: Any, where: str = "state") -> None:
    """Raise CheckpointError naming the first value `torch.load(weights_only=True)` would refuse.

    Checked before anything is written, so a run finds out at its first save, not when it needs to resume.
    """
    kind = type(obj)
    if isinstance(obj, torch.Tensor):
        if kind not in (torch.Tensor, nn.Parameter):
            raise CheckpointError(f"cannot save {where}: a {kind.__qualname__} is not a plain tensor")
        return
    if kind in _PLAIN_LEAVES:
        return
    if kind in _CONTAINERS:
        if isinstance(obj, dict):
            for key, value in obj.items():
                check_loadable(key, f"{where} key {key!r}")
                check_loadable(value, f"{where}[{key!r}]")
        else:
            for i, value in enumerate(obj):
                check_loadable(value, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"cannot save {where}: a {kind.__module__}.{kind.__qualname__}; checkpoints hold tensors, plain "
        "containers and ints/floats/strs/bools/None only (they are read with torch.load(weights_only=True))"
    )


class StagingBuffers:
    """The CPU tensors one async save copied its state into, refilled by the next save of the same state.

    What the training loop waits for in an async save is this copy. Into fresh memory it costs the page faults of
    touching every page (0.25 s for 0.7 GB on 2 cores); into the previous save's buffers, a plain memcpy (0.06 s).
    Buffers are matched by position in the state tree, shape, stride and dtype; a state that changed shape just
    gets fresh ones. Only refill them once the save that used them has been written.
    """

    def __init__(self) -> None:
        self._previous: list[torch.Tensor] = []
        self._current: list[torch.Tensor] = []

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.detach()
        at = len(self._current)
        buffer = self._previous[at] if at < len(self._previous) else None
        if buffer is None or (buffer.shape, buffer.stride(), buffer.dtype) != (
            source.shape,
            source.stride(),
            source.dtype,
        ):
            buffer = torch.empty_like(source, device="cpu")
        buffer.copy_(source)
        self._current.append(buffer)
        return buffer

    def done(self) -> None:
        """The state is copied: its buffers are the ones to refill next time."""
        self._previous, self._current = self._current, []

    def clear(self) -> None:
        self._previous, self._current = [], []


def stage_to_cpu(obj: Any, copy: bool = True, reuse: StagingBuffers | None = None) -> Any:
    """The state tree with CPU tensors: fresh copies (copy=True: what the loop may mutate after save returns), or
    the CPU tensors themselves and host copies of the others (copy=False). With `reuse`, the copies go into the
    buffers of the previous call with the same `reuse` where they fit.

    Device tensors reach the host together: on XLA in one transfer (torch.save or `.cpu()` would fetch them one by
    one). Tensors appearing more than once (tied weights) stay shared in the copy, as torch.save would keep them.
    """
    if reuse is not None and not copy:
        raise ValueError("stage_to_cpu: reuse fills copies, it needs copy=True")
    memo: dict[int, torch.Tensor] = {}
    xla_tensors: dict[int, torch.Tensor] = {}
    _collect_xla(obj, xla_tensors)
    if xla_tensors:
        from hlat.training import xla

        fetched = xla.to_host(list(xla_tensors.values()))  # already fresh host tensors: nothing to refill
        memo.update(zip(xla_tensors, fetched, strict=True))
    staged = _staged(obj, memo, copy, reuse)
    if reuse is not None:
        reuse.done()
    return staged


def _collect_xla(obj: Any, found: dict[int, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "xla":
            found.setdefault(id(obj), obj.detach())
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _collect_xla(value, found)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _collect_xla(value, found)


def _staged(obj: Any, memo: dict[int, torch.Tensor], copy: bool, reuse: StagingBuffers | None) -> Any:
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = reuse.copy(obj) if reuse is not None else obj.detach().to("cpu", copy=copy)
        return memo[key]
    if isinstance(obj, OrderedDict):
        copied = OrderedDict((k, _staged(v, memo, copy, reuse)) for k, v in obj.items())
        # Module.state_dict() hangs per-module versions on the dict; load_state_dict reads them back.
        if hasattr(obj, "_metadata"):
            copied._metadata = obj._metadata  # type: ignore[attr-defined]
        return copied
    if isinstance(obj, Mapping):
        return {k: _staged(v, memo, copy, reuse) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_staged(v, memo, copy, reuse) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_staged(v, memo, copy, reuse) for v in obj)
    return obj


# -- streaming a state into storage ------------------------------------------------------------------------

# Writes at least this big are hashed behind the write when their memory outlives it (see _DigestingWriter);
# smaller ones (zip headers, small tensors) are hashed or copied at once, which costs next to nothing.
_LARGE_WRITE = 1 << 16


def _address(view: memoryview) -> int | None:
    """Where a buffer's bytes are (None: unknown, without NumPy). torch hands out read-only views, which ctypes'
    from_buffer refuses; NumPy reads the address without copying."""
    try:
        import numpy as np
    except ImportError:
        return None
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class _TensorMemory:
    """The address ranges of the CPU tensor storages in a state tree: memory that stays put while the caller
    holds the tree."""

    def __init__(self, obj: Any) -> None:
        spans: dict[int, int] = {}
        self._collect(obj, spans)
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in sorted(spans.items()):  # merged, so one lookup finds the range that holds an address
            if self._ends and start <= self._ends[-1]:
                self._ends[-1] = max(self._ends[-1], end)
            else:
                self._starts.append(start)
                self._ends.append(end)

    def _collect(self, obj: Any, spans: dict[int, int]) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu":
                storage = obj.untyped_storage()
                if storage.nbytes():
                    start = storage.data_ptr()
                    spans[start] = max(spans.get(start, 0), start + storage.nbytes())
        elif isinstance(obj, Mapping):
            for value in obj.values():
                self._collect(value, spans)
        elif isinstance(obj, list | tuple):
            for value in obj:
                self._collect(value, spans)

    def holds(self, view: memoryview) -> bool:
        if not self._starts:
            return False
        address = _address(view)
        if address is None:
            return False
        at = bisect.bisect_right(self._starts, address) - 1
        return at >= 0 and address + view.nbytes <= self._ends[at]


class _DigestingWriter:
    """The file torch.save writes into: every write goes on to `sink`, and its bytes are counted and hashed
    (sha256) on the way, so meta.json gets both without a second pass over the data or a copy of it in memory.

    Hashing runs on a thread of its own, behind the writes (hashlib and file writes both release the GIL), so it
    costs next to nothing on top of torch.save's own work (its CRC32s, the copy into the page cache or the upload
    buffer). A write may return before its bytes are hashed only when they lie in `stable` memory: the storages of
    the tensors being saved, which the caller keeps until `finish()`. torch's other buffers (zip headers, the
    pickle) may be freed as soon as write returns: small ones are copied into the queue, large ones hashed before
    write returns. The queue runs in order (one worker), so the digest is the file's.

    After a failed write (disk full, a lost connection) later writes are dropped, as the file will be; `error`
    keeps the failure, which says more than torch.save's own complaint on its way out (its zip cannot be finished).
    """

    def __init__(self, sink: IO[bytes], stable: _TensorMemory) -> None:
        self._sink = sink
        self._stable = stable
        self._sha = hashlib.sha256()
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-sha256")
        self._queued: deque[Future[None]] = deque()
        self.size = 0
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        if self.error is not None:
            return view.nbytes
        try:
            self._write(view)
        except BaseException as exc:
            self.error = exc
            raise
        return view.nbytes

    def _write(self, view: memoryview) -> None:
        n = view.nbytes
        self._reap()
        if n >= _LARGE_WRITE and self._stable.holds(view):
            self._queued.append(self._hasher.submit(self._sha.update, view))
            self._sink.write(view)
        elif n >= _LARGE_WRITE:  # memory we may not read after returning: hash it during the write, then return
            self._drain()
            hashing = self._hasher.submit(self._sha.update, view)
            self._sink.write(view)
            hashing.result()
        elif self._queued:
            self._queued.append(self._hasher.submit(self._sha.update, bytes(view)))
            self._sink.write(view)
        else:
            self._sha.update(view)
            self._sink.write(view)
        self.size += n

    def flush(self) -> None:
        self._sink.flush()

    def finish(self) -> str:
        """The sha256 of everything written, once hashed."""
        if self.error is not None:  # torch.save returned although a write failed: the file must not be kept
            raise CheckpointError(f"a write failed while saving: {type(self.error).__name__}: {self.error}")
        self._drain()
        self._hasher.shutdown(wait=True)
        return self._sha.hexdigest()

    def abandon(self) -> None:
        """Stop hashing (the save failed); returns once the hasher no longer reads the caller's memory."""
        self._hasher.shutdown(wait=True, cancel_futures=True)

    def _reap(self) -> None:
        while self._queued and self._queued[0].done():
            self._queued.popleft().result()  # re-raises a failed hash

    def _drain(self) -> None:
        while self._queued:
            self._queued.popleft().result()


# -- RNG state ---------------------------------------------------------------------------------------------


def capture_rng_state() -> State:
    """This process's RNG states as weights_only-loadable values: Python `random`, NumPy's global generator
    (when NumPy is installed), torch CPU, torch CUDA (every device, when CUDA is initialised) and the XLA device's
    (when torch-xla is in use)."""
    version, internal, gauss = random.getstate()
    state: State = {"python": {"version": version, "state": list(internal), "gauss_next": gauss}}
    try:
        import numpy as np
    except ImportError:  # numpy is optional here: nothing to capture when it is absent
        pass
    else:
        # The dict form of the legacy global generator's state (MT19937 keys, position, cached gaussian).
        np_state: dict[str, Any] = np.random.get_state(legacy=False)
        state["numpy"] = {
            "bit_generator": str(np_state["bit_generator"]),
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
    state["torch"] = torch.get_rng_state()
    if "torch_xla" in sys.modules:  # the XLA device's generator (a seed), once this process uses the device
        from hlat.training import xla

        state["xla"] = xla.rng_state()
    # Only when CUDA is already in use: querying it would otherwise initialise CUDA in a CPU-only process.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `capture_rng_state` captured (parts absent from `state` are left as they are)."""
    if "python" in state:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(v) for v in py["state"]), py["gauss_next"]))
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        key = torch.as_tensor(n["key"]).numpy().astype(np.uint32)
        np.random.set_state(
            {
                "bit_generator": n["bit_generator"],
                "state": {"key": key, "pos": int(n["pos"])},
                "has_gauss": int(n["has_gauss"]),
                "gauss": float(n["gauss"]),
            }
        )
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
    if "xla" in state and "torch_xla" in sys.modules:
        from hlat.training import xla

        xla.set_rng_state(int(state["xla"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = list(state["cuda"])
        if len(saved) != torch.cuda.device_count():
            log.warning(
                "checkpoint has CUDA RNG states for %d devices, this process sees %d: restoring the first %d",
                len(saved), torch.cuda.device_count(), min(len(saved), torch.cuda.device_count()),
            )  # fmt: skip
        for device, rng in enumerate(saved[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.as_tensor(rng, dtype=torch.uint8).cpu(), device)


# -- the manager -------------------------------------------------------------------------------------------


def _no_barrier() -> None:
    return None


class CheckpointManager(CheckpointIndex):
    """Saves, finds, loads and prunes checkpoints for one rank of a run (see the module docstring); finding is
    `CheckpointIndex`'s (core/layout.py, no torch)."""

    def __init__(
        self,
        storage: Storage,
        keep_last: int,
        keep_every: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], None] = _no_barrier,
        async_save: bool = False,
        fingerprint: str | None = None,
        commit_timeout_s: float = 600.0,
        shard: str | None = None,
        shard_writer: bool = False,
        shards: Sequence[str] = (),
        distributed: bool = False,
    ) -> None:
        """`shard`: this rank's model-state shard (e.g. "tp01-pp00"), None for an unsharded checkpoint (rank 0
        writes train_state.pt); `shard_writer`: whether this rank writes that shard (one data-parallel replica per
        shard does); `shards`: every shard name the checkpoint holds (the same on every rank); `distributed`: the
        model and optimizer states go through torch.distributed.checkpoint (FSDP2), see the module docstring."""
        if distributed and (async_save or shard is not None):
            raise ValueError("distributed checkpoints are written synchronously and hold no per-shard files")
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be at least 1 or None, got {keep_every}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if isinstance(shards, str):  # a lone name would be taken letter by letter
            raise ValueError(f"shards must be a list of shard names, got the string {shards!r}")
        shards = tuple(shards)
        if shard is None:
            if shards or shard_writer:
                raise ValueError(
                    "shards and shard_writer describe a sharded checkpoint: also pass this rank's shard name "
                    "(shard=...), or neither for an unsharded one"
                )
        else:
            for name in shards:
                if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name):
                    raise ValueError(
                        f"shard name {name!r} must be letters, digits, '.', '_' or '-' (it names a file), "
                        "e.g. 'tp01-pp00'"
                    )
            if len(set(shards)) != len(shards):
                raise ValueError(f"shard names must be distinct, got {list(shards)}")
            if shard not in shards:
                raise ValueError(f"this rank's shard {shard!r} is not among shards={list(shards)}")
            if len(shards) > world_size:
                raise ValueError(f"{len(shards)} shards need at least as many ranks to write them, not {world_size}")
        self.storage = storage
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.async_save = async_save
        self.fingerprint = fingerprint
        self.commit_timeout_s = commit_timeout_s
        self.shard = shard
        self.shard_writer = shard_writer
        self.shards = tuple(sorted(shards))
        self.distributed = distributed
        # This rank's shared-state file: the one it loads, and writes when it is that file's writer.
        self._shared_file = SHARED_FILE if shard is None else shard_file(shard)
        self._writes_shared = rank == 0 if shard is None else shard_writer
        self._staging = (StagingBuffers(), StagingBuffers())  # shared, rank state (async saves)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._pending_step: int | None = None
        self._lock = threading.Lock()
        self.bytes_read = 0
        """Bytes this rank has read from checkpoint files (what a resume costs it)."""

    def __repr__(self) -> str:
        sharding = f", shard={self.shard!r}" if self.shard is not None else ""
        return f"CheckpointManager({self.storage.url!r}, rank={self.rank}/{self.world_size}{sharding})"

    # -- saving ------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        shared_state: Mapping[str, Any] | None,
        rank_state: Mapping[str, Any],
        distributed_state: Mapping[str, Any] | None = None,
    ) -> None:
        """Checkpoint `step`: every rank calls this with its own rank_state; shared_state is used by the rank that
        writes it (unsharded: rank 0; sharded: each shard's writer) and ignored elsewhere (pass None there);
        distributed_state (a manager made with distributed=True: every rank, its DTensor state dict) goes through
        torch.distributed.checkpoint. Synchronous unless async_save (then: stage, return, write later)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if (distributed_state is not None) != self.distributed:
            raise ValueError(
                "pass distributed_state exactly when the manager was made with distributed=True "
                f"(distributed={self.distributed})"
            )
        if self._writes_shared and shared_state is None:
            raise ValueError(
                f"rank {self.rank} writes {self._shared_file}: it must pass the shared state (model, optimizer, ...) "
                "to save()"
            )
        shared = shared_state if self._writes_shared else None
        if shared is not None:
            check_loadable(shared, "shared_state")
        check_loadable(rank_state, "rank_state")
        self.wait()
        if not self.async_save:
            if distributed_state is not None:
                self._save_distributed(step, distributed_state)
            staged = stage_to_cpu(shared, copy=False) if shared is not None else None
            self._write(step, staged, stage_to_cpu(rank_state, copy=False), use_barrier=True)
            return
        # The only part that blocks the loop: CPU copies the loop may not change under the writer's feet, into the
        # previous save's buffers (wait() above: its writer is done with them).
        staged_shared = stage_to_cpu(shared, reuse=self._staging[0]) if shared is not None else None
        staged_rank = stage_to_cpu(rank_state, reuse=self._staging[1])
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ckpt-rank{self.rank}")
            self._pending_step = step
            self._pending = self._executor.submit(self._write, step, staged_shared, staged_rank, False)

    def wait(self) -> None:
        """Block until a pending async save has finished; re-raise its error as CheckpointError."""
        with self._lock:
            pending, step = self._pending, self._pending_step
            self._pending, self._pending_step = None, None
        if pending is None:
            return
        try:
            pending.result()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"background save of {self.storage.uri(step_dir(step or 0))} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        """Wait for a pending save, then stop the background thread and free the staging buffers."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            for buffers in self._staging:
                buffers.clear()

    def _write(self, step: int, shared: Any, rank_state: Any, use_barrier: bool) -> None:
        folder = step_dir(step)
        started = time.monotonic()
        known: dict[str, dict[str, Any]] = {}
        if self.rank == 0:
            # A folder left by an earlier attempt at this step: its marker must not vouch for the new files.
            self.storage.remove(f"{folder}/{MARKER}")
            self.storage.remove(f"{folder}/{META}")
        if shared is not None:
            known[self._shared_file] = self._put(f"{folder}/{self._shared_file}", shared)
        known[rank_file(self.rank)] = self._put(f"{folder}/{rank_file(self.rank)}", rank_state)
        if use_barrier:
            self.barrier()
        if self.rank != 0:
            return
        sizes = self._wait_for_files(folder)
        files = {name: {"size": sizes[name], "sha256": known.get(name, {}).get("sha256")} for name in sorted(sizes)}
        for name, info in known.items():
            if files[name]["size"] != info["size"]:
                raise CheckpointError(
                    f"{self.storage.uri(folder, name)} is {files[name]['size']} bytes after writing {info['size']}"
                )
        fingerprint = self.fingerprint
        if fingerprint is None and isinstance(shared, Mapping):
            fingerprint = shared.get("config_fingerprint")
        meta = {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": self.world_size,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "fingerprint": fingerprint,
            "files": files,
        }
        if self.shard is not None:
            meta["shards"] = list(self.shards)
        if self.distributed:
            meta["distributed"] = True
        meta_bytes = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
        self.storage.write_bytes(f"{folder}/{META}", meta_bytes)
        marker = {"step": step, "meta_sha256": hashlib.sha256(meta_bytes).hexdigest()}
        self.storage.write_bytes(f"{folder}/{MARKER}", (json.dumps(marker, sort_keys=True) + "\n").encode())
        log.info("checkpoint %s committed in %.1fs", self.storage.uri(folder), time.monotonic() - started)
        try:
            self.prune(newest=step)
        except Exception as exc:  # the checkpoint is safe; a failed clean-up must not stop training
            log.warning("could not prune old checkpoints under %s: %s", self.storage.url, exc)

    def _put(self, rel: str, state: Any) -> dict[str, Any]:
        """torch.save `state` straight into the storage object `rel`; its size and sha256, taken on the way."""
        with self.storage.atomic_writer(rel) as sink:
            out = _DigestingWriter(sink, _TensorMemory(state))
            try:
                torch.save(state, cast(IO[bytes], out))
                sha256 = out.finish()
            except BaseException as exc:
                out.abandon()
                if out.error is not None and exc is not out.error:
                    # torch.save failed again finishing its zip ("unexpected pos ..."): report the write's error.
                    exc.__context__ = None
                    raise out.error from None
                raise
        return {"size": out.size, "sha256": sha256}

    def _expected_files(self, listed: Mapping[str, int]) -> list[str]:
        shared = [SHARED_FILE] if self.shard is None else [shard_file(s) for s in self.shards]
        # torch.distributed.checkpoint's files: every one is complete by the time rank 0's save returned (its
        # .metadata is written after every rank reported its writes).
        dcp = [DCP_METADATA, *sorted(n for n in listed if n.endswith(".distcp"))] if self.distributed else []
        return [*shared, *(rank_file(r) for r in range(self.world_size)), *dcp]

    # -- torch.distributed.checkpoint (FSDP2) ------------------------------------------------------------
    def _dcp_location(self, step: int) -> tuple[str, dict[str, Any]]:
        """The step folder as torch.distributed.checkpoint addresses it: a local path, or a URL with the storage's
        fsspec options (S3 endpoint, credentials)."""
        folder = step_dir(step)
        if self.storage.is_local:
            return self.storage.path(folder), {}
        return self.storage.uri(folder), dict(getattr(self.storage.fs, "storage_options", {}))

    def _save_distributed(self, step: int, state: Mapping[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        location, options = self._dcp_location(step)
        if self.rank == 0:
            # A folder left by an earlier attempt at this step: its marker must not vouch for the new files.
            self.storage.remove(f"{step_dir(step)}/{MARKER}")
        self.barrier()  # no rank writes the new files while the old marker may still be there
        writer = dcp.FileSystemWriter(location) if self.storage.is_local else FsspecWriter(location, **options)
        with storage_errors(self.storage.uri(step_dir(step))):
            dcp.save(dict(state), storage_writer=writer)

    def load_distributed(self, step: int, state: dict[str, Any]) -> None:
        """Fill `state` (this rank's DTensor state dict, as FSDP2's get_state_dict gives it) in place from the
        distributed files of committed checkpoint `step`; every rank calls it (a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        meta = self.read_meta(step)
        if not meta.get("distributed"):
            raise CheckpointError(
                f"checkpoint {self.storage.uri(step_dir(step))} holds no distributed (FSDP2) state: it was written "
                "without parallelism.fsdp; resume it with the parallelism that wrote it"
            )
        location, options = self._dcp_location(step)
        reader = dcp.FileSystemReader(location) if self.storage.is_local else FsspecReader(location, **options)
        with storage_errors(self.storage.uri(step_dir(step))):
            dcp.load(state, storage_reader=reader)

    def load_distributed_full(self, step: int) -> State:
        """The distributed state of committed checkpoint `step` consolidated into plain CPU tensors (every shard
        gathered: what export reads), without a process group."""
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        meta = self.read_meta(step)
        if not meta.get("distributed"):
            raise CheckpointError(f"checkpoint {self.storage.uri(step_dir(step))} holds no distributed state")
        folder = step_dir(step)
        with tempfile.TemporaryDirectory(prefix="hlat-dcp-") as tmp:
            local = self.storage.path(folder) if self.storage.is_local else os.path.join(tmp, "dcp")
            if not self.storage.is_local:
                os.makedirs(local)
                for name in meta["files"]:
                    if name == DCP_METADATA or name.endswith(".distcp"):
                        self.storage.get_file(f"{folder}/{name}", os.path.join(local, name))
            out = os.path.join(tmp, "full.pt")
            dcp_to_torch_save(local, out)
            state: State = torch.load(out, map_location="cpu", weights_only=True)
        return state

    def _wait_for_files(self, folder: str) -> dict[str, int]:
        """Sizes of the checkpoint's files once all are visible; CheckpointError after commit_timeout_s."""
        deadline = time.monotonic() + self.commit_timeout_s
        delay = 0.05
        while True:
            listed = self._file_sizes(folder)
            expected = self._expected_files(listed)
            missing = [name for name in expected if name not in listed]
            if not missing:
                return {name: listed[name] for name in expected}
            if time.monotonic() >= deadline:
                shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                writers = ""
                if self.shard is not None and any(name.startswith("model-") for name in missing):
                    writers = "; each shard needs one rank with shard_writer=True that passes its shared state"
                raise CheckpointError(
                    f"not committing {self.storage.uri(folder)}: {shown} missing after "
                    f"{self.commit_timeout_s:g}s; every rank must call save({int(folder[5:])}, ...){writers}"
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 2.0)

    # -- loading -----------------------------------------------------------------------------------------
    def load(self, step: int) -> tuple[State, State]:
        """(shared state, this rank's rank_state) of checkpoint `step`, as CPU tensors. The shared state is the
        unsharded train_state.pt, or this rank's own shard (data-parallel replicas read the same one)."""
        folder = step_dir(step)
        meta = self.read_meta(step)
        theirs = _shard_list(meta)
        mine_shards = list(self.shards) if self.shard is not None else None
        if meta["world_size"] != self.world_size or theirs != mine_shards:
            why = []
            if meta["world_size"] != self.world_size:
                why.append("per-rank state (data-loader positions, RNG) cannot be reassigned")
            if theirs != mine_shards:
                why.append(
                    "each rank resumes from its own model shard, so the model-parallel layout must match "
                    "(load_shards reads every shard, to consolidate and re-split)"
                )
            raise CheckpointError(
                f"checkpoint {self.storage.uri(folder)} was written by {_ranks(meta['world_size'])} with "
                f"{_describe_layout(theirs)}, this job has {_ranks(self.world_size)} with "
                f"{_describe_layout(mine_shards)}: {'; '.join(why)}"
            )
        shared = self._read(folder, self._shared_file, meta)
        mine = self._read(folder, rank_file(self.rank), meta)
        return shared, mine

    def load_shared(self, step: int) -> State:
        """The shared state (model, optimizer, step, config...) of unsharded checkpoint `step` alone, whatever
        world size wrote it: what export and evaluation read."""
        folder = step_dir(step)
        meta = self.read_meta(step)
        shards = _shard_list(meta)
        if shards is not None:
            raise CheckpointError(
                f"checkpoint {self.storage.uri(folder)} is sharded ({_describe_layout(shards)}): it has no single "
                f"shared state; read every shard with load_shards({step}) and put them together "
                "(training.sharding.consolidate)"
            )
        return self._read(folder, SHARED_FILE, meta)

    def load_shards(self, step: int) -> dict[str, State]:
        """Every shard's state of sharded checkpoint `step`, by shard name, whatever layout wrote it: what an
        exporter consolidates (all of them in memory at once)."""
        folder = step_dir(step)
        meta = self.read_meta(step)
        shards = _shard_list(meta)
        if shards is None:
            raise CheckpointError(
                f"checkpoint {self.storage.uri(folder)} is not sharded: read its shared state with load_shared({step})"
            )
        return {name: self._read(folder, shard_file(name), meta) for name in shards}

    def shard_names(self, step: int) -> list[str]:
        """The shard names of checkpoint `step`, from its meta.json ([] for an unsharded checkpoint)."""
        return _shard_list(self.read_meta(step)) or []

    def _read(self, folder: str, name: str, meta: Mapping[str, Any]) -> State:
        uri = self.storage.uri(folder, name)
        info = meta["files"].get(name)
        if info is None:
            raise CheckpointError(f"{uri} is not listed in {META}")
        data = self.storage.read_bytes(f"{folder}/{name}")
        self.bytes_read += len(data)
        if len(data) != info["size"]:
            raise CheckpointError(f"{uri} is {len(data)} bytes, {info['size']} were written")
        if info.get("sha256") and hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise CheckpointError(f"{uri} does not match its sha256 in {META} (corrupted)")
        state = _deserialize(data, uri)
        if not isinstance(state, dict):
            raise CheckpointError(f"{uri} holds a {type(state).__name__}, not a dict")
        return state

    # -- retention ---------------------------------------------------------------------------------------
    def prune(self, newest: int | None = None) -> list[int]:
        """Delete what retention does not keep (rank 0 only; see the module docstring); return the steps
        deleted. `newest` is the checkpoint just committed (default: the newest committed one)."""
        if self.rank != 0:
            return []
        steps = self.all_steps()
        committed = [s for s in steps if self.storage.exists(f"{step_dir(s)}/{MARKER}")]
        if not committed:
            return []
        newest = max(committed) if newest is None else newest
        keep = set(committed[-self.keep_last :])
        if self.keep_every:
            keep.update(s for s in committed if s % self.keep_every == 0)
        doomed = [s for s in committed if s not in keep]
        doomed += [s for s in steps if s not in committed and s < newest]
        for step in sorted(doomed):
            self.delete(step)
        return sorted(doomed)

    def delete(self, step: int) -> None:
        """Delete a checkpoint folder, its marker first (a half-deleted folder must not look complete)."""
        folder = step_dir(step)
        self.storage.remove(f"{folder}/{MARKER}")
        self.storage.remove(folder, recursive=True)
        log.info("deleted checkpoint %s", self.storage.uri(folder))


def _shard_list(meta: Mapping[str, Any]) -> list[str] | None:
    """The shard names a checkpoint's meta.json records (None: unsharded, as every checkpoint before sharding)."""
    shards = meta.get("shards")
    return sorted(str(name) for name in shards) if shards is not None else None


def _describe_layout(shards: list[str] | None) -> str:
    if shards is None:
        return f"one shared {SHARED_FILE}"
    shown = ", ".join(shards[:6]) + (f" and {len(shards) - 6} more" if len(shards) > 6 else "")
    return f"{len(shards)} shard{'s' if len(shards) != 1 else ''} ({shown})"


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"
