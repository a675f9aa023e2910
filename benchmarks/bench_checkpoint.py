"""Checkpoint saves at the speed of the disk: `CheckpointManager` against a plain sequential write of the same bytes
and a raw torch.save of the same state, in one run, and the time an async save holds up the training loop, as a
share of a training step of the model it saves.

The state is what `Trainer.save_checkpoint` passes: a `training.model.Transformer` (default: 12 layers, d_model
1024, vocabulary 32000, 220M parameters) after AdamW steps on `--device`, so model, optimizer moments, step and
config: 2.6 GB in FP32. Rows:
- disk (the peer): the state's tensor bytes written one after another with os.write into one file, then fsync:
  what the disk itself takes for that many bytes, with nothing else to do;
- raw torch.save + fsync: torch.save to a path (torch's C++ writer, its CRC32 of every record), then fsync;
- CheckpointManager, sync: what the trainer's synchronous save does: the state copied to host memory (when it is
  on an accelerator), torch.save streamed into the storage (a temporary file whose writeback starts as it is
  written, fsync, rename) with the size and sha256 taken on the way, then meta.json and the commit marker;
- CheckpointManager, async, as the trainer runs it: the time the loop is blocked, `save()` itself plus the wait
  before the next optimizer step for the state's copy in host memory (made while the next forward and backward
  run; an accelerator's state is copied inside `save()`), for a manager's first save (it allocates its staging
  buffers) and later ones (it refills them); and from `save()` to committed.
A synchronous save holds up the loop for all of its time, so "% of a step" is the whole save for those rows. The
step is forward + backward + AdamW on random tokens (`--batch` x `--seq`), best of `--repeats`.
Saves run interleaved, each into a fresh folder; folders are deleted (and the disk synced) between runs, outside
the timings. Save times are the best of `--repeats`; the blocking times of async saves are the worst (what the loop
may have to wait). The benchmark asserts that the checkpoint loads back equal to the peer's file.
Run:

    .venv/bin/python -m benchmarks.bench_checkpoint [--layers N] [--d-model D] [--vocab V] [--batch B] [--seq T]
                                                    [--device cpu|cuda] [--repeats R] [--dir FOLDER]

`--s3-requests` prints instead, with no I/O, the S3 requests of one checkpoint of HLAT 7B and 70B at 64 and 256
trn1 hosts against S3's per-prefix rates (`s3_request_table`): the request counts of the protocol are the ones
tests/integration/test_checkpoint_s3_requests.py measures on a 2 x 2 job (`checkpoint_requests`, `read_requests`),
scaled to each job's files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.measure import best_of, table
from hlat.core.config import ModelConfig
from hlat.core.storage import Storage
from hlat.training.checkpoint import (
    CHECKPOINT_PART_SIZE,
    SHARED_FILE,
    CheckpointManager,
    checkpoint_requests,
    rank_state,
    read_requests,
    step_dir,
)
from hlat.training.model import Transformer


class Training:
    """A Transformer trained with AdamW on `device` on random tokens; `state()` is what the trainer checkpoints."""

    def __init__(self, cfg: ModelConfig, batch: int, seq: int, device: str) -> None:
        torch.manual_seed(0)
        self.cfg, self.device = cfg, device
        self.model = Transformer(cfg)
        self.model.init_weights()
        self.model.to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        tokens = torch.randint(3, cfg.vocab_size, (batch, seq + 1), device=device)
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]
        self.steps = 0

    def forward_backward(self) -> None:
        loss = F.cross_entropy(self.model(self.inputs).flatten(0, 1), self.targets.flatten())
        loss.backward()
        synchronize(self.device)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        self.steps += 1

    def step(self) -> None:
        self.forward_backward()
        self.optimizer_step()

    def state(self) -> dict[str, Any]:
        return {
            "step": self.steps,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "config": self.cfg.model_dump(mode="json"),
        }


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from tensors(value)


def plain_write(host_tensors: list[torch.Tensor], path: str) -> None:
    """The peer: the tensors' bytes written in order with os.write, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in host_tensors:
            view = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_save(state: dict[str, Any], path: str) -> None:
    """torch.save to a path (torch's own C++ file writer), then fsync, as any durable save must."""
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def assert_equal(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), where
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
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--device", default="cpu", help="where the model trains and its state lives (cpu, cuda)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    parser.add_argument("--s3-requests", action="store_true", help="print the S3 request estimate table and stop")
    args = parser.parse_args(argv)
    if args.s3_requests:
        estimate = s3_request_table()
        print(estimate)
        return estimate
    cfg = ModelConfig(
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        ffn_hidden=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=max(args.seq, 16),
    )
    training = Training(cfg, args.batch, args.seq, args.device)
    training.step()  # warm-up, and the optimizer's moments exist from here on
    step_s = best_of(training.step, args.repeats)
    state = training.state()
    mine = rank_state({"epoch": 0, "offset": 123})
    gigabytes = sum(t.nbytes for t in tensors(state)) / 1e9
    root = tempfile.mkdtemp(prefix="hlat-bench-ckpt-", dir=args.dir)
    try:
        results = time_saves(training, mine, root, args.repeats)
        # The peer and ours must hold the same state.
        raw_save(state, os.path.join(root, "check.pt"))
        expected = torch.load(os.path.join(root, "check.pt"), map_location="cpu", weights_only=True)
        store = Storage(os.path.join(root, "check"))
        CheckpointManager(store, keep_last=1).save(1, state, mine)
        assert_equal(expected, CheckpointManager(store, keep_last=1).load(1)[0])
        file_gb = os.path.getsize(os.path.join(store.path(step_dir(1)), SHARED_FILE)) / 1e9
    finally:
        shutil.rmtree(root, ignore_errors=True)

    disk, raw = results["disk"], results["raw"]
    rows = []
    for key, name, whole_save in (
        ("disk", "disk: plain write of the tensor bytes + fsync (peer)", True),
        ("raw", "raw torch.save + fsync", True),
        ("sync", "CheckpointManager, sync", True),
        ("async_first", "CheckpointManager, async: loop blocked, 1st save", False),
        ("async_later", "CheckpointManager, async: loop blocked, later saves", False),
        ("async_total", "CheckpointManager, async: save() to committed", True),
    ):
        seconds = results[key]
        rate = f"{gigabytes / seconds:.2f}" if whole_save else "-"
        vs_disk = f"{disk / seconds:.2f}x" if whole_save else "-"
        vs_raw = f"{raw / seconds:.2f}x" if whole_save else "-"
        rows.append([name, f"{seconds:.2f}", rate, vs_disk, vs_raw, f"{seconds / step_s:.1%}"])
    out = table(["save", "seconds", "GB/s", "vs disk", "vs raw torch.save", "% of a training step"], rows)
    print(
        f"Transformer {cfg.num_params() / 1e6:.1f}M params + AdamW on {args.device}: {gigabytes:.2f} GB of tensors "
        f"({file_gb:.2f} GB file); training step (batch {args.batch} x seq {args.seq}, fp32) {step_s:.2f} s; "
        f"{os.cpu_count()} cores; best of {args.repeats} (blocking times: worst of {args.repeats})\n{out}"
    )
    return out


def time_saves(training: Training, mine: dict[str, Any], root: str, repeats: int) -> dict[str, float]:
    """Best time of each kind of save (worst for the async saves' blocking times), in seconds, the kinds
    interleaved so a disturbance hits each alike."""
    best: dict[str, float] = {}
    runs = 0
    state = training.state()
    host_tensors = [t.detach().cpu() for t in tensors(state)]  # the peer writes from host memory: its bytes only

    def timed(key: str, fn: Callable[[str], float | None]) -> None:
        nonlocal runs
        runs += 1
        folder = os.path.join(root, f"run-{runs}")
        os.makedirs(folder)
        os.sync()
        start = time.perf_counter()
        measured = fn(folder)
        seconds = time.perf_counter() - start if measured is None else measured
        best[key] = min(best.get(key, float("inf")), seconds)
        shutil.rmtree(folder)
        os.sync()  # the deletion's writes must not land in the next timing

    def blocked(manager: CheckpointManager, step: int) -> float:
        """What the loop waits for, as the trainer saves: save(), then the next step's forward and backward while
        the state is copied, then the wait for that copy before the optimizer step."""
        start = time.perf_counter()
        manager.save(step, training.state(), mine)
        waited = time.perf_counter() - start
        training.forward_backward()
        start = time.perf_counter()
        manager.wait_staged()
        waited += time.perf_counter() - start
        training.optimizer_step()
        return waited

    def manager_async(folder: str) -> float:
        manager = CheckpointManager(Storage(folder), keep_last=2, async_save=True, stage_in_background=True)
        try:
            first = blocked(manager, 1)
            manager.wait()
            start = time.perf_counter()
            manager.save(2, training.state(), mine)
            manager.wait()
            total = time.perf_counter() - start
            later = blocked(manager, 3)
            manager.wait()
        finally:
            manager.close()
        # What the loop may have to wait: the worst, not the best.
        best["async_first"] = max(best.get("async_first", 0.0), first)
        best["async_later"] = max(best.get("async_later", 0.0), later)
        return total

    for _ in range(repeats):
        timed("disk", lambda folder: plain_write(host_tensors, os.path.join(folder, "bytes")))
        timed("raw", lambda folder: raw_save(state, os.path.join(folder, "state.pt")))
        timed("sync", lambda folder: CheckpointManager(Storage(folder), keep_last=1).save(1, state, mine))
        timed("async_total", manager_async)
    return best


# -- S3 requests at HLAT's scale: arithmetic over the measured protocol ------------------------------------------
# https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html
S3_PUT_PER_PREFIX_S = 3500
S3_GET_PER_PREFIX_S = 5500
RANKS_PER_HOST = 32  # trn1.32xlarge: 16 Trainium chips, 32 NeuronCores, a rank each
UPLOAD_BYTES_PER_S = 256 << 20  # one s3fs upload (its parts go one after another): ~1 part of 256 MiB a second
S3FS_PART = 50 << 20  # s3fs's default part size: what checkpoints used before
RANK_FILE_BYTES = 64 << 10  # RNG states and the loader's position


@dataclass(frozen=True)
class JobShape:
    """One HLAT training job's checkpoint: its shard files (one per model-parallel shard) and rank files."""

    name: str
    params: float
    hosts: int
    tp: int
    pp: int
    shard_bytes_per_param: int
    """Bytes per parameter in the shard files together (7B, pure BF16: weights and both AdamW moments = 6;
    70B under ZeRO-1: the weights, FP32-typed in torch on both SDKs = 4)."""
    rank_bytes_per_param: int
    """Bytes per parameter in the rank files together (70B, ZeRO-1 on 2.28's bf16-mixed: both FP32 moments = 8, the
    masters being the FP32 parameters; on 2.24.1 NxD's FP64 optimizer dtype makes moments and saved masters 24)."""

    @property
    def world_size(self) -> int:
        return self.hosts * RANKS_PER_HOST

    def files(self) -> dict[str, int]:
        shards = self.tp * self.pp
        files = {f"model-{i}.pt": int(self.params * self.shard_bytes_per_param / shards) for i in range(shards)}
        rank_bytes = int(self.params * self.rank_bytes_per_param / self.world_size) + RANK_FILE_BYTES
        files.update({f"rank-{r}.pt": rank_bytes for r in range(self.world_size)})
        return files


def hlat_jobs() -> list[JobShape]:
    """HLAT 7B (TP8, pure BF16 weights and optimizer states, DP = 4 x hosts) and 70B (TP32 PP8, ZeRO-1 with FP32
    optimizer states, Neuron 2.28's bf16-mixed) at 64 and 256 hosts."""
    jobs = []
    for hosts in (64, 256):
        jobs.append(JobShape("7B", 6.74e9, hosts, tp=8, pp=1, shard_bytes_per_param=6, rank_bytes_per_param=0))
        jobs.append(JobShape("70B", 68.98e9, hosts, tp=32, pp=8, shard_bytes_per_param=4, rank_bytes_per_param=8))
    return jobs


def s3_requests(job: JobShape, part_size: int, spread: bool, manifests: bool) -> dict[str, float]:
    """One checkpoint's S3 requests, all under its step-N/ prefix: `writes` (PUT/POST class), `commit_reads`
    (rank 0 reading the manifests), `resume_reads` (every rank finding the checkpoint and reading its files), and
    the peak requests a second into the prefix while writing and resuming.

    Peaks: without spreading, every rank's first request (a whole file's PUT, or a multipart upload's create) and
    its manifest land within about a second, as the ranks finish serialising together, plus one part a second per
    multipart upload (at UPLOAD_BYTES_PER_S); with spreading, the ranks start at write_rate (2,000/s) and
    read_rate (3,000/s), plus the same parts, and the shard writers' uploads (low ranks, first) at once."""
    files = job.files()
    world = job.world_size
    writes = checkpoint_requests(files, part_size, manifests=world - 1 if manifests else 0)
    multipart = sum(1 for size in files.values() if size > part_size)
    parts_per_s = multipart * max(1.0, UPLOAD_BYTES_PER_S / part_size)
    first = world + (world - 1 if manifests else 0)  # every rank file (or its create), every manifest
    shards = job.tp * job.pp
    if spread:  # now: read_state's requests
        reads_per_rank = sum(read_requests(files[name], part_size) for name in ("model-0.pt", "rank-0.pt"))
    else:  # before: a HEAD, then one GET or a ranged GET per part
        reads_per_rank = sum(1 + max(1, -(-files[name] // part_size)) for name in ("model-0.pt", "rank-0.pt"))
    listed = len(files) + (world - 1 if manifests else 0) + 2
    pages = -(-listed // 1000)
    # Finding the newest checkpoint: before, every rank ran CheckpointIndex.latest_step then read_meta: the listing
    # of checkpoints/, twice the step folder's (a HEAD, a LIST and its pages), the marker and meta.json (a HEAD
    # and a GET each), then meta.json again; now rank 0 alone lists once and GETs the marker and meta.json.
    find = 3 + 2 * (2 + pages + 4) + 2
    write_peak: float
    resume_peak: float
    if spread:
        find = 3 + 2 + pages + 2
        write_peak = min(first, 2000) + multipart + parts_per_s
        resume_peak = min(world * reads_per_rank, 3000)
        resume = find + world * reads_per_rank
    else:
        write_peak = first + multipart + parts_per_s
        resume_peak = world * (find + reads_per_rank) / 2  # ~2 s for each rank's round trips one after another
        resume = world * (find + reads_per_rank)
    return {
        "files": len(files),
        "shards": shards,
        "writes": sum(writes.values()),
        "commit_reads": world - 1 if manifests else 0,
        "write_peak_per_s": write_peak,
        "resume_reads": resume,
        "resume_peak_per_s": resume_peak,
    }


def s3_request_table(part_size: int = CHECKPOINT_PART_SIZE) -> str:
    """The markdown table of `s3_requests` for HLAT's jobs, before (s3fs's 50 MiB parts, every rank finding the
    checkpoint, no manifests or spreading) and now."""
    rows = [
        "| job | hosts (ranks) | file size: shard / rank | PUT-class per checkpoint, before -> now | peak PUT/s "
        "in step-N/, before -> now | resume GET/HEAD, before -> now | peak GET/s, before -> now |",
        "|---|---|---|---|---|---|---|",
    ]
    for job in hlat_jobs():
        files = job.files()
        before = s3_requests(job, S3FS_PART, spread=False, manifests=False)
        now = s3_requests(job, part_size, spread=True, manifests=True)
        rows.append(
            f"| {job.name} | {job.hosts} ({job.world_size}) | {files['model-0.pt'] / 1e6:,.0f} MB / "
            f"{files['rank-0.pt'] / 1e6:,.1f} MB | {before['writes']:,.0f} -> {now['writes']:,.0f} "
            f"(+{now['commit_reads']:,.0f} GET at commit) | {before['write_peak_per_s']:,.0f} -> "
            f"{now['write_peak_per_s']:,.0f} (limit {S3_PUT_PER_PREFIX_S:,}) | {before['resume_reads']:,.0f} -> "
            f"{now['resume_reads']:,.0f} | {before['resume_peak_per_s']:,.0f} -> {now['resume_peak_per_s']:,.0f} "
            f"(limit {S3_GET_PER_PREFIX_S:,}) |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
