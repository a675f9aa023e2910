"""The stage flows and the parent flow `hlat` on a real (temporary) Prefect server."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.config import ConfigError
from hlat.flows.params import STEP, OptionalStep
from tests.conftest import SMALL_RUN
from tests.jobs import task_states

pytestmark = pytest.mark.slow


def artifact_keys() -> set[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {a.key for a in client.read_artifacts(limit=200) if a.key}


def artifacts_of(key: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=50)


def stage_edges(flow_run_id: Any) -> set[tuple[str, str]]:
    """(upstream, downstream) names of the edges into subflow runs in a flow run's graph, as the UI draws it
    (upstream: a subflow's flow name, or a task run's name)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        graph = client._client.get(f"/flow_runs/{flow_run_id}/graph-v2").json()
    nodes = dict(graph["nodes"])
    names = {i: n["label"].split(" / ")[0].rsplit("-", 1)[0] if n["kind"] == "task-run" else n["label"].split(" / ")[0]
             for i, n in nodes.items()}  # fmt: skip
    flows = {i for i, n in nodes.items() if n["kind"] == "flow-run"}
    return {(names[p["id"]], names[i]) for i in flows for p in nodes[i]["parents"] if p["id"] in names}


def config_builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The preset of each config built from a preset and overrides (core.presets.load_config) from now on."""
    import hlat.core.presets as presets

    built: list[str] = []
    apply = presets.apply_overrides

    def counted(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
        built.append(data.get("preset", "?"))
        return apply(data, overrides)

    monkeypatch.setattr(presets, "apply_overrides", counted)
    return built


def test_hlat_runs_both_stages_then_a_rerun_skips_them(
    prefect_server: None, tmp_path: Path, small_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hlat.flows.pretrain import hlat

    built = config_builds(monkeypatch)
    state = hlat(preset="tiny", overrides=small_run, storage=str(tmp_path), return_state=True)
    first = state.result()
    # The config is built once, by the parent flow; its six stages are handed the run (id, storage, config).
    assert built == ["tiny"]
    run = tmp_path / first["run_id"]
    # The parent run's graph (the UI's) chains the six stages in order: no edge from the open-run task into each.
    chain = ["prepare-data", "train-tokenizer", "precompile", "burn-in", "train", "evaluate"]
    assert stage_edges(state.state_details.flow_run_id) == set(itertools.pairwise(chain))
    assert (run / "config.json").exists()
    assert (
        first["prepare-data"]["rows_read"]
        == first["prepare-data"]["rows_kept"] + first["prepare-data"]["rows_quarantined"]
        == 300
    )
    for rel in (
        "data/manifest.json",
        "data/report.json",
        "tokenizer/tokenizer.model",
        "tokenizer/report.json",
    ):
        assert (run / rel).is_file(), rel
    assert first["train-tokenizer"]["vocab_size"] == 512
    assert artifact_keys() >= {f"data-report-{first['run_id']}", f"tokenizer-report-{first['run_id']}"}
    # The parent run's progress: one artifact, updated in place through the six stages.
    progress = artifacts_of(f"pretrain-progress-{first['run_id']}")
    assert len(progress) == 1 and progress[0].data == 100.0
    assert progress[0].description == "6 of 6 stages done"
    # Each source is prepared beside the runs (<storage>/sources/<name>-<key>/), its units committed once.
    commits = {p: p.stat().st_mtime_ns for p in (tmp_path / "sources").rglob("unit.json")}
    assert commits
    model_bytes = (run / "tokenizer/tokenizer.model").read_bytes()

    second = hlat(preset="tiny", overrides=small_run, storage=str(tmp_path))
    assert second["run_id"] == first["run_id"] and second["prepare-data"] == first["prepare-data"]
    assert task_states("build-shards")[-1] == "Cached" and task_states("fit-tokenizer")[-1] == "Cached"
    # nothing was rewritten: a new attempt would have committed its units again
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "sources").rglob("unit.json")} == commits
    assert (run / "tokenizer/tokenizer.model").read_bytes() == model_bytes

    # outputs deleted behind the cache's back are rebuilt, not trusted; `hlat pretrain` builds the config once (the
    # CLI's, handed to the flow it runs) and prints the run's summary
    from hlat.cli import _dispatch, build_parser

    shutil.rmtree(run / "tokenizer")
    built.clear()
    sets = [a for k, v in small_run.items() for a in ("--set", f"{k}={v}")]
    args = build_parser().parse_args(["pretrain", "--preset", "tiny", "--storage", str(tmp_path), *sets])
    assert _dispatch(args) == 0
    assert built == ["tiny"]
    assert (run / "tokenizer/tokenizer.model").read_bytes() == model_bytes
    assert "vocab_size" in json.loads((run / "tokenizer/report.json").read_text())


def test_stages_run_alone_and_refuse_a_changed_config(
    prefect_server: None, tmp_path: Path, small_run: dict[str, Any]
) -> None:
    from hlat.core.storage import StorageNotFound
    from hlat.flows.prepare_data import prepare_data
    from hlat.flows.train_tokenizer import train_tokenizer

    with pytest.raises(StorageNotFound, match="run the prepare-data stage for this run first"):
        train_tokenizer(preset="tiny", overrides=small_run, run_id="alone", storage=str(tmp_path))
    report = prepare_data(preset="tiny", overrides=small_run, run_id="alone", storage=str(tmp_path))
    assert report.rows_kept > 200
    tok = train_tokenizer(preset="tiny", overrides=small_run, run_id="alone", storage=str(tmp_path))
    assert tok["vocab_size"] == 512

    changed = {**small_run, "training.lr": 5e-3}
    with pytest.raises(ConfigError, match=r"run 'alone' .* different config \(training.lr: 0.002 -> 0.005\)"):
        prepare_data(preset="tiny", overrides=changed, run_id="alone", storage=str(tmp_path))


def test_a_trained_run_is_extended_by_the_train_flow_to_the_weights_of_a_longer_run(
    prefect_server: None, prepared: Path, tmp_path: Path
) -> None:
    """The README's example: more steps for an existing run, on its own schedule (training.schedule_steps kept)."""
    from hlat.flows.train import train
    from tests.jobs import final_weights, make_run
    from tests.jobs import train as train_job

    length = {"training.checkpoint_every": 5, "training.eval_every": 5, "training.eval_batches": 1}
    make_run(prepared, tmp_path, "ext", max_steps=10, **length)
    overrides = {**SMALL_RUN, **length, "training.max_steps": 10}
    assert train(preset="tiny", overrides=overrides, run_id="ext", storage=str(tmp_path))["final_step"] == 10

    with pytest.raises(ConfigError, match=r"also set training.schedule_steps=10"):
        train(preset="tiny", overrides={**overrides, "training.max_steps": 14}, run_id="ext", storage=str(tmp_path))
    longer = {**overrides, "training.max_steps": 14, "training.schedule_steps": 10}
    assert train(preset="tiny", overrides=longer, run_id="ext", storage=str(tmp_path))["final_step"] == 14

    # The same 14 steps trained in one go, on the same schedule: bitwise the same weights.
    straight = make_run(prepared, tmp_path, "straight", max_steps=14, schedule_steps=10, **length)
    assert train_job(straight)[0] == 0
    extended, reference = final_weights(tmp_path / "ext"), final_weights(straight)
    assert extended.keys() == reference.keys()
    assert all(torch.equal(extended[k], reference[k]) for k in reference)


def test_a_runs_overrides_merge_over_its_deployments(prefect_server: None, tmp_path: Path) -> None:
    """`--param overrides=...` on a deployment changes the paths it names and keeps the deployment's others."""
    from prefect.client.orchestration import get_client

    from hlat.flows.params import build_config
    from hlat.flows.stage import merged_overrides
    from hlat.flows.train import train

    def resolve_config(preset: str, overrides: dict[str, Any], deployment_id: Any = None) -> Any:
        return build_config(preset, merged_overrides(overrides, deployment_id), None, None)

    deployment = {"training.lr": 3e-3, "job.max_restarts": 7, "data.max_documents": 300}
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(train)
        deployment_id = client.create_deployment(flow_id, "merge-test", parameters={"overrides": deployment})
    config = resolve_config("tiny", {"training.lr": 1e-3, "training.max_steps": 5}, deployment_id)
    assert (config.training.lr, config.training.max_steps) == (1e-3, 5)  # the run's own
    assert (config.job.max_restarts, config.data.max_documents) == (7, 300)  # the deployment's, kept
    # Without a deployment, the run's overrides are all there is.
    alone = resolve_config("tiny", {"training.max_steps": 5})
    assert (alone.training.lr, alone.job.max_restarts) != (3e-3, 7)


def test_a_stage_flow_is_its_body_under_the_stage_parameters(prefect_server: None, tmp_path: Path) -> None:
    """The one stage-flow template (flows/stage.py: stage_flow): the four parameters then the body's own, the run
    (its config inside) resolved from them; a parameter left out is its default (Prefect resolves the Field
    defaults)."""
    import inspect

    from prefect.utilities.hashing import file_hash

    from hlat.flows.stage import stage_flow

    # A body under a stage's name (the template takes a stage of core/stages.py): evaluate's, with its `step`.
    @stage_flow("evaluate", stops_jobs=False)
    def probe(run, step: OptionalStep = STEP) -> dict[str, Any]:
        """A probe stage."""
        config = run.config
        return {"run": run.run_id, "config": config.run_id, "max_steps": config.training.max_steps, "step": step}

    assert list(inspect.signature(probe.fn).parameters) == ["preset", "run_id", "storage", "overrides", "step"]
    assert (probe.name, probe.description, probe.version) == ("evaluate", "A probe stage.", file_hash(__file__))
    assert probe.on_cancellation_hooks == []
    alone = probe(storage=str(tmp_path))
    assert alone["run"].startswith("tiny-") and alone["config"] == alone["run"] and alone["step"] is None
    assert (tmp_path / alone["run"] / "config.json").is_file()
    given = probe("tiny", "p1", str(tmp_path), {"training.max_steps": 7}, step=3)
    assert given == {"run": "p1", "config": "p1", "max_steps": 7, "step": 3}
    with pytest.raises(TypeError, match=r"takes \(run, \.\.\.\)"):
        stage_flow("train")(lambda preset: preset)
    with pytest.raises(ValueError, match="unknown stage 'probe'"):
        stage_flow("probe")
