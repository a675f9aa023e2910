"""The health checks on CPU, in one process: their numbers, their verdicts, and that they leave the RNGs alone."""

from __future__ import annotations

import random
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hlat.core.config import BurnInConfig, HealthThresholds
from hlat.core.storage import Storage
from hlat.training.health import (
    UnhealthyCollective,
    allreduce_check,
    allreduce_floor_gbps,
    compute_dtype,
    device_element_bytes,
    evaluate,
    exact_operands,
    inventory,
    matmul_check,
    matmul_floor_tflops,
    parse_neuron_ls,
    periodic_health_check,
    write_check,
)
from hlat.training.parallel.distributed import World

CPU = torch.device("cpu")
ONE = World(rank=0, world_size=1, local_rank=0, device=CPU)
# Captured from `neuron-ls --json-output` on a trn1.2xlarge (one Trainium device, two NeuronCores), abridged.
NEURON_LS = (
    '[{"neuron_device": 0, "bdf": "0000:00:1e.0", "connected_to": null, "nc_count": 2, '
    '"memory_size": 34359738368, "neuroncore_ids": [0, 1], "neuron_processes": []}]'
)


def test_matmul_numbers_on_cpu() -> None:
    result = matmul_check(CPU, 96, repeats=2, dtype=torch.float32, seed=3)
    assert result["tflops"] > 0 and result["seconds"] > 0
    assert result["rel_error"] < 1e-5
    assert result["dtype"] == "float32" and result["device_name"] == "cpu" and result["reference_rows"] == 64
    again = matmul_check(CPU, 96, repeats=1, dtype=torch.float32, seed=3)
    assert again["checksum"] == result["checksum"]  # same seed, same device: the same bits
    assert result["exact"] and again["exact"]
    corrupted = matmul_check(CPU, 96, repeats=1, dtype=torch.float32, seed=3, corrupt=True)
    assert corrupted["checksum"] != result["checksum"] and corrupted["rel_error"] > 1e-4
    assert not corrupted["exact"]


def test_a_batched_matmul_counts_every_product_and_checks_the_first() -> None:
    single = matmul_check(CPU, 64, repeats=2, seed=3)
    batched = matmul_check(CPU, 64, repeats=2, seed=3, batch=4)
    assert batched["batch"] == 4 and batched["rel_error"] < 1e-5
    assert batched["checksum"] == single["checksum"]  # the first product is the unbatched one
    assert batched["tflops"] == pytest.approx(2 * 64**3 * 4 / batched["seconds"] / 1e12)
    assert "timed_compilations" not in batched  # reported on XLA only
    corrupted = matmul_check(CPU, 64, repeats=1, seed=3, batch=4, corrupt=True)
    assert corrupted["checksum"] != single["checksum"] and corrupted["rel_error"] > 1e-4


def test_an_all_reduce_moves_bf16_bytes_under_xlas_bf16_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    xla = torch.device("xla")
    assert device_element_bytes(torch.float32, xla) == 4
    monkeypatch.setenv("XLA_USE_BF16", "1")
    assert device_element_bytes(torch.float32, xla) == 2
    assert device_element_bytes(torch.float32, CPU) == 4  # the flags are XLA's
    monkeypatch.setenv("XLA_USE_BF16", "0")
    monkeypatch.setenv("XLA_DOWNCAST_BF16", "1")
    assert device_element_bytes(torch.float32, xla) == 2
    assert device_element_bytes(torch.int64, xla) == 8


def test_bf16_is_the_compute_dtype_only_on_accelerators() -> None:
    assert compute_dtype("bf16-sr", torch.device("cuda", 0)) is torch.bfloat16
    assert compute_dtype("bf16-mixed", CPU) is torch.float32
    assert compute_dtype("fp32", torch.device("cuda", 0)) is torch.float32
    bf16 = matmul_check(CPU, 32, repeats=1, dtype=torch.bfloat16, corrupt=True)  # the fault shows in BF16 too
    assert bf16["checksum"] != matmul_check(CPU, 32, repeats=1, dtype=torch.bfloat16)["checksum"]


def test_the_checks_leave_every_global_rng_unchanged(tmp_path: Path) -> None:
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=False))
    matmul_check(CPU, 64, repeats=1, seed=5)
    allreduce_check(ONE, 0.1)
    write_check(Storage(str(tmp_path)), 0.1)
    periodic_health_check(ONE, 0.1, None, step=1)
    after = (torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=False))
    assert torch.equal(before[0], after[0]) and before[1] == after[1]
    assert np.array_equal(before[2]["state"]["key"], after[2]["state"]["key"])


def test_one_process_allreduce_reports_busbw_as_algbw() -> None:
    result = allreduce_check(ONE, 0.5, iters=2)
    assert result["correct"] and result["ranks"] == 1 and result["expected"] == 1.0 and result["mb"] == 0.5
    assert result["busbw_gbps"] == result["algbw_gbps"] > 0
    assert "one rank" in result["note"]


def test_write_check_leaves_nothing_behind(tmp_path: Path) -> None:
    result = write_check(Storage(str(tmp_path / "scratch")), 0.25)
    assert result["mbps"] > 0 and result["mb"] == 0.25 and "error" not in result
    assert list((tmp_path / "scratch").iterdir()) == []


def test_inventory_counts_the_ranks_that_joined() -> None:
    seen = inventory(ONE, expected_world_size=1)
    assert seen["device_type"] == "cpu" and seen["cpus"] and seen["problems"] == []
    short = inventory(ONE, expected_world_size=4)
    assert [(p["check"], p["value"], p["threshold"]) for p in short["problems"]] == [("inventory_ranks", 1, 4)]


def test_neuron_ls_output_is_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_neuron_ls(NEURON_LS) == {"devices": 1, "neuron_cores": 2}
    assert parse_neuron_ls('{"neuron_devices": ' + NEURON_LS + "}") == {"devices": 1, "neuron_cores": 2}
    fake = tmp_path / "neuron-ls"
    fake.write_text(f"#!/bin/sh\necho '{NEURON_LS}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert inventory(ONE)["neuron"] == {"available": True, "devices": 1, "neuron_cores": 2}


def rank_row(rank: int, checksum: str = "aaaa", tflops: float = 1.0, rel_error: float = 1e-7) -> dict[str, Any]:
    return {
        "rank": rank,
        "host": f"algo-{rank // 2 + 1}",
        "inventory": {"problems": []},
        "matmul": {"device": "cpu", "device_name": "cpu", "dtype": "float32", "n": 64, "tflops": tflops,
                   "rel_error": rel_error, "checksum": checksum, "exact": True},
        "allreduce": {"correct": True, "expected": 1.0, "busbw_gbps": 5.0, "mb": 256.0, "ranks": 4},
    }  # fmt: skip


FLOORS = HealthThresholds(min_matmul_tflops=0.5, max_matmul_rel_error=1e-4, min_allreduce_gbps=1.0)


def test_evaluate_names_the_rank_below_a_threshold() -> None:
    failures = evaluate([rank_row(0), rank_row(1), rank_row(2, tflops=0.1), rank_row(3)], FLOORS)
    assert [(f["rank"], f["host"], f["check"], f["value"], f["threshold"]) for f in failures] == [
        (2, "algo-2", "matmul_tflops", 0.1, 0.5)
    ]
    assert "rank 2 on algo-2" in failures[0]["message"]
    assert evaluate([rank_row(0), rank_row(1), rank_row(2, tflops=0.1)], None) == []  # no thresholds: measured


def test_evaluate_names_a_checksum_that_disagrees_with_the_majority() -> None:
    rows = [rank_row(0), rank_row(1), rank_row(2, checksum="bbbb", rel_error=2e-7), rank_row(3)]
    for thresholds in (FLOORS, None):  # under the error bound, and whatever the instance type: still wrong
        failures = evaluate(rows, thresholds)
        assert [(f["rank"], f["check"], f["value"], f["threshold"]) for f in failures] == [
            (2, "matmul_checksum", "bbbb", "aaaa")
        ]
    # Two ranks that disagree: the one further from the float64 reference is named.
    tie = evaluate([rank_row(0, checksum="bbbb", rel_error=3e-3), rank_row(1)], None)
    assert [(f["rank"], f["check"]) for f in tie] == [(0, "matmul_checksum")]


def test_evaluate_fails_wrong_sums_and_raised_checks() -> None:
    wrong = rank_row(1)
    wrong["allreduce"] = {"correct": False, "expected": 3.0, "error": "rank 1 saw 2.0 at element 0", "busbw_gbps": 5.0}
    broken = rank_row(2)
    broken["write"] = {"exception": "StorageError: access denied to s3://bucket/ckpt"}
    failures = evaluate([rank_row(0), wrong, broken], None)
    assert [(f["rank"], f["check"]) for f in failures] == [(1, "allreduce_result"), (2, "write")]


def test_periodic_check_raises_below_the_floor_for_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    assert periodic_health_check(ONE, 0.1, FLOORS.model_copy(update={"min_allreduce_gbps": 0.0}), step=4)["correct"]
    # A link that takes 50 ms an iteration moves 0.1 MB at under 0.002 GB/s, below the floor for 0.1 MB on one rank
    # (about 0.09 GB/s from a 1 GB/s floor: the launch time bounds it).
    monkeypatch.setenv("HLAT_FAULT_ALLREDUCE_SECONDS", "0.05")
    with pytest.raises(
        UnhealthyCollective, match=r"step 7: rank 0 all-reduce busbw .* < 0\.09.* \(the floor for 0\.1 MB"
    ):
        periodic_health_check(ONE, 0.1, HealthThresholds(min_allreduce_gbps=1.0), step=7, instance_type="local")


def test_periodic_check_raises_below_a_fraction_of_the_jobs_first_measurement() -> None:
    thresholds = HealthThresholds(min_allreduce_share_of_first=0.25)  # the default share
    first = periodic_health_check(ONE, 0.1, thresholds, step=2)
    assert first["judged"] and first["slowest_best_busbw_gbps"] >= first["slowest_busbw_gbps"] > 0
    assert first["relative_floor_gbps"] is None  # the first check has nothing to compare with
    reference = first["slowest_best_busbw_gbps"] / 100
    same = periodic_health_check(ONE, 0.1, thresholds, step=4, reference_gbps=reference)
    assert same["relative_floor_gbps"] == pytest.approx(0.25 * reference)
    with pytest.raises(UnhealthyCollective, match=r"step 6: .* < .* \(0\.25 of this job's first measurement"):
        periodic_health_check(ONE, 0.1, thresholds, step=6, reference_gbps=1e12)  # a link now far below what it was


def test_no_relative_check_without_a_share_or_thresholds() -> None:
    """The CPU's ("local") share is 0: a machine shared with other work measures more than 4x apart between checks
    (a CI run's XLA tier failed a precompile rehearsal so); an instance type not listed is never failed."""
    local = BurnInConfig().thresholds["local"]
    assert local.min_allreduce_share_of_first == 0
    for thresholds in (local, None):
        result = periodic_health_check(ONE, 0.1, thresholds, step=4, reference_gbps=1e12)
        assert result["judged"] and result["relative_floor_gbps"] is None


def test_graph_extraction_runs_the_check_and_judges_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HLAT_FAULT_ALLREDUCE_SECONDS", "0.05")  # would fail any floor, and the relative check
    result = periodic_health_check(
        ONE, 0.1, HealthThresholds(min_allreduce_gbps=1.0), 2, reference_gbps=1e12, judge=False
    )
    assert result["judged"] is False and "correct" not in result and result["busbw_gbps"] > 0


TRN1 = BurnInConfig().thresholds["ml.trn1.32xlarge"]
"""The defaults: 30 TFLOP/s BF16 matmul, 20 GB/s all-reduce bus bandwidth."""


@pytest.mark.parametrize(
    ("mb", "ranks", "low", "high"),
    [
        (16, 2048, 0.05, 1.0),  # the in-training check at HLAT-70B's 2,048 ranks: latency-bound, nowhere near 20
        (16, 32, 3.0, 10.0),  # one trn1.32xlarge
        (256, 32, 15.0, 20.0),  # burn-in's size on one instance: close to the bandwidth floor
        (256, 2048, 1.0, 5.0),
        (1e6, 2048, 19.5, 20.0),  # very large: the bandwidth floor itself
    ],
)
def test_the_allreduce_floor_follows_the_message_size_and_the_rank_count(
    mb: float, ranks: int, low: float, high: float
) -> None:
    floor = allreduce_floor_gbps(TRN1.min_allreduce_gbps, mb * 1e6, ranks)
    assert low < floor < high


def test_the_floor_grows_with_the_size_and_falls_with_the_ranks() -> None:
    sizes = [allreduce_floor_gbps(20.0, mb * 1e6, 256) for mb in (1, 4, 16, 64, 256, 1024)]
    ranks = [allreduce_floor_gbps(20.0, 16e6, n) for n in (2, 32, 256, 2048)]
    assert sizes == sorted(sizes) and ranks == sorted(ranks, reverse=True)
    assert allreduce_floor_gbps(0.0, 16e6, 2048) == 0.0  # no floor stays no floor
    assert allreduce_floor_gbps(1.0, 1e6, 1) == pytest.approx(1e6 / (1e-3 + 1e-3) / 1e9)  # one rank: a copy


def test_a_healthy_16_mb_allreduce_on_2048_ranks_passes_where_the_flat_20_gb_floor_failed_it() -> None:
    row = rank_row(0)
    row["allreduce"] = {"correct": True, "expected": 1.0, "busbw_gbps": 2.0, "mb": 16.0, "ranks": 2048}
    assert row["allreduce"]["busbw_gbps"] < TRN1.min_allreduce_gbps
    assert [f["check"] for f in evaluate([row], TRN1) if f["check"].startswith("allreduce")] == []
    dead = rank_row(0)
    dead["allreduce"] = {**row["allreduce"], "busbw_gbps": 0.01}
    assert [f["check"] for f in evaluate([dead], TRN1) if f["check"].startswith("allreduce")] == ["allreduce_busbw"]


def test_the_matmul_floor_is_the_precisions() -> None:
    assert matmul_floor_tflops(TRN1, "bfloat16", "xla:0") == 30.0
    # fp32 on a NeuronCore-v2: 47.5 of 190 TFLOP/s per Trainium chip, a quarter of BF16's: 7.5 against ~23.75 peak.
    assert matmul_floor_tflops(TRN1, "float32", "xla:0") == pytest.approx(7.5)
    assert matmul_floor_tflops(FLOORS, "float32", "cpu") == FLOORS.min_matmul_tflops  # a CPU's floor is fp32's
    core = rank_row(0, tflops=20.0)  # a healthy trn1 core in fp32 (its peak is about 24)
    core["matmul"].update(device="xla:0", device_name="xla", dtype="float32", rel_error=1e-6)
    assert [f["check"] for f in evaluate([core], TRN1) if f["check"].startswith("matmul")] == []
    core["matmul"]["dtype"] = "bfloat16"  # the same speed in BF16 is a bad core
    assert [f["check"] for f in evaluate([core], TRN1) if f["check"].startswith("matmul")] == ["matmul_tflops"]


def stochastic_bf16(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """float32 -> BF16 with stochastic rounding, as a NeuronCore does under NEURON_RT_STOCHASTIC_ROUNDING_EN=1: random
    bits added below BF16's last mantissa bit, then truncated (each core draws its own)."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=gen, dtype=torch.int32)
    return ((bits + noise) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def test_the_checksum_product_does_not_depend_on_stochastic_rounding() -> None:
    """bf16-sr: two healthy cores rounding the same float32 product stochastically, each with its own draws, give
    different bits for random operands (the old checksum would name one of them faulty) and the same bits for the
    checksum's integer operands, which never need rounding."""
    n = 256
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    core0, core1 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    random_product = a @ b
    assert not torch.equal(stochastic_bf16(random_product, core0), stochastic_bf16(random_product, core1))
    left, right = exact_operands(n, torch.Generator().manual_seed(0))
    assert int((left != 0).sum(dim=1).max()) <= 128 and set(right.unique().tolist()) == {-1.0, 0.0, 1.0}
    product = left @ right
    assert torch.equal(stochastic_bf16(product, core0), stochastic_bf16(product, core1))
    assert torch.equal(stochastic_bf16(product, core0).double(), left.double() @ right.double())
    # And matmul_check in BF16 takes its checksum from that product: the bits of the exact result.
    checked = matmul_check(CPU, n, repeats=1, dtype=torch.bfloat16, seed=0)
    assert checked["exact"]


def test_evaluate_names_a_checksum_product_that_is_not_exact() -> None:
    wrong = rank_row(1, checksum="bbbb")
    wrong["matmul"]["exact"] = False
    failures = evaluate([rank_row(0), wrong, rank_row(2)], None)
    assert [(f["rank"], f["check"]) for f in failures] == [(1, "matmul_checksum"), (1, "matmul_exact")]
