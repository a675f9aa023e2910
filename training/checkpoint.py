"""Atomic, sharded-per-rank training checkpoints under a `Storage` (the run's `checkpoints/` folder).

Layout of one checkpoint (`step-000001000/` for step 1000, 9 digits so names sort by step):

    train_state.pt   shared state, written by rank 0 only: model, optimizer, scheduler, step... (torch.save)
    rank-00000.pt    one per rank: what differs between ranks (data-loader position, RNG states)
    rank-00001.pt
    meta.json        step, world_size, time, config fingerprint, and every file's size (sha256 where known)
    COMMITTED        the commit marker: {"step", "meta_sha256"}, written last

Protocol: every rank writes its rank file (rank 0 also train_state.pt), then rank 0 waits for the others
(the `barrier`, and then polling the storage until every rank file is visible, up to `commit_timeout_s`),
lists the folder to record the sizes in meta.json, and writes COMMITTED. Each object is written whole and
atomically by `Storage.write_bytes`, so a crash at any point leaves either a folder without the marker or a
complete checkpoint; only folders with the marker count, and `latest_step` also checks the marker against
meta.json and every listed file's size (a truncated or missing file skips the checkpoint with a warning).
Deleting removes the marker first, so a half-deleted folder never looks complete. Rank 0 re-saving a step
whose folder already exists (a previous attempt reached it, then the job resumed from an earlier step) first
removes that stale marker and meta.json.

Everything is saved with torch.save and loaded with `torch.load(weights_only=True)` only: states must be made
of tensors, plain containers, and ints/floats/strs/bools/None (RNG states included: see `capture_rng_state`). `save`
checks this (`check_loadable`) before writing anything, so a bad state fails the first save, not the resume.

Retention (rank 0, after each commit): the newest `keep_last` complete checkpoints, plus every complete one
whose step is a multiple of `keep_every`, forever; older complete ones and marker-less folders older than the
newest complete checkpoint are deleted. Newer marker-less folders are left alone: with async saves another
rank may already be writing the next checkpoint.

Async saves (`async_save=True`): `save` copies the state to CPU tensors (the only part that blocks the training
loop) and a background thread serialises and writes it. A later `save` or `wait()` first waits for the
pending one and re-raises its error as `CheckpointError`. The background thread never calls `barrier`: a
collective issued from a second thread can deadlock against the loop's own (NCCL, gloo); rank 0 relies on
polling the storage for the other ranks' files instead, so give it a generous `commit_timeout_s`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import random
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import torch
from torch import nn

from infra.storage import Storage, storage_errors

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MARKER = "COMMITTED"
META = "meta.json"
SHARED_FILE = "train_state.pt"
_STEP_DIR = re.compile(r"step-(\d+)")

State = dict[str, Any]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names it and why."""


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


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


def stage_to_cpu(obj: Any, copy: bool = True) -> Any:
    """The state tree with CPU tensors: fresh copies (copy=True: what the loop may mutate after save returns), or
    the CPU tensors themselves and host copies of the others (copy=False).

    Device tensors reach the host together: on XLA in one transfer (torch.save or `.cpu()` would fetch them one by
    one). Tensors appearing more than once (tied weights) stay shared in the copy, as torch.save would keep them.
    """
    memo: dict[int, torch.Tensor] = {}
    xla_tensors: dict[int, torch.Tensor] = {}
    _collect_xla(obj, xla_tensors)
    if xla_tensors:
        from training import xla

        fetched = xla.to_host(list(xla_tensors.values()))
        memo.update(zip(xla_tensors, fetched, strict=True))
    return _staged(obj, memo, copy)


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


def _staged(obj: Any, memo: dict[int, torch.Tensor], copy: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = obj.detach().to("cpu", copy=copy)
        return memo[key]
    if isinstance(obj, OrderedDict):
        copied = OrderedDict((k, _staged(v, memo, copy)) for k, v in obj.items())
        # Module.state_dict() hangs per-module versions on the dict; load_state_dict reads them back.
        if hasattr(obj, "_metadata"):
            copied._metadata = obj._metadata  # type: ignore[attr-defined]
        return copied
    if isinstance(obj, Mapping):
        return {k: _staged(v, memo, copy) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_staged(v, memo, copy) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_staged(v, memo, copy) for v in obj)
    return obj


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
        from training import xla

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
        from training import xla

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


class CheckpointManager:
    """Saves, finds, loads and prunes checkpoints for one rank of a run (see the module docstring)."""

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
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be at least 1 or None, got {keep_every}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.storage = storage
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.async_save = async_save
        self.fingerprint = fingerprint
        self.commit_timeout_s = commit_timeout_s
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._pending_step: int | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.storage.url!r}, rank={self.rank}/{self.world_size})"

    # -- saving ------------------------------------------------------------------------------------------
    def save(self, step: int, shared_state: Mapping[str, Any] | None, rank_state: Mapping[str, Any]) -> None:
        """Checkpoint `step`: every rank calls this with its own rank_state; shared_state is used on rank 0
        only (other ranks may pass None). Synchronous unless async_save (then: stage, return, write later)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.rank == 0 and shared_state is None:
            raise ValueError("rank 0 must pass the shared state (model, optimizer, ...) to save()")
        shared = shared_state if self.rank == 0 else None
        if shared is not None:
            check_loadable(shared, "shared_state")
        check_loadable(rank_state, "rank_state")
        self.wait()
        if not self.async_save:
            staged = stage_to_cpu(shared, copy=False) if shared is not None else None
            self._write(step, staged, stage_to_cpu(rank_state, copy=False), use_barrier=True)
            return
        # The only part that blocks the loop: CPU copies the loop may not change under the writer's feet.
        staged_shared = stage_to_cpu(shared) if shared is not None else None
        staged_rank = stage_to_cpu(rank_state)
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
        """Wait for a pending save, then stop the background thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _write(self, step: int, shared: Any, rank_state: Any, use_barrier: bool) -> None:
        folder = step_dir(step)
        started = time.monotonic()
        known: dict[str, dict[str, Any]] = {}
        if self.rank == 0:
            # A folder left by an earlier attempt at this step: its marker must not vouch for the new files.
            self.storage.remove(f"{folder}/{MARKER}")
            self.storage.remove(f"{folder}/{META}")
            known[SHARED_FILE] = self._put(f"{folder}/{SHARED_FILE}", _serialize(shared))
        known[rank_file(self.rank)] = self._put(f"{folder}/{rank_file(self.rank)}", _serialize(rank_state))
        if use_barrier:
            self.barrier()
        if self.rank != 0:
            return
        sizes = self._wait_for_rank_files(folder)
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
        meta_bytes = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
        self.storage.write_bytes(f"{folder}/{META}", meta_bytes)
        marker = {"step": step, "meta_sha256": hashlib.sha256(meta_bytes).hexdigest()}
        self.storage.write_bytes(f"{folder}/{MARKER}", (json.dumps(marker, sort_keys=True) + "\n").encode())
        log.info("checkpoint %s committed in %.1fs", self.storage.uri(folder), time.monotonic() - started)
        try:
            self.prune(newest=step)
        except Exception as exc:  # the checkpoint is safe; a failed clean-up must not stop training
            log.warning("could not prune old checkpoints under %s: %s", self.storage.url, exc)

    def _put(self, rel: str, data: bytes) -> dict[str, Any]:
        self.storage.write_bytes(rel, data)
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def _expected_files(self) -> list[str]:
        return [SHARED_FILE, *(rank_file(r) for r in range(self.world_size))]

    def _wait_for_rank_files(self, folder: str) -> dict[str, int]:
        """Sizes of the checkpoint's files once all are visible; CheckpointError after commit_timeout_s."""
        deadline = time.monotonic() + self.commit_timeout_s
        delay = 0.05
        while True:
            listed = self._file_sizes(folder)
            missing = [name for name in self._expected_files() if name not in listed]
            if not missing:
                return {name: listed[name] for name in self._expected_files()}
            if time.monotonic() >= deadline:
                shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                raise CheckpointError(
                    f"not committing {self.storage.uri(folder)}: {shown} missing after "
                    f"{self.commit_timeout_s:g}s; every rank must call save({int(folder[5:])}, ...)"
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 2.0)

    def _file_sizes(self, folder: str) -> dict[str, int]:
        # One listing (paginated on S3) instead of a HEAD request per file: thousands of ranks mean thousands
        # of rank files.
        path = self.storage.path(folder)
        with storage_errors(self.storage.uri(folder)):
            if not self.storage.fs.exists(path):
                return {}
            entries = self.storage.fs.ls(path, detail=True)
        sizes = {}
        for entry in entries:
            if entry.get("type") == "file":
                sizes[str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]] = int(entry["size"])
        return sizes

    # -- finding -----------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Steps of every checkpoint folder, complete or not, ascending."""
        steps = []
        for name in self.storage.list():
            match = _STEP_DIR.fullmatch(name)
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps)

    def committed_steps(self) -> list[int]:
        """Steps whose folder has the commit marker (not otherwise validated), ascending."""
        return [s for s in self.all_steps() if self.storage.exists(f"{step_dir(s)}/{MARKER}")]

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (None: none); newer broken ones are skipped with a warning."""
        for step in reversed(self.all_steps()):
            problem = self._problem(step)
            if problem is None:
                return step
            log.warning("skipping checkpoint %s: %s", self.storage.uri(step_dir(step)), problem)
        return None

    def read_meta(self, step: int) -> dict[str, Any]:
        """meta.json of a committed checkpoint."""
        problem = self._problem(step)
        if problem is not None:
            raise CheckpointError(f"checkpoint {self.storage.uri(step_dir(step))} is not usable: {problem}")
        meta: dict[str, Any] = self.storage.read_json(f"{step_dir(step)}/{META}")
        return meta

    def _problem(self, step: int) -> str | None:
        """Why checkpoint `step` is not complete, or None when it is."""
        folder = step_dir(step)
        try:
            sizes = self._file_sizes(folder)
            if MARKER not in sizes:
                return f"no {MARKER} marker (an interrupted save)"
            if META not in sizes:
                return f"{META} is missing"
            meta_bytes = self.storage.read_bytes(f"{folder}/{META}")
            marker = json.loads(self.storage.read_bytes(f"{folder}/{MARKER}"))
            if marker.get("meta_sha256") != hashlib.sha256(meta_bytes).hexdigest():
                return f"{META} does not match the sha256 recorded in {MARKER}"
            meta = json.loads(meta_bytes)
            if meta.get("step") != step:
                return f"{META} is for step {meta.get('step')}"
            for name, info in meta["files"].items():
                if name not in sizes:
                    return f"{name} is missing"
                if sizes[name] != info["size"]:
                    return f"{name} is {sizes[name]} bytes, {info['size']} were written (truncated or replaced)"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"unreadable ({type(exc).__name__}: {exc})"
        return None

    # -- loading -----------------------------------------------------------------------------------------
    def load(self, step: int) -> tuple[State, State]:
        """(shared_state, this rank's rank_state) of checkpoint `step`, as CPU tensors."""
        folder = step_dir(step)
        meta = self.read_meta(step)
        if meta["world_size"] != self.world_size:
            raise CheckpointError(
                f"checkpoint {self.storage.uri(folder)} was written by {meta['world_size']} ranks, this job has "
                f"{self.world_size}: per-rank state (data-loader positions, RNG) cannot be reassigned"
            )
        shared = self._read(folder, SHARED_FILE, meta)
        mine = self._read(folder, rank_file(self.rank), meta)
        return shared, mine

    def load_shared(self, step: int) -> State:
        """The shared state (model, optimizer, step, config...) of checkpoint `step` alone, whatever world size
        wrote it: what export and evaluation read."""
        folder = step_dir(step)
        return self._read(folder, SHARED_FILE, self.read_meta(step))

    def _read(self, folder: str, name: str, meta: Mapping[str, Any]) -> State:
        uri = self.storage.uri(folder, name)
        info = meta["files"].get(name)
        if info is None:
            raise CheckpointError(f"{uri} is not listed in {META}")
        data = self.storage.read_bytes(f"{folder}/{name}")
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
