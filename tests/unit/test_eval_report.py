"""Evaluation reports and run comparisons on fake runs: metrics.jsonl parsing, PNG charts, the markdown report
beside baselines and their citations, and step-by-step differences between two runs."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest

from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.infra.reports.eval_report import (
    MISSING,
    choose_metric,
    compare_line,
    compare_runs,
    evaluation_history,
    load_baselines,
    plot_curves,
    read_metrics,
    render_report,
    write_report,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

BASELINES: dict[str, Any] = {
    "note": "Numbers copied from the papers.",
    "sources": {
        "paper-a": {
            "title": "Paper A: a model",
            "url": "https://example.org/paper-a",
            "where": "Table 3",
            "protocol": "zero-shot",
        },
        "paper-b": {"title": "Paper B", "url": "https://example.org/paper-b", "where": "Table 7"},
    },
    "models": [
        {
            "model": "Big A 7B",
            "source": "paper-a",
            "scores": {
                "hellaswag": {"value": 77.2, "shots": 0, "metric": "acc_norm"},
                "arc_easy": {"value": 75.2, "shots": 25, "metric": "acc"},
            },
        },
        {
            "model": "Big B 1B",
            "source": "paper-b",
            "scores": {"hellaswag": {"value": 61.5, "shots": 0, "metric": "acc"}},
        },
        {"model": "Unrelated", "source": "paper-b", "scores": {"mmlu": {"value": 45.3, "shots": 5, "metric": "acc"}}},
    ],
}


def results(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "run_id": "tiny-abc",
        "step": 6,
        "checkpoint": "runs/tiny-abc/checkpoints/step-000000006",
        "created": "2026-11-22T10:00:00+00:00",
        "model": {"preset": "tiny", "params": 912000},
        "perplexity": {
            "split": "validation",
            "tokens": 20000,
            "documents": 40,
            "bytes": 61000,
            "nll_per_token": 5.4,
            "perplexity": 221.4,
            "bits_per_byte": 2.57,
        },
        "lm_eval": {
            "lm_eval_version": "0.4.13",
            "limit": 50,
            "num_fewshot": None,
            "tasks": {
                "hlat_cloze": {
                    "metrics": {"acc": 0.12, "acc_stderr": 0.04, "perplexity": 812.0},
                    "n_samples": 50,
                    "num_fewshot": 0,
                    "higher_is_better": {"acc": True, "perplexity": False},
                },
                "hellaswag": {
                    "metrics": {
                        "acc,none": 0.25,
                        "acc_stderr,none": 0.02,
                        "acc_norm,none": 0.273,
                        "acc_norm_stderr,none": 0.021,
                    },
                    "n_samples": 50,
                    "num_fewshot": 0,
                },
                "arc_easy": {"metrics": {"acc": 0.314, "acc_stderr": 0.03}, "n_samples": 50, "num_fewshot": 0},
            },
        },
        "duration_s": 12.3,
    }
    base.update(changes)
    return base


def training_lines(steps: range, loss: Any = None, eval_every: int = 0) -> list[dict[str, Any]]:
    """Training lines (and val_loss lines every `eval_every` steps) for a smoothly decreasing loss."""
    loss = loss or (lambda step: 8.0 * 0.97**step + 2.0)
    lines: list[dict[str, Any]] = []
    for step in steps:
        lines.append({"step": step, "loss": loss(step), "grad_norm": 1.0 + 1.0 / step, "lr": 1e-3})
        if eval_every and step % eval_every == 0:
            lines.append({"step": step, "val_loss": loss(step) + 0.1})
    return lines


def fake_run(root: Path, name: str, lines: list[dict[str, Any]] | None) -> Run:
    run = Run.at(str(root / name))
    if lines is not None:
        run.storage.write_text("metrics.jsonl", "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))
    return run


# -- read_metrics ----------------------------------------------------------------------------------------------


def test_read_metrics_merges_a_step_sorts_and_lets_the_later_line_win(tmp_path: Path) -> None:
    run = fake_run(
        tmp_path,
        "r",
        [
            {"step": 1, "loss": 9.0, "grad_norm": 2.0},
            {"step": 2, "loss": 8.0, "grad_norm": 1.5},
            {"step": 3, "loss": 7.5, "grad_norm": 1.4},  # lost with the job, redone after the resume below
            {"step": 2, "val_loss": 8.2},
            {"step": 3, "loss": 7.0, "grad_norm": 1.2},
            {"step": 4, "loss": None, "grad_norm": 9.9},  # a non-finite loss is recorded as null
        ],
    )
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[1] == {"step": 2, "loss": 8.0, "grad_norm": 1.5, "val_loss": 8.2}
    assert records[2] == {"step": 3, "loss": 7.0, "grad_norm": 1.2}
    assert records[3]["loss"] is None


def test_read_metrics_errors_name_the_file(tmp_path: Path) -> None:
    missing = fake_run(tmp_path, "missing", None)
    with pytest.raises(ValueError, match=r"metrics\.jsonl does not exist") as info:
        read_metrics(missing)
    assert str(tmp_path / "missing" / "metrics.jsonl") in str(info.value)

    empty = fake_run(tmp_path, "empty", [])
    with pytest.raises(ValueError, match=r"metrics\.jsonl is empty"):
        read_metrics(empty)

    broken = fake_run(tmp_path, "broken", [])
    broken.storage.write_text("metrics.jsonl", '{"step": 1, "loss": 3.0}\n{"step": 2, "lo\n{"step": 3, "loss": 2.0}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl line 2 is not JSON"):
        read_metrics(broken)


def test_read_metrics_skips_a_last_line_cut_short(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "r", [])
    run.storage.write_text("metrics.jsonl", '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.9}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


# -- charts ----------------------------------------------------------------------------------------------------


def test_plot_curves_returns_and_writes_png(tmp_path: Path) -> None:
    lines = training_lines(range(1, 31), eval_every=10)
    series = {"A": lines, "B": training_lines(range(5, 41))}
    png = plot_curves(series, "loss", None, "loss", extra_keys=("val_loss",), log_y=True, mark_step=20)
    assert png.startswith(PNG_SIGNATURE) and len(png) > 1000

    path = tmp_path / "charts" / "grad_norm.png"
    assert plot_curves(series, "grad_norm", str(path), "grad norm").startswith(PNG_SIGNATURE)
    assert path.read_bytes().startswith(PNG_SIGNATURE)

    buffer = io.BytesIO()
    plot_curves({"A": lines}, "loss", buffer, "one run", log_y=True)
    assert buffer.getvalue().startswith(PNG_SIGNATURE)


def test_plot_curves_without_values_or_with_non_positive_values_still_draws(tmp_path: Path) -> None:
    assert plot_curves({"A": [{"step": 1, "lr": 0.1}]}, "loss", None, "nothing").startswith(PNG_SIGNATURE)
    # log-y falls back to linear when a value is not positive, rather than dropping it silently.
    with_zero: list[dict[str, Any]] = [{"step": 1, "loss": 0.0}, {"step": 2, "loss": 1.0}, {"step": 3, "loss": None}]
    assert plot_curves({"A": with_zero}, "loss", None, "zero", log_y=True).startswith(PNG_SIGNATURE)


# -- baselines and the report ----------------------------------------------------------------------------------


def test_load_baselines_reads_a_file_or_gives_an_empty_table(tmp_path: Path) -> None:
    assert load_baselines(tmp_path / "absent.json") == {"note": "", "sources": {}, "models": []}
    path = tmp_path / "baselines.json"
    path.write_text(json.dumps(BASELINES))
    assert load_baselines(path) == BASELINES
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"baselines\.json is not valid JSON"):
        load_baselines(path)
    # The packaged file (being written separately) loads, or is absent: either way a table with a models list.
    assert isinstance(load_baselines()["models"], list)


def test_choose_metric_prefers_acc_norm_then_acc_then_exact_match() -> None:
    assert choose_metric({"acc": 0.1, "acc_stderr": 0.01, "acc_norm": 0.2}) == "acc_norm"
    assert choose_metric({"acc,none": 0.1, "acc_stderr,none": 0.01}) == "acc,none"
    assert choose_metric({"f1": 0.3, "exact_match,strict-match": 0.2}) == "exact_match,strict-match"
    assert choose_metric({"word_perplexity_stderr": 1.0, "word_perplexity": 30.0}) == "word_perplexity"
    assert choose_metric({"acc_stderr": "N/A"}) is None


def table_row(report: str, first_cell: str) -> list[str]:
    for line in report.splitlines():
        if line.startswith(f"| {first_cell} |"):
            return [cell.strip() for cell in line.strip("|").split("|")]
    raise AssertionError(f"no row {first_cell!r} in:\n{report}")


def published_row(report: str, task: str) -> list[str]:
    """The task's row in the second table (published scores beside this run's)."""
    return table_row(report.split("Published scores of the same tasks:")[1], task)


def test_render_report_puts_our_scores_beside_cited_baselines() -> None:
    report = render_report(results(), BASELINES, {"loss": "loss.png", "gradient norm": "grad_norm.png"})

    assert report.startswith("# Evaluation report: tiny-abc\n")
    for text in ("step-000000006", "2026-11-22T10:00:00+00:00", "912,000", "20,000", "221.40", "5.4000", "2.5700"):
        assert text in report
    # This run's scores: a narrow table of the tasks run, nothing else.
    assert table_row(report, "Task") == ["Task", "Metric", "Shots", "N", "This run"]
    assert table_row(report, "hellaswag") == ["hellaswag", "acc_norm (%)", "0", "50", "27.3 ± 2.1"]
    assert table_row(report, "arc_easy")[4] == "31.4 ± 3.0"
    assert table_row(report, "hlat_cloze")[1:5] == ["acc (%)", "0", "50", "12.0 ± 4.0"]
    # Published scores of the tasks run here, each baseline model a one-letter column named in a legend.
    published = report.split("Published scores of the same tasks:")[1]
    assert table_row(published, "Task") == ["Task", "This run", "A", "B", "C"]
    hellaswag = published_row(report, "hellaswag")
    assert hellaswag[1] == "27.3 ± 2.1"
    assert hellaswag[2] == "77.2"  # same metric and shots: no remark
    assert hellaswag[3] == "61.5 (acc)"
    assert hellaswag[4] == MISSING
    arc = published_row(report, "arc_easy")
    assert arc[1:] == ["31.4 ± 3.0", "75.2 (25-shot)", MISSING, MISSING]
    assert "| hlat_cloze |" not in published.split("\n\n")[1]  # no baseline has it: not in the second table
    assert "- **A:** Big A 7B [^1]" in report and "- **C:** Unrelated [^2]" in report
    # A task only a baseline reports is named on one line, not given a "not run" row.
    assert "| mmlu |" not in report and "not run |" not in report
    assert "Not run here, with published baselines: mmlu." in report

    # Every baseline column is footnoted with its source's title, table and URL.
    for source in ("paper-a", "paper-b"):
        cited = BASELINES["sources"][source]
        footnote = next(line for line in report.splitlines() if cited["url"] in line)
        assert footnote.startswith("[^") and cited["title"] in footnote and cited["where"] in footnote
    assert "Protocol: zero-shot" in report
    assert "shots" in report and "differ" in report
    assert "![loss](loss.png)" in report and "![gradient norm](grad_norm.png)" in report


def test_render_report_without_lm_eval_perplexity_or_baselines() -> None:
    empty = {"note": "", "sources": {}, "models": []}
    report = render_report(results(lm_eval=None, perplexity=None), empty, {}, notes=["No training curves: gone."])
    assert "No lm-eval task was run" in report
    assert "No perplexity evaluation" in report
    assert "_No training curves: gone._" in report
    assert "[^" not in report

    alone = render_report(results(), empty, {})
    assert table_row(alone, "Task") == ["Task", "Metric", "Shots", "N", "This run"]
    assert table_row(alone, "hlat_cloze")[4] == "12.0 ± 4.0"


def test_write_report_writes_report_and_charts_next_to_results(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "tiny-abc", training_lines(range(1, 13), eval_every=6))
    files = write_report(run, results(), BASELINES)

    eval_dir = tmp_path / "tiny-abc" / "eval"
    assert files == {name: str(eval_dir / name) for name in ("loss.png", "grad_norm.png", "report.md")}
    for name in ("loss.png", "grad_norm.png"):
        assert (eval_dir / name).read_bytes().startswith(PNG_SIGNATURE)
    report = (eval_dir / "report.md").read_text()
    assert "(loss.png)" in report and "(grad_norm.png)" in report
    assert "https://example.org/paper-a" in report


def test_write_report_without_metrics_says_so_and_draws_nothing(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "tiny-abc", training_lines(range(1, 5)))
    write_report(run, results(), BASELINES)
    run.storage.remove("metrics.jsonl")

    files = write_report(run, results(), BASELINES)
    assert list(files) == ["report.md"]
    assert sorted(p.name for p in (tmp_path / "tiny-abc" / "eval").iterdir()) == ["report.md"]
    report = run.storage.read_text("eval/report.md")
    assert "metrics.jsonl does not exist" in report
    assert ".png)" not in report
    assert table_row(report, "hlat_cloze")[4] == "12.0 ± 4.0"


# -- comparing runs --------------------------------------------------------------------------------------------


def test_compare_identical_runs_finds_no_difference(tmp_path: Path) -> None:
    lines = training_lines(range(1, 21), eval_every=5)
    a, b = fake_run(tmp_path, "a", lines), fake_run(tmp_path, "b", lines)
    out = Storage(str(tmp_path / "cmp"))

    summary = compare_runs(a, b, out, labels=("reference", "resumed"))
    assert (summary["common_steps"], summary["steps_only_in_a"], summary["steps_only_in_b"]) == (20, 0, 0)
    for key in ("loss", "grad_norm"):
        stats = summary[key]
        assert stats["steps_compared"] == 20
        assert stats["max_abs_diff"] == stats["mean_abs_diff"] == stats["max_rel_diff"] == 0.0
        assert stats["first_divergence_step"] is None
        assert stats["final_step"] == 20 and stats["final_a"] == stats["final_b"]
    assert len(summary["table"]) == 20
    assert all(row["loss_diff"] == 0.0 and row["grad_norm_diff"] == 0.0 for row in summary["table"])
    assert set(summary["files"]) == {"compare-loss.png", "compare-grad_norm.png", "compare.md"}
    for name in ("compare-loss.png", "compare-grad_norm.png"):
        assert (tmp_path / "cmp" / name).read_bytes().startswith(PNG_SIGNATURE)
    markdown = (tmp_path / "cmp" / "compare.md").read_text()
    assert "# Run comparison: reference vs resumed" in markdown
    assert "(compare-loss.png)" in markdown
    json.dumps(summary)  # the summary is plain data, fit for a results file or a Prefect artifact


def test_compare_runs_finds_the_first_divergence(tmp_path: Path) -> None:
    steps = range(1, 101)
    reference = training_lines(steps)
    # Identical to float noise until step 40, then drifting 1 % a step.
    drifted = training_lines(
        steps, loss=lambda s: (8.0 * 0.97**s + 2.0) * (1 + 1e-7 + (0.01 * (s - 39) if s >= 40 else 0))
    )
    out = Storage(str(tmp_path / "cmp"))
    summary = compare_runs(fake_run(tmp_path, "a", reference), fake_run(tmp_path, "b", drifted), out)

    loss = summary["loss"]
    assert loss["first_divergence_step"] == 40
    assert loss["max_rel_diff"] > 0.3
    assert loss["final_b"] > loss["final_a"]
    assert summary["grad_norm"]["first_divergence_step"] is None
    row = summary["table"][39]
    assert row["step"] == 40 and math.isclose(row["loss_diff"], row["loss_b"] - row["loss_a"])
    # The step-by-step table in compare.md samples about 20 steps, and always shows where the runs part.
    markdown = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| First step with relative difference > 0.001 | 40 | none |" in markdown
    assert "\n| 40 | " in markdown.split("## Step by step")[1]
    # What `hlat compare` prints: rounded figures, no float's repr (`final 5.776839256286621 vs 5.9185028076171875`).
    line = compare_line("loss", loss)
    assert line.startswith(f"loss: final {loss['final_a']:.4f} vs {loss['final_b']:.4f}, max |diff| "), line
    assert f"max rel diff {loss['max_rel_diff']:.2%}, first divergence (>1e-3 rel) at step 40" in line
    assert all(len(figure.rstrip(",%")) < 10 for figure in line.split() if figure[:1].isdigit()), line
    assert compare_line("grad_norm", summary["grad_norm"]).endswith("at step none")


def test_compare_runs_counts_partial_overlap_and_writes_a_short_table(tmp_path: Path) -> None:
    a = fake_run(tmp_path, "a", training_lines(range(1, 81)))
    b = fake_run(tmp_path, "b", training_lines(range(51, 131)))
    out = Storage(str(tmp_path / "cmp"))
    summary = compare_runs(a, b, out)

    assert (summary["common_steps"], summary["steps_only_in_a"], summary["steps_only_in_b"]) == (30, 50, 50)
    assert [row["step"] for row in summary["table"]] == list(range(51, 81))
    markdown = (tmp_path / "cmp" / "compare.md").read_text()
    steps = [
        int(line.split("|")[1]) for line in markdown.split("## Step by step")[1].splitlines() if line[2:3].isdigit()
    ]
    assert 10 <= len(steps) <= 21
    assert steps[0] == 51 and steps[-1] == 80 and steps == sorted(steps)


def test_compare_runs_a_null_loss_in_one_run_is_a_divergence(tmp_path: Path) -> None:
    lines = training_lines(range(1, 11))
    broken = [dict(line, loss=None) if line["step"] >= 7 else line for line in lines]
    summary = compare_runs(fake_run(tmp_path, "a", lines), fake_run(tmp_path, "b", broken), None)
    assert summary["files"] == {}
    assert summary["loss"]["first_divergence_step"] == 7
    assert summary["loss"]["steps_compared"] == 6 and summary["loss"]["max_abs_diff"] == 0.0
    assert summary["table"][6]["loss_diff"] is None


def test_compare_runs_without_a_common_step_is_an_error(tmp_path: Path) -> None:
    a = fake_run(tmp_path, "a", training_lines(range(1, 11)))
    b = fake_run(tmp_path, "b", training_lines(range(11, 21)))
    with pytest.raises(ValueError, match="share no step") as info:
        compare_runs(a, b, None)
    assert str(tmp_path / "a" / "metrics.jsonl") in str(info.value)
    with pytest.raises(ValueError, match="labels must differ"):
        compare_runs(a, a, None, labels=("A", "A"))


def test_the_report_tabulates_every_evaluated_checkpoint(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "run", [{"step": s, "loss": 5.0 - s / 10, "grad_norm": 1.0} for s in range(1, 7)])
    early = results(step=3, perplexity={"perplexity": 300.0, "bits_per_byte": 2.9})
    run.storage.write_json("eval/step-000000003/results.json", early)
    run.storage.write_json("eval/step-000000006/results.json", results())
    assert [(r["step"], r["perplexity"]) for r in evaluation_history(run)] == [(3, 300.0), (6, 221.4)]
    assert evaluation_history(run)[0]["hlat_cloze acc"] == 0.12
    write_report(run, results(), BASELINES)
    report = run.storage.read_text("eval/report.md")
    assert "## Checkpoints evaluated" in report
    assert table_row(report, "3")[1] == "300" and table_row(report, "6")[1] == "221.4"
    run.storage.remove("eval/step-000000003", recursive=True)
    write_report(run, results(), BASELINES)
    assert "Checkpoints evaluated" not in run.storage.read_text("eval/report.md")  # one checkpoint: nothing to trace


def test_the_evaluation_job_and_stage_log_rounded_scores() -> None:
    """The job used to log its raw result dict (`'perplexity': 266.55239442907276`)."""
    from hlat.tasks.evaluate import evaluation_summary
    from hlat.training.evaluate import perplexity_line

    result = {"tokens": 12288, "documents": 40, "nll_per_token": 5.585, "perplexity": 266.55239442907276,
              "bits_per_byte": 2.63812345}  # fmt: skip
    assert perplexity_line(result) == (
        "perplexity 266.55 (5.5850 nats/token, 2.6381 bits/byte) over 12,288 tokens of 40 documents"
    )
    assert perplexity_line({**result, "perplexity": None}).startswith("perplexity overflowed (5.5850 nats/token")
    assert evaluation_summary({"perplexity": result}) == "perplexity 266.55, 2.638 bits/byte"
    assert (
        evaluation_summary({"perplexity": {**result, "perplexity": None}}) == "perplexity overflowed, 2.638 bits/byte"
    )
