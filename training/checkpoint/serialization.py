"""Serialization of one checkpoint file: what may be saved, staging to CPU, writing and reading with a sha256.

Rules:
- `torch.load(weights_only=True)` is the only loader; `check_loadable` refuses other states at the first save.
- each file is written whole and atomically (`Storage.atomic_writer`).
- its size and sha256 are taken on the way, without a second pass.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import io
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any, cast

import torch
import torch.utils.serialization
from torch import nn

from hlat.core.layout import CheckpointError
from hlat.core.storage import Storage

State = dict[str, Any]


def _deserialize(data: bytes, what: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{what} cannot be loaded: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc


# Exactly these types (not subclasses: numpy.float64 is a float, an IntEnum an int, and neither loads).
_PLAIN_LEAVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_CONTAINERS = (dict, OrderedDict, list, tuple, set, frozenset)


def check_loadable(obj: Any, where: str = "state") -> None:
    """Raise CheckpointError naming the first value `torch.load(weights_only=True)` would refuse."""
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


def one_intra_op_thread() -> None:
    """Thread initializer for the async writer: one OpenMP thread, so the loop's threads keep spinning.

    docs/stages.md ("Inside the training job") has the measurement.
    """
    torch.set_num_threads(1)


class StagingBuffers:
    """The CPU tensors one async save copied its state into, refilled by the next save (docs/benchmarks.md).

    Buffers match by tree position, shape, stride and dtype. Refill only after the save was written.
    `deferred` CPU tensors are copied later by `fill()`; leave them unchanged until then.
    """

    def __init__(self) -> None:
        self._previous: list[torch.Tensor] = []
        self._current: list[torch.Tensor] = []
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._cuda = False

    def copy(self, tensor: torch.Tensor, defer: bool = False) -> torch.Tensor:
        source = tensor.detach()
        at = len(self._current)
        buffer = self._previous[at] if at < len(self._previous) else None
        if buffer is None or (buffer.shape, buffer.stride(), buffer.dtype) != (
            source.shape,
            source.stride(),
            source.dtype,
        ):
            buffer = torch.empty_like(source, device="cpu", pin_memory=source.is_cuda)
        if defer and source.device.type == "cpu":
            self._deferred.append((buffer, source))
        else:
            buffer.copy_(source, non_blocking=source.is_cuda and buffer.is_pinned())
            self._cuda = self._cuda or source.is_cuda
        self._current.append(buffer)
        return buffer

    def done(self) -> None:
        """The state is staged: its buffers are the ones to refill next time."""
        if self._cuda:  # the copies into pinned memory were queued on the stream: they are done once it is
            torch.cuda.current_stream().synchronize()
            self._cuda = False
        self._previous, self._current = self._current, []

    def fill(self) -> None:
        """Make the deferred copies."""
        deferred, self._deferred = self._deferred, []
        for buffer, source in deferred:
            buffer.copy_(source)

    def clear(self) -> None:
        self._previous, self._current, self._deferred = [], [], []


def stage_to_cpu(obj: Any, copy: bool = True, reuse: StagingBuffers | None = None, defer: bool = False) -> Any:
    """The state tree with CPU tensors: fresh copies (copy=True), or CPU tensors as they are.

    `reuse` refills earlier buffers; with `defer`, CPU copies wait for `reuse.fill()`.
    Device tensors come over together. Tied weights stay shared.
    """
    if reuse is not None and not copy:
        raise ValueError("stage_to_cpu: reuse fills copies, it needs copy=True")
    if defer and reuse is None:
        raise ValueError("stage_to_cpu: defer leaves the copies to reuse.fill(), it needs reuse")
    memo: dict[int, torch.Tensor] = {}
    xla_tensors: dict[int, torch.Tensor] = {}
    _collect_xla(obj, xla_tensors)
    if xla_tensors:
        from hlat.training import xla

        fetched = xla.to_host(list(xla_tensors.values()))  # already fresh host tensors: nothing to refill
        memo.update(zip(xla_tensors, fetched, strict=True))
    staged = _staged(obj, memo, copy, reuse, defer)
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


def _staged(
    obj: Any, memo: dict[int, torch.Tensor], copy: bool, reuse: StagingBuffers | None, defer: bool = False
) -> Any:
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = reuse.copy(obj, defer) if reuse is not None else obj.detach().to("cpu", copy=copy)
        return memo[key]
    if isinstance(obj, OrderedDict):
        copied = OrderedDict((k, _staged(v, memo, copy, reuse, defer)) for k, v in obj.items())
        # Module.state_dict() hangs per-module versions on the dict; load_state_dict reads them back.
        if hasattr(obj, "_metadata"):
            copied._metadata = obj._metadata  # type: ignore[attr-defined]
        return copied
    if isinstance(obj, Mapping):
        return {k: _staged(v, memo, copy, reuse, defer) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_staged(v, memo, copy, reuse, defer) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_staged(v, memo, copy, reuse, defer) for v in obj)
    return obj


# -- streaming a state into storage ------------------------------------------------------------------------

# Writes at least this big are hashed behind the write when their memory outlives it (see _DigestingWriter);
# smaller ones (zip headers, small tensors) are hashed or copied at once, which costs next to nothing.
_LARGE_WRITE = 1 << 16


def _address(view: memoryview) -> int | None:
    """Where a buffer's bytes are (None without NumPy)."""
    try:
        import numpy as np
    except ImportError:
        return None
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class _TensorMemory:
    """The address ranges of the CPU tensors in a state tree."""

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
    """The file torch.save writes into: bytes go on to `sink`, counted and hashed on a thread of their own.

    A write returns before hashing only for `stable` memory, kept until `finish()`.
    After a failed write, later writes are dropped and `error` keeps the cause.
    """

    def __init__(self, sink: IO[bytes], stable: _TensorMemory, abort: threading.Event | None = None) -> None:
        self._sink = sink
        self._stable = stable
        self._abort = abort
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
            if self._abort is not None and self._abort.is_set():
                # Between two writes, so between two parts of an upload: the part in flight has finished.
                raise SaveSuperseded("the write was cut short: a newer save superseded it")
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
        """Stop hashing; returns once the hasher no longer reads the caller's memory."""
        self._hasher.shutdown(wait=True, cancel_futures=True)

    def _reap(self) -> None:
        while self._queued and self._queued[0].done():
            self._queued.popleft().result()  # re-raises a failed hash

    def _drain(self) -> None:
        while self._queued:
            self._queued.popleft().result()


# The S3 part size of checkpoint files (s3fs's default is 50 MiB), and of the ranged GETs that read them.
# A file within one part is a single PUT, so most rank files at HLAT's scale are one request each.
# An upload holds under two parts in memory; docs/multi-host.md ("Checkpoints and S3") has the arithmetic.
# S3's limits: parts up to 5 GiB, 10,000 parts an object (https://docs.aws.amazon.com/AmazonS3/latest/userguide/qfacts.html).
CHECKPOINT_PART_SIZE = 512 << 20


class SaveSuperseded(CheckpointError):
    """A save cut short by a newer one (`CheckpointManager.supersede`); nothing of it is committed."""


def write_state(
    storage: Storage, rel: str, state: Any, part_size: int | None = None, abort: threading.Event | None = None
) -> dict[str, Any]:
    """torch.save `state` atomically into storage object `rel`; return its size and sha256.

    `abort`: once set, the next write raises SaveSuperseded and no object is created.
    """
    parts = {} if storage.is_local else {"part_size": part_size or storage.block_size or CHECKPOINT_PART_SIZE}
    with storage.atomic_writer(rel, **parts) as sink:
        out = _DigestingWriter(sink, _TensorMemory(state), abort)
        try:
            with _no_record_crc32():
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


_crc32_lock = threading.Lock()
_crc32_off = 0
_crc32_before = True


@contextlib.contextmanager
def _no_record_crc32() -> Iterator[None]:
    """torch.save without its per-record CRC32 (the sha256 covers every byte); counted, as the switch is global."""
    global _crc32_off, _crc32_before
    save = torch.utils.serialization.config.save
    with _crc32_lock:
        if _crc32_off == 0:
            _crc32_before = save.compute_crc32
        _crc32_off += 1
        save.compute_crc32 = False
    try:
        yield
    finally:
        with _crc32_lock:
            _crc32_off -= 1
            if _crc32_off == 0:
                save.compute_crc32 = _crc32_before


def read_state(storage: Storage, rel: str, info: Mapping[str, Any] | None) -> tuple[State, int]:
    """(the state in `rel`, its size), checked against meta.json's size and sha256."""
    uri = storage.uri(rel)
    if info is None:
        raise CheckpointError(f"{uri} is not listed in its checkpoint's meta.json")
    part_size = storage.block_size or CHECKPOINT_PART_SIZE
    # No larger than a part: one GET (no HEAD first); larger: concurrent ranged GETs of a part each.
    data = storage.read_bytes(rel, part_size=part_size, one_request=int(info["size"]) <= part_size)
    if len(data) != info["size"]:
        raise CheckpointError(f"{uri} is {len(data)} bytes, {info['size']} were written")
    if info.get("sha256") and hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise CheckpointError(f"{uri} does not match its sha256 in meta.json (corrupted)")
    state = _deserialize(data, uri)
    if not isinstance(state, dict):
        raise CheckpointError(f"{uri} holds a {type(state).__name__}, not a dict")
    return state, len(data)
