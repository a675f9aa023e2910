"""Checkpoint saves: `CheckpointManager` against a raw torch.save + fsync of the same state, in one run, and the
time an async save holds up the training loop, as a share of a training step of the model it saves.

The state is what `Trainer.save_checkpoint` passes: a `training.model.Transformer` (default: 8 layers, d_model 512,
vocabulary 32000, 58M parameters) after AdamW steps on CPU, so model, optimizer moments, step and config, about
0.7 GB. Rows:
- raw torch.save + fsync (the peer): torch.save to a path, then fsync: the floor any file-based save stands on;
- CheckpointManager, sync: torch.save streamed into the storage (a temporary file, fsync, rename) with the size
  and sha256 taken on the way, then meta.json and the commit marker;
- the previous CheckpointManager save, rebuilt here: torch.save into bytes in memory, sha256, `write_bytes`;
- CheckpointManager, async: the time `save()` blocks (staging the state to CPU), for a manager's first save (it
  allocates its staging buffers) and later ones (it refills them); and from `save()` to committed.
A synchronous save holds up the loop for all of its time, so "% of a step" is the whole save for those rows.
The step is forward + backward + AdamW on random tokens (`--batch` x `--seq`), best of `--repeats`.
Saves run interleaved, each into a fresh folder; folders are deleted (and the disk synced) between runs, outside
the timings. Save times are the best of `--repeats`; the blocking times of async saves are the worst (what the loop
may have to wait). The benchmark asserts that the checkpoint loads back equal to the peer's file.
Run:

    .venv/bin/python -m benchmarks.bench_checkpoint [--layers N] [--d-model D] [--vocab V] [--batch B] [--seq T]
                                                    [--repeats R] [--dir FOLDER]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import best_of, table
from hlat.core.config import ModelConfig
from hlat.core.storage import Storage
from hlat.training.checkpoint import SHARED_FILE, CheckpointManager, capture_rng_state, step_dir
from hlat.training.model import Transformer


def trained_state(cfg: ModelConfig, batch: int, seq: int, repeats: int) -> tuple[dict[str, Any], float]:
    """(the checkpoint state of a Transformer after AdamW steps, the best time of one step)."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(3, cfg.vocab_size, (batch, seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    steps = 0

    def step() -> None:
        nonlocal steps
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1

    step()  # warm-up, and the optimizer's moments exist from here on
    step_s = best_of(step, repeats)
    state = {
        "step": steps,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "config": cfg.model_dump(mode="json"),
    }
    return state, step_s


def state_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(state_bytes(v) for v in obj)
    return 0


def raw_save(state: dict[str, Any], path: str) -> None:
    """The peer: torch.save to a path (torch's own C++ file writer), then fsync, as any durable save must."""
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def in_memory_save(state: dict[str, Any], rank_state: dict[str, Any], store: Storage, step: int) -> None:
    """The files of the previous CheckpointManager save: each serialised whole in memory, hashed, then written
    (its meta.json and marker, a few hundred bytes, are left out: this row is a little flattered)."""
    for name, obj in ((SHARED_FILE, state), ("rank-00000.pt", rank_state)):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
        hashlib.sha256(data).hexdigest()
        store.write_bytes(f"{step_dir(step)}/{name}", data)


def assert_equal(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1376)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    args = parser.parse_args(argv)
    cfg = ModelConfig(
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        ffn_hidden=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=max(args.seq, 16),
    )
    state, step_s = trained_state(cfg, args.batch, args.seq, args.repeats)
    rank_state = {"loader": {"epoch": 0, "offset": 123}, "rng": capture_rng_state()}
    gigabytes = state_bytes(state) / 1e9
    root = tempfile.mkdtemp(prefix="hlat-bench-ckpt-", dir=args.dir)
    try:
        results = time_saves(state, rank_state, root, args.repeats)
        # The peer and ours must hold the same state.
        raw_save(state, os.path.join(root, "check.pt"))
        expected = torch.load(os.path.join(root, "check.pt"), weights_only=True)
        store = Storage(os.path.join(root, "check"))
        CheckpointManager(store, keep_last=1).save(1, state, rank_state)
        assert_equal(expected, CheckpointManager(store, keep_last=1).load(1)[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)

    peer = results["raw"]
    rows = []
    for key, name, seconds_per_save in (
        ("raw", "raw torch.save + fsync (peer)", True),
        ("sync", "CheckpointManager, sync (streamed)", True),
        ("in_memory", "previous save: bytes in memory, then write", True),
        ("async_first", "CheckpointManager, async: save() blocks, 1st save", False),
        ("async_later", "CheckpointManager, async: save() blocks, later saves", False),
        ("async_total", "CheckpointManager, async: save() to committed", True),
    ):
        seconds = results[key]
        rate = f"{gigabytes / seconds:.2f}" if seconds_per_save else "-"
        ratio = f"{peer / seconds:.2f}x" if seconds_per_save else "-"
        rows.append([name, f"{seconds:.3f}", rate, ratio, f"{seconds / step_s:.1%}"])
    out = table(["save", "seconds", "GB/s", "speed vs raw torch.save", "% of a training step"], rows)
    print(
        f"Transformer {cfg.num_params() / 1e6:.1f}M params + AdamW: {gigabytes:.2f} GB of tensors; training step "
        f"(batch {args.batch} x seq {args.seq}, fp32, CPU) {step_s:.2f} s; {os.cpu_count()} cores; "
        f"best of {args.repeats} (blocking times: worst of {args.repeats})\n{out}"
    )
    return out


def time_saves(state: dict[str, Any], rank_state: dict[str, Any], root: str, repeats: int) -> dict[str, float]:
    """Best time of each kind of save (worst for the async saves' blocking times), in seconds, the kinds
    interleaved so a disturbance hits each alike."""
    best: dict[str, float] = {}
    runs = 0

    def timed(key: str, fn: Callable[[str], float | None]) -> None:
        nonlocal runs
        runs += 1
        folder = os.path.join(root, f"run-{runs}")
        os.makedirs(folder)
        start = time.perf_counter()
        measured = fn(folder)
        seconds = time.perf_counter() - start if measured is None else measured
        best[key] = min(best.get(key, float("inf")), seconds)
        shutil.rmtree(folder)
        os.sync()  # the deletion's writes must not land in the next timing

    def manager_async(folder: str) -> float:
        manager = CheckpointManager(Storage(folder), keep_last=2, async_save=True)
        try:
            start = time.perf_counter()
            manager.save(1, state, rank_state)
            first = time.perf_counter() - start
            manager.wait()
            start = time.perf_counter()
            manager.save(2, state, rank_state)
            later = time.perf_counter() - start
            manager.wait()
            total = time.perf_counter() - start
        finally:
            manager.close()
        # What the loop may have to wait: the worst, not the best.
        best["async_first"] = max(best.get("async_first", 0.0), first)
        best["async_later"] = max(best.get("async_later", 0.0), later)
        return total

    for _ in range(repeats):
        timed("raw", lambda folder: raw_save(state, os.path.join(folder, "state.pt")))
        timed("sync", lambda folder: CheckpointManager(Storage(folder), keep_last=1).save(1, state, rank_state))
        timed("in_memory", lambda folder: in_memory_save(state, rank_state, Storage(folder), 1))
        timed("async_total", manager_async)
    return best


if __name__ == "__main__":
    main()
