"""Nothing read from a distributed (FSDP2) checkpoint runs code (issue 51): a planted `.metadata` pickle or a planted
non-tensor item of a `.distcp` file is refused, naming the file, by every reader hlat has of them (resume's
`dcp.load`, export's and evaluation's `load_full`, `hlat average`'s metadata read), and the marker its payload would
create never appears. DCP's own readers, for contrast, run the payload."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from hlat.core.layout import CheckpointError, step_dir
from hlat.core.storage import Storage
from hlat.training.checkpoint import dcp
from hlat.training.checkpoint.average import _dcp_metadata


class Payload:
    """Unpickled, it creates the file `path` (what a planted pickle could do with the operator's rights)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def save(folder: Path, state: dict[str, Any]) -> dict[str, Any]:
    """A DCP checkpoint of `state` in `folder` (no process group: one writer); its meta.json's fields hlat reads."""
    torch_dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return {"distributed": True, "files": {p.name: {"size": p.stat().st_size} for p in folder.iterdir()}}


@pytest.fixture
def checkpoints(tmp_path: Path) -> Storage:
    return Storage(str(tmp_path / "checkpoints"))


STATE = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3, "extra": {"lr": 1e-3, "name": "x"}}


def test_a_checkpoint_of_dcp_classes_and_plain_items_loads(checkpoints: Storage) -> None:
    meta = save(Path(checkpoints.path(step_dir(1))), STATE)
    full = dcp.load_full(checkpoints, 1, meta)
    assert torch.equal(full["model"]["w"], STATE["model"]["w"]) and full["step"] == 3 and full["extra"]["lr"] == 1e-3
    into: dict[str, Any] = {"model": {"w": torch.zeros(2, 3)}, "step": 0, "extra": {"lr": 0.0, "name": ""}}
    dcp.load(checkpoints, 1, meta, into)
    assert torch.equal(into["model"]["w"], STATE["model"]["w"]) and into["step"] == 3
    assert "model.w" in {index.fqn for index in _dcp_metadata(checkpoints, 1, meta).storage_data}


def refused_by_every_reader(checkpoints: Storage, meta: dict[str, Any], pattern: str, marker: Path) -> None:
    """Resume (`dcp.load`), export and evaluation (`dcp.load_full`) and `hlat average` refuse step 1 with `pattern`,
    and the payload's marker file is not there."""
    for read in (
        lambda: dcp.load_full(checkpoints, 1, meta),
        lambda: dcp.load(checkpoints, 1, meta, {"model": {"w": torch.zeros(2, 3)}}),
        lambda: _dcp_metadata(checkpoints, 1, meta),
    ):
        with pytest.raises(CheckpointError, match=pattern):
            read()
        assert not marker.exists()


def test_a_planted_metadata_pickle_is_refused_by_every_reader(checkpoints: Storage, tmp_path: Path) -> None:
    folder = Path(checkpoints.path(step_dir(1)))
    meta = save(folder, STATE)
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    refused_by_every_reader(checkpoints, meta, r"refusing .*step-000000001/\.metadata: it names io.open", marker)
    torch_dcp.FileSystemReader(str(folder)).read_metadata()  # DCP's own reader: the payload runs
    assert marker.exists()


def test_a_planted_item_of_a_distcp_file_is_refused(checkpoints: Storage, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    meta = save(Path(checkpoints.path(step_dir(1))), {**STATE, "extra": {"lr": 1e-3, "name": Payload(marker)}})
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"refusing an item of .*step-000000001"):
        dcp.load_full(checkpoints, 1, meta)
    with pytest.raises(CheckpointError, match=r"refusing an item of .*step-000000001"):
        dcp.load(checkpoints, 1, meta, {"model": {"w": torch.zeros(2, 3)}, "extra": {"lr": 0.0, "name": ""}})
    assert not marker.exists()
    unsafe: dict[str, Any] = {}
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    torch_dcp.load(  # DCP's own planner: the payload runs
        unsafe,
        storage_reader=torch_dcp.FileSystemReader(checkpoints.path(step_dir(1))),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    assert marker.exists()


def test_a_metadata_that_differs_from_its_recorded_sha256_is_refused_before_it_is_parsed(
    checkpoints: Storage, tmp_path: Path
) -> None:
    """The commit records `.metadata`'s sha256 in meta.json (`dcp.metadata_sha256`): a file replaced afterwards, even
    by another checkpoint's genuine DCP metadata, is refused by every reader without being unpickled."""
    folder = Path(checkpoints.path(step_dir(1)))
    meta = save(folder, STATE)
    meta["files"][".metadata"]["sha256"] = dcp.metadata_sha256(checkpoints, step_dir(1))
    other = save(tmp_path / "other", {**STATE, "model": {"w": torch.ones(2, 3)}})
    assert other["files"][".metadata"]
    marker = tmp_path / "pwned"
    for planted in ((tmp_path / "other" / ".metadata").read_bytes(), pickle.dumps(Payload(marker))):
        (folder / ".metadata").write_bytes(planted)
        refused_by_every_reader(checkpoints, meta, r"\.metadata: it does not match its sha256 in meta.json", marker)
