"""Data parallelism on CPU: two gloo ranks give the result of one rank at the same global batch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.core.storage import Storage
from tests.conftest import SMALL_DATA
from tests.integration.conftest import free_port

pytestmark = pytest.mark.slow

STEPS, SEQ = 3, 32


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed token rows: (8, SEQ) inputs and targets per step, the same for every layout."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        rows = torch.randint(3, 512, (8, SEQ + 1), generator=gen)
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def run_layout(
    rank: int, world_size: int, port: int, run_dir: str, out_file: str, extra: dict[str, object] | None = None
) -> None:
    """One rank of a `world_size`-rank job (`extra`: more config overrides) over the fixed global batches; rank 0
    saves the losses and the whole model (FSDP2's shards gathered first, on every rank)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from hlat.training.loop import DeviceBatch, Trainer
    from hlat.training.parallel.distributed import close_world, init_world

    overrides = {
        **SMALL_DATA,
        "training.seq_len": SEQ,
        "training.global_batch_size": 8,
        "training.micro_batch_size": 8 // (2 * world_size),
        "training.eval_every": 0,
        "job.processes_per_node": world_size,
        **(extra or {}),
    }
    cfg = load_config("tiny", overrides, run_id="dp")
    world = init_world("cpu")
    try:
        trainer = Trainer(
            cfg,
            Run.at(run_dir),
            Storage(f"{run_dir}/ckpt-{world_size}"),
            world,
            f"{run_dir}/tokenizer/tokenizer.model",
        )
        micro = cfg.training.micro_batch_size
        batches = []
        for inputs, targets in global_batches():
            mine = slice(rank * 2 * micro, (rank + 1) * 2 * micro)  # this rank's share of the global batch
            for i in range(2):  # gradient-accumulation micro-batches
                part = slice(mine.start + i * micro, mine.start + (i + 1) * micro)
                batches.append(DeviceBatch(inputs[part], targets[part], None, {}, 0))
        stream = iter(batches)
        losses = [float(trainer.train_step(stream)["loss"]) for _ in range(STEPS)]
        trainer.loader.close()
        sharded = any(hasattr(p, "full_tensor") for p in trainer.model.parameters())
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()}
        if rank == 0:
            torch.save({"model": full, "losses": losses, "sharded": sharded}, out_file)
    finally:
        close_world()


def test_two_gloo_ranks_match_one_rank(prepared: Path, tmp_path: Path) -> None:
    results = {}
    for world_size in (1, 2):
        out = tmp_path / f"ws{world_size}.pt"
        mp.start_processes(
            run_layout, args=(world_size, free_port(), str(prepared), str(out)), nprocs=world_size, start_method="spawn"
        )
        results[world_size] = torch.load(out, weights_only=True)
    one, two = results[1], results[2]
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-5)
    for name, tensor in one["model"].items():
        # Summation order differs (gloo's all-reduce vs one rank's accumulation) and Adam divides by sqrt(v): after 3
        # steps single elements of the embedding (rows of tokens seen once, whose v is tiny) differ by a few 1e-6,
        # depending on the machine's kernels (1.3e-6 seen on one machine, 3.8e-6 in 1 of 65,536 on another).
        torch.testing.assert_close(two["model"][name], tensor, rtol=1e-5, atol=1e-5, msg=name)
    # and training did move the weights
    assert not torch.equal(one["model"]["embed.weight"], load_initial(prepared)["embed.weight"])


def load_initial(prepared: Path) -> dict[str, torch.Tensor]:
    from hlat.training.model import Transformer

    torch.manual_seed(load_config("tiny", SMALL_DATA).training.seed)
    model = Transformer(load_config("tiny", SMALL_DATA).model)
    model.init_weights()
    return model.state_dict()


def host_collectives(rank: int, port: int, out_dir: str) -> None:
    """One of two gloo ranks: the stop vote and rank 0's objects, over the main group (gloo) and over the gloo group
    init_world makes beside a main group of another backend (nccl on CUDA, xla on trn1: its backend faked here)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import random
    from dataclasses import replace
    from unittest import mock

    import torch.distributed as dist

    from hlat.training.parallel import distributed
    from hlat.training.parallel.distributed import close_world, init_world

    world = init_world("cpu")
    try:
        rng = (torch.get_rng_state(), random.getstate())
        result = {
            "own_group": world.host_group is None,  # the main group is gloo: it serves
            "votes": [world.any_rank(rank == 1), world.any_rank(False), world.any_rank(True)],
            "shared": world.share_from_main({"listing": [f"step-{rank}"]}),
        }
        with mock.patch.object(dist, "get_backend", return_value="nccl"):
            with pytest.raises(RuntimeError, match="need a gloo group beside the nccl one"):
                world.any_rank(True)
            side = replace(world, host_group=distributed._host_side_group())
            result["side"] = [side.any_rank(rank == 0), side.any_rank(False), side.share_from_main(rank + 10)]
        result["side_backend"] = dist.get_backend(side.host_group)
        result["rng_untouched"] = torch.equal(rng[0], torch.get_rng_state()) and rng[1] == random.getstate()
        torch.save(result, f"{out_dir}/host-{rank}.pt")
    finally:
        close_world()


def test_the_stop_vote_and_rank_0s_objects_go_over_a_gloo_group_on_the_host(tmp_path: Path) -> None:
    mp.start_processes(host_collectives, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        result = torch.load(tmp_path / f"host-{rank}.pt", weights_only=False)
        assert result["own_group"]
        assert result["votes"] == [True, False, True]  # rank 1's flag reaches rank 0, and the reverse below
        assert result["shared"] == {"listing": ["step-0"]}  # rank 0's, on both
        assert result["side"] == [True, False, 10] and result["side_backend"] == "gloo"
        assert result["rng_untouched"]


def test_on_one_process_the_vote_is_the_flag_and_sharing_is_identity() -> None:
    from hlat.training.parallel.distributed import World

    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    listing = {"step": 3}
    assert world.any_rank(True) and not world.any_rank(False)
    assert world.share_from_main(listing) is listing
