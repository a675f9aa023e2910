"""From a config to the job specs of each stage, and the dry run's estimate."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from hlat.core.config import ConfigError
from hlat.core.contract import UNSUPERVISED_ENV
from hlat.core.environment import neuron_environment, xla_precision_environment
from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.infra.cost.estimates import estimate
from hlat.infra.stage_jobs import job_environment, job_spec, stop_terms

RUN = "s3://bucket/hlat/r1"


def test_stage_jobs_share_the_training_instances_and_differ_in_program() -> None:
    config = load_config("hlat-7b")
    specs = {stage: job_spec(Run.at(RUN, config, "r1"), 1, stage) for stage in ("precompile", "burn-in", "train")}
    for spec in specs.values():
        assert (spec.instance_type, spec.instance_count, spec.processes_per_node) == ("ml.trn1.32xlarge", 64, 32)
        assert spec.environment["NEURON_COMPILE_CACHE_URL"] == f"{RUN}/compile-cache/neuron"
        assert spec.config_uri == f"{RUN}/config.json"
    assert {s: spec.entry for s, spec in specs.items()} == {
        "precompile": "hlat.training.precompile",
        "burn-in": "hlat.training.burn_in",
        "train": "hlat.training.train",
    }
    # neuron_parallel_compile wraps torchrun only for the precompile job
    assert specs["precompile"].environment["RUN_NEURON_PARALLEL_COMPILE"] == "1"
    assert "RUN_NEURON_PARALLEL_COMPILE" not in specs["train"].environment
    assert specs["train"].environment["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"  # hlat-7b: bf16-sr
    # No stage job has a CheckpointConfig (node-local on SageMaker): training writes to the run's checkpoints/
    # itself; short jobs get short runtimes
    assert {s: spec.checkpoint_prefix for s, spec in specs.items()} == dict.fromkeys(specs)
    assert specs["burn-in"].max_runtime_s == 3600
    # The training's ends shortly after its budget (1.25 x the estimate: 22 days on 64 nodes) would run out.
    terms = stop_terms(config)
    assert terms.budget_usd is not None
    left = terms.budget_usd / terms.price_per_hour_usd * 3600
    assert specs["train"].max_runtime_s == math.ceil(left + config.job.stop_grace_seconds) < 28 * 24 * 3600
    assert [s.name for s in specs.values()] == ["hlat-r1-precompile-1", "hlat-r1-burn-in-1", "hlat-r1-train-1"]


def test_the_evaluation_job_runs_one_process_on_its_own_instance_and_image() -> None:
    config = load_config("hlat-7b", {"job.region": "eu-west-1"})
    spec = job_spec(Run.at(RUN, config, "r1"), 2, "evaluate", step=1000)
    assert (spec.instance_type, spec.instance_count, spec.processes_per_node) == ("ml.p4d.24xlarge", 1, 1)
    assert (
        spec.entry == "hlat.training.evaluate" and spec.args == {"step": "1000"} and spec.name == "hlat-r1-evaluate-2"
    )
    assert spec.image_uri is not None and spec.image_uri.startswith("763104351884.dkr.ecr.eu-west-1.")
    assert "pytorch-training:" in spec.image_uri and "gpu" in spec.image_uri
    assert spec.checkpoint_prefix is None and spec.max_runtime_s == 24 * 3600
    assert "NEURON_COMPILE_CACHE_URL" not in spec.environment
    mine = load_config(
        "hlat-7b", {"evaluation.image_uri": "1.dkr.ecr/me:1", "evaluation.instance_type": "ml.g5.48xlarge"}
    )
    assert job_spec(Run.at(RUN, mine, "r1"), 1, "evaluate").image_uri == "1.dkr.ecr/me:1"
    assert job_spec(Run.at(RUN, mine, "r1"), 1, "evaluate").args == {}  # the newest checkpoint
    local = job_spec(Run.at(RUN, load_config("tiny"), "r1"), 1, "evaluate")
    assert (local.instance_type, local.image_uri) == ("local", None)


def test_local_jobs_carry_no_neuron_settings() -> None:
    spec = job_spec(Run.at("/tmp/runs/r", load_config("tiny"), "r"), 2)
    # The run's stop terms: locally only the supervision timeout (no budget, no deadline by default).
    expected = {"HLAT_RUN_ID": "r", UNSUPERVISED_ENV: "1800.0"}
    assert spec.environment == expected and spec.arguments() == ["--config", "/tmp/runs/r/config.json"]


TRN1_STAGES = ("train", "precompile", "burn-in")


@pytest.mark.parametrize("preset", ["hlat-7b", "hlat-70b"])
def test_every_trn1_stage_job_carries_the_presets_neuron_settings(preset: str) -> None:
    config = load_config(preset, {"neuron.sdk": "2.24.1"})  # HLAT's flag-based precision: 2.24.1 has the flags
    expected = neuron_environment(config, f"{RUN}/compile-cache/neuron")
    for stage in TRN1_STAGES:
        env = job_spec(Run.at(RUN, config, "r1"), 1, stage).environment
        assert {k: env[k] for k in expected} == expected, stage
        assert env["NEURON_CC_FLAGS"] == "--model-type transformer --distribution-strategy=llm-training"
        assert env["NEURON_RT_EXEC_TIMEOUT"] == "4000" and env["MALLOC_ARENA_MAX"] == "64"
        assert env["FI_EFA_FORK_SAFE"] == "1" and env["HLAT_RUN_ID"] == "r1"
    env = job_spec(Run.at(RUN, config, "r1"), 1, "train").environment
    if preset == "hlat-7b":
        assert env["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "3"
        assert "NEURON_EXPERIMENTAL_COMPRESS_RG" not in env and "TORCH_DIST_INIT_BARRIER" not in env
        assert (env["XLA_USE_BF16"], env["NEURON_RT_STOCHASTIC_ROUNDING_EN"]) == ("1", "1")
    else:
        assert env["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "31"
        assert (env["NEURON_EXPERIMENTAL_COMPRESS_RG"], env["TORCH_DIST_INIT_BARRIER"]) == ("1", "0")
        assert (env["XLA_USE_BF16"], env["XLA_DOWNCAST_BF16"]) == ("0", "1")
    evaluation = job_spec(Run.at(RUN, config, "r1"), 1, "evaluate").environment
    assert evaluation == {"HLAT_RUN_ID": "r1"}  # a GPU job of its own: none of it


def test_neuron_overrides_reach_every_trn1_stage_job_and_neuron_env_wins() -> None:
    config = load_config(
        "hlat-7b",
        {
            "neuron.exec_timeout": 7200,
            "neuron.compiler_flags": "--model-type transformer -O1",
            "neuron.env.NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": 5,  # over neuron.async_inflight_requests
            "neuron.env.NEURON_RT_LOG_LEVEL": "INFO",
        },
    )
    for stage in TRN1_STAGES:
        env = job_spec(Run.at(RUN, config, "r1"), 1, stage).environment
        assert env["NEURON_RT_EXEC_TIMEOUT"] == "7200"
        # the user's flags, then what 2.28's BF16 model (bf16-sr) needs
        assert env["NEURON_CC_FLAGS"] == "--model-type transformer -O1 --enable-mixed-precision-accumulation"
        assert env["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "5"
        assert env["NEURON_RT_LOG_LEVEL"] == "INFO"


def test_the_xla_cpu_rehearsal_runs_with_the_precision_flags_on_pjrt_cpu() -> None:
    config = load_config("tiny", {"training.device": "xla", "precision.mode": "bf16-mixed", "neuron.sdk": "2.24.1"})
    for stage in TRN1_STAGES:
        env = job_environment(Run.at("/tmp/runs/r", config, "r"), stage)
        assert env == {
            "HLAT_RUN_ID": "r", "PJRT_DEVICE": "CPU", "TORCHINDUCTOR_COMPILE_THREADS": "1",
            **xla_precision_environment("bf16-mixed"),
        }  # fmt: skip
    assert job_environment(Run.at("/tmp/runs/r", config, "r"), "evaluate") == {"HLAT_RUN_ID": "r"}
    # The same through the job spec, with an interpreter that exists everywhere (the XLA one may not).
    overrides = {"training.device": "xla", "job.python": sys.executable, "neuron.sdk": "2.24.1"}
    spec = job_spec(Run.at("/tmp/r", load_config("tiny", overrides), "r"), 1)
    assert spec.environment["PJRT_DEVICE"] == "CPU" and spec.environment["XLA_USE_BF16"] == "0"
    # The default SDK (2.28.0) sets neither flag: the trainer autocasts
    default = job_spec(Run.at("/tmp/r", load_config("tiny", {**overrides, "neuron.sdk": "2.28.0"}), "r"), 1).environment
    assert default["PJRT_DEVICE"] == "CPU" and not {"XLA_USE_BF16", "XLA_DOWNCAST_BF16"} & set(default)
    assert not [k for k in spec.environment if k.startswith(("NEURON_CC", "NEURON_RT_ASYNC", "FI_", "MALLOC"))]


def test_estimate_of_hlat_7b_is_the_planners_figure_for_its_configured_layout() -> None:
    est = estimate(load_config("hlat-7b"))
    assert est["hourly_usd"] == pytest.approx(64 * 24.725)
    assert est["tokens"] == 429_000 * 1024 * 4096
    # HLAT's layout (TP8, SP, selective) on 64 nodes by the planner's model: about 17.7 days
    assert 15 * 24 < est["hours"] < 20 * 24
    assert est["basis"].startswith("configured layout TP8 PP1 DP256 SP")
    assert est["total_usd"] == pytest.approx(est["hours"] * est["hourly_usd"])
    assert estimate(load_config("tiny"))["hours"] is None  # no throughput figure for a local machine


def test_xla_jobs_run_in_the_xla_environment_and_its_absence_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hlat.infra.stage_jobs
    from hlat.core.environment import NEURON_SDKS
    from hlat.infra.stage_jobs import job_python

    config = load_config("tiny", {"training.device": "xla", "neuron.sdk": "2.24.1"})
    monkeypatch.setattr(hlat.infra.stage_jobs, "PROJECT_ROOT", tmp_path)  # job_python reads it from there
    with pytest.raises(ConfigError, match=r"training\.device=xla .*2\.24\.1.* run `scripts/install\.sh xla` first"):
        job_python(config, "train")
    newer = load_config("tiny", {"training.device": "xla"})  # the default SDK, 2.28.0
    with pytest.raises(ConfigError, match=r"neuron\.sdk=2\.28\.0.* run `scripts/install\.sh xla-2\.28` first"):
        job_python(newer, "train")
    for sdk, cfg in (("2.24.1", config), ("2.28.0", newer)):  # each SDK's jobs run in its own environment
        python = tmp_path / NEURON_SDKS[sdk].local_python
        python.parent.mkdir(parents=True)
        python.touch()
        assert [job_python(cfg, stage) for stage in ("train", "precompile", "burn-in")] == [str(python)] * 3
    assert job_python(config, "evaluate") is None  # evaluation runs transformers and lm-eval in the flow's Python
    assert job_python(load_config("tiny"), "train") is None
    own = load_config("tiny", {"training.device": "xla", "job.python": "/opt/image/bin/python"})
    assert job_python(own, "train") == "/opt/image/bin/python"


def test_the_dry_run_shows_hlats_layouts() -> None:
    from hlat.infra.dry_run import describe_layout

    assert describe_layout(load_config("hlat-7b")) == (
        "2048 ranks = TP 8 x PP 1 x DP 256, micro-batch 1 x 4 accumulation steps, sequence parallel, selective "
        "activation checkpointing, precision bf16-sr"
    )
    assert describe_layout(load_config("hlat-70b")) == (
        "8192 ranks = TP 32 x PP 8 x DP 32, micro-batch 1 x 32 pipeline micro-batches, sequence parallel, ZeRO-1 "
        "with FP32 master weights, selective activation checkpointing, precision bf16-mixed"
    )


def test_the_accounts_ceiling_refuses_a_run_over_it_whatever_its_parameters() -> None:
    """Issue 51: a run's parameters cannot lift what the account allows (HLAT_MAX_BUDGET_USD, HLAT_MAX_INSTANCES, in
    the environment where flow runs start), and a node-hour price of 0 cannot switch budget enforcement off."""
    from hlat.infra.cost.budget import check_spend

    aws = {"job.backend": "sagemaker", "job.region": "us-west-2", "job.role_arn": "arn:aws:iam::123456789012:role/r"}
    limits = {"HLAT_MAX_BUDGET_USD": "100000", "HLAT_MAX_INSTANCES": "64"}
    check_spend(load_config("hlat-7b", {**aws, "job.budget_usd": 100_000}), limits)  # at the ceiling: allowed
    refusals = [
        ({"job.budget_usd": 100_001}, r"job.budget_usd: .*\$100,001.00, is over this account's ceiling of \$100,000"),
        ({}, r"job.budget_usd: the training's budget, \$[\d,.]+ = 1.25 x the estimate .* over this account's ceiling"),
        ({"job.budget_usd": 50, "job.instance_count": 128}, r"job.instance_count: 128 instances is over .* of 64"),
        ({"job.budget_usd": 50, "job.price_per_hour_usd": 0}, r"job.price_per_hour_usd is 0: .* must be above 0"),
        ({"job.budget_usd": 50, "job.instance_type": "ml.m5.xlarge"}, r"is unset and 'ml.m5.xlarge' has no price"),
    ]
    for overrides, message in refusals:
        with pytest.raises(ConfigError, match=message):
            check_spend(load_config("hlat-7b", {**aws, **overrides}), limits)
    with pytest.raises(ConfigError, match=r"HLAT_MAX_INSTANCES='many': the account's ceiling must be a number"):
        check_spend(load_config("hlat-7b", {**aws, "job.budget_usd": 50}), {"HLAT_MAX_INSTANCES": "many"})
    check_spend(load_config("tiny", {"job.price_per_hour_usd": 0}), limits)  # local: nothing billed, not checked


def test_a_flow_runs_config_is_checked_against_the_ceiling(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every flow run resolves its run first (build_config, then the preflight): a run over the ceiling stops there,
    before its config.json is written."""
    from hlat.flows.stage import resolve

    monkeypatch.setenv("HLAT_MAX_BUDGET_USD", "1000")
    changes = {"job.budget_usd": 8_700_000, "job.role_arn": "arn:aws:iam::123456789012:role/r"}
    with pytest.raises(ConfigError, match=r"over this account's ceiling of \$1,000.00"):
        resolve("hlat-70b", changes, "r1", str(tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()
