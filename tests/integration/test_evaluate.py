"""The evaluate stage on a temporary Prefect server, with real evaluation jobs on the local backend: perplexity,
the real lm-eval harness on the project's offline tasks, the report with baseline rows and plots, any checkpoint,
intermediate checkpoints while training runs, clear errors, and `hlat compare`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from hlat.cli import main
from hlat.training.checkpoint import CheckpointError
from tests.conftest import SMALL_DATA
from tests.integration.test_flows import artifact_keys
from tests.jobs import make_run, task_states, train

pytestmark = pytest.mark.slow

TRAINING = {"max_steps": 4, "checkpoint_every": 2, "eval_every": 0}
EVALUATION = {"evaluation.limit": 10, "evaluation.perplexity_tokens": 3000, "evaluation.batch_size": 4}


def overrides(**extra: Any) -> dict[str, Any]:
    return {**SMALL_DATA, **{f"training.{k}": v for k, v in TRAINING.items()}, **EVALUATION, **extra}


@pytest.fixture(scope="module")
def trained(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained to step 4 with checkpoints at 2 and 4."""
    root = tmp_path_factory.mktemp("evaluate")
    run = make_run(prepared, root, "scored", **TRAINING)
    code, out = train(run)
    assert code == 0, out
    return run


def test_evaluate_scores_the_newest_checkpoint_writes_the_report_and_is_cached(
    prefect_server: None, trained: Path
) -> None:
    from hlat.flows.evaluate import evaluate

    storage = str(trained.parent)
    results = evaluate(preset="tiny", overrides=overrides(), run_id="scored", storage=storage)
    assert results["step"] == 4 and results["checkpoint"].endswith("step-000000004")
    ppl = results["perplexity"]
    assert ppl["tokens"] >= 3000 and ppl["bytes"] > ppl["tokens"] and ppl["documents"] > 0
    assert math.isclose(ppl["perplexity"], math.exp(ppl["nll_per_token"]), rel_tol=1e-9)
    assert ppl["nll_per_token"] < math.log(512)  # four steps already beat a uniform guess over the vocabulary
    tasks = results["lm_eval"]["tasks"]
    assert set(tasks) == {"hlat_cloze", "hlat_choice"}
    assert 0 <= tasks["hlat_cloze"]["metrics"]["acc"] <= 1 and 0 <= tasks["hlat_choice"]["metrics"]["acc_norm"] <= 1
    assert tasks["hlat_choice"]["n_samples"] == 10

    evaluated = trained / "eval"
    assert json.loads((evaluated / "results.json").read_text()) == json.loads(
        (evaluated / "step-000000004" / "results.json").read_text()
    )
    report = (evaluated / "report.md").read_text()
    # The tiny run's offline tasks have no published counterpart: the 7B suite is named on one line, no rows.
    assert "| hlat_choice |" in report and "Not run here, with published baselines: arc_challenge" in report
    assert "| mmlu |" not in report and "LLaMA-2 7B" not in report
    for png in ("loss.png", "grad_norm.png"):
        assert (evaluated / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png})" in report
    assert {"eval-report-scored", "eval-scores-scored"} <= artifact_keys()
    (job,) = [p for p in (trained / "jobs").iterdir() if "-evaluate-" in p.name]
    assert json.loads((job / "status.json").read_text())["status"] == "Completed"
    log = (job / "output.log").read_text()
    assert "\r" not in log and max(len(line) for line in log.splitlines()) < 1000  # no progress bars in a job's log

    again = evaluate(preset="tiny", overrides=overrides(), run_id="scored", storage=storage)
    assert again["perplexity"] == ppl
    assert task_states("evaluate-checkpoint")[-1] == "Cached"


def test_any_committed_checkpoint_can_be_evaluated(prefect_server: None, trained: Path) -> None:
    from hlat.flows.evaluate import evaluate

    storage = str(trained.parent)
    scores = evaluate(preset="tiny", overrides=overrides(), run_id="scored", storage=storage, step=2)
    assert scores["step"] == 2 and (trained / "eval" / "step-000000002" / "results.json").is_file()
    # Step 3 was never saved: the committed steps are listed (not "no COMMITTED marker", an interrupted save's).
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 3 under .*: the committed steps are 2, 4;"):
        evaluate(preset="tiny", overrides=overrides(), run_id="scored", storage=storage, step=3)


def test_an_unknown_task_or_a_run_without_checkpoints_fails_before_any_job(
    prefect_server: None, prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hlat.flows.evaluate import evaluate

    run = make_run(prepared, tmp_path, "untrained", **TRAINING)
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*run the train stage first"):
        evaluate(preset="tiny", overrides=overrides(), run_id="untrained", storage=str(tmp_path))
    bad = overrides(**{"evaluation.tasks": ["hellaswag", "helaswag"]})
    args = ["run", "evaluate", "--preset", "tiny", "--run-id", "untrained", "--storage", str(tmp_path)]
    for key, value in bad.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "unknown lm-eval task 'helaswag'" in err and "hellaswag" in err
    assert not (run / "jobs" / "evaluate-attempts.json").exists()


def test_intermediate_checkpoints_are_evaluated_while_training_runs(
    prefect_server: None, prepared: Path, tmp_path: Path
) -> None:
    from hlat.flows.train import train as train_flow

    make_run(prepared, tmp_path, "watched", **TRAINING)
    every = overrides(**{"evaluation.every_steps": 2, "evaluation.tasks": ["hlat_cloze"]})
    summary = train_flow(preset="tiny", overrides=every, run_id="watched", storage=str(tmp_path))
    assert summary["final_step"] == 4
    evaluated = sorted(p.name for p in (tmp_path / "watched" / "eval").iterdir())
    assert "step-000000002" in evaluated
    scores = json.loads((tmp_path / "watched" / "eval" / "step-000000002" / "results.json").read_text())
    assert scores["step"] == 2 and set(scores["lm_eval"]["tasks"]) == {"hlat_cloze"}


def test_compare_puts_two_runs_on_one_chart_with_their_difference(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    twin = tmp_path / "twin"
    twin.mkdir()
    lines = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        if line.get("step") == 3 and "loss" in line:
            line["loss"] *= 1.01  # the twin departs at step 3
    (twin / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "cmp"
    assert main(["compare", str(trained), str(twin), "--out", str(out), "--labels", "trn1", "gpu"]) == 0
    printed = capsys.readouterr().out
    assert "4 common steps" in printed and "first divergence (>1e-3 rel) at step 3" in printed
    for name in ("compare.md", "compare-loss.png", "compare-grad_norm.png"):
        assert (out / name).is_file()
    assert main(["compare", str(trained), str(tmp_path / "missing")]) == 1


def test_the_average_of_the_last_checkpoints_is_evaluated_by_the_stage(prefect_server: None, trained: Path) -> None:
    """`hlat average` then `hlat run evaluate --averaged`: the evaluation job scores <run>/averaged/step-N, its
    results beside the trained step's (eval/averaged-step-N), and the stage caches it apart from step N's."""
    from hlat.flows.evaluate import evaluate

    assert main(["average", str(trained), "--last", "2"]) == 0
    storage = str(trained.parent)
    scores = evaluate(preset="tiny", overrides=overrides(), run_id="scored", storage=storage, averaged=True)
    assert scores["step"] == 4 and scores["averaged"] and "/averaged/step-000000004" in scores["checkpoint"]
    assert (trained / "eval" / "averaged-step-000000004" / "results.json").is_file()
    trained_step = evaluate(preset="tiny", overrides=overrides(), run_id="scored", storage=storage, step=4)
    assert not trained_step["averaged"] and scores["perplexity"] != trained_step["perplexity"]
