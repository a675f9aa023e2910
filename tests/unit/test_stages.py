"""The table of stages (core/stages.py) is what every layer reads: each row's files exist, and the CLI, the parent
flow, the job specs, `hlat status` and deployments/prefect.yaml agree with it."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest
import yaml

from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.core.stages import STAGES, TRAINING, job_stages, stage, stage_names

JOB_STAGES, STAGE_NAMES = job_stages(), stage_names()

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("row", STAGES, ids=STAGE_NAMES)
def test_each_stage_is_a_row_and_its_three_files(row: object) -> None:
    from prefect import Flow

    s = stage(row.name)
    flow = getattr(importlib.import_module(f"hlat.flows.{s.module}"), s.module)
    assert isinstance(flow, Flow) and flow.name == s.name
    assert (ROOT / "tasks" / f"{s.module}.py").is_file()
    if s.runs_on is None:
        assert s.program is None and s.name not in JOB_STAGES
    else:
        assert s.program == f"hlat.training.{s.module}" and importlib.util.find_spec(s.program) is not None


def test_a_stage_feeds_only_later_stages_and_each_input_has_its_checksum() -> None:
    OUTPUT_CHECKSUMS = [s.name for s in STAGES if s.checksum is not None]  # the rows' own (core/stages.py)

    for k, s in enumerate(STAGES):
        for upstream in s.inputs:
            assert upstream in STAGE_NAMES[:k], (s.name, upstream)
            assert upstream in OUTPUT_CHECKSUMS, upstream


def test_an_unknown_stage_is_named_with_the_stages() -> None:
    with pytest.raises(ValueError, match="unknown stage 'train-tokeniser'; the stages are prepare-data, "):
        stage("train-tokeniser")


def test_the_cli_and_the_status_list_the_table() -> None:
    from hlat.cli import build_parser

    args = build_parser().parse_args(["run", "burn-in"])
    assert args.stage == "burn-in"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "tokenize"])
    run_parser = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    choices = next(a.choices for a in run_parser._actions if a.dest == "stage")
    assert tuple(choices) == STAGE_NAMES


def test_each_job_runs_its_program_on_the_shape_and_under_the_cap_of_its_row() -> None:
    from hlat.infra.stage_jobs import job_spec

    config = load_config("hlat-7b")
    run = Run.at("s3://bucket/hlat/r1", config)
    for name in JOB_STAGES:
        s, spec = stage(name), job_spec(run, 1, name)
        assert spec.entry == s.program and spec.stage == name
        if s.runs_on == TRAINING:
            assert (spec.instance_type, spec.instance_count) == (config.job.instance_type, config.job.instance_count)
            assert "NEURON_CC_FLAGS" in spec.environment
        else:
            assert "NEURON_CC_FLAGS" not in spec.environment
        if s.cap_hours is not None:
            assert spec.max_runtime_s == int(min(s.cap_hours, config.job.max_runtime_hours) * 3600)
    assert job_spec(run, 1, "evaluate").instance_type == config.evaluation.instance_type
    assert job_spec(run, 1, "prepare-data").instance_type == config.data.instance_type


def test_a_stage_without_a_job_has_no_job_spec() -> None:
    from hlat.core.config import ConfigError
    from hlat.infra.stage_jobs import job_spec

    with pytest.raises(ConfigError, match="train-tokenizer stage runs in the flow's own process"):
        job_spec(Run.at("/tmp/runs/r", load_config("tiny")), 1, "train-tokenizer")


def test_the_deployments_hold_each_stage_alone_in_dag_order() -> None:
    """deployments/prefect.yaml: each stage alone, for the tiny preset and for HLAT 7B, named, tagged and described
    by its place in the table."""
    deployments = {d["name"]: d for d in yaml.safe_load((ROOT / "deployments/prefect.yaml").read_text())["deployments"]}
    for k, s in enumerate(STAGES, start=1):
        for suffix in ("tiny", "7b"):
            d = deployments[f"{s.name}-{suffix}"]
            assert d["entrypoint"] == f"flows/{s.module}.py:{s.module}"
            assert f"stage-{k}" in d["tags"]
            assert d["description"].startswith(f"Stage {k} of {len(STAGES)} ")
    for name in ("pretrain-tiny", "pretrain-7b"):
        assert deployments[name]["entrypoint"] == "flows/pretrain.py:hlat"
