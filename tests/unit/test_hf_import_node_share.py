"""The node's local ranks read each tensor of published weights once between them (hf_import.NodeShare): the first
to ask claims it, reads it from remote storage and leaves it on the node's disk for the others."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from hlat.core.init_from import InitFromError
from hlat.core.storage import Storage
from hlat.training.checkpoint.hf_import import NodeShare, SafetensorsReader, fill_parameters
from hlat.training.model import Transformer
from tests.hf_checkpoints import run_config, write_checkpoint


class CountingStorage(Storage):
    """Remote storage as the node sees it: every ranged read counted (shared by the node's ranks)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.ranges: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        with self.lock:
            self.ranges.append((rel, start, end))
        return super().read_range(rel, start, end)


def test_four_local_ranks_read_each_tensor_once_between_them_and_get_the_same_weights(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    tensors = write_checkpoint("llama", folder)
    store = CountingStorage(str(folder))
    cfg = run_config(folder)
    ranks = 4
    models = [Transformer(cfg.model) for _ in range(ranks)]
    shares = [NodeShare(str(tmp_path / "node"), rank, ranks) for rank in range(ranks)]
    errors: list[BaseException] = []

    def rank(i: int) -> None:
        try:
            fill_parameters(models[i], dict(models[i].named_parameters()), SafetensorsReader(store, "x", shares[i]))
            shares[i].close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    data_reads = [r for r in store.ranges if r[2] - r[1] > 8 and not r[0].endswith(".json")]
    headers = 2 * len(list(folder.glob("*.safetensors")))
    # Each tensor fetched once for the node (each rank reads the headers itself: a few KB).
    assert len(data_reads) - ranks * headers // 2 == len(tensors) == sum(s.fetched for s in shares)
    reference = dict(models[0].state_dict())
    for model in models[1:]:
        assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    assert not (tmp_path / "node").exists()  # the last rank to finish removed the node's copies


def test_a_failed_read_fails_the_waiting_ranks_too_instead_of_waiting_out_the_timeout(tmp_path: Path) -> None:
    first, second = NodeShare(str(tmp_path / "node"), 0, 2, timeout_s=30), NodeShare(str(tmp_path / "node"), 1, 2)

    def broken() -> bytes:
        raise OSError("SlowDown")

    with pytest.raises(OSError, match="SlowDown"):
        first.read("model.safetensors:8:16", broken)
    with pytest.raises(RuntimeError, match=r"the local rank that read model.safetensors:8:16 .* OSError: SlowDown"):
        second.read("model.safetensors:8:16", lambda: b"never")


def test_a_job_with_one_local_rank_or_a_local_checkpoint_shares_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert NodeShare.for_job("s3://bucket/weights", "ab" * 32) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert NodeShare.for_job(str(tmp_path), "ab" * 32) is None  # a folder on this node is read in place
    monkeypatch.setenv("HLAT_NODE_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("LOCAL_RANK", "3")
    share = NodeShare.for_job("s3://bucket/weights", "ab" * 32)
    assert share is not None and share.local_rank == 3 and share.local_world == 8
    assert Path(share.folder).parent == tmp_path / "scratch" and Path(share.folder).name.startswith("hlat-import-abab")


def test_a_missing_shard_still_fails_in_one_line_through_the_share(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    write_checkpoint("llama", folder)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    cfg = run_config(folder)
    model = Transformer(cfg.model)
    reader = SafetensorsReader(Storage(str(folder)), "org/x", NodeShare(str(tmp_path / "node"), 0, 2))
    shard.unlink()
    with pytest.raises(InitFromError, match=rf"model.init_from='org/x': .*{shard.name} is missing"):
        fill_parameters(model, dict(model.named_parameters()), reader)
