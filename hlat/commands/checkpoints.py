"""`hlat export` and `hlat average`: a run's checkpoints as a Hugging Face folder, or averaged into a new one."""

from __future__ import annotations

import argparse
import json
import time

from hlat.infra.inputs.tokenizer import export_hf_tokenizer
from hlat.training.checkpoint.average import average_checkpoints
from hlat.training.checkpoint.hf_export import export_checkpoint


def export(args: argparse.Namespace) -> int:

    start = time.perf_counter()
    out, ref = export_checkpoint(
        args.source, args.out, step=args.step, tokenizer=args.tokenizer, build_tokenizer_json=export_hf_tokenizer
    )
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"hlat: exported {ref.uri} (step {ref.step}) to {out} in {time.perf_counter() - start:.1f} s: {files}")
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"  load it with transformers: {architecture}.from_pretrained({str(out)!r})")
    return 0


def average(args: argparse.Namespace) -> int:

    start = time.perf_counter()
    averaged = average_checkpoints(args.run, args.last, out=args.out)
    steps = ", ".join(map(str, averaged.steps))
    print(f"hlat: averaged the model weights of steps {steps} ({averaged.layout}) into {averaged.uri} in "
          f"{time.perf_counter() - start:.1f} s (optimizer state left out)")  # fmt: skip
    print(f"  export it: hlat export {averaged.uri} <out> (--tokenizer <run>/tokenizer when it is not in the run)")
    return 0
