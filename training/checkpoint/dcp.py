"""FSDP2's checkpoints: the sharded model and optimizer states through torch.distributed.checkpoint (DCP), in the
step folder beside the other files (`__<rank>_0.distcp` per rank, `.metadata` by rank 0, written last of them).

Synchronous saves are `dcp.save`; asynchronous ones `dcp.async_save`, which copies the state to CPU before it
returns (on CUDA into the pinned copies of the previous save: the writer's cache_staged_state_dict) and writes it
on a thread of its own. DCP's background writes plan and finish with collectives, so they go over a gloo process
group of their own (made once, by every rank, when the manager is): a collective issued from a second thread on
the loop's own group can deadlock against the loop's, and NCCL groups cannot hold CPU tensors at all. The files
are complete once rank 0's save has finished (rank 0 writes `.metadata` after every rank reported its writes).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch

from hlat.core.layout import CheckpointError, step_dir
from hlat.core.storage import Storage, storage_errors

METADATA = ".metadata"
"""torch.distributed.checkpoint's index of a distributed checkpoint (written last of its files, by rank 0)."""

State = dict[str, Any]


def is_dcp_file(name: str) -> bool:
    return name == METADATA or name.endswith(".distcp")


def expected_files(listed: Mapping[str, int]) -> list[str]:
    """The DCP files a committed checkpoint must hold, given what its folder lists: the metadata and every
    .distcp file (each complete by the time rank 0's save returned)."""
    return [METADATA, *sorted(n for n in listed if n.endswith(".distcp"))]


def _location(storage: Storage, step: int) -> tuple[str, dict[str, Any]]:
    """The step folder as DCP addresses it: a local path, or a URL with the storage's fsspec options (S3 endpoint,
    credentials)."""
    folder = step_dir(step)
    if storage.is_local:
        return storage.path(folder), {}
    return storage.uri(folder), dict(getattr(storage.fs, "storage_options", {}))


class DistributedWriter:
    """One rank's writer of DCP checkpoints under a storage, kept between saves (its staging copies are reused)."""

    def __init__(self, storage: Storage, asynchronous: bool) -> None:
        self.storage = storage
        self.asynchronous = asynchronous
        self._writer: Any = None
        self._group: Any = None
        if asynchronous:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self._group = dist.new_group(backend="gloo")  # a collective: every rank makes its manager together

    def _storage_writer(self, location: str, options: dict[str, Any]) -> Any:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        if self._writer is None:
            if self.storage.is_local:
                # Async on CUDA: the (pinned) staging copies are kept and refilled by the next save; DCP pins them,
                # which needs an accelerator.
                cache = self.asynchronous and torch.cuda.is_available()
                self._writer = dcp.FileSystemWriter(location, cache_staged_state_dict=cache)
            else:
                self._writer = FsspecWriter(location, **options)
        return self._writer

    def save(self, step: int, state: Mapping[str, Any]) -> Future[Any] | None:
        """Write this rank's part of `state` into checkpoint `step`'s folder (a collective every rank enters). Async:
        returns once the state is copied to CPU, with the future of the writes."""
        import torch.distributed.checkpoint as dcp

        location, options = _location(self.storage, step)
        writer = self._storage_writer(location, options)
        with storage_errors(self.storage.uri(step_dir(step))):
            if not self.asynchronous:
                dcp.save(dict(state), checkpoint_id=location, storage_writer=writer)
                return None
            future: Any = dcp.async_save(
                dict(state), checkpoint_id=location, storage_writer=writer, process_group=self._group
            )
        return getattr(future, "upload_completion", future)  # an AsyncSaveResponse in some releases

    def close(self) -> None:
        if self._writer is not None and hasattr(self._writer, "close"):
            self._writer.close()
        self._writer = None


def load(storage: Storage, step: int, meta: Mapping[str, Any], state: dict[str, Any]) -> None:
    """Fill `state` (this rank's DTensor state dict, as FSDP2's get_state_dict gives it) in place from the
    distributed files of committed checkpoint `step`; every rank calls it (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    if not meta.get("distributed"):
        raise CheckpointError(
            f"checkpoint {storage.uri(step_dir(step))} holds no distributed (FSDP2) state: it was written "
            "without parallelism.fsdp; resume it with the parallelism that wrote it"
        )
    location, options = _location(storage, step)
    reader = dcp.FileSystemReader(location) if storage.is_local else FsspecReader(location, **options)
    with storage_errors(storage.uri(step_dir(step))):
        dcp.load(state, storage_reader=reader)


def load_full(storage: Storage, step: int, meta: Mapping[str, Any]) -> State:
    """The distributed state of committed checkpoint `step` consolidated into plain CPU tensors (every shard
    gathered: what export reads), without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not meta.get("distributed"):
        raise CheckpointError(f"checkpoint {storage.uri(step_dir(step))} holds no distributed state")
    folder = step_dir(step)
    with tempfile.TemporaryDirectory(prefix="hlat-dcp-") as tmp:
        local = storage.path(folder) if storage.is_local else os.path.join(tmp, "dcp")
        if not storage.is_local:
            os.makedirs(local)
            for name in meta["files"]:
                if is_dcp_file(name):
                    storage.get_file(f"{folder}/{name}", os.path.join(local, name))
        out = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(local, out)
        state: State = torch.load(out, map_location="cpu", weights_only=True)
    return state
