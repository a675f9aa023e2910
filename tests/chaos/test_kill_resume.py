"""Chaos: a training job SIGKILLed at random moments (once mid-checkpoint) and relaunched each time ends
bitwise equal to one that was never interrupted, having consumed the same samples in the same order (on a mixture of
two sources, on CPU; on one source on CUDA)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.jobs import final_weights, launch, make_run, metrics, train

pytestmark = pytest.mark.slow

STEPS = 48
RUN = {"max_steps": STEPS, "checkpoint_every": 4, "keep_checkpoints": 2, "eval_every": 0, "warmup_steps": 5}


def history(run: Path) -> list[tuple[int, float, int]]:
    """(step, loss, checksum of the step's tokens) for every optimizer step."""
    return [(r["step"], r["loss"], r["samples_crc32"]) for r in metrics(run) if "samples_crc32" in r]


def kill_and_resume(prepared: Path, root: Path, kills: int, *, exact_kills: bool = True, **run: Any) -> None:
    """An uninterrupted job, and the same job torn mid-checkpoint then SIGKILLed `kills` times at random steps and
    relaunched each time: both end with the same per-step history and bitwise the same weights. A fast device may
    finish before every kill lands (`exact_kills=False`: at least one random kill, besides the torn checkpoint)."""
    reference = make_run(prepared, root, "uninterrupted", **run)
    code, out = train(reference)
    assert code == 0, out[-2000:]

    chaos = make_run(prepared, root, "chaos", **run)
    # A torn checkpoint first: the job dies after writing step 12's files, before its commit marker.
    code, out = train(chaos, {"HLAT_FAULT_KILL_BEFORE_COMMIT": "12"})
    assert code == -9, out[-2000:]
    assert not (chaos / "checkpoints/step-000000012/COMMITTED").exists()
    rng = random.Random(20261121)
    done_kills = 0
    for _ in range(200):
        if done_kills == kills:
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
            done_kills += 1
        proc.communicate()
    assert done_kills == kills if exact_kills else done_kills >= 1
    code, out = train(chaos)
    assert code == 0, out[-2000:]

    assert history(chaos) == history(reference)  # same samples, same order, same losses
    ours, theirs = final_weights(chaos), final_weights(reference)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_killed_five_times_and_mid_checkpoint_ends_bitwise_equal(prepared_mixture: Path, tmp_path: Path) -> None:
    """On a mixture of two sources: the loader's per-source positions and token counts resume bitwise too."""
    kill_and_resume(prepared_mixture, tmp_path, kills=5, **RUN)
    shares = [r for r in metrics(tmp_path / "chaos") if "tokens/prose" in r][-1]
    assert shares["tokens/prose"] > 0 and shares["tokens/stdlib"] > 0


# The CUDA paths a GPU run takes: plain FP32; HLAT's pure BF16 with stochastic rounding (a CUDA generator);
# compiled blocks in BF16-mixed with FlexAttention's document masks and fused AdamW (benchmarks/bench_train.py).
CUDA_VARIANTS = {
    "fp32": {},
    "bf16-sr": {"precision.mode": "bf16-sr"},
    "bf16-mixed-compiled": {
        "precision.mode": "bf16-mixed",
        "training.compile": True,
        "training.document_masking": True,
    },
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", list(CUDA_VARIANTS))
def test_killed_on_cuda_ends_bitwise_equal(prepared: Path, tmp_path: Path, variant: str) -> None:
    """On a GPU, under `training.deterministic` (the default), as on CPU."""
    kill_and_resume(
        prepared, tmp_path, kills=3, exact_kills=False, **RUN, **{"training.device": "cuda", **CUDA_VARIANTS[variant]}
    )
