"""The precompile and burn-in stage flows on a temporary Prefect server, with real jobs on the local backend:
what they write, what they publish, that a failing burn-in stops the DAG before training, and that both skip on a
cached re-run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SMALL_DATA
from tests.jobs import make_run, task_states

pytestmark = pytest.mark.slow

BURN_IN = {"burn_in.matmul_size": 128, "burn_in.matmul_repeats": 2, "burn_in.allreduce_mb": 1, "burn_in.write_mb": 2}
TRAINING = {"max_steps": 4, "checkpoint_every": 2, "eval_every": 0}


def overrides(**extra: Any) -> dict[str, Any]:
    return {**SMALL_DATA, **BURN_IN, **{f"training.{k}": v for k, v in TRAINING.items()}, **extra}


def test_burn_in_passes_is_published_and_skips_when_cached(
    prefect_server: None, prepared: Path, tmp_path: Path
) -> None:
    from hlat.flows.burn_in import burn_in

    run = make_run(prepared, tmp_path, "healthy", **TRAINING)
    report = burn_in(preset="tiny", overrides=overrides(), run_id="healthy", storage=str(tmp_path))
    assert report["passed"] is True and report["world_size"] == 1
    assert (run / "burn-in/report.json").is_file()
    again = burn_in(preset="tiny", overrides=overrides(), run_id="healthy", storage=str(tmp_path))
    assert again == report
    assert task_states("burn-in-cluster")[-2:] == ["Completed", "Cached"]


def test_a_wrong_rank_fails_burn_in_and_the_dag_stops_before_training(
    prefect_server: None, prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hlat.flows.pretrain import hlat
    from hlat.tasks.burn_in import BurnInFailed

    two_ranks = overrides(**{"job.processes_per_node": 2})
    run = make_run(prepared, tmp_path, "faulty", **TRAINING, **{"job.processes_per_node": 2})
    monkeypatch.setenv("HLAT_FAULT_BURN_IN_WRONG_RANK", "1")
    with pytest.raises(BurnInFailed, match=r"rank 1"):
        hlat(preset="tiny", overrides=two_ranks, run_id="faulty", storage=str(tmp_path))
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_a_threshold_not_met_fails_unless_told_to_go_on(prefect_server: None, prepared: Path, tmp_path: Path) -> None:
    from hlat.flows.burn_in import burn_in
    from hlat.tasks.burn_in import BurnInFailed

    make_run(prepared, tmp_path, "slow", **TRAINING)
    impossible = overrides(**{"burn_in.thresholds": {"local": {"min_matmul_tflops": 1e6}}})
    with pytest.raises(BurnInFailed, match="matmul"):
        burn_in(preset="tiny", overrides=impossible, run_id="slow", storage=str(tmp_path))
    report = burn_in(
        preset="tiny",
        overrides={**impossible, "burn_in.continue_on_failure": True},
        run_id="slow",
        storage=str(tmp_path),
    )
    assert report["passed"] is False and report["failures"]


def test_precompile_skips_without_compile_and_builds_the_cache_with_it(
    prefect_server: None, prepared: Path, tmp_path: Path
) -> None:
    from hlat.flows.precompile import precompile

    make_run(prepared, tmp_path, "eager", **TRAINING)
    skipped = precompile(preset="tiny", overrides=overrides(), run_id="eager", storage=str(tmp_path))
    assert skipped["status"] == "skipped" and "training.compile is off" in skipped["reason"]

    compiled = overrides(**{"training.compile": True})
    run = make_run(prepared, tmp_path, "compiled", **TRAINING, compile=True)
    built = precompile(preset="tiny", overrides=compiled, run_id="compiled", storage=str(tmp_path))
    assert built["status"] == "built" and (run / "compile-cache/latest.json").is_file()
    assert not (run / "metrics.jsonl").exists()  # the precompile job trains nothing into the run
    again = precompile(preset="tiny", overrides=compiled, run_id="compiled", storage=str(tmp_path))
    assert again == built and task_states("precompile-graphs")[-1] == "Cached"
