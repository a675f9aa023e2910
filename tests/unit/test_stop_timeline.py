"""The stop's timeline (core/stop_timeline.py): hlat-70b at 256 hosts and hlat-7b at 64 hosts fit SageMaker's 120 s
grace in the worst case under the plan the code follows now, and did not under the one before issue 50; the bytes it
counts are the ones the checkpoint code writes (checked against the training code's own rules and optimizers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hlat.core.config import TrainingConfig
from hlat.core.environment import NEURON_SDKS
from hlat.core.presets import load_config
from hlat.core.stop_timeline import (
    OLD_PLAN,
    PART_BYTES,
    PLAN,
    S3FS_DEFAULT_POOL,
    StopPlan,
    StopTimeline,
    checkpoint_shape,
    grace_seconds,
    state_bytes,
    stop_timeline,
    write_start_seconds,
)
from hlat.core.storage import S3_CLIENT_CONFIG, S3_MAX_POOL_CONNECTIONS, Storage

SAGEMAKER = {"job.role_arn": "arn:aws:iam::123456789012:role/hlat", "storage.root": "s3://bucket/runs"}
# The step times the dry run estimates for the presets (tokens per step / the catalog's tokens per second).
STEP_S = {"hlat-7b": 3.58, "hlat-70b": 9.28}


def timeline(preset: str, plan: StopPlan = PLAN, **overrides: str) -> StopTimeline:
    config = load_config(preset, {**SAGEMAKER, **overrides})
    return stop_timeline(config, STEP_S[preset], plan=plan)


# (preset, overrides): the worst case from SIGTERM before issue 50 and now, in seconds (rounded).
CASES = {
    ("hlat-70b", ""): (129, 42),  # 256 hosts, Neuron 2.28 (the default): FP32 weights, FP32 moments under ZeRO-1
    ("hlat-70b", "2.24.1"): (131, 43),  # HLAT's flag-based precision: FP64-typed masters and moments, 24 B/param
    ("hlat-7b", "2.24.1"): (138, 74),  # 64 hosts, XLA_USE_BF16: FP32-typed weights and moments, 12 B/param
    ("hlat-7b", ""): (83, 43),  # 64 hosts, 2.28's BF16 model and moments: the old plan fitted already
}


@pytest.mark.parametrize(("preset", "sdk"), list(CASES))
def test_the_worst_case_stop_fits_the_grace_now_and_did_not_before(preset: str, sdk: str) -> None:
    overrides = {"neuron.sdk": sdk} if sdk else {}
    before, now = timeline(preset, OLD_PLAN, **overrides), timeline(preset, PLAN, **overrides)
    assert (round(before.total), round(now.total)) == CASES[(preset, sdk)], (before.line(), now.line())
    assert now.fits() and now.grace == 120.0, now.line()
    assert before.fits() is (CASES[(preset, sdk)][0] <= 120), before.line()
    assert [p.name for p in now.phases] == ["to the vote", "in-flight save", "staging", "writes", "commit"]


def test_what_the_new_plan_changed_at_256_hosts() -> None:
    before, now = timeline("hlat-70b", OLD_PLAN), timeline("hlat-70b", PLAN)
    # The commit: 8,191 manifests through s3fs's 10 connections, now 64.
    assert OLD_PLAN.manifest_connections == S3FS_DEFAULT_POOL == 10 and PLAN.manifest_connections == 64
    assert before.seconds("commit") == pytest.approx(45.0, abs=0.1) and now.seconds("commit") < 11
    assert "8,191 manifests over 10 connections 41.0 s" in before.line()
    # The in-flight async save: waited for whole (its writes and commit), now cut at its next 512 MiB part.
    assert before.seconds("in-flight save") == pytest.approx(before.seconds("writes") + before.seconds("commit"))
    assert now.seconds("in-flight save") < 4
    # Pacing: pipeline stage 7's shard writers (ranks 7,168-7,199) started 7.2 s in, behind 7,168 ranks; now first.
    assert before.seconds("writes") == pytest.approx(14.5, abs=0.1) and now.seconds("writes") < 9
    # To the stop's boundary: a vote at every step stopped after the step in progress; the stop step agreed through
    # the store (training/stop_vote.py) may be the next one, when a rank went past its boundary before it heard.
    assert before.seconds("to the vote") == STEP_S["hlat-70b"] and now.seconds("to the vote") == 2 * STEP_S["hlat-70b"]


def test_the_steps_to_the_stop_and_measured_figures_enter_the_timeline() -> None:
    config = load_config("hlat-70b", SAGEMAKER)
    now, voted = stop_timeline(config, 9.28), stop_timeline(config, 9.28, plan=OLD_PLAN)
    assert now.seconds("to the vote") == pytest.approx(2 * 9.28) and "up to 2 steps" in now.line()
    assert voted.seconds("to the vote") == pytest.approx(9.28) and "(the step in progress)" in voted.line()
    # A job that was sent SIGTERM knows how long the way to the stop's boundary took.
    heard = stop_timeline(config, 9.28, since_sigterm=3.0)
    assert heard.seconds("to the vote") == 3.0 and heard.measured[0] == "to the vote"
    measured = stop_timeline(config, 9.28, save_seconds=50.0, in_flight_left_s=1.0)
    assert [p.name for p in measured.phases] == ["to the vote", "in-flight save", "save"]
    assert measured.total == pytest.approx(2 * 9.28 + 1.0 + 50.0) and measured.measured == ("in-flight save", "save")
    # No async save in flight; a measured save that does not fit.
    idle = stop_timeline(config, 9.28, save_seconds=115.0, in_flight=False)
    assert [p.name for p in idle.phases] == ["to the vote", "save"] and not idle.fits()
    assert "does NOT fit" in idle.line() and idle.fits(grace=140)
    # The old plan waits for what is left of the in-flight save.
    waited = stop_timeline(config, 9.28, save_seconds=20.0, in_flight_left_s=30.0, plan=OLD_PLAN)
    assert waited.seconds("in-flight save") == 30.0
    # Unknown step time: said so.
    assert "step time unknown" in stop_timeline(config).line()


def test_the_grace_is_sagemakers_or_the_local_backends() -> None:
    assert grace_seconds(load_config("hlat-70b", SAGEMAKER)) == 120.0
    assert grace_seconds(load_config("tiny", {"job.stop_grace_seconds": 20})) == 20.0


def test_the_checkpoint_shape_is_the_formats() -> None:
    """hlat-70b (TP 32 x PP 8 x DP 32, ZeRO-1): 256 shard files of FP32 weights, one per (tensor, pipeline)
    position, written by data rank 0 of each (NxD's order: stage p's writers are ranks p x 1,024 + 0..31, one whole
    host each), and every rank's FP32 moments in its rank file; hlat-7b (TP 8, no ZeRO-1): 8 shard files with the
    BF16 weights and moments, on host 0."""
    big = checkpoint_shape(load_config("hlat-70b", SAGEMAKER))
    params = load_config("hlat-70b", SAGEMAKER).model.num_params()
    assert big.world == 8192 and len(big.writers) == 256 and big.files == 256 + 2 * 8192
    assert sorted(big.writers) == [p * 1024 + t for p in range(8) for t in range(32)]
    assert {w // 32 for w in big.writers} == {32 * p for p in range(8)}
    assert big.shard_bytes == params * 4 // 256 and big.rank_bytes == params * 8 // 8192 + (64 << 10)
    assert round(big.shard_bytes / 1e6) == 1078 and round(big.rank_bytes / 1e6, 1) == 67.4  # docs/multi-host.md
    small = checkpoint_shape(load_config("hlat-7b", SAGEMAKER))
    assert small.writers == tuple(range(8)) and round(small.shard_bytes / 1e6) == 5054
    assert small.rank_bytes == 64 << 10


def test_pacing_puts_the_shard_writers_first_and_bounds_the_last_rank() -> None:
    assert write_start_seconds(5, 1, 2000.0) == 0.0 and write_start_seconds(5, 8, None) == 0.0
    assert write_start_seconds(7168, 8192, 2000.0) == pytest.approx(7.168)  # the old order: by global rank
    assert write_start_seconds(7168, 8192, 2000.0, writer_index=255, writers=256) == pytest.approx(0.255)
    assert write_start_seconds(8191, 8192, 2000.0, writers=256) == pytest.approx((256 + 8191) * 2 / 2000)


@pytest.mark.parametrize("sdk", sorted(NEURON_SDKS))
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-sr"])
def test_zero1_bytes_follow_the_training_codes_rule_for_master_weights(precision: str, sdk: str) -> None:
    from hlat.training.parallel.neuron import zero1_masters_outrank_parameters

    config = load_config("hlat-70b", {**SAGEMAKER, "precision.mode": precision, "neuron.sdk": sdk})
    sb = state_bytes(config)
    dtype = 8 if precision == "bf16-mixed" and NEURON_SDKS[sdk].precision_flags else 4
    saved = zero1_masters_outrank_parameters(config)
    assert sb.optimizer_in_rank_files and sb.optimizer == dtype * (3 if saved else 2), sb


@pytest.mark.parametrize("flags", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-sr"])
def test_unsharded_optimizer_bytes_are_what_the_optimizer_holds(precision: str, flags: bool) -> None:
    """The optimizer state per parameter that `training.optim.optimizer_recipe` builds, counted after one step on
    the CPU (flags=True: as under torch-xla's precision flags), equals the timeline's."""
    from hlat.training.optim import optimizer_recipe

    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    if precision == "bf16-sr" and not flags:
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    cls, args = optimizer_recipe(params, TrainingConfig(lr=1e-3), precision, "cpu", flags=flags)
    optimizer = cls(params, **args)
    model(torch.randn(4, 16, dtype=params[0].dtype)).float().pow(2).mean().backward()
    optimizer.step()
    count = sum(p.numel() for p in params)
    held = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim()
    )
    weights = sum(p.numel() * p.element_size() for p in params)
    # The timeline's rule for a config whose flags are `flags` (Neuron 2.24.1 on trn1) or not (on the CPU).
    overrides = {"precision.mode": precision, "parallelism.zero1": False, "parallelism.pipeline": 1}
    if flags:
        config = load_config("hlat-7b", {**SAGEMAKER, **overrides, "neuron.sdk": "2.24.1"})
    else:
        config = load_config("tiny", {"precision.mode": precision})
    sb = state_bytes(config)
    assert (weights / count, held / count) == (sb.weights, sb.optimizer), (precision, flags, sb)


def test_the_constants_agree_with_the_code_they_describe() -> None:
    from hlat.training.checkpoint.serialization import CHECKPOINT_PART_SIZE

    assert PART_BYTES == CHECKPOINT_PART_SIZE
    assert S3_CLIENT_CONFIG["max_pool_connections"] == S3_MAX_POOL_CONNECTIONS == PLAN.manifest_connections
    assert Storage("s3://bucket/x").parallel_reads == S3_MAX_POOL_CONNECTIONS
    assert Storage("s3://bucket/x", config_kwargs={"max_pool_connections": 8}).parallel_reads == 8


def test_the_dry_run_shows_the_stops_phases() -> None:
    from hlat.infra.dry_run import dry_run

    line = next(x for x in dry_run(load_config("hlat-70b", SAGEMAKER)).splitlines() if x.startswith("stop:"))
    assert line.startswith("stop: 42 s of the 120 s grace from SIGTERM, fits: to the vote 18.6 s"), line
    for phase in ("in-flight save 3.4 s (superseded", "staging 1.1 s", "writes 8.9 s", "commit 10.4 s"):
        assert phase in line, line
    assert "8,191 manifests over 64 connections" in line and "1.08 GB a shard" in line
