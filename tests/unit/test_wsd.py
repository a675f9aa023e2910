"""training.schedule='wsd': the learning rates, a run extended by half its length continuing bitwise, and the
refusal once the decay has begun (in the scheduler a job resumes, and in the fingerprint open_run compares)."""

from __future__ import annotations

import io
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hlat.core.config import ConfigError, HlatConfig, TrainingConfig
from hlat.core.presets import load_config
from hlat.core.run import CONFIG_FILE, open_run
from hlat.training.optim import build_optimizer, build_scheduler, lr_at

PEAK, FLOOR = 1e-3, 1e-4


def wsd(max_steps: int, **fields: Any) -> TrainingConfig:
    return TrainingConfig(lr=PEAK, min_lr_ratio=0.1, warmup_steps=10, max_steps=max_steps, schedule="wsd", **fields)


def test_wsd_warms_up_holds_the_peak_and_decays_1_sqrt_to_the_floor_on_the_last_step() -> None:
    cfg = wsd(100)  # decay_steps None: the last 20 steps
    assert cfg.decay_start == 80
    assert lr_at(0, cfg) == pytest.approx(PEAK / 10)
    assert lr_at(9, cfg) == pytest.approx(PEAK)
    assert [lr_at(s, cfg) for s in range(10, 80)] == [PEAK] * 70  # stable: exactly the peak
    # 1-sqrt: lr = floor + (peak - floor) * (1 - sqrt((step - 80 + 1) / 20)).
    assert lr_at(80, cfg) == pytest.approx(FLOOR + (PEAK - FLOOR) * (1 - math.sqrt(1 / 20)), rel=1e-12)
    assert lr_at(84, cfg) == pytest.approx(FLOOR + (PEAK - FLOOR) * (1 - math.sqrt(5 / 20)), rel=1e-12)
    assert lr_at(99, cfg) == pytest.approx(FLOOR, rel=1e-12)  # the horizon's last step runs at the floor
    assert lr_at(150, cfg) == pytest.approx(FLOOR, rel=1e-12)
    decay = [lr_at(s, cfg) for s in range(79, 100)]
    assert all(a > b for a, b in itertools.pairwise(decay))
    # An explicit decay length, and a horizon longer than the run.
    assert wsd(100, decay_steps=30).decay_start == 70
    assert wsd(100, schedule_steps=200).decay_start == 160 and lr_at(99, wsd(100, schedule_steps=200)) == PEAK


def test_the_decay_never_starts_inside_the_warm_up() -> None:
    cfg = TrainingConfig(lr=PEAK, min_lr_ratio=0.1, warmup_steps=10, max_steps=11, schedule="wsd")
    assert cfg.decay_start == 10  # 20% of 11 steps would start at step 9, inside the warm-up
    assert [lr_at(s, cfg) for s in (9, 10)] == [pytest.approx(PEAK), pytest.approx(FLOOR)]
    with pytest.raises(ValueError, match=r"warm-up \(10\) and decay do not fit"):
        load_config("tiny", {"training.schedule": "wsd", "training.max_steps": 20, "training.warmup_steps": 10,
                             "training.decay_steps": 15})  # fmt: skip


def train(cfg: TrainingConfig, steps: range, state: dict[str, Any] | None = None) -> tuple[dict[str, Any], list]:
    """Train a tiny model over `steps` (from `state`, a checkpoint saved and loaded as the jobs do, or from scratch)
    under `cfg`; return the checkpoint after the last step and the learning rate each step used."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = build_optimizer(model, cfg, "fp32")
    sched = build_scheduler(opt, cfg)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
    lrs = []
    for step in steps:
        data = torch.Generator().manual_seed(step)
        x = torch.randn(16, 4, generator=data)
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True), lrs


def test_a_wsd_run_extended_by_half_before_its_decay_continues_bitwise_with_no_re_warm() -> None:
    n = 40  # decay_start 32; the run is extended at step 30, before its decay began
    first, first_lrs = train(wsd(n), range(30))
    extended, extended_lrs = train(wsd(n * 3 // 2), range(30, n * 3 // 2), first)
    whole, whole_lrs = train(wsd(n * 3 // 2), range(n * 3 // 2))
    assert first_lrs + extended_lrs == whole_lrs  # every learning rate equal, the steps already taken included
    assert first_lrs == whole_lrs[:30]
    assert extended_lrs[0] == first_lrs[-1] == PEAK  # no re-warm: the stable phase goes on at the peak
    assert wsd(n * 3 // 2).decay_start == 48
    for name, tensor in whole["model"].items():
        assert torch.equal(tensor, extended["model"][name]), name


def test_extending_after_the_decay_began_is_refused_with_the_reason_and_the_fix() -> None:
    state, _ = train(wsd(40), range(35))  # decay_start 32: three decay steps taken
    with pytest.raises(ValueError) as info:
        train(wsd(60), range(35, 60), state)
    message = str(info.value)
    assert "\n" not in message
    assert "its decay began at step 32 and it has taken 35 steps" in message
    assert "start a new run from its checkpoint" in message and "re-run with the longer horizon" in message
    # Resuming under the schedule it ran under is fine, as is a checkpoint saved before the record existed.
    train(wsd(40), range(35, 40), state)
    old = {**state, "sched": {k: v for k, v in state["sched"].items() if k != "schedule"}}
    train(wsd(60), range(35, 36), old)


def test_a_cosine_run_is_still_refused_a_longer_horizon() -> None:
    cosine = TrainingConfig(lr=PEAK, warmup_steps=10, max_steps=40)
    assert cosine.extension_problem(cosine.model_copy(update={"max_steps": 60}), 30) is not None
    assert cosine.extension_problem(cosine.model_copy(update={"max_steps": 60}), 10) is None  # still warming up
    kept = cosine.model_copy(update={"max_steps": 60, "schedule_steps": 40})
    assert cosine.extension_problem(kept, 40) is None


def test_open_run_extends_a_wsd_run_in_place_and_refuses_cosine_as_before(tmp_path: Path) -> None:
    def config(max_steps: int, **more: Any) -> Any:
        overrides = {"training.schedule": "wsd", "training.max_steps": max_steps, **more}
        return load_config("tiny", overrides, run_id="w", storage=str(tmp_path))

    first = config(40)
    open_run(first)
    longer = config(60)
    assert longer.trajectory_fingerprint() == first.trajectory_fingerprint()
    assert open_run(longer).run_id == "w"
    assert json.loads((tmp_path / "w" / CONFIG_FILE).read_text())["training"]["max_steps"] == 60
    # Any other change is still refused, as is the cosine's longer horizon.
    other = config(90, **{"training.lr": 0.004})
    with pytest.raises(ConfigError, match=r"training\.lr"):
        open_run(other)
    cosine = load_config("tiny", {"training.max_steps": 40}, run_id="c", storage=str(tmp_path))
    open_run(cosine)
    with pytest.raises(ConfigError, match=r"also set training\.schedule_steps=40"):
        open_run(load_config("tiny", {"training.max_steps": 60}, run_id="c", storage=str(tmp_path)))


@pytest.mark.slow
def test_a_wsd_job_extended_by_half_continues_bitwise_and_one_past_its_decay_is_refused(
    prepared: Path, tmp_path: Path
) -> None:
    from tests.jobs import final_weights, make_run, metrics, train
    from tests.sizes import SMALL_DATA

    common = {"checkpoint_every": 4, "eval_every": 0, "warmup_steps": 2, "schedule": "wsd", "keep_checkpoints": 5}
    whole = make_run(prepared, tmp_path, "whole", max_steps=12, **common)
    code, out = train(whole)
    assert code == 0, out[-3000:]

    # An 8-step run (its decay would start at step 7) stopped at step 6 (a NaN exit; checkpoint 4), then extended to
    # 12 steps in place: the relaunch resumes from step 4 under the 12-step schedule.
    ext = make_run(prepared, tmp_path, "ext", max_steps=8, **common)
    code, out = train(ext, {"HLAT_FAULT_NAN_AT_STEP": "6"})
    assert code == 3, out[-3000:]

    def longer(max_steps: int) -> HlatConfig:
        overrides = {**SMALL_DATA, **{f"training.{k}": v for k, v in common.items()}, "training.max_steps": max_steps}
        return load_config("tiny", overrides, run_id="ext", storage=str(tmp_path))

    def extended(max_steps: int) -> None:
        open_run(longer(max_steps))

    extended(12)
    code, out = train(ext)
    assert code == 0 and "resumed from step 4" in out, out[-3000:]

    def history(run: Path) -> list[tuple[int, float, float]]:
        return [(r["step"], r["lr"], r["loss"]) for r in metrics(run) if "loss" in r]

    assert history(ext) == history(whole)  # every step's learning rate and loss, bitwise
    lrs = [lr for _, lr, _ in history(ext)]
    assert lrs[2:9] == [lrs[2]] * 7  # the peak held from the warm-up's end past the old decay's start: no re-warm
    for name, tensor in final_weights(whole).items():
        assert torch.equal(final_weights(ext)[name], tensor), name

    # Past its decay (it began at step 10 of 12), a longer run is refused before any job, saying why and what to do;
    # and by the job itself, for a config.json that did not come through open_run.
    refused = "its decay began at step 10 and it has taken 12 steps; start a new run from its checkpoint"
    with pytest.raises(ConfigError, match=refused):
        extended(18)
    (ext / "config.json").write_text(longer(18).model_dump_json(indent=2))
    code, out = train(ext)
    assert code != 0 and refused in out


def test_decay_steps_without_wsd_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"decay_steps=50 is the decay of training\.schedule='wsd'.*schedule=wsd"):
        load_config("tiny", {"training.decay_steps": 50})
