"""Deployments for real: docs/deployments.md's block, pasted as written, starts a `prefect server`, registers the
tiny deployments with `hlat deploy`, starts a process worker with `hlat worker` and runs the tiny DAG through it
with `prefect deployment run` (the fixture in conftest.py). The tests check that block's output and its run, then
drive its server and worker further, as users drive the pipeline: every deployment registered, a stage re-run alone,
a run cancelled, and from the Prefect UI in headless Chromium (the last tests).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hlat.core.run import Run
from tests.conftest import SMALL_DATA
from tests.e2e.conftest import ROOT, DeploymentsBlock, api, prefect, wait_until
from tests.jobs import make_run, processes_mentioning

pytestmark = pytest.mark.slow

STAGES = ("prepare-data", "train-tokenizer", "precompile", "burn-in", "train", "evaluate")
DEPLOYMENTS = [
    *(f"hlat/pretrain-{p}" for p in ("tiny", "7b", "70b", "pythia-6.9b", "neox-20b")),
    *(f"{stage}/{stage}-{size}" for size in ("tiny", "7b") for stage in STAGES),
]


def run_states(env: dict[str, str]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Flow-run names with their states, and task-run (name, state) oldest first, read from the server."""
    from prefect.client.schemas.sorting import TaskRunSort

    with api(env) as client:
        flow_runs = client.read_flow_runs(limit=50)
        task_runs = client.read_task_runs(sort=TaskRunSort.EXPECTED_START_TIME_ASC, limit=200)
    flows = [(r.name, r.state.name if r.state else "?") for r in flow_runs]
    return flows, [(t.name, t.state.name if t.state else "?") for t in task_runs]


def test_the_docs_deployments_block_works_as_written(deployments_block: DeploymentsBlock) -> None:
    out, run = deployments_block.out, deployments_block.run
    assert "Traceback" not in out, out[-6000:]
    assert "work pool 'hlat': created (type process)" in out
    assert out.count("Flow run finished successfully in 'Completed'") == 3, out[-6000:]
    assert (run / "checkpoints" / "step-000000800").is_dir() and (run / "eval" / "report.md").is_file()


def test_hlat_deploy_registers_every_deployment_with_forms_pull_steps_and_paused_schedules(
    prefect_env: dict[str, str], deployed: str
) -> None:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterTags

    assert "work pool 'hlat': exists (type process)" in deployed  # the block created it
    with api(prefect_env) as client:
        pool = client.read_work_pool("hlat")
        deployments = {d.name: d for d in client.read_deployments(limit=100)}
        flows = {f.id: f.name for f in client.read_flows(limit=100)}
        stages = client.read_deployments(deployment_filter=DeploymentFilter(tags=DeploymentFilterTags(all_=["stage"])))
    assert pool.type == "process"
    assert sorted(f"{flows[d.flow_id]}/{name}" for name, d in deployments.items()) == sorted(DEPLOYMENTS)
    assert len(stages) == 12 and {d.work_pool_name for d in deployments.values()} == {"hlat"}

    # Parameters are forms: the preset a choice, overrides a model of typed, described config fields.
    schema = deployments["evaluate-7b"].parameter_openapi_schema
    assert schema["properties"]["preset"]["enum"] == ["tiny", "hlat-7b", "hlat-70b", "pythia-6.9b", "neox-20b"]
    assert list(schema["properties"]) == ["preset", "run_id", "storage", "overrides", "step", "averaged"]
    # Optional parameters: their type alone, no null default for the UI to fill in and then refuse.
    for name, kind in (("run_id", "string"), ("storage", "string"), ("step", "integer")):
        assert schema["properties"][name]["type"] == kind and "default" not in schema["properties"][name]
    form = schema["definitions"]["Overrides"]["properties"]
    assert form["training.max_steps"]["description"].startswith("Optimizer steps to train. Empty: the preset's")
    assert (form["training.max_steps"]["type"], form["training.max_steps"]["minimum"]) == ("integer", 1)

    # The AWS deployments: S3 storage and the role's Secret block filled in; the code where the pool's workers have
    # it (this checkout on a process pool, the worker image's /opt/hlat on an ecs one: no git remote); paused
    # schedules. The tiny ones run from HLAT_PROJECT_DIR (the block's copy of the project).
    seven = deployments["pretrain-7b"]
    assert seven.parameters == {
        "preset": "hlat-7b",
        "storage": "s3://hlat-e2e-bucket/runs",
        "overrides": {"job.role_arn_secret": "hlat-sagemaker-role"},
    }
    assert seven.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    nightly = deployments["evaluate-7b"].schedules
    assert [(s.schedule.cron, s.active) for s in nightly] == [("0 2 * * *", False)]  # type: ignore[union-attr]
    tiny = deployments["pretrain-tiny"]
    assert tiny.parameters == {"preset": "tiny", "storage": "./runs"}
    copy = prefect_env["HLAT_PROJECT_DIR"]
    assert tiny.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": copy}}]


def test_production_pool_types_are_created_with_their_workers_templates(prefect_env: dict[str, str]) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from hlat.deploy import DeployError, ensure_pool

    with temporary_settings({PREFECT_API_URL: prefect_env["PREFECT_API_URL"]}):
        assert ensure_pool("hlat-ecs", "ecs", prefect_env) == "created (type ecs)"
        assert ensure_pool("hlat-ecs", "ecs", prefect_env) == "exists (type ecs)"
        with pytest.raises(DeployError, match="exists with type ecs, not process: use --type ecs"):
            ensure_pool("hlat-ecs", "process", prefect_env)
    with api(prefect_env) as client:
        template = client.read_work_pool("hlat-ecs").base_job_template
    assert {"image", "cluster", "task_role_arn", "cpu", "memory"} <= set(template["variables"]["properties"])


def flow_runs_named(env: dict[str, str], name: str) -> list[Any]:
    """The flow runs called `name` (`<flow>/<run id>`), oldest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with api(env) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    return sorted(runs, key=lambda r: r.created)


def test_the_blocks_dag_ran_every_stage_and_a_stage_rerun_alone_is_cached(
    prefect_env: dict[str, str], deployments_block: DeploymentsBlock
) -> None:
    env, run = prefect_env, deployments_block.run
    assert (run / "data/manifest.json").is_file() and (run / "tokenizer/tokenizer.model").is_file()
    assert (run / "checkpoints/step-000000800/COMMITTED").is_file()  # the DAG's 600 steps, then the block's train
    assert json.loads((run / "eval/results.json").read_text())["step"] == 800 and (run / "eval/report.md").is_file()
    model = (run / "tokenizer/tokenizer.model").read_bytes()

    # A stage re-run alone from its own deployment finds its work cached and leaves the outputs as they were.
    # (With the block's overrides: the run's config is now the extended one, and a stage of it takes the same.)
    extended = "overrides=" + json.dumps({"training.max_steps": 800, "training.schedule_steps": 600})
    rerun = ["--param", "run_id=demo-ui", "--param", extended, "--watch"]
    prefect(env, "deployment", "run", "train-tokenizer/train-tokenizer-tiny", *rerun)
    assert (run / "tokenizer/tokenizer.model").read_bytes() == model
    flows, tasks = run_states(env)
    flows = [(name, state) for name, state in flows if name.endswith("/demo-ui")]
    assert sorted(name for name, _ in flows) == [
        "burn-in/demo-ui",
        "evaluate/demo-ui",
        "evaluate/demo-ui",
        "hlat/demo-ui",
        "precompile/demo-ui",
        "prepare-data/demo-ui",
        "train-tokenizer/demo-ui",
        "train-tokenizer/demo-ui",
        "train/demo-ui",
        "train/demo-ui",
    ]
    assert {state for _, state in flows} == {"Completed"}
    assert [state for name, state in tasks if name.startswith("fit-tokenizer")] == ["Completed", "Cached"]


def test_cancelling_a_train_run_stops_its_job(prefect_env: dict[str, str], prepared: Path, tmp_path: Path) -> None:
    """Cancel from the API (as from the UI) while the job trains on the block's worker: the job is stopped, no
    process is left."""
    from hlat.infra.backends.local import LocalBackend
    from hlat.infra.supervision.ledger import Ledger

    training = {"max_steps": 5000, "checkpoint_every": 50, "eval_every": 0, "log_every": 1}
    run = make_run(prepared, tmp_path / "runs", "cancel", **training)
    overrides = {**SMALL_DATA, **{f"training.{k}": v for k, v in training.items()}}
    params = ["--param", f"storage={tmp_path / 'runs'}", "--param", "run_id=cancel"]
    out = prefect(
        prefect_env, "deployment", "run", "train/train-tiny", *params, "--param", f"overrides={json.dumps(overrides)}"
    )
    match = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout)
    assert match, out.stdout
    flow_run_id = match[1]
    ledger, backend = Ledger(Run.at(str(run)), "train"), LocalBackend(str(run / "jobs"))

    def training_steps() -> bool:
        attempts = ledger.load()
        return bool(attempts) and any(" step 3 loss" in line for line in backend.logs(attempts[0].job_name)[0])

    wait_until(training_steps, 240, "the job to train a few steps")
    name = ledger.load()[0].job_name
    prefect(prefect_env, "flow-run", "cancel", flow_run_id)

    def flow_state() -> str:
        with api(prefect_env) as client:
            state = client.read_flow_run(flow_run_id).state
        return state.name if state else "?"

    wait_until(lambda: flow_state() == "Cancelled", 120, "the flow run to be cancelled")
    wait_until(lambda: (s := backend.describe(name)) is not None and s.terminal, 120, "the job to stop")
    state = backend.describe(name)
    assert state is not None and state.status.value == "Stopped"
    assert processes_mentioning(str(run)) == []


# -- The Prefect UI in a real browser --------------------------------------------------------------------------
# Headless Chromium (Debian's package, driven by Playwright through `executable_path`; Playwright downloads no
# browser) finds the hlat deployments, starts a stage from its deployment's Custom run form with one parameter
# changed, and the run completes on the worker; the flow run's page, graph included, is saved as
# test-artifacts/ui/flow-run-graph.png. Without Chromium the test is skipped, unless HLAT_REQUIRE_BROWSER=1 (CI
# sets it: there it must run). It shares this module's server, deployments and worker (the block's).

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
    prefect_env: dict[str, str], deployed: str, page: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

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
    deployment_id = page.url.rsplit("/", 1)[1]

    # Run > Custom run: the form shows the parameters; change one (storage) and submit.
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Custom run", exact=True).click()
    page.wait_for_url(re.compile(r".*/run(\?.*)?$"))
    page.get_by_text("Named preset the run starts from").wait_for()  # the parameter descriptions are shown
    page.get_by_text("training.max_steps", exact=False).first.wait_for()  # the overrides form's typed fields
    page.get_by_text("tiny 600 · hlat-7b 429,000", exact=False).first.wait_for()  # each preset's value
    assert "Property is type" not in page.content()  # no optional field stuck on a "None" type switch
    # The storage field shows the deployment's value (its text box is found by that value: the form's layout
    # varies between UI versions).
    boxes = page.locator("textarea, input[type=text]")
    found = [boxes.nth(i) for i in range(boxes.count()) if boxes.nth(i).input_value() == "./runs"]
    assert len(found) == 1, [boxes.nth(i).input_value() for i in range(boxes.count())]
    storage_box = found[0]
    storage = tmp_path / "from-the-ui"
    # Typed in and left (Tab), as a user does, and read back before Submit: the form takes a value it has been
    # given, and a submit that raced the field's update sent the deployment's "./runs" (CI saw no flow run with
    # the typed storage appear in 120 s; the run the form made is now found by its deployment, whatever it holds).
    storage_box.fill(str(storage))
    storage_box.press("Tab")
    expect(storage_box).to_have_value(str(storage))
    page.wait_for_load_state("networkidle")

    def runs_of_the_deployment() -> list[Any]:
        with api(prefect_env) as client:
            of_it = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
            return client.read_flow_runs(deployment_filter=of_it)

    before = {r.id for r in runs_of_the_deployment()}
    page.get_by_role("button", name="Submit").click()

    # The form created one flow run (found through the API: the toast that links to it can be gone before it is
    # looked for, as a loaded CI machine showed) with the storage typed in; its page opens, and the worker runs it.
    def created() -> list[Any]:
        return [r for r in runs_of_the_deployment() if r.id not in before]

    try:
        wait_until(lambda: bool(created()), 120, "the flow run the form submitted")
    except TimeoutError:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "custom-run-form-not-submitted.png"))
        raise
    (made,) = created()
    assert made.parameters.get("storage") == str(storage), made.parameters
    flow_run_id = str(made.id)
    page.goto(f"{ui}/runs/flow-run/{flow_run_id}", wait_until="networkidle")

    def state() -> str:
        with api(prefect_env) as client:
            run = client.read_flow_run(flow_run_id)
        return run.state.type.value if run.state else "?"

    wait_until(lambda: state() in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"), 300, "the flow run to finish")
    with api(prefect_env) as client:
        run = client.read_flow_run(flow_run_id)
    assert run.state is not None and run.state.is_completed(), run.state
    assert run.parameters["storage"] == str(storage) and run.parameters["preset"] == "tiny"
    (run_dir,) = [p for p in storage.iterdir() if p.is_dir() and p.name != "sources"]  # sources/: prepared data
    manifest = json.loads((run_dir / "data" / "manifest.json").read_text())
    assert manifest["sources"] and manifest["sources"][0]["train_rows"], manifest

    # The finished run's page: its state and its graph of task runs.
    page.reload(wait_until="networkidle")
    page.get_by_text("Completed").first.wait_for()
    page.wait_for_timeout(2000)  # the graph draws on a canvas after the data arrives
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "flow-run-graph.png"
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 20_000


def test_the_ui_shows_the_stage_chain_one_card_per_artifact_and_the_reports_images(
    prefect_env: dict[str, str], page: Any
) -> None:
    ui = prefect_env["PREFECT_UI_URL"]
    page.set_default_timeout(60_000)
    (parent,) = flow_runs_named(prefect_env, "hlat/demo-ui")
    train = str(flow_runs_named(prefect_env, "train/demo-ui")[0].id)  # the DAG's train (the block then trains on)
    with api(prefect_env) as client:
        artifacts = client.read_artifacts(limit=200)

    # The parent run's graph, as the page fetches it, chains the six stages in order.
    with page.expect_response(lambda r: r.url.endswith(f"/flow_runs/{parent.id}/graph-v2")) as graph:
        page.goto(f"{ui}/runs/flow-run/{parent.id}", wait_until="networkidle")
    nodes = dict(graph.value.json()["nodes"])
    stages = {i: n["label"].split(" / ")[0] for i, n in nodes.items() if n["kind"] == "flow-run"}
    edges = {(stages[p["id"]], stages[i]) for i in stages for p in nodes[i]["parents"] if p["id"] in stages}
    assert edges == set(itertools.pairwise(STAGES))
    page.wait_for_timeout(2000)  # the graph draws on a canvas after the data arrives
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dag-graph.png"))

    # The train run's Artifacts tab: one card per key (an updated table is one artifact, not one per version).
    train_keys = sorted(a.key for a in artifacts if str(a.flow_run_id) == train)
    assert train_keys == ["train-attempts-demo-ui", "train-progress-demo-ui", "training-report-demo-ui"]
    page.goto(f"{ui}/runs/flow-run/{train}", wait_until="networkidle")
    page.locator("li.p-tab", has_text="Artifacts").click()
    cards = page.locator(".artifact-card .artifact-card__title")
    cards.first.wait_for()
    assert sorted(cards.all_inner_texts()) == train_keys

    # The evaluation report renders with its images loaded (embedded, not links to files the UI cannot reach).
    # (The block evaluates twice, the DAG's 600 steps then its 800: the newest version.)
    report = max((a for a in artifacts if a.key == "eval-report-demo-ui"), key=lambda a: a.created)
    page.goto(f"{ui}/artifacts/artifact/{report.id}", wait_until="networkidle")
    page.get_by_text("Evaluation report: demo-ui").wait_for()
    page.wait_for_function("Array.from(document.images).every(i => i.complete)")
    images = page.evaluate("Array.from(document.images).map(i => [i.src.slice(0, 22), i.naturalWidth])")
    assert images and all(src == "data:image/png;base64," and width > 0 for src, width in images), images
    assert page.locator("td", has_text="not run").count() == 0  # the suite it did not run is one line, not rows
    page.screenshot(path=str(ARTIFACTS / "eval-report.png"))
