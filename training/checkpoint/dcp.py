"""FSDP2's checkpoints: sharded model and optimizer states through torch.distributed.checkpoint (DCP).

Rules:
- files: `__<rank>_0.distcp` per rank, then `.metadata` by rank 0, in the step folder.
- async saves use a gloo group of their own, as collectives from a second thread can deadlock.
- nothing read back runs code: `.metadata` admits DCP's classes only, items load with weights_only=True
  (https://docs.python.org/3/library/pickle.html#restricting-globals).
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
"""DCP's index of a distributed checkpoint, written last."""

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
"""The globals a DCP `.metadata` pickle may name (torch 2.13's), besides torch's dtypes."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not one of DCP's metadata classes")


def recorded_sha256(meta: Mapping[str, Any] | None) -> str | None:
    """The sha256 of `.metadata` that meta.json records (None in older checkpoints)."""
    info = ((meta or {}).get("files") or {}).get(METADATA)
    return info.get("sha256") if isinstance(info, Mapping) else None


def read_metadata(data: bytes, where: str, sha256: str | None = None) -> Any:
    """DCP's metadata from `.metadata` bytes, admitting DCP's classes only; CheckpointError otherwise.

    With `sha256`, differing bytes are refused before parsing.
    """
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
    """A .distcp item loaded with weights_only=True."""
    try:
        item = torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"refusing an item of {where}: {str(exc).splitlines()[0]}") from None
    clean = io.BytesIO()
    torch.save(item, clean)
    clean.seek(0)
    return clean


def _safe_reader(location: str, options: Mapping[str, Any], local: bool, sha256: str | None = None) -> Any:
    """DCP's reader of `location`, with `read_metadata`."""
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
    """Refuse checkpoint `step` whose `.metadata` fails the sha256 or class check."""
    folder = step_dir(step)
    with storage_errors(storage.uri(folder)):
        data = storage.read_bytes(f"{folder}/{METADATA}")
    read_metadata(data, storage.uri(folder, METADATA), recorded_sha256(meta))


def metadata_sha256(storage: Storage, folder: str) -> str:
    """The sha256 of a step's `.metadata`, recorded in meta.json."""
    with storage_errors(storage.uri(folder, METADATA)):
        return hashlib.sha256(storage.read_bytes(f"{folder}/{METADATA}")).hexdigest()


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """A refusal of ours comes out of DCP's CheckpointException as itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        for error, _ in exc.failures.values():
            if isinstance(error, CheckpointError):
                raise error from None
        raise


def _safe_planner(base: Any, where: str) -> Any:
    """DCP load planner `base` whose non-tensor items load with weights_only=True."""

    class SafePlanner(base):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            super().load_bytes(read_item, _weights_only(value, where))

    return SafePlanner()


def is_dcp_file(name: str) -> bool:
    return name == METADATA or name.endswith(".distcp")


def expected_files(listed: Mapping[str, int]) -> list[str]:
    """The DCP files a committed checkpoint must hold."""
    return [METADATA, *sorted(n for n in listed if n.endswith(".distcp"))]


def _location(storage: Storage, step: int) -> tuple[str, dict[str, Any]]:
    """The step folder as DCP addresses it: a path, or a URL with fsspec options."""
    folder = step_dir(step)
    if storage.is_local:
        return storage.path(folder), {}
    return storage.uri(folder), dict(getattr(storage.fs, "storage_options", {}))


class DistributedWriter:
    """One rank's DCP writer, kept between saves to reuse its staging copies."""

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
        """Write this rank's part of `state` into step `step` (a collective); async returns a future."""
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
    """Fill `state` in place from committed checkpoint `step`; a collective."""
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
    """Checkpoint `step`'s distributed state gathered on the CPU, without a process group."""
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
