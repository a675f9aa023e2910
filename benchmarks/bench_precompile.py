"""Time to first training step with torch.compile: cold (no compile cache, everything compiled from scratch)
against warm (after the precompile job wrote the run's compile-cache/), on a small tiny-preset run, in one run.

Every start is a fresh `python -m training.train` process on a fresh copy of the run, with its own empty
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR: neither torch's in-memory caches nor Inductor's on-disk cache can
help either side, so warm gets exactly what compile-cache/ gives it. The figure compared is the trainer's
`first_step_seconds` (from building the Trainer to the end of step 1: model, compile or cache load, one step);
the process's wall time (imports, data, evaluation and checkpoint after the step included) is shown beside it.
Best of N each, cold and warm alternating. A third row, for reference, starts without compile-cache/ but with the
precompile job's own Inductor disk cache (possible only on the machine that compiled): on CPU it also holds the
compiled C++ kernels, which torch.compile's portable artifacts do not carry (on CUDA they carry the Triton
kernels), so it shows how much of a warm start is left to kernel compilation. Run:

    .venv/bin/python -m benchmarks.bench_precompile [--repeats N] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import table
from infra.prepare import prepare_dataset
from infra.runs import open_run
from infra.tokenizer import build_tokenizer
from training.compile_cache import CACHE_DIR, human_bytes
from training.presets import load_config

# The tiny preset over a small corpus and vocabulary (as the tests use), one step with torch.compile.
OVERRIDES: dict[str, Any] = {
    "data.max_documents": 300,
    "model.vocab_size": 512,
    "tokenizer.sample_bytes": 400_000,
    "tokenizer.report_sample_bytes": 100_000,
    "training.compile": True,
    "training.max_steps": 1,
    "training.eval_every": 0,
    "training.eval_batches": 1,
    "training.checkpoint_every": 1000,
}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2, help="cold and warm starts each (best is reported)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hlat-bench-precompile-") as tmp:
        root = Path(tmp)
        base = prepare(root)
        precompile_s, summary = run_program("training.precompile", base, root / "inductor-precompile", args.device)
        manifest = json.loads((base / CACHE_DIR / "latest.json").read_text())
        starts: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": [], "disk": []}
        for repeat in range(args.repeats):
            for mode in starts:
                run = root / f"{mode}-{repeat}"
                ignore = None if mode == "warm" else shutil.ignore_patterns(CACHE_DIR)
                shutil.copytree(base, run, ignore=ignore)
                inductor = root / ("inductor-precompile" if mode == "disk" else f"inductor-{mode}-{repeat}")
                wall, _ = run_program("training.train", run, inductor, args.device)
                first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
                expected = "hit" if mode == "warm" else "missing"
                if first.get("compile_cache") != expected:
                    raise RuntimeError(f"{mode} start found the compile cache {first.get('compile_cache')!r}")
                starts[mode].append((float(first["first_step_seconds"]), wall))
    warm = min(starts["warm"])

    def row(name: str, mode: str, status: str) -> list[str]:
        first, wall = min(starts[mode])
        return [name, status, f"{first:.1f}", f"{wall:.1f}", f"{first / warm[0]:.2f}x"]

    out = table(
        ["start", "compile cache", "first step (s)", "process (s)", "first step vs warm"],
        [
            row("cold: nothing cached", "cold", "missing"),
            row("warm: after precompile", "warm", "hit"),
            row("(reference) precompile's Inductor disk cache", "disk", "missing"),
        ],
    )
    device = args.device if args.device != "auto" else _auto_device()
    print(
        f"tiny model, torch.compile, {device}, best of {args.repeats}; the precompile job took {precompile_s:.1f} s "
        f"once ({manifest['steps']} steps, {human_bytes(manifest['size'])} of artifacts)\n{out}\n{summary}"
    )
    return out


def prepare(root: Path) -> Path:
    """A run with prepared data, a tokenizer and config.json (training.compile on)."""
    cfg = load_config("tiny", OVERRIDES, run_id="bench", storage=str(root))
    run = open_run(cfg)
    prepare_dataset(cfg.data, run.stage("data"), fingerprint="bench-precompile")
    build_tokenizer(
        run.stage("data"), run.stage("tokenizer"), cfg.model.vocab_size, cfg.model.max_seq_len, cfg.tokenizer
    )
    return root / "bench"


def run_program(module: str, run: Path, inductor_dir: Path, device: str) -> tuple[float, str]:
    """Run `python -m <module> --config <run>/config.json` with empty compiler caches; its wall time and summary."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir),
        "TRITON_CACHE_DIR": str(inductor_dir / "triton"),
    }
    command = [sys.executable, "-m", module, "--config", str(run / "config.json"), "--device", device]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{module} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    found = re.search(r"^precompile: .*$", proc.stdout, re.MULTILINE)
    return wall, found.group(0) if found else ""


def _auto_device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


if __name__ == "__main__":
    main()
