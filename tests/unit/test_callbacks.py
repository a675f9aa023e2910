"""The loop's callbacks (`training/callbacks.py`): the NaN and spike policies on the host, the order the Trainer
calls its callbacks and hook points in, a callback's stop, and the model the Trainer is given
(`training/assembly.py`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.config import HlatConfig, validate_config
from hlat.core.contract import EXIT_NAN
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training.assembly import build_model
from hlat.training.callbacks import (
    Callback,
    FirstStepMetrics,
    MetricsLogging,
    NanPolicy,
    SpikePolicy,
    SyncPoint,
)
from hlat.training.checkpoint import CheckpointManager
from hlat.training.loop import Trainer
from hlat.training.parallel.distributed import init_world
from hlat.training.spikes import SpikeDetector
from hlat.training.stop_protocol import StopProtocol
from tests.jobs import make_run, metrics


def point(step: int, **seen: Any) -> SyncPoint:
    values = {"loss": 2.0, "grad_norm": 0.5, "samples_crc32": 1}
    return SyncPoint(step, first=False, seen=seen, values=values, seconds=1.0, logged=True)


NONFINITE = {"nonfinite": 1, "first_step": 7, "first_loss": float("nan"), "finite": False}


def test_nan_policy_exit_ends_the_job_and_skip_marks_the_step_once(caplog: pytest.LogCaptureFixture) -> None:
    assert NanPolicy("exit", extracting_graphs=False).on_sync(point(8, **NONFINITE)) == EXIT_NAN
    skip = NanPolicy("skip", extracting_graphs=False)
    caplog.set_level(logging.WARNING, logger="hlat")
    skipped = point(8, **NONFINITE)
    assert skip.on_sync(skipped) is None and skipped.values["skipped"] is True
    assert "loss is nan at step 7: 1 step(s) skipped so far" in caplog.text
    caplog.clear()
    later = point(9, **{**NONFINITE, "finite": True})
    assert skip.on_sync(later) is None and "skipped" not in later.values and not caplog.text  # logged once
    # Under graph extraction the values are invalid: no exit.
    assert NanPolicy("exit", extracting_graphs=True).on_sync(point(8, **NONFINITE)) is None


def test_the_spike_policy_keeps_its_window_in_checkpoints_and_logs_only_this_jobs_spikes() -> None:
    detector = SpikeDetector(4, 6.0, 3, torch.device("cpu"))
    detector.skipped += 2
    state: dict[str, Any] = {}
    SpikePolicy(detector, 3, 6.0, extracting_graphs=False).on_checkpoint(state)
    resumed = SpikePolicy(SpikeDetector(4, 6.0, 3, torch.device("cpu")), 3, 6.0, extracting_graphs=False)
    resumed.on_resume({"spikes": {k: v.clone() if torch.is_tensor(v) else v for k, v in state["spikes"].items()}})
    resumed.on_fit_start(10)
    assert resumed.restored == 2 and resumed.seen == 2 and int(resumed.detector.skipped) == 2
    seen = {k: v for k, v in resumed.sync_tensors().items()}
    at = point(11, **seen)
    assert resumed.on_sync(at) is None and at.values["spikes_skipped"] == 2 and "skipped" not in at.values


class Recorder(Callback):
    """Every hook call, in order."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.stop_at = stop_at

    def on_resume(self, state: dict[str, Any]) -> None:
        self.calls.append(("resume", state["step"]))

    def on_fit_start(self, step: int) -> None:
        self.calls.append(("fit_start", step))

    def on_step_end(self, step: int) -> bool:
        self.calls.append(("step_end", step))
        return step == self.stop_at

    def on_sync(self, point: SyncPoint) -> int | None:
        self.calls.append(("sync", (point.step, point.first, point.logged, "first_step_seconds" in point.values)))
        return None

    def on_stop(self, point: SyncPoint) -> None:
        self.calls.append(("stop", point.step))

    def on_checkpoint(self, state: dict[str, Any]) -> None:
        self.calls.append(("checkpoint", state["step"]))

    def on_fit_end(self) -> None:
        self.calls.append(("fit_end", None))


def trainer_of(run: Path, built: bool = False) -> Trainer:
    cfg: HlatConfig = validate_config(Storage(str(run)).read_json("config.json"))
    world = init_world("cpu", cfg)
    return Trainer(
        cfg=cfg,
        run=Run.of(Storage(str(run)), cfg),
        checkpoints=Storage(str(run / "checkpoints")),
        world=world,
        tokenizer_model=str(run / "tokenizer" / "tokenizer.model"),
        built=build_model(cfg, world) if built else None,
    )


SHORT = {"max_steps": 4, "checkpoint_every": 2, "eval_every": 0, "log_every": 3, "async_checkpoint": False}


def test_the_trainer_calls_its_callbacks_in_the_stated_order_at_each_hook_point(prepared: Path, tmp_path: Path) -> None:
    run = make_run(prepared, tmp_path, "order", **SHORT, spike_skip=True, spike_window=8)
    trainer = trainer_of(run)
    kinds = [type(c) for c in trainer.callbacks]
    assert kinds == [StopProtocol, NanPolicy, SpikePolicy, FirstStepMetrics, MetricsLogging]
    recorder = Recorder()
    trainer.callbacks.append(recorder)
    trainer.resume()
    assert trainer.fit() == 0
    assert recorder.calls == [
        ("fit_start", 0),
        ("step_end", 1), ("sync", (1, True, True, True)),  # the first step: a sync point, recorded, timed
        ("step_end", 2), ("sync", (2, False, False, False)), ("checkpoint", 2),  # checkpoint_every: a sync point
        ("step_end", 3), ("sync", (3, False, True, False)),  # log_every
        ("step_end", 4), ("sync", (4, False, True, False)), ("checkpoint", 4),  # the last step
        ("fit_end", None),
    ]  # fmt: skip
    # The earlier callbacks' work is in the record the later ones see: metrics.jsonl has the spike counter.
    assert [r["spikes_skipped"] for r in metrics(run) if "loss" in r] == [0, 0, 0]
    # A resumed trainer hands its callbacks the checkpoint's shared state.
    again = trainer_of(run)
    resumed = Recorder()
    again.callbacks.append(resumed)
    assert again.resume() == 4 and resumed.calls == [("resume", 4)]
    again.loader.close()


def test_a_callback_that_asks_for_a_stop_gets_the_stop_checkpoint_and_exit_zero(prepared: Path, tmp_path: Path) -> None:
    run = make_run(prepared, tmp_path, "stop", **{**SHORT, "max_steps": 6, "checkpoint_every": 5})
    trainer = trainer_of(run, built=True)
    recorder = Recorder(stop_at=3)
    trainer.callbacks.append(recorder)
    trainer.resume()
    assert trainer.fit() == 0
    assert trainer.step == 3 and trainer.stopped_at == 3
    assert recorder.calls[-4:] == [("sync", (3, False, True, False)), ("checkpoint", 3), ("stop", 3), ("fit_end", None)]
    assert CheckpointManager(Storage(str(run / "checkpoints")), keep_last=5).latest_step() == 3


def test_a_trainer_given_its_model_starts_from_the_weights_it_builds_itself(prepared: Path, tmp_path: Path) -> None:
    run = make_run(prepared, tmp_path, "built", **SHORT)
    own, given = trainer_of(run), trainer_of(run, built=True)
    for trainer in (own, given):
        trainer.loader.close()
    mine, theirs = own.model.state_dict(), given.model.state_dict()
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    assert given.optimizer is not own.optimizer and given.wrapped is not None
