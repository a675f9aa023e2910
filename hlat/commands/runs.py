"""`hlat status`, `hlat stop` and `hlat compare`: the commands that look at a run or stop its job.

They import no torch, so they answer quickly."""

from __future__ import annotations

import argparse
from typing import Any

from hlat.core.layout import compare_path
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.infra.reports.eval_report import compare_line, compare_runs
from hlat.infra.supervision import status as run_status
from hlat.tasks.aws import activate


def _located_run(args: argparse.Namespace) -> Any:
    """The run `hlat status RUN` / `hlat stop RUN` names (its config.json read and validated here, once), with the
    AWS credentials block its config names (if any) made this process's credentials."""

    run = Run.of(run_status.locate(args.run, args.storage))
    job = run.config.job
    if job.aws_credentials_block:
        activate(job)
    return run


def status(args: argparse.Namespace) -> int:

    if args.run is None:
        print(run_status.list_runs(Storage(args.storage or "./runs")))
        return 0
    print(run_status.render(run_status.run_status(_located_run(args))))
    return 0


def stop(args: argparse.Namespace) -> int:

    run = _located_run(args)
    results = run_status.stop_run(run, wait_s=args.wait, say=lambda text: print(f"hlat: {text}", flush=True))
    print(run_status.stop_summary(results, args.run))
    return 0


def compare(args: argparse.Namespace) -> int:

    a, b = Run.at(args.run_a.rstrip("/")), Run.at(args.run_b.rstrip("/"))
    labels = tuple(args.labels) if args.labels else (a.run_id, b.run_id)
    out = Storage(args.out) if args.out else a.storage.child(compare_path(labels[1]))
    summary = compare_runs(a, b, out, labels=labels)
    print(f"hlat: compared {labels[0]} and {labels[1]} over {summary['common_steps']} common steps")
    for key in ("loss", "grad_norm"):
        d = summary.get(key) or {}
        if d:
            print(f"  {compare_line(key, d)}")
    for name, uri in summary.get("files", {}).items():
        print(f"  {name}: {uri}")
    return 0
