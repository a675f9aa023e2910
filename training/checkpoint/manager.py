"""The commit protocol and retention: `CheckpointManager` saves, commits, finds, loads and prunes checkpoints.

Rules:
- every rank writes its files; rank 0 waits until all are visible, writes meta.json, then COMMITTED.
- only a folder whose marker verifies against meta.json counts.
- deleting removes the marker first; a resumed job first deletes every folder past its step.
- the async writer thread never calls a collective: rank 0 polls the storage instead.
- under graph extraction nothing is written or deleted.
docs/stages.md ("Checkpoints") explains the protocol; docs/multi-host.md the S3 pacing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

from hlat.core.layout import CHECKPOINT_MARKER as MARKER
from hlat.core.layout import CHECKPOINT_META as META
from hlat.core.layout import CheckpointError, CheckpointIndex, shard_file, step_dir
from hlat.core.stop_timeline import COMMIT_POLL_S, write_start_seconds
from hlat.core.storage import Storage, StorageError
from hlat.training.checkpoint import dcp
from hlat.training.checkpoint.serialization import (
    CHECKPOINT_PART_SIZE,
    SaveSuperseded,
    StagingBuffers,
    check_loadable,
    one_intra_op_thread,
    read_state,
    stage_to_cpu,
    write_state,
)

log = logging.getLogger("hlat.training.checkpoint")

FORMAT_VERSION = 1
SHARED_FILE = "train_state.pt"
# Shard names become file names (model-<shard>.pt) and must not look like anything else in the folder.
_SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")

State = dict[str, Any]


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def manifest_file(rank: int) -> str:
    """A rank's manifest: its files' sizes and sha256, merged into meta.json by rank 0."""
    return f"manifest-{rank:05d}.json"


def _is_manifest(name: str) -> bool:
    return name.startswith("manifest-") and name.endswith(".json")


_RANK_NAME = re.compile(r"(?:rank|manifest)-(\d{5})\.(?:pt|json)")


def _no_barrier() -> None:
    return None


def _identity(value: Any) -> Any:
    return value


def host_of(rank: int, env: Mapping[str, str] | None = None) -> str:
    """The host that runs `rank`, from torchrun's and SageMaker's environment.

    SageMaker numbers nodes by sorted(SM_HOSTS): from 10 hosts on, node 1 is algo-10.
    Without SM_HOSTS: "node N"; outside a job: this machine for RANK, "host unknown" for others.
    """
    env = os.environ if env is None else env
    local = _int(env.get("LOCAL_WORLD_SIZE"))
    if local:
        node = rank // local
        try:
            hosts = sorted(json.loads(env.get("SM_HOSTS") or "[]"))
        except (ValueError, TypeError):
            hosts = []
        if 0 <= node < len(hosts):
            return str(hosts[node])
        return f"node {node}"
    if _int(env.get("RANK")) in (rank, None):
        return env.get("SM_CURRENT_HOST") or socket.gethostname()
    return "host unknown"


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def request_offset(rank: int, world_size: int, requests_per_rank: float, rate: float | None) -> float:
    """Seconds `rank` waits so all ranks together send about `rate` requests a second (0: no rate)."""
    if not rate or world_size <= 1:
        return 0.0
    return rank * requests_per_rank / rate


def read_requests(size: int, part_size: int | None = None) -> int:
    """S3 requests s3fs makes to read `size` bytes: one GET, or a HEAD and a ranged GET per part."""
    part = part_size or CHECKPOINT_PART_SIZE
    return 1 if size <= part else 1 + -(-size // part)


def checkpoint_requests(sizes: Mapping[str, int], part_size: int, manifests: int) -> dict[str, int]:
    """The S3 write requests of one checkpoint's files (name -> size), as s3fs makes them.

    bench_checkpoint.py and the S3 test use this count.
    """
    counts = {"PutObject": 0, "CreateMultipartUpload": 0, "UploadPart": 0, "CompleteMultipartUpload": 0}
    for size in sizes.values():
        if size < part_size:  # s3fs: one PUT when the file is closed before a whole part has been written
            counts["PutObject"] += 1
        else:
            counts["CreateMultipartUpload"] += 1
            counts["UploadPart"] += -(-size // part_size)
            counts["CompleteMultipartUpload"] += 1
    counts["PutObject"] += manifests + 2
    return counts


class CheckpointManager(CheckpointIndex):
    """Saves, finds, loads and prunes one rank's checkpoints; finding is `CheckpointIndex`'s (core/layout.py)."""

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
        stage_in_background: bool = False,
        share: Callable[[Any], Any] = _identity,
        write_rate: float | None = 2000.0,
        read_rate: float | None = 3000.0,
        extracting_graphs: bool = False,
    ) -> None:
        """`shard`: this rank's shard name (None: unsharded); `shard_writer`: this rank writes it; `shards`: all
        names.

        `distributed`: FSDP2 through DCP. `stage_in_background`: the writer thread copies; see `wait_staged()`.
        `share`: broadcasts rank 0's value. `write_rate` / `read_rate`: S3 requests a second, all ranks.
        `extracting_graphs`: write and delete nothing.
        """
        if distributed and shard is not None:
            raise ValueError("distributed (DCP) checkpoints hold no per-shard files: pass no shard")
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
        self._verified: set[int] = set()  # steps retention found complete (see prune)
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
        self.stage_in_background = stage_in_background
        self._staged = threading.Event()
        self._staged.set()
        # This rank's shared-state file: the one it loads, and writes when it is that file's writer.
        self._shared_file = SHARED_FILE if shard is None else shard_file(shard)
        self._writes_shared = rank == 0 if shard is None else shard_writer
        self._staging = (StagingBuffers(), StagingBuffers())  # shared, rank state (async saves)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._pending_step: int | None = None
        self._lock = threading.Lock()
        self._superseding = threading.Event()  # set while `supersede` cuts the pending async save short
        self.bytes_read = 0
        """Bytes this rank has read from checkpoint files."""
        self.share = share
        self.write_rate = write_rate
        self.read_rate = read_rate
        self.host = host_of(rank)
        self._metas: dict[int, dict[str, Any]] = {}  # meta.json of checkpoints resume_point found (rank 0's)
        self._dcp = dcp.DistributedWriter(storage, asynchronous=async_save) if distributed else None
        self.extracting_graphs = extracting_graphs

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
        """Checkpoint `step`; every rank calls this with its own rank_state.

        shared_state matters only on its writer. distributed_state is the DTensor state (distributed=True).
        Async saves stage, return, and write in the background.
        """
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
        if self.extracting_graphs:
            # Invalid values: fetched as a save fetches them (the transfers are traced), then dropped. DCP's
            # FSDP2 path never runs on XLA, where graphs are extracted.
            if shared is not None:
                stage_to_cpu(shared, copy=False)
            stage_to_cpu(rank_state, copy=False)
            if not self.async_save:
                self.barrier()  # where a synchronous save waits for every rank's files
            log.info("checkpoint of step %d not written: extracting graphs (the values are invalid)", step)
            return
        self._metas.pop(step, None)  # the folder is about to change: what resume_point read of it is stale
        distributed_writes: Future[Any] | None = None
        if distributed_state is not None:
            self._clear_stale_marker(step)
            self.barrier()  # no rank writes the new files while the old marker may still be there
            assert self._dcp is not None
            distributed_writes = self._dcp.save(step, distributed_state)
        if not self.async_save:
            staged = stage_to_cpu(shared, copy=False) if shared is not None else None
            self._write(step, staged, stage_to_cpu(rank_state, copy=False), use_barrier=True)
            return
        # The only part that blocks the loop: CPU copies the loop may not change under the writer's feet, into the
        # previous save's buffers (wait() above: its writer is done with them).
        # With stage_in_background, the CPU tensors' copies are left to the writer thread (see wait_staged).
        defer = self.stage_in_background
        staged_shared = stage_to_cpu(shared, reuse=self._staging[0], defer=defer) if shared is not None else None
        staged_rank = stage_to_cpu(rank_state, reuse=self._staging[1], defer=defer)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"ckpt-rank{self.rank}", initializer=one_intra_op_thread
                )
            self._pending_step = step
            self._staged.clear()
            self._pending = self._executor.submit(
                self._stage_then_write, step, staged_shared, staged_rank, distributed_writes
            )

    def _stage_then_write(
        self, step: int, shared: Any, rank_state: Any, distributed_writes: Future[Any] | None
    ) -> None:
        try:
            for buffers in self._staging:
                buffers.fill()
        finally:
            self._staged.set()
        self._write(step, shared, rank_state, False, distributed_writes)

    def wait_staged(self) -> None:
        """Block until a pending async save has copied the state; the caller may then change its tensors."""
        self._staged.wait()

    def check(self) -> None:
        """Raise CheckpointError if the pending async save failed; no I/O, so cheap after every step."""
        with self._lock:
            pending = self._pending
            if pending is None or not pending.done() or pending.exception() is None:
                return
        self.wait()  # done and failed: wait() returns nothing but its error

    def wait(self) -> None:
        """Block until a pending async save has finished; re-raise its error."""
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
                f"background save of {self.storage.uri(step_dir(step or 0))} failed ({self._who()}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def supersede(self) -> int | None:
        """Cut the pending async save short for a newer one (a stop's); return its step or None.

        It commits nothing. Every rank must supersede alike, or rank 0 waits for files nobody writes.
        DCP's own async writes are waited for. A failed pending save is logged, not raised.
        """
        with self._lock:
            pending, step = self._pending, self._pending_step
            self._pending, self._pending_step = None, None
        if pending is None:
            return None
        self._superseding.set()
        try:
            pending.result()
        except SaveSuperseded:
            log.info("the save of step %s was superseded (%s): not committed", step, self._who())
            return step
        except Exception as exc:
            log.warning(
                "the background save of step %s had failed (%s): %s: %s; superseded", step, self._who(),
                type(exc).__name__, exc,
            )  # fmt: skip
            return step
        finally:
            self._superseding.clear()
        return None

    def _who(self, rank: int | None = None) -> str:
        """`rank 5 on algo-1`, as error messages name a rank."""
        rank = self.rank if rank is None else rank
        return f"rank {rank} on {self.host if rank == self.rank else host_of(rank)}"

    def close(self) -> None:
        """Wait for a pending save, stop the background thread, free the staging buffers."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            for buffers in self._staging:
                buffers.clear()
            if self._dcp is not None:
                self._dcp.close()

    def discard_after(self, step: int | None) -> list[int]:
        """Before the first save: rank 0 deletes every folder past `step` (None: all); then a barrier.

        An earlier attempt's files there must not pass for this one's. Returns the steps deleted.
        """
        doomed: list[int] = []
        if self.rank == 0:
            doomed = [s for s in self.all_steps() if step is None or s > step]
            if doomed:
                log.info(
                    "discarding what an earlier attempt left past %s: steps %s",
                    "the start" if step is None else f"step {step}",
                    ", ".join(map(str, doomed)),
                )
            for old in doomed:
                self.delete(old)
            try:
                self.abort_incomplete_uploads()
            except Exception as exc:  # billed leftovers, not a reason to stop the job
                log.warning("could not abort incomplete uploads under %s: %s", self.storage.url, exc)
        self.barrier()
        return doomed

    def abort_incomplete_uploads(self) -> int:
        """Rank 0 at job start: abort a killed attempt's unfinished uploads (S3 bills them); return the count."""
        if self.rank != 0 or self.extracting_graphs:
            return 0
        aborted = self.storage.abort_incomplete_uploads()
        if aborted:
            log.info("aborted %d incomplete upload(s) an earlier attempt left under %s", aborted, self.storage.url)
        return aborted

    def _clear_stale_marker(self, step: int) -> None:
        """Rank 0: an earlier attempt's marker at this step must not vouch for new files."""
        if self.rank == 0 and not self.extracting_graphs:
            self.storage.remove(f"{step_dir(step)}/{MARKER}")
            self.storage.remove(f"{step_dir(step)}/{META}")

    def _write(
        self,
        step: int,
        shared: Any,
        rank_state: Any,
        use_barrier: bool,
        distributed_writes: Future[Any] | None = None,
    ) -> None:
        folder = step_dir(step)
        started = time.monotonic()
        known: dict[str, dict[str, Any]] = {}
        if distributed_writes is not None:
            distributed_writes.result()  # DCP's files first: rank 0's marks every rank's complete
        elif not self.distributed:
            self._clear_stale_marker(step)
        if not self.storage.is_local:
            # Spread the ranks' first requests over time, the shard writers first (see the module docstring).
            self._pause(self._write_offset())
        if shared is not None:
            self._check_superseded(step)
            known[self._shared_file] = self._write_file(folder, self._shared_file, shared)
        self._check_superseded(step)
        known[rank_file(self.rank)] = self._write_file(folder, rank_file(self.rank), rank_state)
        self._check_superseded(step)
        if self.rank != 0:
            manifest = {"rank": self.rank, "host": self.host, "files": known}
            with self._naming_errors(f"{folder}/{manifest_file(self.rank)}"):
                self.storage.write_bytes(
                    f"{folder}/{manifest_file(self.rank)}", (json.dumps(manifest, sort_keys=True) + "\n").encode()
                )
        if use_barrier:
            self.barrier()
        if self.rank != 0:
            return
        sizes = self._wait_for_files(folder, step)
        # The manifests' contents go into meta.json; they themselves are not part of the checkpoint.
        files: dict[str, dict[str, Any]] = {
            name: {"size": sizes[name], "sha256": None} for name in sorted(sizes) if not _is_manifest(name)
        }
        manifests = self._read_manifests(folder, sizes)
        self._check_superseded(step)  # the last moment a superseded save may stop: nothing of it is committed
        for rank, written in [(0, known), *manifests]:
            for name, info in written.items():
                if name not in files or files[name]["size"] != info["size"]:
                    listed = files[name]["size"] if name in files else "missing"
                    raise CheckpointError(
                        f"not committing {self.storage.uri(folder)}: {name} ({self._who(rank)}) is {listed} bytes "
                        f"after writing {info['size']}"
                    )
                files[name]["sha256"] = info.get("sha256")
        if self.distributed and dcp.METADATA in files and files[dcp.METADATA]["sha256"] is None:
            # DCP writes its index itself: read back (it is small), so that loads check it before parsing it.
            files[dcp.METADATA]["sha256"] = dcp.metadata_sha256(self.storage, folder)
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

    def _write_file(self, folder: str, name: str, state: Any) -> dict[str, Any]:
        with self._naming_errors(f"{folder}/{name}"):
            return write_state(self.storage, f"{folder}/{name}", state, abort=self._superseding)

    def _write_offset(self) -> float:
        """This rank's pacing delay: shard writers first, then every rank in rank order."""
        if self.shard is not None:
            writer = self.shards.index(self.shard) if self.shard_writer else None
            return write_start_seconds(self.rank, self.world_size, self.write_rate, writer, len(self.shards))
        if self.distributed:
            return write_start_seconds(self.rank, self.world_size, self.write_rate)
        return write_start_seconds(self.rank, self.world_size, self.write_rate, 0 if self.rank == 0 else None, 1)

    def _pause(self, seconds: float) -> None:
        """Sleep, cut short when the save being written is superseded."""
        if seconds > 0:
            self._superseding.wait(seconds)

    def _check_superseded(self, step: int) -> None:
        if self._superseding.is_set():
            raise SaveSuperseded(f"the save of step {step} was superseded by a stop's save ({self._who()})")

    @contextlib.contextmanager
    def _naming_errors(self, rel: str) -> Iterator[None]:
        """Errors of a write name this rank, its host and the key."""
        try:
            yield
        except Exception as exc:
            uri = self.storage.uri(rel)
            text = str(exc) if uri in str(exc) else f"{uri}: {type(exc).__name__}: {exc}"
            raise _same_kind(exc, f"{self._who()}: {text}") from exc

    def _read_manifests(self, folder: str, sizes: Mapping[str, int]) -> list[tuple[int, dict[str, Any]]]:
        """(rank, its files' sizes and sha256) from every other rank's manifest, read in parallel."""
        ranks = [r for r in range(1, self.world_size) if manifest_file(r) in sizes]

        def read(rank: int) -> tuple[int, dict[str, Any]]:
            try:
                manifest = json.loads(self.storage.read_bytes(f"{folder}/{manifest_file(rank)}", one_request=True))
                return rank, dict(manifest["files"])
            except (StorageError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(
                    f"not committing {self.storage.uri(folder)}: the manifest of {self._who(rank)} is unreadable: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc

        if not ranks:
            return []
        # As many reads in flight as the S3 client has connections (core.storage.S3_MAX_POOL_CONNECTIONS): at 8,192
        # ranks this is most of a commit's time, inside the stop's grace (core/stop_timeline.py).
        workers = min(self.storage.parallel_reads, len(ranks))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-manifests") as pool:
            return list(pool.map(read, ranks))

    def _expected_files(self, listed: Mapping[str, int]) -> list[str]:
        shared = [SHARED_FILE] if self.shard is None else [shard_file(s) for s in self.shards]
        distributed = dcp.expected_files(listed) if self.distributed else []
        manifests = [manifest_file(r) for r in range(1, self.world_size)]
        return [*shared, *(rank_file(r) for r in range(self.world_size)), *manifests, *distributed]

    # -- torch.distributed.checkpoint (FSDP2) ------------------------------------------------------------
    def load_distributed(self, step: int, state: dict[str, Any]) -> None:
        """Fill `state` (this rank's DTensor state dict) in place from checkpoint `step`; a collective."""
        dcp.load(self.storage, step, self._meta(step), state)

    def load_distributed_full(self, step: int) -> State:
        """Checkpoint `step`'s distributed state gathered into CPU tensors, without a process group."""
        return dcp.load_full(self.storage, step, self.read_meta(step))

    def _wait_for_files(self, folder: str, step: int | None = None) -> dict[str, int]:
        """The files' sizes once all are visible; CheckpointError after commit_timeout_s."""
        deadline = time.monotonic() + self.commit_timeout_s
        delay = 0.05
        while True:
            if step is not None:
                self._check_superseded(step)
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
                    f"{self.commit_timeout_s:g}s{self._missing_ranks(missing)}; every rank must call "
                    f"save({int(folder[5:])}, ...){writers}"
                )
            self._pause(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, COMMIT_POLL_S)

    def _missing_ranks(self, missing: Sequence[str]) -> str:
        """` (the files of 2 ranks are missing, by host: algo-1: rank 5; algo-2: rank 37)`."""
        ranks = sorted({int(m.group(1)) for m in map(_RANK_NAME.fullmatch, missing) if m})
        if not ranks:
            return ""
        by_host: dict[str, list[int]] = {}
        for rank in ranks:
            by_host.setdefault(host_of(rank), []).append(rank)
        hosts = "; ".join(
            f"{host}: rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs[:8]))}{' ...' if len(rs) > 8 else ''}"
            for host, rs in sorted(by_host.items())[:8]
        )
        more = f" and {len(by_host) - 8} more hosts" if len(by_host) > 8 else ""
        return f" (the files of {_ranks(len(ranks))} are missing, by host: {hosts}{more})"

    # -- loading -----------------------------------------------------------------------------------------
    def resume_point(self) -> tuple[int, dict[str, Any]] | None:
        """(step, meta.json) of the newest complete checkpoint, or None; a collective.

        Only rank 0 lists and reads, then `share`s the result.
        """
        found: Any = None
        if self.share is _identity and self.world_size > 1:
            # No broadcast given: every rank must look for itself (a None from the default share on ranks other
            # than 0 would make them start from scratch).
            found = self.latest()
            if found is not None:
                self._metas[found[0]] = found[1]
            return found
        if self.rank == 0:
            try:
                found = self.latest()
            except Exception as exc:  # every rank must learn of it, or the others wait in share() forever
                found = {"error": f"{type(exc).__name__}: {exc}"}
        found = self.share(found)
        if isinstance(found, dict):
            raise CheckpointError(
                f"rank 0 could not find the newest checkpoint under {self.storage.url}: {found['error']}"
            )
        if found is None:
            return None
        step, meta = int(found[0]), dict(found[1])
        self._metas[step] = meta
        return step, meta

    def _meta(self, step: int) -> dict[str, Any]:
        meta = self._metas.get(step)
        return meta if meta is not None else self.read_meta(step)

    def load(self, step: int) -> tuple[State, State]:
        """(shared state, this rank's rank_state) of checkpoint `step`, as CPU tensors."""
        folder = step_dir(step)
        meta = self._meta(step)
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
        if not self.storage.is_local:  # spread the ranks' reads (see the module docstring)
            reads = sum(
                read_requests(int(meta["files"].get(name, {}).get("size", 0)), self.storage.block_size)
                for name in (self._shared_file, rank_file(self.rank))
            )
            time.sleep(request_offset(self.rank, self.world_size, reads, self.read_rate))
        shared = self._read(folder, self._shared_file, meta)
        mine = self._read(folder, rank_file(self.rank), meta)
        return shared, mine

    def load_shared(self, step: int) -> State:
        """The shared state of unsharded checkpoint `step`, whatever world size wrote it."""
        folder = step_dir(step)
        meta = self.read_meta(step)
        shards = _shard_list(meta)
        if shards is not None:
            raise CheckpointError(
                f"checkpoint {self.storage.uri(folder)} is sharded ({_describe_layout(shards)}): it has no single "
                f"shared state; read every shard with load_shards({step}) and put them together "
                "(training.parallel.tensor_slices.consolidate)"
            )
        return self._read(folder, SHARED_FILE, meta)

    def load_shards(self, step: int) -> dict[str, State]:
        """Every shard's state of checkpoint `step`, by shard name, all in memory (for export)."""
        folder = step_dir(step)
        meta = self.read_meta(step)
        shards = _shard_list(meta)
        if shards is None:
            raise CheckpointError(
                f"checkpoint {self.storage.uri(folder)} is not sharded: read its shared state with load_shared({step})"
            )
        return {name: self._read(folder, shard_file(name), meta) for name in shards}

    def shard_names(self, step: int) -> list[str]:
        """Checkpoint `step`'s shard names ([] when unsharded)."""
        return _shard_list(self.read_meta(step)) or []

    def _read(self, folder: str, name: str, meta: Mapping[str, Any]) -> State:
        state, size = read_state(self.storage, f"{folder}/{name}", meta["files"].get(name))
        self.bytes_read += size
        return state

    # -- retention ---------------------------------------------------------------------------------------
    def prune(self, newest: int | None = None) -> list[int]:
        """Delete what retention does not keep (rank 0 only); return the steps deleted."""
        if self.rank != 0:
            return []
        steps = self.all_steps()
        marked = [s for s in steps if self.storage.exists(f"{step_dir(s)}/{MARKER}")]
        # Only checkpoints that verify (the marker's sha256 of meta.json, every file it lists at its size) count or
        # are deleted: a folder that merely looks committed (planted, or broken) must neither push this run's
        # checkpoints out of keep_last nor be deleted as if it were one of them. It is left alone, with a warning.
        # The step just committed here is verified by its own commit; a step verified once keeps its verdict for
        # this manager's life (a commit then costs no re-reads of the checkpoints it keeps).
        if newest is not None:
            self._verified.add(newest)
        committed: list[int] = []
        suspect: list[int] = []
        for step in marked:
            problem = None if step in self._verified else self._problem(step)
            if problem is None:
                self._verified.add(step)
            (committed if problem is None else suspect).append(step)
            if problem is not None:
                log.warning(
                    "retention leaves %s alone, neither kept nor deleted as a checkpoint: %s",
                    self.storage.uri(step_dir(step)), problem,
                )  # fmt: skip
        if not committed:
            return []
        steps = [s for s in steps if s not in suspect]
        doomed = retention(steps, committed, self.keep_last, self.keep_every, newest, pinned=self.pinned_steps())
        for step in doomed:
            self.delete(step)
        return doomed

    def delete(self, step: int) -> None:
        """Delete a checkpoint folder, its marker first. Nothing under graph extraction."""
        if self.extracting_graphs:
            return
        folder = step_dir(step)
        self._verified.discard(step)
        self.storage.remove(f"{folder}/{MARKER}")
        self.storage.remove(folder, recursive=True)
        log.info("deleted checkpoint %s", self.storage.uri(folder))


def _same_kind(exc: Exception, message: str) -> Exception:
    """An exception of `exc`'s class saying `message`, else a CheckpointError."""
    try:
        renamed = type(exc)(message)
    except Exception:
        return CheckpointError(message)
    return renamed if str(renamed) == message else CheckpointError(message)


def _shard_list(meta: Mapping[str, Any]) -> list[str] | None:
    """The shard names a checkpoint's meta.json records (None: unsharded)."""
    shards = meta.get("shards")
    return sorted(str(name) for name in shards) if shards is not None else None


def _describe_layout(shards: list[str] | None) -> str:
    if shards is None:
        return f"one shared {SHARED_FILE}"
    shown = ", ".join(shards[:6]) + (f" and {len(shards) - 6} more" if len(shards) > 6 else "")
    return f"{len(shards)} shard{'s' if len(shards) != 1 else ''} ({shown})"


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def retention(
    steps: Sequence[int],
    committed: Sequence[int],
    keep_last: int,
    keep_every: int | None,
    newest: int | None,
    pinned: Collection[int] = (),
) -> list[int]:
    """The steps to delete, ascending.

    Keeps the newest `keep_last` complete ones, multiples of `keep_every` and `pinned` steps.
    Deletes incomplete folders older than `newest`.
    """
    if not committed:
        return []
    committed = sorted(committed)
    newest = committed[-1] if newest is None else newest
    keep = set(committed[-keep_last:])
    if keep_every:
        keep.update(s for s in committed if s % keep_every == 0)
    doomed = {s for s in committed if s not in keep}
    doomed.update(s for s in steps if s not in committed and s < newest)
    return sorted(doomed - set(pinned))
