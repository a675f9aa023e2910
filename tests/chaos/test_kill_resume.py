"""Chaos: a training job SIGKILLed at random moments (once mid-checkpoint) and relaunched each time ends
bitwise equal to one that was never interrupted, having consumed the same samples in the same order."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from tests.jobs import final_weights, launch, make_run, metrics, train

pytestmark = pytest.mark.slow

STEPS = 48
RUN = {"max_steps": STEPS, "checkpoint_every": 4, "keep_checkpoints": 2, "eval_every": 0, "warmup_steps": 5}


def history(run: Path) -> list[tuple[int, float, int]]:
    """(step, loss, checksum of the step's tokens) for every optimizer step."""
    return [(r["step"], r["loss"], r["samples_crc32"]) for r in metrics(run) if "samples_crc32" in r]


def test_killed_five_times_and_mid_checkpoint_ends_bitwise_equal(prepared: Path, tmp_path: Path) -> None:
    reference = make_run(prepared, tmp_path, "uninterrupted", **RUN)
    code, out = train(reference)
    assert code == 0, out[-2000:]

    chaos = make_run(prepared, tmp_path, "chaos", **RUN)
    # A torn checkpoint first: the job dies after writing step 12's files, before its commit marker.
    code, out = train(chaos, {"HLAT_FAULT_KILL_BEFORE_COMMIT": "12"})
    assert code == -9, out[-2000:]
    assert not (chaos / "checkpoints/step-000000012/COMMITTED").exists()
    rng = random.Random(20261121)
    kills = 0
    for _ in range(200):
        if kills == 5:
            break
        done = len(history(chaos))
        if done >= STEPS - 2:
            break
        target = min(STEPS - 1, done + rng.randint(2, 8))  # kill once the job has logged this many steps
        proc = launch(chaos)
        deadline = time.monotonic() + 120
        while proc.poll() is None and len(history(chaos)) < target and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.05))
        if proc.poll() is None:
            proc.kill()
            kills += 1
        proc.communicate()
    assert kills == 5
    code, out = train(chaos)
    assert code == 0, out[-2000:]

    assert history(chaos) == history(reference)  # same samples, same order, same losses
    ours, theirs = final_weights(chaos), final_weights(reference)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
