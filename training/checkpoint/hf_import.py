"""Start a run from a Hugging Face Llama or GPT-NeoX checkpoint (`model.init_from`), in any layout.

Each rank reads only the tensors its parameters need, one at a time, by ranged reads of the safetensors
(https://huggingface.co/docs/safetensors); no file is read whole. `import_weights(trainer)` fills this rank's
parameters: whole (dense), its TP slice, its PP stage's, or its FSDP2 shard. Slicing follows `tensor_slices.shard`, the
same rules as initialisation; vocabulary rows are zero-padded. Every parameter is filled exactly once. A missing,
misshapen or unknown tensor fails in one line naming model.init_from. docs/training.md ("Published
weights") has the details."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hlat.core.config import ModelConfig
from hlat.core.contract import in_sagemaker
from hlat.core.init_from import InitFromError, import_record
from hlat.core.storage import Storage, StorageNotFound
from hlat.training.checkpoint.hf_export import SAFETENSORS_FILE, _pad_rows
from hlat.training.checkpoint.hf_export import hf_names as export_names
from hlat.training.model import Transformer
from hlat.training.models import modules_of
from hlat.training.parallel.tensor_slices import DenseParameter, dense_parameters

log = logging.getLogger("hlat.train")

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""The safetensors dtypes a weight may have (https://huggingface.co/docs/safetensors, "Format")."""
MAX_HEADER = 100_000_000
"""The format's limit on a header's size (safetensors refuses larger ones): anything above is a corrupt file."""


def _refuse(source: str, what: str) -> InitFromError:
    return InitFromError(f"model.init_from={source!r}: {what}")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: its file and the absolute byte range [start, end) in it."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


NODE_SCRATCH_ENV = "HLAT_NODE_SCRATCH"
SAGEMAKER_SCRATCH = "/opt/ml/input/data"
"""A SageMaker job's node-local disk (instance NVMe), as the Neuron cache's node-local copy uses."""
NODE_SHARE_TIMEOUT_S = 1800.0


class NodeShare:
    """One read per node of each tensor: a node's local ranks share what any of them read, via a folder on its disk.

    Under TP every rank of a stage needs the same full tensors; S3 throttles past 5,500 GETs a second per prefix. The
    first rank to ask claims a byte range (an O_EXCL file), reads it and writes it; the others wait and read it. No
    collective is used. The folder is this job's (`node_job_token`), so a relaunch never waits on a dead claim."""

    def __init__(self, folder: str, local_rank: int, local_world: int, timeout_s: float = NODE_SHARE_TIMEOUT_S):
        self.folder, self.local_rank, self.local_world, self.timeout_s = folder, local_rank, local_world, timeout_s
        os.makedirs(folder, exist_ok=True)
        self.fetched = 0
        """Byte ranges this rank read from remote storage (the others came from the node's disk)."""

    @classmethod
    def for_job(cls, location: str, sha256: str) -> NodeShare | None:
        """The share of this job's local ranks when there are several and the weights are remote; else None."""
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_world <= 1 or Storage(location).is_local:
            return None
        from hlat.training.compile_cache import node_job_token

        scratch = os.environ.get(NODE_SCRATCH_ENV) or (SAGEMAKER_SCRATCH if in_sagemaker() else tempfile.gettempdir())
        job = hashlib.sha256(node_job_token().encode()).hexdigest()[:12]
        folder = os.path.join(scratch, f"hlat-import-{sha256[:16]}-{job}")
        return cls(folder, int(os.environ.get("LOCAL_RANK", "0")), local_world)

    def read(self, key: str, fetch: Callable[[], bytes]) -> bytes:
        """The bytes `fetch` gives for `key`, fetched by one local rank of the node."""
        path = os.path.join(self.folder, hashlib.sha256(key.encode()).hexdigest())
        if not os.path.exists(path):
            try:
                os.close(os.open(f"{path}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return self._wait(path, key)
            try:
                data = fetch()
            except Exception as exc:  # the waiting ranks fail too, naming it, instead of waiting out the timeout
                with open(f"{path}.failed", "w") as fh:
                    fh.write(f"{type(exc).__name__}: {exc}")
                raise
            self.fetched += 1
            part = f"{path}.part-{os.getpid()}"
            with open(part, "wb") as fh:
                fh.write(data)
            os.replace(part, path)
            return data
        with open(path, "rb") as fh:
            return fh.read()

    def _wait(self, path: str, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(path):
            if os.path.exists(f"{path}.failed"):
                with open(f"{path}.failed") as fh:
                    raise RuntimeError(f"the local rank that read {key} for this node failed: {fh.read()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {self.timeout_s:.0f} s for another local rank to read {key} into {self.folder}"
                )
            time.sleep(0.02)
        with open(path, "rb") as fh:
            return fh.read()

    def close(self) -> None:
        """This rank is done; the last of the node's local ranks removes the folder."""
        os.close(os.open(os.path.join(self.folder, f"done-{self.local_rank}"), os.O_CREAT | os.O_WRONLY))
        try:
            done = [name for name in os.listdir(self.folder) if name.startswith("done-")]
        except FileNotFoundError:  # another rank, done too, saw every rank's file first and removed the folder
            return
        if len(done) >= self.local_world:
            shutil.rmtree(self.folder, ignore_errors=True)


class SafetensorsReader:
    """A safetensors checkpoint in `store` (folder or s3://), read one tensor at a time. `source` names it in errors;
    `bytes_read`, `reads` and `largest_read` count the reads."""

    def __init__(self, store: Storage, source: str = "", share: NodeShare | None = None) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("safetensors files are little-endian; this host is not")
        self.store = store
        self.share = share
        """With a NodeShare, tensor data is read once per node."""
        self.source = source or store.uri()
        self.bytes_read = 0
        self.reads = 0
        self.largest_read = 0
        self._headers: dict[str, dict[str, TensorEntry]] = {}
        self.weight_map = self._weight_map()
        """Tensor name -> the file holding it."""

    def _weight_map(self) -> dict[str, str]:
        if self.store.exists(INDEX_FILE):
            index = json.loads(self._read(INDEX_FILE, 0, self.store.size(INDEX_FILE), what="index"))
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise _refuse(self.source, f"{self.store.uri(INDEX_FILE)} has no weight_map")
            return {str(name): str(file) for name, file in weight_map.items()}
        if self.store.exists(SAFETENSORS_FILE):
            return {name: SAFETENSORS_FILE for name in self._header(SAFETENSORS_FILE)}
        raise _refuse(
            self.source, f"neither {INDEX_FILE} nor {SAFETENSORS_FILE} in {self.store.uri()}: hlat imports "
            "safetensors checkpoints (save_pretrained's default)"
        )  # fmt: skip

    def names(self) -> set[str]:
        return set(self.weight_map)

    def _read(self, file: str, start: int, end: int, what: str = "tensor") -> bytes:
        """Bytes [start, end) of `file` in one ranged read; a missing or short file is a one-line error."""
        try:
            if self.share is not None and what == "tensor":
                data = self.share.read(f"{file}:{start}:{end}", lambda: self.store.read_range(file, start, end))
            else:
                data = self.store.read_range(file, start, end)
        except (StorageNotFound, FileNotFoundError):
            named = f" (named by {INDEX_FILE})" if file != SAFETENSORS_FILE and file != INDEX_FILE else ""
            raise _refuse(self.source, f"{self.store.uri(file)} is missing{named}") from None
        self.reads += 1
        self.bytes_read += len(data)
        self.largest_read = max(self.largest_read, len(data))
        if len(data) != end - start:
            raise _refuse(
                self.source, f"{self.store.uri(file)} is truncated: its {what} needs bytes {start}-{end}, the file "
                f"ends at {start + len(data)}"
            )  # fmt: skip
        return data

    def _header(self, file: str) -> dict[str, TensorEntry]:
        """The tensors of `file`, from its header (read once, then kept: names and offsets only)."""
        if file in self._headers:
            return self._headers[file]
        length = int.from_bytes(self._read(file, 0, 8, what="header length"), "little")
        if length > MAX_HEADER:
            raise _refuse(self.source, f"{self.store.uri(file)} is not a safetensors file (header of {length} bytes)")
        try:
            header = json.loads(self._read(file, 8, 8 + length, what="header"))
        except json.JSONDecodeError as exc:
            raise _refuse(self.source, f"{self.store.uri(file)} has an unreadable safetensors header: {exc}") from None
        entries = {}
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            try:
                begin, end = (int(offset) for offset in spec["data_offsets"])
                shape = tuple(int(size) for size in spec["shape"])
                entries[name] = TensorEntry(file, str(spec["dtype"]), shape, 8 + length + begin, 8 + length + end)
            except (KeyError, TypeError, ValueError):
                raise _refuse(
                    self.source, f"{self.store.uri(file)}: {name}'s header entry {spec!r} is malformed"
                ) from None
        self._headers[file] = entries
        return entries

    def entry(self, name: str) -> TensorEntry:
        file = self.weight_map.get(name)
        if file is None:
            raise _refuse(self.source, f"the checkpoint has no tensor {name!r}")
        found = self._header(file).get(name)
        if found is None:
            raise _refuse(self.source, f"{INDEX_FILE} puts {name!r} in {file}, which does not hold it")
        return found

    def read(self, name: str) -> Tensor:
        """Tensor `name`, in the dtype of the file, from one ranged read of its bytes."""
        entry = self.entry(name)
        dtype = DTYPES.get(entry.dtype)
        if dtype is None:
            raise _refuse(self.source, f"{name} is {entry.dtype}; hlat imports weights in {', '.join(DTYPES)}")
        numel = 1
        for size in entry.shape:
            numel *= size
        itemsize = torch.empty((), dtype=dtype).element_size()
        if entry.end - entry.start != numel * itemsize:
            raise _refuse(
                self.source, f"{self.store.uri(entry.file)}: {name}'s byte range ({entry.end - entry.start}) is not "
                f"its shape {list(entry.shape)} x {itemsize} bytes"
            )  # fmt: skip
        if numel == 0:
            return torch.empty(entry.shape, dtype=dtype)
        data = self._read(entry.file, entry.start, entry.end)
        with warnings.catch_warnings():
            # The bytes object is not writable: the tensor is only read (copied into the parameters), never written.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(data, dtype=dtype).reshape(entry.shape)


# -- the tensors of the dense model ---------------------------------------------------------------------------
_VOCAB = ("embed.weight", "output.weight")


def hf_names(name: str, cfg: ModelConfig) -> tuple[str, ...]:
    """The checkpoint names that dense parameter `name` may be stored under: the family's, then its aliases."""
    family = modules_of(cfg)
    return tuple(hf for ours in family.hf_sources(name) for hf in export_names(ours, family))


class _DenseTensors:
    """The dense model's tensors, read when asked; only the last is kept (for GPT-NeoX's fused QKV)."""

    def __init__(self, reader: SafetensorsReader, cfg: ModelConfig) -> None:
        self.reader, self.cfg = reader, cfg
        self._last: tuple[str, dict[str, Tensor]] | None = None
        self.tensors = 0

    def source_name(self, param: DenseParameter) -> str:
        names = hf_names(param.name, self.cfg)
        return next((n for n in names if n in self.reader.weight_map), names[0])

    def get(self, param: DenseParameter) -> Tensor:
        hf = self.source_name(param)
        if self._last is None or self._last[0] != hf:
            self._last = None  # freed before the next is read
            self._last = (hf, self._convert(hf, param))
            self.tensors += 1
        return self._last[1][param.name]

    def _convert(self, hf: str, param: DenseParameter) -> dict[str, Tensor]:
        cfg, source = self.cfg, self.reader.source
        t = self.reader.read(hf)
        family = modules_of(cfg)
        want = family.hf_shape(param)
        vocab = param.name in _VOCAB
        if (tuple(t.shape[1:]) if vocab else tuple(t.shape)) != (want[1:] if vocab else want):
            raise _refuse(source, f"{hf} has shape {list(t.shape)}; this run's model needs {list(want)}")
        if vocab:
            if t.shape[0] > cfg.padded_vocab_size:
                raise _refuse(source, f"{hf} has {t.shape[0]} rows, more than the model's {cfg.padded_vocab_size}")
            if t.shape[0] < cfg.padded_vocab_size:
                t = _pad_rows(t, cfg.padded_vocab_size)  # rows no token reaches, masked like any padding
            return {"embed.weight": t, "output.weight": t}  # a tied output projection is the embedding
        return family.split_hf(param, family.hf_sources(param.name)[0], t, cfg)


def rank_parameters(trainer: Any) -> dict[str, nn.Parameter]:
    """This rank's parameters under the model's local names (its stage's only under NxD's pipeline)."""
    if trainer.world.layout.pipeline > 1:
        return dict(trainer.wrapped.local_named_parameters())
    return dict(trainer.model.named_parameters())


def _local_targets(model: Transformer, params: Mapping[str, nn.Parameter]) -> Iterator[tuple[DenseParameter, str]]:
    """(dense parameter, local name) per entry of `params`, in model order; a tied output copy is the embedding's."""
    cfg = model.cfg
    dense = dense_parameters(cfg)
    local = {model.parallel.local_name(p.name): p for p in dense}
    if cfg.tie_embeddings:  # the embedding's tensor and slice (both split the vocabulary's rows)
        local.setdefault("output.weight", next(p for p in dense if p.name == "embed.weight"))
    strangers = sorted(set(params) - set(local))
    if strangers:
        family = modules_of(cfg).name
        raise ValueError(f"import: parameters {strangers[:5]} are not the model's ({family}) dense parameters")
    for name, param in local.items():
        if name in params:
            yield param, name


def check_names(reader: SafetensorsReader, cfg: ModelConfig) -> None:
    """Check that the checkpoint holds every needed tensor and nothing unknown; one line says what is wrong."""
    available, family = reader.names(), modules_of(cfg).name
    needed: set[str] = set()
    lacking: list[str] = []
    for param in dense_parameters(cfg):
        names = hf_names(param.name, cfg)
        present = [n for n in names if n in available]
        needed.update(present)
        if not present:
            lacking.append(names[0])
    lacking = sorted(set(lacking))
    if lacking:
        raise _refuse(
            reader.source, f"the checkpoint lacks {len(lacking)} tensor(s) the {family} model needs: "
            f"{', '.join(lacking[:8])}{' ...' if len(lacking) > 8 else ''}"
        )  # fmt: skip
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    buffers = [re.compile(pattern) for pattern in modules_of(cfg).hf_non_parameters]
    unknown = sorted(n for n in available - needed - ignored if not any(p.fullmatch(n) for p in buffers))
    if unknown:
        raise _refuse(
            reader.source, f"the checkpoint holds {len(unknown)} tensor(s) the {family} model does not take: "
            f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}"
        )  # fmt: skip


@torch.no_grad()
def _copy(param: nn.Parameter, value: Tensor, name: str) -> None:
    """`value` (this rank's part of the parameter, on the host) into `param`, in the parameter's dtype."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"import: {name} is {list(param.shape)} on this rank, its slice {list(value.shape)}")
    value = value.to(param.dtype)
    # A DTensor parameter means FSDP2 has imported torch.distributed.tensor (a second of imports otherwise).
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(param, dtensor.DTensor):
        # Each rank cuts its own shard from the whole tensor it read (src_data_rank=None: no collective).
        value = dtensor.distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    # On XLA, a copy from the host is a transfer into the parameter's device data (torch-xla's _copy_from), as
    # loading a checkpoint's state dict is: no operation is left pending for the loop's first graph
    # (tests/xla/test_xla_import.py).
    param.copy_(value)


def fill_parameters(model: Transformer, params: Mapping[str, nn.Parameter], reader: SafetensorsReader) -> int:
    """Fill `params` from the checkpoint, each exactly once, and return how many tensors were read."""
    cfg = model.cfg
    check_names(reader, cfg)
    tensors = _DenseTensors(reader, cfg)
    targets = list(_local_targets(model, params))
    # The parameters one checkpoint tensor fills in a row (GPT-NeoX's q, k, v weights, then their biases): each
    # tensor is read once.
    first: dict[str, int] = {}
    for i, (dense, _) in enumerate(targets):
        first.setdefault(tensors.source_name(dense), i)
    targets.sort(key=lambda target: first[tensors.source_name(target[0])])
    filled: set[str] = set()
    for dense, name in targets:
        full = tensors.get(dense)
        _copy(params[name], model.parallel.shard(dense, full), name)
        filled.add(name)
    unfilled = sorted(set(params) - filled)
    if unfilled:
        raise ValueError(f"import: parameters {unfilled[:5]} of this rank were not filled")
    return tensors.tensors


def _refresh_zero1_masters(optimizer: Any) -> None:
    """Rebuild ZeRO-1's master-weight shards from the imported parameters (as its `load_state_dict` does)."""
    zero1 = getattr(optimizer, "optimizer", optimizer)
    init_zero = getattr(zero1, "init_zero", None)
    if init_zero is None:
        raise TypeError(f"parallelism.zero1: {type(zero1).__name__} has no init_zero to rebuild its master weights")
    init_zero()


def import_weights(trainer: Any) -> dict[str, Any]:
    """Fill this rank's parameters from the run's imported checkpoint, in any layout, and log what was read. Returns
    {"source", "sha256", "tensors", "parameters", "bytes", "reads", "fetched", "largest_read", "seconds"}."""
    began = time.perf_counter()
    cfg = trainer.cfg
    record = import_record(trainer.run)
    source = str(record.get("source") or cfg.model.init_from)
    sha = str(record.get("sha256", ""))
    share = NodeShare.for_job(str(record["location"]), sha)
    reader = SafetensorsReader(Storage(str(record["location"])), source, share)
    params = rank_parameters(trainer)
    try:
        tensors = fill_parameters(trainer.model, params, reader)
    finally:
        if share is not None:
            share.close()
    if cfg.parallelism.zero1:
        _refresh_zero1_masters(trainer.optimizer)
    seconds = time.perf_counter() - began
    if trainer.world.is_main:
        log.info(
            "imported %d tensors (%.3f GB) from %s (sha256 %s) in %.1f s",
            tensors, reader.bytes_read / 1e9, source, sha[:12], seconds,
        )  # fmt: skip
    return {
        "source": source,
        "sha256": sha,
        "tensors": tensors,
        "parameters": len(params),
        "bytes": reader.bytes_read,
        "reads": reader.reads,
        "fetched": share.fetched if share is not None else None,
        "largest_read": reader.largest_read,
        "seconds": seconds,
    }
