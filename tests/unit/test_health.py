"""The health checks on CPU, in one process: their numbers, their verdicts, and that they leave the RNGs alone."""

from __future__ import annotations

import random
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hlat.core.config import HealthThresholds
from hlat.core.storage import Storage
from hlat.training.health import (
    UnhealthyCollective,
    allreduce_check,
    compute_dtype,
    device_element_bytes,
    evaluate,
    inventory,
    matmul_check,
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
    corrupted = matmul_check(CPU, 96, repeats=1, dtype=torch.float32, seed=3, corrupt=True)
    assert corrupted["checksum"] != result["checksum"] and corrupted["rel_error"] > 1e-4


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
        "matmul": {"device_name": "cpu", "dtype": "float32", "n": 64, "tflops": tflops, "rel_error": rel_error,
                   "checksum": checksum},
        "allreduce": {"correct": True, "expected": 10.0, "busbw_gbps": 5.0},
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


def test_periodic_check_raises_below_the_floor() -> None:
    assert periodic_health_check(ONE, 0.1, FLOORS.model_copy(update={"min_allreduce_gbps": 0.0}), step=4)["correct"]
    with pytest.raises(UnhealthyCollective, match=r"step 7: rank 0 all-reduce busbw .* < 1e\+09"):
        periodic_health_check(ONE, 0.1, HealthThresholds(min_allreduce_gbps=1e9), step=7, instance_type="local")
