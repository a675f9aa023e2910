"""The training loop on XLA:CPU against the same loop in eager PyTorch on the CPU, in one run (the XLA environment):
graph compilations after step 2, graph executions and device-to-host transfers per step that does not log, and the
steady step time, for the tiny model.

    .venv-xla-2.28/bin/python -m benchmarks.bench_xla [--steps 40] [--log-every 10] [--precision fp32]
        [--graph-cuts micro-batch|step]

The run (documents from the standard library's sources, shards and a tokenizer made as the stages make them) is
built in a temporary folder: no Prefect, no network. Step times exclude steps 1-2 (compilation) and sync points.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("PJRT_DEVICE", "CPU")

from benchmarks.measure import table
from hlat.core.environment import rehearsal_sdk
from hlat.core.layout import CHECKPOINTS_DIR, MANIFEST_FILE
from hlat.core.presets import load_config
from hlat.core.shards import DataManifest, ShardWriter, iter_documents
from hlat.core.storage import Storage
from hlat.infra.inputs.tokenizer import train_sentencepiece, training_lines

VOCAB = 512


def stdlib_documents(count: int) -> Iterator[str]:
    """The standard library's module sources, cut to 20 kB each: text that exists on every machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    made = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= 500:
            yield text[:20_000]
            made += 1
            if made == count:
                return


def prepare_offline_run(folder: Path, documents: int = 300) -> Path:
    """data/ (parquet shards, the validation split every 20th document, the manifest last) and tokenizer/ (a
    sentencepiece BPE of VOCAB pieces) in `folder`, without Prefect, great-expectations or datasets."""
    data = Storage(str(folder / "data"))
    writer = ShardWriter(data, "shards-offline-1", "parquet", shard_rows=100)
    for i, text in enumerate(stdlib_documents(documents)):
        writer.add(text, "validation" if i % 20 == 0 else "train")
    manifest = DataManifest(fingerprint="offline", format="parquet", shards=writer.close())
    data.write_json(MANIFEST_FILE, manifest.model_dump(mode="json"))
    tokenizer = load_config("tiny").tokenizer
    lines = training_lines(iter_documents(data, manifest, "train"), 400_000, tokenizer.max_sentence_length)
    train_sentencepiece(lines, VOCAB, tokenizer, str(folder / "tokenizer"))
    return folder


def make_run(prepared: Path, root: Path, run_id: str, device: str = "xla", **overrides: Any) -> Path:
    """A tiny-preset run folder on `device` (config.json, and data/ and tokenizer/ copied from `prepared`), for the
    Neuron SDK whose torch-xla this environment has (neuron.sdk: .venv-xla is 2.24.1's, .venv-xla-2.28 2.28.0's)."""
    changes = {
        "model.vocab_size": VOCAB,
        "training.device": device,
        "neuron.sdk": rehearsal_sdk().version,
        "training.eval_every": 0,
        "training.checkpoint_every": 1000,
        **overrides,
    }
    cfg = load_config("tiny", changes, run_id=run_id, storage=str(root))
    run = root / run_id
    for stage in ("data", "tokenizer"):
        shutil.copytree(prepared / stage, run / stage)
    Storage(str(run)).write_json("config.json", cfg.model_dump(mode="json"))
    return run


def measure(run: Path, sync_steps: set[int]) -> dict[str, Any]:
    """Train the run's steps with `Trainer.fit`; per step, the time and (XLA) counters once its work is done."""
    from hlat.core.run import Run
    from hlat.training.loop import Trainer
    from hlat.training.parallel.distributed import init_world

    job_run = Run.at(str(run))
    cfg = job_run.config
    world = init_world(cfg.training.device, cfg)
    trainer = Trainer(
        cfg=cfg,
        run=job_run,
        checkpoints=job_run.storage.child(CHECKPOINTS_DIR),
        world=world,
        tokenizer_model=str(run / "tokenizer" / "tokenizer.model"),
    )
    on_xla = world.on_xla
    if on_xla:
        from hlat.training import xla
    marks: list[tuple[float, dict[str, float]]] = []
    step_fn = trainer.train_step

    def train_step(batches: Any) -> dict[str, Any]:
        start = time.perf_counter()
        out = step_fn(batches)
        counts: dict[str, float] = {}
        if on_xla:
            xla.wait()
            counts = xla.counters()
        marks.append((time.perf_counter() - start, counts))
        return out

    trainer.train_step = train_step  # type: ignore[method-assign]
    assert trainer.fit() == 0
    steps = len(marks)
    # Step k + 1 after a step k without a sync point: nothing but step k + 1 happened in between.
    quiet = [k + 1 for k in range(2, steps) if k not in sync_steps and k + 1 not in sync_steps]
    result: dict[str, Any] = {"ms": 1000 * sum(marks[k - 1][0] for k in quiet) / len(quiet), "quiet": len(quiet)}
    if on_xla:
        per = [{key: marks[k - 1][1][key] - marks[k - 2][1][key] for key in marks[k - 1][1]} for k in quiet]
        result.update(
            compilations=marks[-1][1]["compilations"] - marks[1][1]["compilations"],
            executions=sum(d["executions"] for d in per) / len(per),
            transfers=sum(d["transfers_to_host"] for d in per) / len(per),
        )
    return result


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--precision", choices=["fp32", "bf16-mixed", "bf16-sr"], default="fp32")
    parser.add_argument("--graph-cuts", choices=["micro-batch", "step"], default="micro-batch")
    args = parser.parse_args(argv)
    import torch_xla.core.xla_model as xm

    xm.xla_device()  # before any backward: autograd sizes its device queues at the first one
    with tempfile.TemporaryDirectory(prefix="hlat-bench-xla-") as tmp:
        root = Path(tmp)
        prepared = prepare_offline_run(root / "prepared")
        overrides = {
            "training.max_steps": args.steps,
            "training.log_every": args.log_every,
            "precision.mode": args.precision,
            "training.xla_graph_cuts": args.graph_cuts,
        }
        sync = {1, args.steps, *range(args.log_every, args.steps + 1, args.log_every)}
        results = {d: measure(make_run(prepared, root, d, d, **overrides), sync) for d in ("cpu", "xla")}
    cpu, on_xla = results["cpu"], results["xla"]
    out = table(
        ["loop", "compilations after step 2", "executions / quiet step", "transfers / quiet step", "ms / step",
         "vs eager"],
        [
            ["XLA:CPU (training.device=xla)", f"{on_xla['compilations']:g}", f"{on_xla['executions']:g}",
             f"{on_xla['transfers']:g}", f"{on_xla['ms']:.0f}", f"{cpu['ms'] / on_xla['ms']:.2f}x"],
            ["eager CPU (training.device=cpu)", "-", "-", "-", f"{cpu['ms']:.0f}", "1.00x"],
        ],
    )  # fmt: skip
    print(
        f"tiny model, {args.precision}, graph cuts per {args.graph_cuts}, {args.steps} steps, log_every "
        f"{args.log_every}; "
        f"times are means over {on_xla['quiet']} steps without a sync point\n{out}"
    )
    return out


if __name__ == "__main__":
    main()
