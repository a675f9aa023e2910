"""Tensor x data parallelism through neuronx-distributed's groups and optimizer (CPU mode, 4 gloo ranks): the loader
shards by data-parallel rank, gradients reduce over the data-parallel group only, clipping sees the global norm, and
one optimizer step equals the dense single-process step."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.nxd.conftest import make_run, run_ranks

COMMON = {"training.global_batch_size": 8, "training.micro_batch_size": 2, "training.warmup_steps": 1}


def test_tp2_x_dp2_one_step_equals_the_dense_step_and_tp_peers_read_the_same_tokens(
    prepared: Path, tmp_path: Path
) -> None:
    dense_run = make_run(prepared, tmp_path, "dense", **COMMON)
    (dense,) = run_ranks(1, "one_step", tmp_path / "dense-ranks", run=str(dense_run))
    split_run = make_run(
        prepared, tmp_path, "tp2-dp2", **COMMON, **{"parallelism.tensor": 2, "job.processes_per_node": 4}
    )
    ranks = run_ranks(4, "one_step", tmp_path / "split-ranks", run=str(split_run))

    coordinates = [r["coordinates"] for r in ranks]
    assert sorted((c["dp"][0], c["tp"][0]) for c in coordinates) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    tokens_by_dp: dict[int, set[int]] = {}
    for r in ranks:
        tokens_by_dp.setdefault(r["coordinates"]["dp"][0], set()).add(r["first_batch_crc"])
    assert all(len(crcs) == 1 for crcs in tokens_by_dp.values()), tokens_by_dp  # TP peers: the same tokens
    assert tokens_by_dp[0] != tokens_by_dp[1]  # data-parallel ranks: different ones

    for r in ranks:
        assert abs(r["loss"] - dense["loss"]) <= 1e-5 * dense["loss"]
        assert abs(r["grad_norm"] - dense["grad_norm"]) <= 1e-5 * dense["grad_norm"]  # global norm across TP
        for name, weight in dense["weights"].items():
            assert torch.allclose(r["weights"][name], weight, rtol=0, atol=1e-5), name
    moved = max(float((dense["weights"][n] - ranks[0]["weights"][n]).abs().max()) for n in dense["weights"])
    assert moved <= 1e-5
