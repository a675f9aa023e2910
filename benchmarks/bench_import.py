"""Importing a Hugging Face checkpoint (model.init_from, training/checkpoint/hf_import.py) per rank of a TP x PP
layout: each rank's peak host memory against its share of the checkpoint (the checkpoint's bytes / (TP x PP)), and
the import's time against `safetensors.torch.load_file` of the same files, in one run.

The checkpoint is a LLaMA in BF16 (default: d_model 1024, 8 layers, 16 heads, ffn 2816, vocabulary 32000: 167M
parameters, 334 MB), written as transformers lays one out (its tensor names, config.json, shards of
`--shard-mb` and model.safetensors.index.json). Each position (TP rank, PP stage) imports in a process of its own:
it allocates its parameters (its stage's, sliced for its TP rank by training/parallel/tensor_slices.py, the rules
NxD's layers are initialised by; stages as NxD's auto partition cuts them: the blocks spread evenly, any remainder to
the later stages, the embedding on the first, the final norm and the output projection on the last), then fills
them with `fill_parameters`, reading tensor by tensor. Rows:
- a position: its parameters' bytes (its share of the checkpoint), the peak growth of its resident memory from
  before its parameters were allocated to the end of the import (VmHWM, reset through /proc/self/clear_refs) against
  that share, what it adds over its parameters (one checkpoint tensor at a time, and its TP slice), the largest
  single read, the checkpoint bytes it read, its time, and that time over load_file's;
- dense (1 x 1): one process importing everything, the same bytes as the peer reads;
- the peer: `safetensors.torch.load_file` of every file, each tensor copied into the dense model's parameters, in a
  process of its own (load_file maps the file: its bytes are read by the copy).
The files are read once before any timing (so every row reads from the page cache). Times are the best of
`--repeats` processes. The benchmark asserts that the dense import holds the peer's values. Run:

    .venv/bin/python -m benchmarks.bench_import [--tp 2] [--pp 2] [--layers 8] [--d-model 1024] [--heads 16]
                                                [--ffn 2816] [--vocab 32000] [--shard-mb 100] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.measure import table
from hlat.core.config import ModelConfig
from hlat.core.storage import Storage
from hlat.training.checkpoint.hf_import import SafetensorsReader, fill_parameters, hf_names
from hlat.training.models.llama import hf_llama_config
from hlat.training.parallel.tensor_slices import DenseParameter, dense_parameters, local_name, shard

MB = 1e6


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        ffn_hidden=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=2048,
    )


def write_checkpoint(cfg: ModelConfig, folder: Path, shard_bytes: int) -> int:
    """A random BF16 LLaMA of `cfg` in transformers' layout (config.json, shards of about `shard_bytes`, their
    index), written one tensor at a time; returns the tensors' bytes."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    hf_llama_config(cfg).save_pretrained(folder)
    generator = torch.Generator().manual_seed(0)
    shapes = {p.name: p.shape for p in dense_parameters(cfg)}
    groups: list[list[tuple[str, str]]] = [[]]
    size = 0
    for name in shapes:
        nbytes = 2 * _numel(shapes[name])
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, hf_names(name, cfg)[0]))
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {hf: (torch.randn(shapes[name], generator=generator) * 0.02).bfloat16() for name, hf in group}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map |= {hf: file for hf in tensors}
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def stage_of(param: DenseParameter, cfg: ModelConfig, pp: int) -> int:
    """The pipeline stage holding `param` (NxD's auto partition: blocks spread evenly, the remainder to the later
    stages; the embedding first, the final norm and output last)."""
    if param.name.startswith("layers."):
        layer = int(param.name.split(".")[1])
        base, extra = divmod(cfg.n_layers, pp)
        bounds, start = [], 0
        for stage in range(pp):
            start += base + (1 if stage >= pp - extra else 0)
            bounds.append(start)
        return next(stage for stage, end in enumerate(bounds) if layer < end)
    return 0 if param.name == "embed.weight" else pp - 1


class Position:
    """One (TP rank, PP stage): what `fill_parameters` uses of its model, and its parameters, allocated."""

    def __init__(self, cfg: ModelConfig, tp_rank: int, tp: int, stage: int, pp: int) -> None:
        self.cfg = cfg
        self.parallel = self
        self._rank, self._tp = tp_rank, tp
        self.params = {
            local_name(p.name, cfg, tp): torch.nn.Parameter(torch.zeros(self._shape(p), dtype=torch.bfloat16), False)
            for p in dense_parameters(cfg)
            if stage_of(p, cfg, pp) == stage
        }

    def _shape(self, param: DenseParameter) -> tuple[int, ...]:
        """The shape of this rank's slice of `param` (a slice of a meta tensor: nothing is allocated)."""
        return tuple(self.shard(param, torch.empty(param.shape, device="meta")).shape)

    def local_name(self, name: str) -> str:
        return local_name(name, self.cfg, self._tp)

    def shard(self, param: DenseParameter, full: torch.Tensor) -> torch.Tensor:
        return shard(param, full, self._rank, self._tp, self.cfg)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Reset this process's VmHWM to its current RSS (Linux: writing 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def warm_up(folder: str, cfg: ModelConfig, tp_rank: int, tp: int) -> None:
    """What a first import pays once per process, outside the measurement: the storage's modules, the index, one
    small tensor read and copied, every kind of slice (on the meta device and on the host) of a small model."""
    reader = SafetensorsReader(Storage(folder), "bench")
    norm = reader.read(hf_names("norm.weight", cfg)[0])
    torch.zeros(norm.shape, dtype=torch.bfloat16).copy_(norm)
    small = cfg.model_copy(update={"n_layers": 1, "d_model": 8 * cfg.head_dim, "ffn_hidden": 64, "vocab_size": 512})
    small = small.model_copy(update={"n_heads": 8})
    position = Position(small, tp_rank, tp, 0, 1)
    for param in dense_parameters(small):
        position.shard(param, torch.zeros(param.shape))


def run_position(folder: str, cfg: ModelConfig, tp_rank: int, tp: int, stage: int, pp: int) -> dict[str, Any]:
    """The import of one position, in this process: its parameters' bytes, the peak RSS growth from before they
    were allocated to the end of the import, the time of the import."""
    warm_up(folder, cfg, tp_rank, tp)
    _reset_peak()
    before = _status_kb("VmRSS")
    position = Position(cfg, tp_rank, tp, stage, pp)
    param_bytes = sum(p.nbytes for p in position.params.values())
    began = time.perf_counter()
    reader = SafetensorsReader(Storage(folder), "bench")
    tensors = fill_parameters(position, position.params, reader)  # type: ignore[arg-type]
    seconds = time.perf_counter() - began
    peak = _status_kb("VmHWM")
    return {
        "checksum": checksum(position.params.values()),
        "param_bytes": param_bytes,
        "growth": (peak - before) * 1024,
        "tensors": tensors,
        "read": reader.bytes_read,
        "largest": reader.largest_read,
        "seconds": seconds,
    }


def run_peer(folder: str, cfg: ModelConfig) -> dict[str, Any]:
    """`safetensors.torch.load_file` of every file of the checkpoint, each tensor copied into the dense model's
    parameters (allocated first, as for a position): load_file maps the file and reads nothing until a tensor is
    used, so the copy is where its bytes are read."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    load_file(str(files[0]))  # its modules, outside the measurement
    _reset_peak()
    before = _status_kb("VmRSS")
    params = {hf_names(p.name, cfg)[0]: torch.zeros(p.shape, dtype=torch.bfloat16) for p in dense_parameters(cfg)}
    began = time.perf_counter()
    read = 0
    for file in files:
        for name, tensor in load_file(str(file)).items():
            params[name].copy_(tensor)
            read += tensor.nbytes
    seconds = time.perf_counter() - began
    peak = _status_kb("VmHWM")
    param_bytes = sum(t.nbytes for t in params.values())
    return {
        "checksum": checksum(params.values()),
        "growth": (peak - before) * 1024,
        "param_bytes": param_bytes,
        "read": read,
        "seconds": seconds,
    }


def checksum(tensors: Any) -> float:
    """A float64 sum of every element (the dense import and the peer must hold the same values)."""
    return float(sum(t.double().sum() for t in tensors))


def in_process(argv: list[str], job: dict[str, Any]) -> dict[str, Any]:
    """`job` run by this module in a fresh Python (its own memory), with the benchmark's arguments."""
    command = [sys.executable, "-m", "benchmarks.bench_import", *argv, "--job", json.dumps(job)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench_import {job} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def best(argv: list[str], job: dict[str, Any], repeats: int) -> dict[str, Any]:
    runs = [in_process(argv, job) for _ in range(repeats)]
    return min(runs, key=lambda r: r["seconds"])


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=float, default=100)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary folder)")
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)  # one measurement, in a child process
    args = parser.parse_args(argv)
    cfg = model_config(args)
    if args.job is not None:
        job = json.loads(args.job)
        if job["kind"] == "peer":
            result = run_peer(job["folder"], cfg)
        else:
            result = run_position(job["folder"], cfg, job["tp_rank"], job["tp"], job["stage"], job["pp"])
        print(json.dumps(result))
        return ""

    shape_args = [
        "--layers", str(args.layers), "--d-model", str(args.d_model), "--heads", str(args.heads),
        "--ffn", str(args.ffn), "--vocab", str(args.vocab),
    ]  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="hlat-bench-import-", dir=args.dir))
    try:
        folder = root / "hf"
        total = write_checkpoint(cfg, folder, int(args.shard_mb * MB))
        files = sorted(folder.glob("*.safetensors"))
        for file in files:  # into the page cache: every row reads from memory
            file.read_bytes()
        peer = best(shape_args, {"kind": "peer", "folder": str(folder)}, args.repeats)
        positions = [(t, s, args.tp, args.pp) for s in range(args.pp) for t in range(args.tp)]
        measured = []
        for tp_rank, stage, tp, pp in [(0, 0, 1, 1), *positions]:
            job = {"kind": "position", "folder": str(folder), "tp_rank": tp_rank, "tp": tp, "stage": stage, "pp": pp}
            measured.append(((tp_rank, stage, tp, pp), best(shape_args, job, args.repeats)))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    dense = measured[0][1]
    assert dense["checksum"] == peer["checksum"], (dense["checksum"], peer["checksum"])  # the same weights
    rows = []
    for (tp_rank, stage, tp, pp), r in measured:
        name = "dense (1 x 1)" if tp == pp == 1 else f"tp{tp_rank} pp{stage} of {tp} x {pp}"
        share = total / (tp * pp)
        rows.append([
            name, f"{r['param_bytes'] / MB:.0f}", f"{share / MB:.0f}", f"{r['growth'] / MB:.0f}",
            f"{r['growth'] / share:.2f}", f"{(r['growth'] - r['param_bytes']) / MB:.0f}", f"{r['largest'] / MB:.0f}",
            f"{r['read'] / MB:.0f}", r["tensors"], f"{r['seconds']:.2f}", f"{r['seconds'] / peer['seconds']:.2f}x",
        ])  # fmt: skip
    rows.append([
        "load_file into the dense parameters (peer)", f"{peer['param_bytes'] / MB:.0f}", f"{total / MB:.0f}",
        f"{peer['growth'] / MB:.0f}", f"{peer['growth'] / total:.2f}",
        f"{(peer['growth'] - peer['param_bytes']) / MB:.0f}", "-", f"{peer['read'] / MB:.0f}", "-",
        f"{peer['seconds']:.2f}", "1.00x",
    ])  # fmt: skip
    head = [
        "position", "params MB", "ckpt / (TP x PP) MB", "peak RSS growth MB", "growth / share", "over params MB",
        "largest read MB", "read MB", "tensors", "s", "vs load_file",
    ]  # fmt: skip
    n_params = sum(_numel(p.shape) for p in dense_parameters(cfg))
    out = (
        f"HF import of a BF16 LLaMA ({n_params / 1e6:.0f}M parameters, {total / MB:.0f} MB in {len(files)} files) "
        f"per position of TP {args.tp} x PP {args.pp}\n" + table(head, rows)
    )
    print(out)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
