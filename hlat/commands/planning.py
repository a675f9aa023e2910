"""`hlat presets`, `hlat config` and `hlat plan`: what a config holds and what running it takes.

Also the mixture check the run commands share, and the column layout of the CLI's tables.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from hlat.core.config import ConfigError
from hlat.core.mixture import check_repetition, source_draws
from hlat.core.presets import PRESETS, load_config
from hlat.infra.cost import planner
from hlat.infra.cost.estimates import data_estimate, for_tokens
from hlat.infra.dry_run import source_lines
from hlat.infra.inputs.init_from import model_notes


def presets(args: argparse.Namespace) -> int:
    print(presets_table())
    return 0


def show_config(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    config = load_config(args.preset, overrides, run_id=args.run_id, storage=args.storage)
    print(json.dumps(config.model_dump(mode="json") | {"run_id": config.resolved_run_id()}, indent=2))
    return 0


def check_mixture(config: Any, *, show: bool) -> None:
    """Refuse (ConfigError naming the source and its numbers) a run that would repeat a source of its data mixture
    more often than that source's max_epochs (core.mixture.check_repetition), before anything starts; `show`:
    print the per-source table first (dry run, plan), so the refusal comes with the numbers of every source."""
    try:
        check_repetition(config)
    except ConfigError:
        if show:
            print("\n".join(source_lines(config)))
        raise


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
    return "\n".join(columns(rows))


def columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def plan(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    config = load_config(args.preset, overrides)
    # The sources' draws of the budget planned (--tokens, else the run's): a budget that would repeat a source past
    # its max_epochs is refused with the table (exit 2), as the run itself would be.
    budgeted = for_tokens(config, args.tokens) if args.tokens else config
    check_mixture(budgeted, show=not args.json)
    instance_type, note = planner.planning_instance(config)
    the_plan = planner.plan(config, nodes=args.nodes, instance_type=instance_type)
    if note:
        the_plan.notes.append(note)
    tokens = args.tokens or planner.default_tokens(config)
    costs = planner.compare_instances(config, the_plan, tokens) if the_plan.ranked else []
    data = data_estimate(config, tokens)  # the text behind those tokens, prepared before training
    if args.json:
        body = {**the_plan.to_dict(top=args.top), "tokens": tokens, "costs": [c.row() for c in costs]}
        body["prepare_data"] = {
            "bytes": data.bytes, "hours": round(data.hours, 3), "usd": None if data.usd is None else round(data.usd, 2),
            "workers": data.workers, "instances": data.instances, "instance_type": data.instance_type,
            "mb_per_s_per_worker": data.mb_per_s_per_worker, "basis": data.basis,
        }  # fmt: skip
        body["sources"] = [
            {"name": d.name, "share": round(d.share, 6), "tokens": d.tokens, "source_tokens": d.available,
             "epochs": None if d.epochs is None else round(d.epochs, 4), "max_epochs": d.max_epochs}
            for d in source_draws(budgeted)
        ]  # fmt: skip
        print(json.dumps(body, indent=2))
    else:
        print(planner.render(the_plan, costs, top=args.top, also=[data.line()], sources=source_lines(budgeted)))
        for note in model_notes(config):
            print(note)
    return 0
