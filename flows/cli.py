"""The `hlat` command line: run the whole DAG or one stage, list presets, show a resolved config.

    hlat pretrain --preset tiny [--run-id R] [--storage DIR|s3://...] [--set training.lr=1e-3 ...] [--dry-run]
    hlat run prepare-data|train-tokenizer|precompile|burn-in|train --preset tiny --run-id R --storage DIR
    hlat presets
    hlat config --preset hlat-7b [--set ...]

Flows run on the Prefect API configured in the environment, or in Prefect's ephemeral mode when none is.
User mistakes (config, data, storage) end with one line on stderr and exit code 2 (config) or 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from training.config import ConfigError, parse_override
from training.presets import PRESETS, load_config

STAGES = ("prepare-data", "train-tokenizer", "precompile", "burn-in", "train")


def _stage_flow(name: str) -> Callable[..., Any]:
    import importlib

    module = importlib.import_module(f"flows.{name.replace('-', '_')}")
    return getattr(module, name.replace("-", "_"))


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), help="named preset (default: tiny)")
    p.add_argument("--run-id", help="run identifier (default: <preset>-<config hash>)")
    p.add_argument("--storage", help="storage root: a folder or s3://bucket/prefix (default: ./runs)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a config field by dotted path, e.g. --set training.lr=1e-3 (repeatable)",
    )


def _add_dry_run(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the training job requests, the hourly cost and an estimate of total time and cost; send nothing",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hlat", description="HLAT-style LLM pretraining pipeline (Prefect DAG).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pretrain", help="run the whole DAG (the parent flow 'hlat')")
    _add_run_options(p)
    _add_dry_run(p)
    p = sub.add_parser("run", help="run one stage flow alone")
    p.add_argument("stage", choices=STAGES)
    _add_run_options(p)
    _add_dry_run(p)
    sub.add_parser("presets", help="list presets with their key figures")
    p = sub.add_parser("config", help="print the resolved config as JSON")
    _add_run_options(p)
    return parser


def _overrides(items: list[str]) -> dict[str, Any]:
    return dict(parse_override(item) for item in items)


def presets_table() -> str:
    head = (
        "preset",
        "params",
        "layers",
        "d_model",
        "heads/kv",
        "seq",
        "vocab",
        "batch",
        "lr",
        "precision",
        "TPxPP",
        "nodes",
    )
    rows = [head]
    for name in PRESETS:
        c = load_config(name)
        m, t = c.model, c.training
        rows.append(
            (
                name,
                _human(m.num_params()),
                str(m.n_layers),
                str(m.d_model),
                f"{m.n_heads}/{m.kv_heads}",
                str(t.seq_len),
                str(m.vocab_size),
                str(t.global_batch_size),
                f"{t.lr:g}",
                c.precision.mode,
                f"{c.parallelism.tensor}x{c.parallelism.pipeline}",
                f"{c.job.instance_count} x {c.job.instance_type}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except ConfigError as exc:
        print(f"hlat: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        known = _known_error(exc)
        if known is None:
            raise
        print(f"hlat: error: {known}", file=sys.stderr)
        return 1


def _known_error(exc: BaseException) -> str | None:
    """User-facing errors print as one line; anything else keeps its traceback."""
    from infra.corpus import SourceError
    from infra.storage import StorageError
    from infra.supervisor import SupervisorError
    from infra.validation import DataValidationError
    from tasks.jobs import BurnInFailed

    known = (SourceError, StorageError, DataValidationError, SupervisorError, BurnInFailed, ValueError)
    if isinstance(exc, known):
        return str(exc)
    return None


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "presets":
        print(presets_table())
        return 0
    overrides = _overrides(args.overrides)
    if args.command == "config":
        config = load_config(args.preset, overrides, run_id=args.run_id, storage=args.storage)
        print(json.dumps(config.model_dump(mode="json") | {"run_id": config.resolved_run_id()}, indent=2))
        return 0
    # Fail on a bad config before Prefect starts (an ephemeral API takes seconds to come up).
    config = load_config(args.preset, overrides, run_id=args.run_id, storage=args.storage)
    if args.dry_run:
        from infra.backends import dry_run

        if args.command == "run" and args.stage in ("prepare-data", "train-tokenizer"):
            print(f"hlat: --dry-run shows a stage's job; {args.stage} runs in the flow's own process", file=sys.stderr)
            return 2
        print(dry_run(config, stage=args.stage if args.command == "run" else "train"))
        return 0
    flow_fn: Callable[..., Any]
    if args.command == "pretrain":
        from flows.pretrain import hlat

        flow_fn = hlat
    else:
        flow_fn = _stage_flow(args.stage)
    start = time.perf_counter()
    flow_fn(preset=args.preset, overrides=overrides or None, run_id=args.run_id, storage=args.storage)
    print(f"hlat: {args.command} finished in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
