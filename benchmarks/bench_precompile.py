"""Time to first training step with torch.compile: cold (no compile cache, everything compiled from scratch)
against warm (after the precompile job wrote the run's compile-cache/), on a small tiny-preset run, in one run.

Every start is a fresh `python -m hlat.training.train` process on a fresh copy of the run, with its own empty
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR: neither torch's in-memory caches nor a leftover Inductor disk cache
can help either side, so warm gets exactly what compile-cache/ gives it (its artifacts, and the Inductor cache
tarball that the job extracts into a fresh folder of its own). A third row starts from the artifacts alone (the
tarball removed from the copy and its manifest): on CPU they do not carry the compiled C++ kernels (on CUDA they
carry the Triton kernels), so it shows what the tarball adds. The figure compared is the trainer's
`first_step_seconds` (from building the Trainer to the end of step 1: model, compile or cache load, one step);
the process's wall time (imports, data, evaluation and checkpoint after the step included) is shown beside it.
Best of N each, the starts alternating. Run:

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

from benchmarks.measure import table
from hlat.core.presets import load_config
from hlat.core.run import open_run
from hlat.infra.inputs.tokenizer import build_tokenizer
from hlat.training.compile_cache import CACHE_DIR, KERNELS_FILE, LATEST_FILE, human_bytes
from hlat.training.data.units import prepare_dataset

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
    parser.add_argument("--repeats", type=int, default=2, help="starts of each kind (best is reported)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--no-artifacts-row", action="store_true", help="leave out the artifacts-only start")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hlat-bench-precompile-") as tmp:
        root = Path(tmp)
        base = prepare(root)
        precompile_s, summary = run_program("hlat.training.precompile", base, root / "inductor-precompile", args.device)
        manifest = json.loads((base / CACHE_DIR / LATEST_FILE).read_text())
        modes = ("cold", "warm") if args.no_artifacts_row else ("cold", "warm", "artifacts")
        starts: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
        for repeat in range(args.repeats):
            for mode in starts:
                run = root / f"{mode}-{repeat}"
                shutil.copytree(base, run, ignore=shutil.ignore_patterns(CACHE_DIR) if mode == "cold" else None)
                if mode == "artifacts":
                    drop_kernels(run / CACHE_DIR)
                inductor = root / f"inductor-{mode}-{repeat}"
                wall, _ = run_program("hlat.training.train", run, inductor, args.device)
                first = checked_first_record(run, mode, inductor)
                starts[mode].append((float(first["first_step_seconds"]), wall))
    warm = min(starts["warm"])

    def row(name: str, mode: str, status: str) -> list[str]:
        first, wall = min(starts[mode])
        return [name, status, f"{first:.1f}", f"{wall:.1f}", f"{first / warm[0]:.2f}x"]

    out = table(
        ["start", "compile cache", "first step (s)", "process (s)", "first step vs warm"],
        [
            row("cold: nothing cached", "cold", "missing"),
            *([row("warm: artifacts only (no Inductor cache)", "artifacts", "hit")] if "artifacts" in starts else []),
            row("warm: artifacts and Inductor cache", "warm", "hit"),
        ],
    )
    device = args.device if args.device != "auto" else _auto_device()
    print(
        f"tiny model, torch.compile, {device}, best of {args.repeats}; the precompile job took {precompile_s:.1f} s "
        f"once ({manifest['steps']} steps, {human_bytes(manifest['size'])} of artifacts, "
        f"{human_bytes(manifest.get('inductor_bytes', 0))} of Inductor cache)\n{out}\n{summary}"
    )
    return out


def drop_kernels(cache: Path) -> None:
    """Make a copied compile-cache/ an artifacts-only one: its Inductor tarball and the manifest's fields gone."""
    latest = json.loads((cache / LATEST_FILE).read_text())
    manifest_path = cache / latest["manifest"]
    manifest = json.loads(manifest_path.read_text())
    for name in ("inductor_files", "inductor_bytes", "inductor_sha256"):
        manifest.pop(name, None)
    manifest_path.write_text(json.dumps(manifest))
    (manifest_path.parent / KERNELS_FILE).unlink()


def checked_first_record(run: Path, mode: str, inductor: Path) -> dict[str, Any]:
    """The start's first metrics record, once it shows the start found the cache it was meant to and took the
    kernels from it only where they were there to take (warm leaves the folder it was given untouched)."""
    first: dict[str, Any] = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    expected = "missing" if mode == "cold" else "hit"
    if first.get("compile_cache") != expected:
        raise RuntimeError(f"{mode} start found the compile cache {first.get('compile_cache')!r}")
    if ("compile_cache_kernels_bytes" in first) != (mode == "warm"):
        raise RuntimeError(f"{mode} start: compile_cache_kernels_bytes is {first.get('compile_cache_kernels_bytes')}")
    if mode == "warm" and inductor.exists() and any(inductor.iterdir()):
        raise RuntimeError(f"warm start wrote to {inductor}: its Inductor cache was not the extracted one")
    return first


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
