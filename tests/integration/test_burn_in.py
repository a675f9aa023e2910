"""The burn-in program as jobs run it (torchrun, gloo ranks), and the periodic health check inside training."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.jobs import final_weights, launch, make_run, train

pytestmark = pytest.mark.slow

# Small checks: a burn-in of two ranks takes about 3 s, most of it starting Python and torch.
SMALL_BURN_IN = {"burn_in.matmul_size": 128, "burn_in.matmul_repeats": 2, "burn_in.allreduce_mb": 1}


def burn_in(
    run: Path, nproc: int = 1, env: dict[str, str] | None = None, *args: str
) -> tuple[int, str, dict[str, Any]]:
    """Run the program (under torchrun for several ranks); its exit code, output and report."""
    program = ["-m", "hlat.training.burn_in", "--config", str(run / "config.json"), *args]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    proc = subprocess.run(
        [sys.executable, *launcher, *program],
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
    )
    report_path = Path(args[args.index("--report") + 1]) if "--report" in args else run / "burn-in/report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    return proc.returncode, proc.stdout + proc.stderr, report


def test_a_healthy_two_rank_burn_in_passes(prepared: Path, tmp_path: Path) -> None:
    run = make_run(prepared, tmp_path, "healthy", **SMALL_BURN_IN, **{"job.processes_per_node": 2})
    code, out, report = burn_in(run, nproc=2)
    assert code == 0, out[-3000:]
    assert report["passed"] and report["failures"] == [] and report["world_size"] == 2
    assert report["instance_type"] == "local" and report["thresholds"]["min_write_mbps"] == 5.0
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for row in report["ranks"]:
        assert row["matmul_tflops"] > 0 and row["matmul_rel_error"] < 1e-5 and row["allreduce_busbw_gbps"] > 0
    assert report["ranks"][0]["matmul_checksum"] == report["ranks"][1]["matmul_checksum"]
    assert report["ranks"][0]["write_mbps"] > 0 and report["ranks"][1]["write_mbps"] is None  # one write per node
    assert not (run / "checkpoints/burn-in-scratch").exists()


def test_a_wrong_rank_fails_the_burn_in_naming_it(prepared: Path, tmp_path: Path) -> None:
    # Correctness only: no performance floors, which a loaded CI machine can miss on the healthy rank too.
    correctness_only = {"local": {"min_matmul_tflops": 0, "min_allreduce_gbps": 0, "min_write_mbps": 0}}
    overrides = {"job.processes_per_node": 2, "burn_in.thresholds": correctness_only}
    run = make_run(prepared, tmp_path, "wrong", **SMALL_BURN_IN, **overrides)
    failure = tmp_path / "failure"
    env = {"HLAT_FAULT_BURN_IN_WRONG_RANK": "1", "HLAT_FAILURE_FILE": str(failure)}
    code, out, report = burn_in(run, 2, env)
    assert code != 0 and re.search(r"exitcode\s*:\s*4", out), out[-3000:]  # torchrun reports each rank's code
    assert not report["passed"]
    assert {f["rank"] for f in report["failures"]} == {1}
    assert "matmul_checksum" in {f["check"] for f in report["failures"]}
    reason = failure.read_text()
    assert reason.split("] ", 1)[-1].startswith("BurnInFailed: rank 1 on ") and "matmul_checksum" in reason


def test_a_threshold_not_met_fails_naming_the_check(prepared: Path, tmp_path: Path) -> None:
    run = make_run(
        prepared, tmp_path, "slow", **SMALL_BURN_IN, **{"burn_in.thresholds": {"local": {"min_matmul_tflops": 1e6}}}
    )
    report_path = tmp_path / "elsewhere" / "burn-in.json"
    failure = tmp_path / "failure"
    code, out, report = burn_in(run, 1, {"HLAT_FAILURE_FILE": str(failure)}, "--report", str(report_path))
    assert code == 4, out[-3000:]
    assert [(f["rank"], f["check"], f["threshold"]) for f in report["failures"]] == [(0, "matmul_tflops", 1e6)]
    assert "matmul_tflops" in failure.read_text() and "burn-in failure: rank 0 on" in out


def test_an_instance_type_without_thresholds_is_measured_not_failed(prepared: Path, tmp_path: Path) -> None:
    run = make_run(prepared, tmp_path, "unknown", **SMALL_BURN_IN, **{"job.instance_type": "ml.g5.xlarge"})
    code, out, report = burn_in(run)
    assert code == 0, out[-3000:]
    assert report["passed"] and report["thresholds"] is None and "no thresholds" in report["note"]
    assert report["ranks"][0]["matmul_tflops"] > 0


HEALTH = {"burn_in.health_check_every": 2, "burn_in.health_allreduce_mb": 1}


def test_health_checks_leave_training_bitwise_unchanged(prepared: Path, tmp_path: Path) -> None:
    plain = make_run(prepared, tmp_path, "plain", max_steps=6, checkpoint_every=3, eval_every=3)
    checked = make_run(prepared, tmp_path, "checked", max_steps=6, checkpoint_every=3, eval_every=3, **HEALTH)
    procs = [launch(plain), launch(checked)]  # side by side: the runs are independent
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert re.findall(r"health check at step (\d+)", outs[1]) == ["2", "4", "6"]
    assert "health check" not in outs[0]
    a, b = final_weights(plain), final_weights(checked)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_unhealthy_collective_ends_training_for_a_relaunch(prepared: Path, tmp_path: Path) -> None:
    run = make_run(
        prepared,
        tmp_path,
        "unhealthy",
        max_steps=6,
        checkpoint_every=2,
        eval_every=0,
        **HEALTH,
        **{"burn_in.thresholds": {"local": {"min_allreduce_gbps": 1.0}}},
    )
    failure = tmp_path / "failure"
    # A link that takes 50 ms an all-reduce: 1 MB at under 0.02 GB/s, below the 0.5 GB/s floor for 1 MB on one rank.
    code, out = train(run, {"HLAT_FAILURE_FILE": str(failure), "HLAT_FAULT_ALLREDUCE_SECONDS": "0.05"})
    assert code == 5, out[-2000:]
    assert failure.read_text().split("] ", 1)[-1].startswith("UnhealthyCollective: step 2: rank 0 all-reduce busbw")
    assert not (run / "checkpoints/step-000000002").exists()  # health first: no checkpoint of a suspect step
