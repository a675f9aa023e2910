"""The local rehearsal of the trn1 path: the whole tiny DAG with its training, burn-in and precompile jobs on
XLA:CPU (`training.device=xla`), run by the local backend in the XLA environment of `scripts/install.sh xla`.

Pinned to neuron.sdk=2.24.1 (not the default, 2.28.0): only torch-xla 2.7's XLA:CPU loads graphs back from the
persistent cache (`NeuronSdk.cpu_cache_loads`), which is what the training job's "compiled 0 graph(s)" shows. The
default SDK's loop on XLA:CPU is the XLA tier's (tests/xla, in .venv-xla-2.28).

Skipped without that environment, unless HLAT_REQUIRE_XLA=1 (CI), which makes its absence a failure."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from hlat.core.environment import NEURON_SDKS
from hlat.infra.backends.local import PROJECT_ROOT
from tests.jobs import metrics

pytestmark = pytest.mark.slow


@pytest.fixture
def xla_environment() -> None:
    python = NEURON_SDKS["2.24.1"].local_python
    if not (PROJECT_ROOT / python).exists():
        message = f"{python} is missing: run scripts/install.sh xla"
        if os.environ.get("HLAT_REQUIRE_XLA") == "1":
            pytest.fail(f"HLAT_REQUIRE_XLA=1 but {message}")
        pytest.skip(message)


def test_the_tiny_dag_runs_end_to_end_with_its_jobs_on_xla_cpu(
    xla_environment: None, prefect_server: None, tmp_path: Path, small_run: dict[str, Any]
) -> None:
    from hlat.flows.pretrain import hlat

    overrides = {**small_run, "training.device": "xla", "neuron.sdk": "2.24.1"}
    result = hlat(preset="tiny", overrides=overrides, storage=str(tmp_path))
    run = tmp_path / result["run_id"]
    job_dirs = {stage: list((run / "jobs").glob(f"*-{stage}-1")) for stage in ("burn-in", "train", "evaluate")}
    assert all(len(found) == 1 for found in job_dirs.values()), job_dirs

    text = (job_dirs["train"][0] / "output.log").read_text()
    assert ".venv-xla/bin/python" in text  # the local backend ran the job in the XLA environment
    assert "seq 128 on xla" in text  # ... and the trainer trained on the XLA device
    steps = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert steps[-1]["loss"] < steps[0]["loss"]

    report = json.loads((run / "burn-in" / "report.json").read_text())
    assert report["passed"] and {r["device"] for r in report["ranks"]} == {"xla"}
    # precompile rehearsed the loop on XLA:CPU into torch-xla's persistent cache; the training job, started on it,
    # compiled no graph: not its steps, sync points, health check, checkpoints nor validation pass.
    assert result["precompile"]["status"] == "built" and result["precompile"]["kind"] == "xla"
    assert "compile cache: hit" in text
    assert "xla: this job compiled 0 graph(s) and loaded" in text
    evaluation = json.loads((run / "eval" / "results.json").read_text())
    assert evaluation["step"] == 12 and evaluation["device"] == "cpu" and evaluation["perplexity"]
