"""Loss-spike skipping on the XLA device (XLA:CPU): a spiking step runs the graphs a normal step runs, with no host
read, no extra transfer at a sync point and no recompilation after step 2, compared with the same run with
training.spike_skip off; and its update is not applied (the weights after it are those before it).

Spikes come from tests/spike_hooks.py through the job's `loss_of_step` hook point (the loss of the named steps times
ten, after the backward: the gradients are a normal step's, the loss decides)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.config import validate_config
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training import hooks as job_hooks
from hlat.training.loop import Trainer
from hlat.training.parallel.distributed import init_world
from tests import spike_hooks
from tests.xla.conftest import make_run
from tests.xla.test_xla_loop import counted_fit, deltas

STEPS = 20
LOG_EVERY = 5
SPIKES = (12, 13)  # after the window of 8 is full, between the sync points of steps 10 and 15
CHANGES = {"training.max_steps": STEPS, "training.log_every": LOG_EVERY, "training.checkpoint_every": 10}
SPIKY = {"training.spike_skip": True, "training.spike_window": 8}


@pytest.fixture
def spiking(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(job_hooks.HOOKS_ENV, spike_hooks.MODULE)
    monkeypatch.setenv(spike_hooks.SPIKE_STEPS, ",".join(str(s) for s in SPIKES))
    job_hooks.hooks.cache_clear()
    yield
    job_hooks.hooks.cache_clear()


def build(run: Path) -> Trainer:
    cfg = validate_config(Storage(str(run)).read_json("config.json"))
    return Trainer(
        cfg=cfg,
        run=Run.at(str(run)),
        checkpoints=Storage(str(run / "checkpoints")),
        world=init_world(cfg.training.device, cfg),
        tokenizer_model=str(run / "tokenizer" / "tokenizer.model"),
    )


def counted_steps(trainer: Trainer) -> list[dict[str, float]]:
    """fit() (which must succeed); per step k (index k - 1), the XLA counters' change from the end of step k to the
    end of step k + 1: step k's sync work, if any, and the whole of step k + 1 (`deltas` of the loop tier's marks,
    less the one at fit's end)."""
    code, marks = counted_fit(trainer)
    assert code == 0
    return deltas(marks[:-1])


def records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_spike_is_skipped_with_the_graphs_and_transfers_of_a_run_without_spike_skipping(
    prepared: Path, tmp_path: Path, spiking: None
) -> None:
    plain = counted_steps(build(make_run(prepared, tmp_path, "plain", **CHANGES)))
    run = make_run(prepared, tmp_path, "spiky", **CHANGES, **SPIKY)
    spiky = counted_steps(build(run))
    assert len(spiky) == len(plain) == STEPS - 1
    # After step 2 the graphs of the run without spike skipping, the spiking steps 12 and 13 included: none recompiled
    # by a spike. The one exception is step 10's checkpoint, which stages the detector's state with the rest while
    # steps 11 and 12 run (in the background: it lands at index 9 or 10): a graph of its own, compiled once (unless an
    # earlier test in the same process compiled it).
    extra = [spiky[i]["compilations"] - plain[i]["compilations"] for i in range(1, len(spiky))]
    assert all(e >= 0 for e in extra) and sum(extra) <= 1, (spiky, plain)
    assert all(e == 0 for i, e in enumerate(extra, 1) if i not in (9, 10)), (spiky, plain)
    for k, (ours, theirs) in enumerate(zip(spiky, plain, strict=True), 1):
        assert ours["transfers_to_host"] == theirs["transfers_to_host"], (k, ours, theirs)
        assert ours["executions"] == theirs["executions"], (k, ours, theirs)
    for k in (11, 12, 13):  # steps 12, 13 and 14, each after a step without a sync point: nothing reaches the host
        assert spiky[k - 1]["transfers_to_host"] == 0, (k + 1, spiky[k - 1])
    logged = {r["step"]: r for r in records(run) if "loss" in r}
    assert logged[10]["spikes_skipped"] == 0 and logged[15]["spikes_skipped"] == 2 == logged[20]["spikes_skipped"]


def test_a_spiking_steps_update_is_not_applied_on_the_device(prepared: Path, tmp_path: Path, spiking: None) -> None:
    trainer = build(make_run(prepared, tmp_path, "weights", **{**CHANGES, **SPIKY, "training.max_steps": 14}))
    after: list[dict[str, torch.Tensor]] = []
    step = trainer.train_step

    def train_step(batches: Any) -> dict[str, Any]:
        out = step(batches)
        after.append(trainer.world.to_host({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}))
        return out

    trainer.train_step = train_step  # type: ignore[method-assign]
    assert trainer.fit() == 0
    for name, before in after[10].items():  # after steps 12 and 13: the weights after step 11
        assert torch.equal(after[11][name], before) and torch.equal(after[12][name], before), name
    assert any(not torch.equal(after[13][n], after[12][n]) for n in after[12])  # step 14 is applied
