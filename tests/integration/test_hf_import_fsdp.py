"""Importing Hugging Face checkpoints (model.init_from) in the integration tier: into FSDP2's shards on two gloo
ranks, through the Trainer's own resume (each rank its DTensor shards: gathered, the dense import's weights, and the
sharded checkpoint saved right after exports bitwise to the original tensors), also into a model built on the meta
device and sharded (`shard_fully`: no host ever holds it whole); and from an s3:// prefix on the moto server, by
ranged GETs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.multiprocessing as mp

from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training.checkpoint.hf_export import export_hf
from hlat.training.checkpoint.hf_import import SafetensorsReader, fill_parameters, import_weights
from hlat.training.model import Transformer
from hlat.training.parallel.parallelize import shard_fully
from tests.hf_checkpoints import (
    ARCHS,
    VOCAB,
    assert_first_checkpoint_exports_the_original,
    dense_import,
    fake_trainer,
    original_tensors,
    run_config,
    saved,
    write_import_record,
)
from tests.integration.conftest import S3Env, free_port

os.environ["HF_HUB_OFFLINE"] = "1"


def fsdp_rank(
    rank: int, world_size: int, port: int, prepared: str, run: str, folder: str, vocab_multiple: int, out: str
) -> None:
    """One FSDP2 rank: the Trainer of a run starting from `folder`, its resume (the import), a checkpoint of step
    0; rank 0 saves the gathered weights and each parameter's local shard shape."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from hlat.training.loop import Trainer
    from hlat.training.parallel.distributed import close_world, init_world

    overrides = {
        "parallelism.fsdp": True,
        "job.processes_per_node": world_size,
        "training.global_batch_size": 8,
        "training.micro_batch_size": 2,
        "training.async_checkpoint": False,
    }
    cfg = run_config(folder, vocab_multiple, **overrides)
    world = init_world("cpu")
    try:
        trainer = Trainer(
            cfg,
            Run.at(run),
            Storage(f"{run}/checkpoints"),
            world,
            f"{prepared}/tokenizer/tokenizer.model",
            data=Storage(f"{prepared}/data"),
        )
        assert trainer.resume() == 0  # no checkpoint: the import
        local = {name: tuple(p.to_local().shape) for name, p in trainer.model.named_parameters()}
        full = {k: v.full_tensor() for k, v in trainer.model.state_dict().items()}
        # A model built on the meta device and sharded (never whole on a host), then imported: the same weights and
        # logits.
        meta = Transformer(cfg.model, device="meta")
        shard_fully(meta, cfg, world)
        fill_parameters(meta, dict(meta.named_parameters()), SafetensorsReader(Storage(folder)))
        meta_full = {k: v.full_tensor() for k, v in meta.state_dict().items()}
        x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            same_logits = torch.equal(meta(x), trainer.model(x))
        trainer.save_checkpoint(0)
        trainer.ckpt.wait()
        trainer.loader.close()
        if rank == 0:
            torch.save({"model": full, "local": local, "meta": meta_full, "same_logits": same_logits}, out)
    finally:
        close_world()


@pytest.mark.slow  # two spawned ranks: ~15 s
@pytest.mark.parametrize("arch", ARCHS)
def test_an_fsdp2_import_on_two_gloo_ranks_is_the_dense_import_and_exports_bitwise(
    arch: str, prepared: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "hf"
    saved(arch, folder, seed=21, max_shard_size="40KB")
    run = tmp_path / "run"
    write_import_record(Run.at(str(run)), folder)
    out = tmp_path / "rank0.pt"
    args = (2, free_port(), str(prepared), str(run), str(folder), 128, str(out))
    mp.start_processes(fsdp_rank, args=args, nprocs=2, start_method="spawn")
    found = torch.load(out, weights_only=True)
    dense = dense_import(folder, 128)
    # Each rank held half of every parameter's rows (FSDP2 shards dim 0).
    assert found["local"]["embed.weight"] == (192, 64) and found["local"]["norm.weight"] == (32,)
    for name, tensor in dense.state_dict().items():
        assert torch.equal(found["model"][name], tensor), name
        assert torch.equal(found["meta"][name], tensor), name
    assert found["same_logits"]
    # The checkpoint saved right after the import (FSDP2's torch.distributed.checkpoint shards) exports bitwise.
    assert_first_checkpoint_exports_the_original(run, folder)


class CountingStorage(Storage):
    """A Storage that records every ranged read (in the class: the import makes its own)."""

    ranges: ClassVar[list[tuple[str, int, int]]] = []

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        self.ranges.append((rel, start, end))
        return super().read_range(rel, start, end)


def upload(folder: Path, prefix: str) -> None:
    store = Storage(prefix)
    for path in sorted(folder.iterdir()):
        store.put_file(str(path), path.name)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_import_from_an_s3_prefix_reads_tensor_by_tensor_and_gives_transformers_logits(
    arch: str, s3_env: S3Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "hf"
    hf: Any = saved(arch, folder, seed=22, max_shard_size="40KB")
    prefix = f"{s3_env.url}/models/{arch}"
    upload(folder, prefix)
    run = Run.at(f"{s3_env.url}/run")
    record = write_import_record(run, prefix, source=f"org/{arch}-tiny")
    cfg = run_config(folder, 64, **{"model.init_from": prefix, "tokenizer.pretrained": prefix})
    trainer = fake_trainer(cfg, run.uri)
    monkeypatch.setattr(CountingStorage, "ranges", [])
    monkeypatch.setattr("hlat.training.checkpoint.hf_import.Storage", CountingStorage)
    found = import_weights(trainer)
    assert found["source"] == f"org/{arch}-tiny" and found["sha256"] == record["sha256"]
    tensor_bytes = sum(t.numel() * t.element_size() for t in original_tensors(folder).values())
    assert tensor_bytes < found["bytes"] < tensor_bytes + 40_000  # the tensors, the headers and the index
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    model = trainer.model.eval()
    with torch.no_grad():
        assert (model(x)[..., :VOCAB] - hf(x).logits).abs().max().item() < 1e-5
    export_hf(model, cfg.model, tmp_path / "export")
    exported = original_tensors(tmp_path / "export")
    for name, tensor in original_tensors(folder).items():
        assert torch.equal(exported[name], tensor), name

    # Every read of a shard was one ranged GET of a part of it, never the whole object.
    sizes = {p.name: p.stat().st_size for p in folder.glob("*.safetensors")}
    assert {file for file, _, _ in CountingStorage.ranges} >= set(sizes)
    assert len(CountingStorage.ranges) == found["reads"]
    assert all(end - start < sizes[file] for file, start, end in CountingStorage.ranges if file in sizes)
