"""`hlat average`: the mean of a run's last K complete checkpoints' model weights, as a new committed checkpoint.

Rules:
- the mean is uniform, summed in float32, cast back; non-float tensors must be equal and are kept.
- each layout is averaged in its own form, one file or DCP chunk at a time.
- the result is `<run>/averaged/step-N` with meta.json and COMMITTED, readable like any checkpoint.
- optimizer and rank states are left out: the result is for evaluation and export, not resuming.
- checkpoints of another layout or trajectory are refused before anything is written.
docs/training.md ("Averaging") gives the sources (Sanyal et al. 2023, https://arxiv.org/abs/2306.03241).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import pickle
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from hlat.core.config import validate_config
from hlat.core.layout import (
    AVERAGED_DIR,
    CHECKPOINT_MARKER,
    CHECKPOINT_META,
    CHECKPOINTS_DIR,
    CheckpointError,
    CheckpointIndex,
    shard_file,
    step_dir,
)
from hlat.core.storage import Storage
from hlat.training.checkpoint.dcp import METADATA, is_dcp_file, read_metadata, recorded_sha256
from hlat.training.checkpoint.manager import FORMAT_VERSION, SHARED_FILE
from hlat.training.checkpoint.serialization import read_state, write_state

log = logging.getLogger("hlat.training.checkpoint")

"""Where a run's averaged checkpoints go by default: <run>/averaged/step-NNNNNNNNN."""

MODEL_PREFIX = "model."
"""The flattened DCP names of the model's tensors (FSDP2's state is {"model": ..., "optimizer": ...})."""

State = dict[str, Any]


@dataclass(frozen=True)
class AveragedCheckpoint:
    """What `average_checkpoints` wrote."""

    folder: Storage
    """The parent folder of the averaged checkpoint (like a run's checkpoints/)."""
    step: int
    """Its step: the newest step averaged."""
    steps: list[int]
    """The steps averaged, ascending."""
    layout: str

    @property
    def uri(self) -> str:
        return self.folder.uri(step_dir(self.step))


def checkpoints_folder(source: str) -> Storage:
    """A run folder's checkpoints/, or `source` itself when it is a checkpoints folder."""
    folder = Storage(source.rstrip("/"))
    return folder.child(CHECKPOINTS_DIR) if folder.exists(CHECKPOINTS_DIR) else folder


def last_complete_steps(index: CheckpointIndex, count: int) -> list[int]:
    """The steps of the newest `count` complete checkpoints, ascending; CheckpointError when there are fewer."""
    if count < 1:
        raise ValueError(f"--last must be at least 1, got {count}")
    found: list[int] = []
    for step in reversed(index.all_steps()):
        try:
            index.read_meta(step)
        except CheckpointError as exc:
            log.warning("not averaging %s", exc)
            continue
        found.append(step)
        if len(found) == count:
            return sorted(found)
    have = ", ".join(map(str, sorted(found))) or "none"
    raise CheckpointError(
        f"{index.storage.uri()} has {len(found)} complete checkpoint(s) (steps {have}), fewer than the {count} to "
        "average: ask for fewer (--last), or train until there are more (training.keep_checkpoints keeps that many)"
    )


def average_checkpoints(source: str, last: int, out: str | None = None) -> AveragedCheckpoint:
    """Average the newest `last` complete checkpoints of `source` (run or checkpoints folder) into `<out>/step-N`."""
    checkpoints = checkpoints_folder(source)
    index = CheckpointIndex(checkpoints)
    if not checkpoints.exists():
        raise CheckpointError(f"no checkpoints at {source}: {checkpoints.uri()} does not exist")
    steps = last_complete_steps(index, last)
    metas = {step: index.read_meta(step) for step in steps}
    layout = _layout(checkpoints, metas)
    target = _target(checkpoints, out)
    newest = steps[-1]
    folder = step_dir(newest)
    if target.exists(f"{folder}/{CHECKPOINT_MARKER}"):
        target.remove(f"{folder}/{CHECKPOINT_MARKER}")  # marker first: a half-replaced folder never looks complete
    files: dict[str, dict[str, Any]] = {}
    if layout == "distributed":
        shared = {s: _read(checkpoints, s, SHARED_FILE, metas[s]) for s in steps}
        _check_configs(checkpoints, shared)
        files[SHARED_FILE] = write_state(target, f"{folder}/{SHARED_FILE}", _kept(shared[newest], steps))
        files.update(_average_dcp(checkpoints, steps, metas, target, folder))
    else:
        names = [shard_file(s) for s in metas[newest]["shards"]] if layout == "sharded" else [SHARED_FILE]
        for position, name in enumerate(names):
            state = _average_file(checkpoints, steps, metas, name, check_configs=position == 0)
            files[name] = write_state(target, f"{folder}/{name}", state)
            del state
    _commit(target, newest, metas[newest], files, checkpoints, steps)
    averaged = AveragedCheckpoint(folder=target, step=newest, steps=steps, layout=layout)
    log.info("averaged steps %s of %s into %s", steps, checkpoints.uri(), averaged.uri)
    return averaged


def _layout(checkpoints: Storage, metas: dict[int, dict[str, Any]]) -> str:
    """'unsharded', 'sharded' (NxD's model-parallel shard files) or 'distributed' (FSDP2's DCP): the same for all."""

    def kind(meta: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        if meta.get("distributed"):
            return "distributed", tuple(sorted(n for n in meta["files"] if is_dcp_file(n)))
        if meta.get("shards"):
            return "sharded", tuple(meta["shards"])
        return "unsharded", ()

    kinds = {step: kind(meta) for step, meta in metas.items()}
    if len(set(kinds.values())) > 1:
        described = "; ".join(f"step {s}: {k} {', '.join(files)}".strip() for s, (k, files) in sorted(kinds.items()))
        raise CheckpointError(
            f"the checkpoints to average under {checkpoints.uri()} were saved in different layouts ({described}): "
            "average checkpoints of one layout (fewer, with --last)"
        )
    return next(iter(kinds.values()))[0]


def _target(checkpoints: Storage, out: str | None) -> Storage:
    if out is not None:
        return Storage(out.rstrip("/"))
    base, _, last = checkpoints.uri().rstrip("/").rpartition("/")
    if last != CHECKPOINTS_DIR or not base:
        raise CheckpointError(f"{checkpoints.uri()} is not a run's checkpoints folder: say where to write (--out)")
    return Storage(base).child(AVERAGED_DIR)


def _read(checkpoints: Storage, step: int, name: str, meta: dict[str, Any]) -> State:
    state, _ = read_state(checkpoints, f"{step_dir(step)}/{name}", meta["files"].get(name))
    return state


def _check_configs(checkpoints: Storage, states: dict[int, State]) -> None:
    """Refuse checkpoints whose configs compute different trajectories (another model, data, optimizer...)."""
    prints: dict[str, list[int]] = {}
    for step, state in sorted(states.items()):
        if "config" not in state:
            raise CheckpointError(f"{checkpoints.uri(step_dir(step))} holds no config (keys: {sorted(state)})")
        prints.setdefault(validate_config(state["config"]).trajectory_fingerprint(), []).append(step)
    if len(prints) > 1:
        groups = "; ".join(f"steps {', '.join(map(str, s))}: {p[:12]}" for p, s in prints.items())
        raise CheckpointError(
            f"the checkpoints to average under {checkpoints.uri()} were trained with different configs (config "
            f"fingerprints {groups}): average checkpoints of one configuration (fewer, with --last)"
        )


def _kept(newest: State, steps: list[int]) -> State:
    """The newest checkpoint's shared state less the model and the optimizer, recording what was averaged."""
    kept = {k: v for k, v in newest.items() if k not in ("model", "optimizer")}
    kept["averaged_steps"] = list(steps)
    return kept


class _Mean:
    """A running float32 sum of same-named tensors, and their mean cast back to each one's dtype."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.sums: dict[str, torch.Tensor] = {}
        self.kept: dict[str, torch.Tensor] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.count = 0

    def add(self, tensors: dict[str, torch.Tensor], what: str) -> None:
        if self.count and set(tensors) != set(self.dtypes):
            raise CheckpointError(
                f"{what}: its model tensors are not those of the others in {self.where} "
                f"(differ: {sorted(set(tensors) ^ set(self.dtypes))[:5]})"
            )
        for name, tensor in tensors.items():
            if not self.count:
                self.dtypes[name] = tensor.dtype
                if tensor.is_floating_point():
                    self.sums[name] = tensor.detach().to(torch.float32, copy=True)
                else:
                    self.kept[name] = tensor
                continue
            first = self.sums[name] if name in self.sums else self.kept[name]
            if tensor.shape != first.shape or tensor.dtype != self.dtypes[name]:
                raise CheckpointError(f"{what}: {name} is {tuple(tensor.shape)} {tensor.dtype}, unlike the others")
            if name in self.sums:
                self.sums[name].add_(tensor.to(torch.float32))
            elif not torch.equal(tensor, self.kept[name]):
                raise CheckpointError(f"{what}: {name} ({tensor.dtype}) differs between checkpoints: not averageable")
        self.count += 1

    def mean(self) -> dict[str, torch.Tensor]:
        out = {name: (total / self.count).to(self.dtypes[name]) for name, total in self.sums.items()}
        return {name: out[name] if name in out else self.kept[name] for name in self.dtypes}


def _average_file(
    checkpoints: Storage, steps: list[int], metas: dict[int, dict[str, Any]], name: str, check_configs: bool
) -> State:
    """The averaged state of one file (train_state.pt or a shard's): each checkpoint's copy read in turn."""
    mean = _Mean(name)
    newest: State = {}
    configs: dict[int, State] = {}
    for step in steps:
        state = _read(checkpoints, step, name, metas[step])
        if "model" not in state:
            raise CheckpointError(f"{checkpoints.uri(step_dir(step), name)} holds no model (keys: {sorted(state)})")
        mean.add(state["model"], checkpoints.uri(step_dir(step), name))
        if check_configs:
            configs[step] = {k: v for k, v in state.items() if k == "config"}
        if step == steps[-1]:
            newest = _kept(state, steps)
        del state
    if check_configs:
        _check_configs(checkpoints, configs)
    return {**newest, "model": mean.mean()}


# -- FSDP2's torch.distributed.checkpoint files ------------------------------------------------------------------
def _dcp_metadata(checkpoints: Storage, step: int, meta: dict[str, Any]) -> Any:
    metadata = read_metadata(  # as meta.json recorded it, and DCP's own classes only: a planted .metadata runs nothing
        checkpoints.read_bytes(f"{step_dir(step)}/{METADATA}"),
        checkpoints.uri(step_dir(step), METADATA),
        recorded_sha256(meta),
    )
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith(MODEL_PREFIX) and getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{checkpoints.uri(step_dir(step))}: {index.fqn} was saved through DCP storage transforms "
                f"({info.transform_descriptors}), which averaging does not read"
            )
    return metadata


def _model_chunks(metadata: Any) -> dict[tuple[str, tuple[int, ...]], Any]:
    """The model's chunks of a DCP checkpoint: (fqn, offset in the tensor) -> where its bytes are."""
    return {
        (index.fqn, tuple(index.offset or ())): info
        for index, info in metadata.storage_data.items()
        if index.fqn.startswith(MODEL_PREFIX)
    }


def _average_dcp(
    checkpoints: Storage, steps: list[int], metas: dict[int, dict[str, Any]], target: Storage, folder: str
) -> dict[str, dict[str, Any]]:
    """Average the model's chunks of DCP files, file by file; return the new files' sizes and sha256."""
    metadatas = {step: _dcp_metadata(checkpoints, step, metas[step]) for step in steps}
    chunks = {step: _model_chunks(md) for step, md in metadatas.items()}
    newest = metadatas[steps[-1]]
    layout = {key: info.relative_path for key, info in chunks[steps[-1]].items()}
    for step in steps:
        if {key: info.relative_path for key, info in chunks[step].items()} != layout:
            raise CheckpointError(
                f"{checkpoints.uri(step_dir(step))}: its model's DCP chunks are not laid out as step {steps[-1]}'s "
                "(another world size?): average checkpoints of one layout (fewer, with --last)"
            )
    by_file: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for key, relative in layout.items():
        by_file.setdefault(relative, []).append(key)
    written: dict[str, dict[str, Any]] = {}
    storage_data: dict[Any, Any] = {}
    indexes = {(i.fqn, tuple(i.offset or ())): i for i in newest.storage_data if i.fqn.startswith(MODEL_PREFIX)}
    for relative in sorted(by_file):
        buffer = io.BytesIO()
        for key in sorted(by_file[relative], key=lambda k: chunks[steps[-1]][k].offset):
            mean = _Mean(f"{relative} {key[0]}")
            for step in steps:
                info = chunks[step][key]
                raw = checkpoints.read_range(f"{step_dir(step)}/{relative}", info.offset, info.offset + info.length)
                mean.add({key[0]: _chunk(raw, checkpoints.uri(step_dir(step), relative))}, f"step {step}")
            offset = buffer.tell()
            torch.save(mean.mean()[key[0]], buffer)
            storage_data[indexes[key]] = dataclasses.replace(
                chunks[steps[-1]][key], offset=offset, length=buffer.tell() - offset
            )
        data = buffer.getvalue()
        del buffer
        target.write_bytes(f"{folder}/{relative}", data)
        written[relative] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    metadata = dataclasses.replace(
        newest,
        state_dict_metadata={k: v for k, v in newest.state_dict_metadata.items() if k.startswith(MODEL_PREFIX)},
        planner_data={k: v for k, v in (newest.planner_data or {}).items() if k.startswith(MODEL_PREFIX)},
        storage_data=storage_data,
    )
    data = pickle.dumps(metadata)
    target.write_bytes(f"{folder}/{METADATA}", data)
    written[METADATA] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return written


def _chunk(raw: bytes, where: str) -> torch.Tensor:
    tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{where}: a model chunk holds a {type(tensor).__name__}, not a tensor")
    return tensor


# -- the commit -----------------------------------------------------------------------------------------------
def _commit(
    target: Storage,
    step: int,
    newest: dict[str, Any],
    files: dict[str, dict[str, Any]],
    checkpoints: Storage,
    steps: list[int],
) -> None:
    """meta.json and the COMMITTED marker, as CheckpointManager writes them (the marker last)."""
    folder = step_dir(step)
    meta: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": newest["world_size"],
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "fingerprint": newest.get("fingerprint"),
        "files": dict(sorted(files.items())),
        "averaged": {
            "steps": steps,
            "source": checkpoints.uri(),
            "method": "uniform mean of the model weights, float32 accumulation, cast back to each dtype",
            "optimizer": "left out",
        },
    }
    for key in ("shards", "distributed"):
        if key in newest:
            meta[key] = newest[key]
    meta_bytes = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
    target.write_bytes(f"{folder}/{CHECKPOINT_META}", meta_bytes)
    marker = {"step": step, "meta_sha256": hashlib.sha256(meta_bytes).hexdigest()}
    target.write_bytes(f"{folder}/{CHECKPOINT_MARKER}", (json.dumps(marker, sort_keys=True) + "\n").encode())
