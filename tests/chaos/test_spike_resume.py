"""Chaos: a training job with loss spikes (training.spike_skip, spikes injected at fixed steps by tests/spike_hooks.py)
SIGKILLed mid-checkpoint and at random steps, relaunched each time, skips the same steps and ends bitwise equal to an
uninterrupted one: the spike window and counters resume with the checkpoint."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from hlat.core.storage import Storage
from hlat.training.checkpoint import CheckpointManager
from tests import spike_hooks
from tests.jobs import launch, make_run, metrics, train

pytestmark = pytest.mark.slow

STEPS = 24
RUN = {"max_steps": STEPS, "checkpoint_every": 4, "keep_checkpoints": 2, "eval_every": 0, "warmup_steps": 5,
       "spike_skip": True, "spike_window": 8}  # fmt: skip
SPIKES = {"HLAT_JOB_HOOKS": spike_hooks.MODULE, spike_hooks.SPIKE_STEPS: "10,13,17,18"}


def history(run: Path) -> list[tuple[int, float, int, bool, int]]:
    """(step, loss, checksum of its tokens, skipped, spikes skipped so far) for every optimizer step."""
    return [
        (r["step"], r["loss"], r["samples_crc32"], bool(r.get("skipped")), r["spikes_skipped"])
        for r in metrics(run)
        if "samples_crc32" in r
    ]


def final_state(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    manager = CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1)
    step = manager.latest_step()
    assert step == STEPS
    shared, _ = manager.load(step)
    spikes = {k: v for k, v in shared["spikes"].items() if isinstance(v, torch.Tensor)}
    return {"model": shared["model"], "spikes": spikes}


def test_a_run_with_spikes_killed_and_resumed_is_bitwise_the_uninterrupted_one(prepared: Path, tmp_path: Path) -> None:
    reference = make_run(prepared, tmp_path, "uninterrupted", **RUN)
    code, out = train(reference, SPIKES)
    assert code == 0, out[-2000:]
    expected = history(reference)
    assert [step for step, _, _, skipped, _ in expected if skipped] == [10, 13, 17, 18]
    assert expected[-1][-1] == 4

    chaos = make_run(prepared, tmp_path, "chaos", **RUN)
    # A torn checkpoint first: the job dies writing step 12's commit marker, between two spikes.
    code, out = train(chaos, {**SPIKES, "HLAT_FAULT_KILL_BEFORE_COMMIT": "12"})
    assert code == -9, out[-2000:]
    rng = random.Random(20261128)
    kills = 0
    for _ in range(50):
        done = len(history(chaos))
        if kills == 2 or done >= STEPS - 2:
            break
        target = min(STEPS - 1, done + rng.randint(2, 5))
        proc = launch(chaos, SPIKES)
        deadline = time.monotonic() + 120
        while proc.poll() is None and len(history(chaos)) < target and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.05))
        if proc.poll() is None:
            proc.kill()
            kills += 1
        proc.communicate()
    assert kills >= 1
    code, out = train(chaos, SPIKES)
    assert code == 0, out[-2000:]

    assert history(chaos) == expected  # the same samples, losses and skipped steps
    ours, theirs = final_state(chaos), final_state(reference)
    for part in ("model", "spikes"):
        assert ours[part].keys() == theirs[part].keys()
        for name in ours[part]:
            assert torch.equal(ours[part][name], theirs[part][name]), (part, name)


def test_a_job_stopped_by_spikes_in_a_row_is_not_relaunched_by_the_train_stage(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the local job backend and the train stage's supervisor: the job exits EXIT_LOSS_SPIKES with its
    failure record, and the stage stops with one line naming the steps, after one job (job.max_repeats is 3)."""
    from hlat.core.presets import load_config
    from hlat.core.run import Run
    from hlat.infra.stage_jobs import supervisor_for
    from hlat.infra.supervision.errors import JobFailed
    from tests.sizes import SMALL_DATA

    training = {**RUN, "max_steps": 14, "spike_max_consecutive": 3}
    job = {"job.poll_seconds": 0.5, "job.max_repeats": 3}
    run_id = "diverged"
    run = make_run(prepared, tmp_path, run_id, **training, **job)
    config = load_config(
        "tiny", {**SMALL_DATA, **{f"training.{k}": v for k, v in training.items()}, **job}, run_id=run_id,
        storage=str(tmp_path),
    )  # fmt: skip
    monkeypatch.setenv("HLAT_JOB_HOOKS", spike_hooks.MODULE)  # the job's processes inherit the test's environment
    monkeypatch.setenv(spike_hooks.SPIKE_STEPS, "10,11,12")

    def latest() -> int | None:
        return CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1).latest_step()

    with pytest.raises(JobFailed) as info:
        supervisor_for(Run.at(str(run), config, run_id), current_step=latest).run_to_completion()
    message = str(info.value)
    assert "\n" not in message and "the run diverged, not relaunched" in message, message
    assert "LossSpikes: steps 10-12 spiked 3 in a row" in message, message
    assert [(a.action, a.category) for a in info.value.attempts] == [("fatal", "loss-spikes")]
    assert latest() == 8  # no checkpoint of the spiking steps
