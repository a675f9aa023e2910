"""A stage is its row: no code outside core/stages.py and the stage's own modules decides by a stage's name, and a
throwaway stage added as docs/stages.md's "Adding a stage" says is picked up everywhere without another edit."""

from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import importlib.util
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import hlat.core.stages as table
from hlat.core.config import HlatConfig
from hlat.core.presets import load_config
from hlat.core.run import Run, open_run
from hlat.core.stages import STAGES, TRAINING, Stage, stage

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("core", "training", "infra", "tasks", "flows", "hlat")
NAMES = {s.name for s in STAGES}


def own_modules() -> set[Path]:
    """The files allowed to name stages: the table and each stage's flow, tasks and job program."""
    own = {ROOT / "core" / "stages.py"}
    return own | {ROOT / layer / f"{s.module}.py" for s in STAGES for layer in ("flows", "tasks", "training")}


def package_files() -> list[Path]:
    return [p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py")) if p not in own_modules()]


def _names_a_stage(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def _about_splits(nodes: list[ast.expr]) -> bool:
    """'train' is also a data split's name: `split == "train"` and {"train": ..., "validation": ...} are splits."""
    for node in nodes:
        if isinstance(node, ast.Name | ast.Attribute) and (getattr(node, "id", "") or node.attr).endswith("split"):
            return True
        if isinstance(node, ast.Constant) and node.value == "validation":
            return True
    return False


def stage_decisions(source: str) -> list[tuple[int, str]]:
    """Where `source` decides by a stage's name: a comparison with one, or a per-stage table (a dict keyed by stage
    names, a list of two or more)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        parts: list[ast.expr]
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            parts = operands + [e for o in operands if isinstance(o, ast.Tuple | ast.List | ast.Set) for e in o.elts]
            named = any(map(_names_a_stage, parts))
        elif isinstance(node, ast.Dict):
            parts = [k for k in node.keys if k is not None]
            named = any(map(_names_a_stage, parts))
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            parts = list(node.elts)  # names, or pairs that start with one: ("train", image)
            heads = [e.elts[0] if isinstance(e, ast.Tuple) and e.elts else e for e in parts]
            named = sum(map(_names_a_stage, heads)) >= 2
        else:
            continue
        if named and not _about_splits(parts):
            found.append((node.lineno, ast.unparse(node)[:100]))
    return found


def test_the_scan_finds_the_shapes_of_a_stage_branch() -> None:
    branches = (
        'if stage == "evaluate":\n    pass\n',
        'x = "a" if name != "prepare-data" else "b"\n',
        'ok = stage in ("train", "burn-in")\n',
        'IMAGES = {"evaluate": 1}\n',
        'ORDER = ["precompile", "train"]\n',
        'for name, image in (("prepare-data", a), ("train", b)):\n    pass\n',
    )
    for source in branches:
        assert stage_decisions(source), source
    splits = (
        'if split == "train":\n    pass\n',
        'b = {"train": [], "validation": []}\n',
        'job_spec(run, 1, "train")\n',
    )
    for source in splits:
        assert not stage_decisions(source), source


def test_no_module_but_the_table_and_the_stages_own_decides_by_a_stage_name() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{line}: {text}"
        for p in package_files()
        for line, text in stage_decisions(p.read_text())
    ]
    assert not found, "decide by the row's fields (core/stages.py), not the stage's name:\n" + "\n".join(found)
    # The issue's own check, as text: `git grep -nE 'stage ?== ?"'`.
    pattern = re.compile(r'stage ?[!=]= ?"')
    texts = [f"{p.relative_to(ROOT)}: {line}" for p in package_files() for line in p.read_text().splitlines()]
    assert not [t for t in texts if pattern.search(t)]


# -- a throwaway stage, added as docs/stages.md says ------------------------------------------------------------
def _rehearse_done(run: Run, config: HlatConfig) -> bool:
    return run.storage.exists("rehearse/report.json")


def _rehearse_checksum(run: Run) -> str:
    return hashlib.sha256(run.storage.read_bytes("rehearse/report.json")).hexdigest()


REHEARSE = Stage(
    "rehearse",
    "a dress rehearsal on the training's instances",
    ("rehearse/",),
    _rehearse_done,
    runs_on=TRAINING,
    cap_hours=0.5,
    inputs=("train-tokenizer",),
    checksum=_rehearse_checksum,
)
REVIEW = Stage(
    "review",
    "read the rehearsal in the flow's own process",
    ("review.json",),
    lambda run, config: run.storage.exists("review.json"),
    inputs=("rehearse",),
)


def _module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _body(name: str) -> Any:
    def body(run: Run) -> dict[str, Any]:
        return {"stage": name}

    return body


@pytest.fixture
def throwaway(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1, the rows (between burn-in and train); step 2, their files (here modules made in the test)."""
    k = [s.name for s in STAGES].index("train")
    monkeypatch.setattr(table, "STAGES", (*STAGES[:k], REHEARSE, REVIEW, *STAGES[k:]))
    from hlat.flows.stage import stage_flow

    for row in (REHEARSE, REVIEW):
        body = _body(row.name)
        body.__name__ = body.__qualname__ = row.module
        _module(monkeypatch, f"hlat.flows.{row.module}", **{row.module: stage_flow(row.name)(body)})
        _module(monkeypatch, f"hlat.tasks.{row.module}", present=lambda run, r=row: r.done(run, run.config))
    _module(monkeypatch, f"hlat.training.{REHEARSE.module}", main=lambda argv: 0)


def test_the_recipe_is_in_the_docs() -> None:
    text = (ROOT / "docs" / "stages.md").read_text()
    recipe = text.split("## Adding a stage", 1)[1].split("\n## ", 1)[0]
    for step in ("core/stages.py", "flows/<module>.py", "tasks/<module>.py", "training/<module>.py"):
        assert step in recipe, step
    assert "deployments/prefect.yaml" in recipe and "tests/unit/test_stage_rows.py" in recipe


@pytest.mark.usefixtures("throwaway")
def test_a_throwaway_stage_joins_the_dag_the_cli_and_its_job() -> None:
    from hlat.cli import build_parser
    from hlat.commands.flows import flow_call
    from hlat.flows.pretrain import chain
    from hlat.infra.backends.sagemaker_source import requirements_of
    from hlat.infra.backends.sagemaker_validation import _config_field
    from hlat.infra.checks.capacity import instance_needs, own_job_names
    from hlat.infra.checks.images import stage_images
    from hlat.infra.stage_jobs import job_spec
    from hlat.infra.supervision.status import stage_price

    order = [(row.name, flow.name) for row, flow in chain()]
    assert order[3:7] == [("burn-in", "burn-in"), ("rehearse", "rehearse"), ("review", "review"), ("train", "train")]
    args = build_parser().parse_args(["run", "rehearse"])
    flow, _ = flow_call(args, {})
    assert flow.name == "rehearse"
    with pytest.raises(Exception, match="apply to 'hlat run evaluate' only, not rehearse"):
        flow_call(build_parser().parse_args(["run", "rehearse", "--step", "5"]), {})
    assert importlib.util.find_spec(REHEARSE.program or "") is not None

    config = load_config("hlat-7b")
    spec = job_spec(Run.at("s3://bucket/hlat/r1", config), 1, "rehearse")
    assert (spec.entry, spec.stage) == ("hlat.training.rehearse", "rehearse")
    assert (spec.instance_type, spec.instance_count) == (config.job.instance_type, config.job.instance_count)
    assert spec.processes_per_node == config.job.processes_per_node and spec.image_uri == config.job.image_uri
    assert spec.max_runtime_s == 1800 and "NEURON_CC_FLAGS" in spec.environment
    assert requirements_of(spec) == requirements_of(job_spec(Run.at("s3://bucket/hlat/r1", config), 1, "train"))
    assert _config_field("ResourceConfig.InstanceType", "rehearse") == "job.instance_type"
    assert stage_price(config, "rehearse") == stage_price(config, "train")
    needs = instance_needs(config)[config.job.instance_type]
    assert needs[1] == ["precompile", "burn-in", "rehearse", "train"]
    assert own_job_names("r1")(spec.name)
    images = {"job.image_uri": "i-train", "data.image_uri": "i-data", "evaluation.image_uri": "i-eval"}
    assert stage_images(load_config("hlat-7b", images)) == {  # by instances: the rehearsal runs the training's
        "i-data": ["prepare-data"],
        "i-train": ["train"],
        "i-eval": ["evaluate"],
    }
    with pytest.raises(Exception, match="review stage runs in the flow's own process"):
        job_spec(Run.at("s3://bucket/hlat/r1", config), 1, "review")


@pytest.mark.usefixtures("throwaway")
def test_a_throwaway_stage_is_in_status_done_and_cache_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hlat.tasks.caching as caching
    from hlat.infra.supervision.status import render, run_status

    monkeypatch.setattr(caching, "output_checksum", caching.output_checksum.fn)  # the task's body, no Prefect API
    run = open_run(load_config("tiny", storage=str(tmp_path / "runs")))
    stood = dict(run_status(run).stages)
    assert (stood["rehearse"], stood["review"]) == ("not started", "not started")

    run.storage.write_bytes("tokenizer/tokenizer.model", b"a tokenizer")
    run.storage.write_text("rehearse/report.json", '{"passed": true}')
    stood = dict(run_status(run).stages)
    assert stood["rehearse"] == "done" and stood["review"] == "not started"
    assert "  rehearse " in render(run_status(run))
    assert sys.modules["hlat.tasks.rehearse"].present(run)

    before = (caching.stage_cache_key(run, "rehearse"), caching.stage_cache_key(run, "review"))
    assert caching.output_checksum(run, "rehearse") == hashlib.sha256(b'{"passed": true}').hexdigest()
    run.storage.write_text("rehearse/report.json", '{"passed": false}')
    run.storage.write_bytes("tokenizer/tokenizer.model", b"another tokenizer")
    after = (caching.stage_cache_key(run, "rehearse"), caching.stage_cache_key(run, "review"))
    assert before[0] != after[0] and before[1] != after[1]  # each keys on its input's checksum
    with pytest.raises(ValueError, match="review stage's output has no checksum"):
        stage("review").output_checksum(run)


def test_an_unknown_stage_is_an_error_not_the_last_stage() -> None:
    from hlat.infra.backends.run_roles import access_of
    from hlat.infra.supervision.status import stage_price

    config = load_config("tiny")
    for ask in (lambda: stage("rehearse").done, lambda: stage_price(config, "rehearse"), lambda: access_of("x")):
        with pytest.raises(ValueError, match="unknown stage"):
            ask()
