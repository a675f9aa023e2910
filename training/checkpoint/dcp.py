"""FSDP2's checkpoints: the sharded model and optimizer states through torch.distributed.checkpoint (DCP), in the
step folder beside the other files (`__<rank>_0.distcp` per rank, `.metadata` by rank 0, written last of them).

Synchronous saves are `dcp.save`; asynchronous ones `dcp.async_save`, which copies the state to CPU before it
returns (on CUDA into the pinned copies of the previous save: the writer's cache_staged_state_dict) and writes it
on a thread of its own. DCP's background writes plan and finish with collectives, so they go over a gloo process
group of their own (made once, by every rank, when the manager is): a collective issued from a second thread on
the loop's own group can deadlock against the loop's, and NCCL groups cannot hold CPU tensors at all. The files
are complete once rank 0's save has finished (rank 0 writes `.metadata` after every rank reported its writes).

Nothing read back runs code. DCP's `.metadata` is a pickle by design, and DCP loads each non-tensor item of a
`.distcp` file with `torch.load(weights_only=False)` (torch 2.13's `DefaultLoadPlanner.load_bytes`): whoever can
write to the run's storage could plant either. So every read here goes through `read_metadata` (an unpickler that
admits DCP's own metadata classes and nothing else, https://docs.python.org/3/library/pickle.html#restricting-globals)
and planners that load those items with `weights_only=True`; a refused file is named in the error.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from hlat.core.layout import CheckpointError, step_dir
from hlat.core.storage import Storage, storage_errors

METADATA = ".metadata"
"""torch.distributed.checkpoint's index of a distributed checkpoint (written last of its files, by rank 0)."""

State = dict[str, Any]

DCP_METADATA_CLASSES = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of a local save
        ("collections", "OrderedDict"),
    }
)  # fmt: skip
"""The globals a DCP `.metadata` pickle may name (torch 2.13's, listed from real saves), besides torch's dtypes."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not one of DCP's metadata classes")


def recorded_sha256(meta: Mapping[str, Any] | None) -> str | None:
    """The sha256 of the `.metadata` file that meta.json records (the commit reads it back; None in checkpoints
    written before it did)."""
    info = ((meta or {}).get("files") or {}).get(METADATA)
    return info.get("sha256") if isinstance(info, Mapping) else None


def read_metadata(data: bytes, where: str, sha256: str | None = None) -> Any:
    """DCP's checkpoint metadata from the bytes of a `.metadata` file, admitting DCP's own classes only; a file
    naming anything else (a planted one) raises CheckpointError naming `where`, and nothing of it runs. With
    `sha256` (meta.json's record of it), bytes that differ are refused before they are parsed at all."""
    from torch.distributed.checkpoint.metadata import Metadata

    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"refusing {where}: it does not match its sha256 in meta.json (replaced or corrupted)")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as exc:
        raise CheckpointError(f"refusing {where}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"refusing {where}: it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def _weights_only(value: io.BytesIO, where: str) -> io.BytesIO:
    """A non-tensor item of a .distcp file, loaded with weights_only=True (a planted item naming any other global is
    refused) and saved again for the planner's own torch.load: what reaches that load is what weights_only admitted."""
    try:
        item = torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"refusing an item of {where}: {str(exc).splitlines()[0]}") from None
    clean = io.BytesIO()
    torch.save(item, clean)
    clean.seek(0)
    return clean


def _safe_reader(location: str, options: Mapping[str, Any], local: bool, sha256: str | None = None) -> Any:
    """DCP's reader of `location` (FileSystemReader, or FsspecReader for a URL) with `read_metadata` above."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    base: Any = dcp.FileSystemReader if local else FsspecReader

    class SafeReader(base):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self.fs.concat_path(self.path, METADATA)
            with self.fs.create_stream(path, "rb") as stream:
                metadata = read_metadata(stream.read(), str(path), sha256)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(location) if local else SafeReader(location, **options)


def _check_metadata(storage: Storage, step: int, meta: Mapping[str, Any]) -> None:
    """Refuse checkpoint `step` before DCP opens it when its `.metadata` differs from meta.json's sha256 of it or
    names anything but DCP's classes (the readers refuse it again when they read it: a file replaced in between is
    no way around)."""
    folder = step_dir(step)
    with storage_errors(storage.uri(folder)):
        data = storage.read_bytes(f"{folder}/{METADATA}")
    read_metadata(data, storage.uri(folder, METADATA), recorded_sha256(meta))


def metadata_sha256(storage: Storage, folder: str) -> str:
    """The sha256 of a step folder's `.metadata` as DCP wrote it: what the commit records in meta.json."""
    with storage_errors(storage.uri(folder, METADATA)):
        return hashlib.sha256(storage.read_bytes(f"{folder}/{METADATA}")).hexdigest()


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """DCP wraps each rank's error in its CheckpointException: a refusal of ours comes out as itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        for error, _ in exc.failures.values():
            if isinstance(error, CheckpointError):
                raise error from None
        raise


def _safe_planner(base: Any, where: str) -> Any:
    """An instance of DCP load planner class `base` whose non-tensor items load with weights_only=True."""

    class SafePlanner(base):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            super().load_bytes(read_item, _weights_only(value, where))

    return SafePlanner()


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
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    if not meta.get("distributed"):
        raise CheckpointError(
            f"checkpoint {storage.uri(step_dir(step))} holds no distributed (FSDP2) state: it was written "
            "without parallelism.fsdp; resume it with the parallelism that wrote it"
        )
    _check_metadata(storage, step, meta)
    location, options = _location(storage, step)
    where = storage.uri(step_dir(step))
    with storage_errors(where), _refusals():
        dcp.load(
            state,
            storage_reader=_safe_reader(location, options, storage.is_local, recorded_sha256(meta)),
            planner=_safe_planner(DefaultLoadPlanner, where),
        )


def load_full(storage: Storage, step: int, meta: Mapping[str, Any]) -> State:
    """The distributed state of committed checkpoint `step` consolidated into plain CPU tensors (every shard
    gathered: what export reads), without a process group."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if not meta.get("distributed"):
        raise CheckpointError(f"checkpoint {storage.uri(step_dir(step))} holds no distributed state")
    _check_metadata(storage, step, meta)
    folder = step_dir(step)
    with tempfile.TemporaryDirectory(prefix="hlat-dcp-") as tmp:
        local = storage.path(folder) if storage.is_local else os.path.join(tmp, "dcp")
        if not storage.is_local:
            os.makedirs(local)
            for name in meta["files"]:
                if is_dcp_file(name):
                    storage.get_file(f"{folder}/{name}", os.path.join(local, name))
        # What torch's dcp_to_torch_save does (its private loader: the public one fills only the keys it is
        # given), through the safe reader and planner, which it does not take.
        state: State = {}
        with _refusals():
            _load_state_dict(
                state,
                storage_reader=_safe_reader(local, {}, local=True, sha256=recorded_sha256(meta)),
                planner=_safe_planner(_EmptyStateDictLoadPlanner, storage.uri(folder)),
                no_dist=True,
            )
    return state
