"""The evaluation report as the Prefect UI shows it: charts embedded in the artifact, narrow tables, and only
the tasks that were run."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import pytest
from PIL import Image

from hlat.core.presets import HLAT_EVAL_TASKS
from hlat.core.storage import Storage
from hlat.infra.reports.eval_report import UI_IMAGE_WIDTH, embed_images, load_baselines, render_report, write_report
from tests.unit.test_eval_report import fake_run, results, training_lines

DATA_URI = re.compile(r"!\[(?P<caption>[^\]]*)\]\(data:image/png;base64,(?P<data>[A-Za-z0-9+/=]+)\)")


def tables(report: str) -> list[list[list[str]]]:
    """Every markdown table of the report, as rows of cells."""
    found: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*report.splitlines(), ""]:
        if line.startswith("|"):
            current.append([cell.strip() for cell in line.strip("|").split("|")])
        elif current:
            found.append(current)
            current = []
    return found


def offline_tasks_only() -> dict[str, object]:
    r = results()
    r["lm_eval"]["tasks"] = {  # type: ignore[index]
        "hlat_cloze": {"metrics": {"acc": 0.12, "acc_stderr": 0.04}, "n_samples": 50, "num_fewshot": 0},
        "hlat_choice": {"metrics": {"acc": 0.31, "acc_stderr": 0.05}, "n_samples": 50, "num_fewshot": 0},
    }
    return r


def test_a_tiny_report_shows_the_tasks_it_ran_and_names_the_others_on_one_line() -> None:
    report = render_report(offline_tasks_only(), load_baselines(), {})
    benchmarks = report.split("## Benchmarks")[1].split("## Training curves")[0]
    assert "not run" not in benchmarks.lower().replace("not run here", "")
    [table] = tables(benchmarks)
    assert [row[0] for row in table[2:]] == ["hlat_choice", "hlat_cloze"]
    [line] = [line for line in benchmarks.splitlines() if line.startswith("Not run here")]
    for task in HLAT_EVAL_TASKS:
        assert task in line
    # No published table, so no legend or citations of models nothing is compared with.
    assert "[^" not in benchmarks and "Published scores" not in benchmarks


def test_the_full_suite_beside_every_baseline_stays_narrow() -> None:
    r = results()
    r["lm_eval"]["tasks"] = {  # type: ignore[index]
        task: {"metrics": {"acc": 0.3, "acc_stderr": 0.02}, "n_samples": 100, "num_fewshot": 0}
        for task in HLAT_EVAL_TASKS
    }
    baselines = load_baselines()
    report = render_report(r, baselines, {})
    ours, published = tables(report.split("## Benchmarks")[1])
    assert len(ours) - 2 == len(published) - 2 == len(HLAT_EVAL_TASKS)
    # The old single table had 5 + one column per model, each headed by the model's full name.
    assert len(published[0]) == 2 + len(baselines["models"]) and len(published[0]) <= 8
    assert all(len(cell) <= 8 for cell in published[0])
    widest = max(len(line) for line in report.splitlines() if line.startswith("|"))
    assert widest < 120, widest
    for label, model in zip(published[0][2:], baselines["models"], strict=True):
        assert f"- **{label}:** {model['model']} [^" in report
    assert "Not run here" not in report


def test_the_artifact_embeds_small_charts_and_report_md_keeps_its_files(tmp_path: Path) -> None:
    run = fake_run(tmp_path, "tiny-abc", training_lines(range(1, 60), eval_every=10))
    write_report(run, results(), load_baselines())
    on_disk = run.storage.read_text("eval/report.md")
    assert "](loss.png)" in on_disk and "](grad_norm.png)" in on_disk

    ui = embed_images(on_disk, run.storage.child("eval"))
    assert ".png)" not in ui
    images = list(DATA_URI.finditer(ui))
    assert [m.group("caption") for m in images] == ["loss (training; validation dashed)", "gradient norm"]
    for match in images:
        png = base64.b64decode(match.group("data"))
        with Image.open(io.BytesIO(png)) as image:
            assert image.format == "PNG" and image.width == UI_IMAGE_WIDTH
        assert len(png) < 40_000  # small enough for an artifact: a fraction of the full-size file
    assert ui.replace(images[0].group(0), "").count("data:image") == 1


def test_a_missing_chart_stays_a_link_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = Storage(str(tmp_path))
    assert embed_images("![loss](loss.png)", folder) == "![loss](loss.png)"
    assert "loss.png is not in" in caplog.text


def test_the_published_artifact_carries_its_images(prefect_server: None, tmp_path: Path) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from hlat.tasks.evaluate import publish_eval_report

    run = fake_run(tmp_path, "report-ui", training_lines(range(1, 30), eval_every=10))
    write_report(run, results(), load_baselines())
    flow(name="publish-report")(publish_eval_report)(run, results(), "report-ui")  # artifacts belong to a flow run
    with get_client(sync_client=True) as client:
        [artifact] = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["eval-report-report-ui"]))
        )
    markdown = str(artifact.data)
    assert len(DATA_URI.findall(markdown)) == 2 and "](loss.png)" not in markdown
    assert f"`{run.storage.uri('eval')}/`" in markdown
