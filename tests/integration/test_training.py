"""The training entrypoint for real, as jobs run it: learning, NaN policy, SIGTERM, and two gloo ranks."""

from __future__ import annotations

import math
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.shards import iter_documents, read_manifest
from hlat.core.storage import Storage
from hlat.training.checkpoint import CheckpointManager
from tests.jobs import final_weights, launch, make_run, metrics, train

pytestmark = pytest.mark.slow


def unigram_entropy(run: Path) -> float:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(run / "tokenizer/tokenizer.model"))
    data = Storage(str(run / "data"))
    counts: Counter[int] = Counter()
    for doc in iter_documents(data, read_manifest(data), "validation"):
        counts.update([*sp.encode(doc), sp.eos_id()])
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


def test_the_tiny_model_learns(prepared: Path, tmp_path: Path) -> None:
    run = make_run(prepared, tmp_path, "learn", max_steps=300, eval_every=100, checkpoint_every=100)
    code, out = train(run)
    assert code == 0, out[-3000:]
    records = metrics(run)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    entropy = unigram_entropy(run)
    assert len(val) == 3 and val[-1] < val[0]
    assert val[-1] < entropy - 0.5, f"validation loss {val[-1]:.3f} vs unigram entropy {entropy:.3f}"
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 301))
    assert {"grad_norm", "lr", "tokens_per_s", "memory_gb", "samples_crc32"} <= set(steps[-1])
    assert (run / "tensorboard").is_dir() and any((run / "tensorboard").iterdir())
    # Launched again on the finished run: it says there is nothing to do, and trains nothing.
    code, out = train(run)
    assert code == 0 and "nothing to train: the run is at step 300, training.max_steps is 300" in out, out[-2000:]
    assert "training tiny" not in out and len(metrics(run)) == len(records)


def test_nan_loss_exits_for_a_restart_or_skips(prepared: Path, tmp_path: Path) -> None:
    run = make_run(prepared, tmp_path, "nan-exit", max_steps=12, checkpoint_every=5, eval_every=0)
    code, out = train(run, {"HLAT_FAULT_NAN_AT_STEP": "8"})
    assert code == 3, out[-2000:]
    assert "loss is nan at step 8" in out
    code, out = train(run, {"HLAT_FAULT_NAN_AT_STEP": "8"})  # the relaunch resumes from step 5 and finishes
    assert code == 0, out[-2000:]
    assert "resumed from step 5" in out

    run = make_run(prepared, tmp_path, "nan-skip", max_steps=12, checkpoint_every=5, eval_every=0, nan_policy="skip")
    code, out = train(run, {"HLAT_FAULT_NAN_AT_STEP": "8"})
    assert code == 0, out[-2000:]
    skipped = [r["step"] for r in metrics(run) if r.get("skipped")]
    assert skipped == [8]


def test_sigterm_checkpoints_and_exits_zero(prepared: Path, tmp_path: Path) -> None:
    run = make_run(prepared, tmp_path, "sigterm", max_steps=2000, checkpoint_every=1000, eval_every=0)
    proc = launch(run)
    deadline = time.monotonic() + 120
    while len(metrics(run)) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:]
    step = CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1).latest_step()
    assert step is not None and 5 <= step < 2000
    assert "SIGTERM: checkpointing step" in out


def test_two_ranks_under_torchrun_on_the_local_backend(prepared: Path, tmp_path: Path) -> None:
    from hlat.infra.backends.local import LocalBackend
    from hlat.infra.backends.protocol import JobSpec, Status

    run = make_run(
        prepared, tmp_path, "torchrun", max_steps=6, checkpoint_every=3, eval_every=3, **{"job.processes_per_node": 2}
    )
    backend = LocalBackend(str(tmp_path / "jobs"))
    spec = JobSpec("torchrun-train-1", "torchrun", 1, str(run), str(run / "config.json"), "local", 1, 2, 600)
    backend.submit(spec)
    deadline = time.monotonic() + 300
    while (state := backend.describe(spec.name)) is not None and not state.terminal and time.monotonic() < deadline:
        time.sleep(0.2)
    assert state is not None and state.status == Status.COMPLETED, "\n".join(backend.logs(spec.name)[0][-30:])
    step_dir = run / "checkpoints/step-000000006"
    assert {"rank-00000.pt", "rank-00001.pt", "COMMITTED"} <= {p.name for p in step_dir.iterdir()}
    assert [r["step"] for r in metrics(run) if "val_loss" in r] == [3, 6]


@pytest.mark.parametrize(
    ("precision", "options"),
    [
        ("bf16-sr", {"document_masking": True}),
        ("bf16-mixed", {"async_checkpoint": True, "parallelism.activation_checkpointing": "selective"}),
    ],
)
def test_precision_modes_and_options_train_and_resume(
    prepared: Path, tmp_path: Path, precision: str, options: dict[str, Any]
) -> None:
    run = make_run(
        prepared,
        tmp_path,
        precision,
        max_steps=8,
        checkpoint_every=4,
        eval_every=0,
        **{"precision.mode": precision},
        **options,
    )
    code, out = train(run, {"HLAT_FAULT_KILL_BEFORE_COMMIT": "8"})
    assert code == -9, out[-2000:]
    assert f"precision {precision}" in out
    code, out = train(run)
    assert code == 0 and "resumed from step 4" in out, out[-2000:]
    weights = final_weights(run)
    expected = torch.bfloat16 if precision == "bf16-sr" else torch.float32
    assert {t.dtype for t in weights.values()} == {expected}
    losses = [r["loss"] for r in metrics(run) if "loss" in r]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)


def test_torch_compile_matches_eager(prepared: Path, tmp_path: Path) -> None:
    losses = {}
    for compiled in (False, True):
        run = make_run(
            prepared, tmp_path, f"compile-{compiled}", max_steps=3, checkpoint_every=3, eval_every=0, compile=compiled
        )
        code, out = train(run, timeout=600)
        assert code == 0, out[-2000:]
        losses[compiled] = [r["loss"] for r in metrics(run) if "loss" in r]
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)
