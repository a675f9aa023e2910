"""The Prefect UI, in a real browser: headless Chromium (Debian's package, driven by Playwright through
`executable_path`; Playwright downloads no browser) finds the hlat deployments, starts a stage from its
deployment's Custom run form with one parameter changed, and the run completes on the worker. The flow run's
page, graph included, is saved as test-artifacts/ui/flow-run-graph.png.

Without Chromium the test is skipped, unless HLAT_REQUIRE_BROWSER=1 (CI sets it: there it must run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import ROOT, Started, api, wait_until

pytestmark = pytest.mark.slow

ARTIFACTS = ROOT / "test-artifacts" / "ui"
# As the machine's own Chromium check starts it: no sandbox as root, and nothing fetched in the background.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str | None:
    return os.environ.get("HLAT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    executable = chromium()
    if executable is None:
        if os.environ.get("HLAT_REQUIRE_BROWSER") == "1":
            pytest.fail("HLAT_REQUIRE_BROWSER=1 but no chromium: apt-get install chromium (scripts/install.sh dev)")
        pytest.skip("no chromium on PATH (scripts/install.sh dev installs Debian's package where it can)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        try:
            yield context.new_page()
        finally:
            context.close()
            browser.close()


def test_a_stage_started_from_the_ui_form_completes(
    prefect_env: dict[str, str], worker: Started, page: Any, tmp_path: Path
) -> None:
    ui = prefect_env["PREFECT_UI_URL"]
    page.set_default_timeout(60_000)

    # The deployments page lists the hlat deployments (searched by name: the list pages ten at a time).
    page.goto(f"{ui}/deployments", wait_until="networkidle")
    page.get_by_placeholder("Search deployments").fill("pretrain")
    for preset in ("tiny", "7b", "70b", "pythia-6.9b", "neox-20b"):
        page.get_by_role("link", name=f"pretrain-{preset}", exact=True).wait_for()
    page.get_by_placeholder("Search deployments").fill("prepare-data-tiny")
    page.get_by_role("link", name="prepare-data-tiny", exact=True).click()
    page.wait_for_url(re.compile(r".*/deployments/deployment/[0-9a-f-]{36}$"))

    # Run > Custom run: the form shows the parameters; change one (storage) and submit.
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Custom run", exact=True).click()
    page.wait_for_url(re.compile(r".*/run(\?.*)?$"))
    page.get_by_text("Named preset the run starts from").wait_for()  # the parameter descriptions are shown
    page.get_by_text("training.max_steps", exact=False).first.wait_for()  # the overrides form's typed fields
    storage_box = page.locator("textarea").filter(has_text="./runs")
    if storage_box.count() == 0:  # the textarea's value is not its text in every UI version
        storage_box = page.locator("textarea").nth(0)
    assert storage_box.input_value() == "./runs"
    storage = tmp_path / "from-the-ui"
    storage_box.fill(str(storage))
    page.get_by_role("button", name="Submit").click()

    # The toast's "View run" opens the new flow run; the worker runs it to completion.
    page.get_by_role("button", name="View run").first.dispatch_event("click")  # the toast overlays its button
    page.wait_for_url(re.compile(r".*/runs/flow-run/[0-9a-f-]{36}$"))
    flow_run_id = page.url.rsplit("/", 1)[-1]

    def state() -> str:
        with api(prefect_env) as client:
            run = client.read_flow_run(flow_run_id)
        return run.state.type.value if run.state else "?"

    wait_until(lambda: state() in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"), 300, "the flow run to finish")
    with api(prefect_env) as client:
        run = client.read_flow_run(flow_run_id)
    assert run.state is not None and run.state.is_completed(), run.state
    assert run.parameters["storage"] == str(storage) and run.parameters["preset"] == "tiny"
    (run_dir,) = [p for p in storage.iterdir() if p.is_dir()]
    manifest = json.loads((run_dir / "data" / "manifest.json").read_text())
    assert manifest["shards"], manifest

    # The finished run's page: its state and its graph of task runs.
    page.reload(wait_until="networkidle")
    page.get_by_text("Completed").first.wait_for()
    page.wait_for_timeout(2000)  # the graph draws on a canvas after the data arrives
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "flow-run-graph.png"
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 20_000
