"""Checkpoints queued for evaluation are pinned against retention: the train stage's CheckpointEvaluator
(tasks/evaluate.py) pins each checkpoint it queues and unpins it once its evaluation has ended, successfully or
not, while the trainer's CheckpointManager keeps saving and pruning (keep_last=1). The evaluation job is replaced by
one that waits for the test."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.layout import CHECKPOINTS_DIR, PINS_DIR
from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.tasks import evaluate
from hlat.training.checkpoint import CheckpointManager, step_dir


def test_a_checkpoint_queued_for_evaluation_outlives_retention_until_evaluated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    trainer = CheckpointManager(Storage(str(run / CHECKPOINTS_DIR)), keep_last=1)
    gate = threading.Event()
    evaluated: list[tuple[int, list[int], bool]] = []

    def evaluation_job(run_: Any, step: int) -> dict[str, Any]:
        evaluated.append((step, trainer.pinned_steps(), trainer.latest_step() is not None))
        assert gate.wait(timeout=30)
        if step == 4:
            raise RuntimeError("the evaluation job failed (injected)")
        assert torch.equal(trainer.load_shared(step)["w"], torch.full((2,), float(step)))  # still there
        return {}

    monkeypatch.setattr(evaluate, "run_evaluation_job", evaluation_job)
    trainer.pin(1, why="an earlier stage's evaluator, which died")
    config = load_config("tiny", {"evaluation.every_steps": 2})
    evaluator = evaluate.CheckpointEvaluator(Run.at(str(run), config, "pinned"))
    assert trainer.pinned_steps() == []  # stale: cleared when the stage's evaluator starts

    def save(step: int) -> None:
        trainer.save(step, {"w": torch.full((2,), float(step))}, {})

    save(2)
    evaluator.poll()  # queues 2 and pins it; its evaluation waits at the gate
    for step in (3, 4):
        save(step)
    evaluator.poll()  # queues 4 behind 2
    for step in (5, 6):
        save(step)  # keep_last=1: without the pins, 2 and 4 would be gone by now
    assert trainer.all_steps() == [2, 4, 6] and trainer.pinned_steps() == [2, 4]
    assert not (run / CHECKPOINTS_DIR / step_dir(3)).exists()
    gate.set()
    evaluator.close()
    assert [step for step, _, _ in evaluated] == [2, 4, 6]
    assert evaluated[0][1] == [2] and 4 in evaluated[1][1]  # each was pinned while evaluated
    assert trainer.pinned_steps() == []  # unpinned after success (2, 6) and failure (4) alike
    assert not (run / CHECKPOINTS_DIR / PINS_DIR).exists()
    save(7)
    assert trainer.all_steps() == [7]  # no longer pinned: retention takes them
