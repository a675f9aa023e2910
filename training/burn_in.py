"""The burn-in program: `python -m hlat.training.burn_in --config <config.json uri> [--report <uri or path>]`.

It runs under torchrun on the training's exact instances, one process per device, before training.
Each rank takes an inventory, checks a matmul and joins an all-reduce; each node also writes to checkpoint storage.
Rank 0 judges all results (`training.health.evaluate`) and writes `<run>/burn-in/report.json`.
Exit 0 when every rank passed; else `BurnInFailed: ...` naming ranks and hosts, and EXIT_BURN_IN_FAILED.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import datetime, timezone
from typing import Any

import torch.distributed as dist

from hlat.core.config import HlatConfig
from hlat.core.contract import (
    EXIT_BURN_IN_FAILED,
    checkpoint_location,
    job_arguments,
    read_job_config,
    reporting_failure,
    write_failure,
)
from hlat.core.layout import BURN_IN_REPORT as REPORT
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training.health import (
    allreduce_check,
    compute_dtype,
    evaluate,
    host_name,
    inventory,
    matmul_check,
    write_check,
)
from hlat.training.hooks import hooks
from hlat.training.parallel.distributed import World, close_world, init_world

log = logging.getLogger("hlat.burn_in")

SCRATCH = "burn-in-scratch"


def _guarded(check: str, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run one check; an exception becomes a failure in the result, not a crash that would strand the other ranks."""
    try:
        result: dict[str, Any] = fn(*args, **kwargs)
        return result
    except Exception as exc:
        log.exception("the %s check raised", check)
        return {"exception": f"{type(exc).__name__}: {exc}"}


def run_checks(cfg: HlatConfig, run: Run, world: World) -> dict[str, Any]:
    """This rank's results; barriers keep the checks from timing each other.

    All matmuls run at once, then the all-reduce, then one write per node, as in training.
    """
    b = cfg.burn_in
    row: dict[str, Any] = {"rank": world.rank, "local_rank": world.local_rank, "host": host_name()}
    row["inventory"] = _guarded("inventory", inventory, world, cfg.world_size)
    row["matmul"] = _guarded(
        "matmul",
        matmul_check,
        world.device,
        b.matmul_size,
        b.matmul_repeats,
        compute_dtype(cfg.precision.mode, world.device),
        seed=cfg.training.seed,
        corrupt=hooks().matmul_corrupted(world.rank),
        batch=b.matmul_batch,
    )
    world.barrier()
    row["allreduce"] = _guarded("allreduce", allreduce_check, world, b.allreduce_mb)
    world.barrier()
    scratch = checkpoint_location(run).child(SCRATCH)
    if world.local_rank == 0:
        row["write"] = _guarded("write", write_check, scratch, b.write_mb)
    world.barrier()
    if world.is_main and scratch.is_local and not scratch.list():
        scratch.remove("", recursive=True)  # the emptied folder (object stores have none); every node is done
    return row


def gather(world: World, row: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's results, in rank order, on every rank (so that all of them exit with the same code)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [row]
    rows: list[Any] = [None] * world.world_size
    dist.all_gather_object(rows, row)
    return rows


def summary_row(row: dict[str, Any]) -> dict[str, Any]:
    """One line of the report's table: the figures compared against the thresholds."""
    m, a, w = row.get("matmul") or {}, row.get("allreduce") or {}, row.get("write") or {}
    return {
        "rank": row["rank"],
        "host": row["host"],
        "device": m.get("device_name") or (row.get("inventory") or {}).get("device_type"),
        "matmul_tflops": m.get("tflops"),
        "matmul_rel_error": m.get("rel_error"),
        "matmul_checksum": m.get("checksum"),
        "allreduce_busbw_gbps": a.get("busbw_gbps"),
        "write_mbps": w.get("mbps"),
    }


def build_report(cfg: HlatConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    instance_type = cfg.job.instance_type
    thresholds = cfg.burn_in.thresholds.get(instance_type)
    failures = evaluate(rows, thresholds)
    report: dict[str, Any] = {
        "job": os.environ.get("TRAINING_JOB_NAME"),  # set by SageMaker and the local backend: not a stale report
        "instance_type": instance_type,
        "world_size": len(rows),
        "expected_world_size": cfg.world_size,
        "hosts": sorted({r["host"] for r in rows}),
        "settings": {
            "matmul_size": cfg.burn_in.matmul_size,
            "matmul_repeats": cfg.burn_in.matmul_repeats,
            "matmul_batch": cfg.burn_in.matmul_batch,
            "allreduce_mb": cfg.burn_in.allreduce_mb,
            "write_mb": cfg.burn_in.write_mb,
            "precision": cfg.precision.mode,
            "seed": cfg.training.seed,
        },
        "thresholds": thresholds.model_dump() if thresholds is not None else None,
        "ranks": [summary_row(r) for r in rows],
        "failures": failures,
        "passed": not failures,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "results": rows,
    }
    if thresholds is None:
        report["note"] = (
            f"no thresholds for instance type {instance_type!r} in burn_in.thresholds: speeds are measured, never "
            "failed; wrong results (checksums, all-reduce sums, missing ranks or devices) still fail"
        )
    return report


def failure_reason(report: dict[str, Any], report_uri: str) -> str:
    """`BurnInFailed: ...` with the failing ranks first (SageMaker keeps 1024 characters of it)."""
    by_rank: dict[int, list[str]] = {}
    hosts: dict[int, str] = {}
    for f in report["failures"]:
        by_rank.setdefault(f["rank"], []).append(f["check"])
        hosts[f["rank"]] = f["host"]
    ranks = ", ".join(f"rank {r} on {hosts[r]} ({', '.join(dict.fromkeys(c))})" for r, c in sorted(by_rank.items()))
    return f"BurnInFailed: {ranks}; report: {report_uri}"


def _split(uri: str) -> tuple[Storage, str]:
    folder, _, name = uri.rstrip("/").rpartition("/")
    return Storage(folder or "."), name


def main(argv: list[str] | None = None) -> int:
    def report_option(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--report", default=None, help=f"where to write the report (default: <run>/{REPORT})")

    args = job_arguments("python -m hlat.training.burn_in", __doc__, argv, report_option)
    return reporting_failure(lambda: _burn_in(args.config, args.report, args.device))


def _burn_in(config_uri: str, report_uri: str | None, device: str | None) -> int:
    run = read_job_config(config_uri)
    cfg = run.config
    report_uri = report_uri or run.storage.uri(REPORT)
    world = init_world(device or cfg.training.device, cfg)
    try:
        row = run_checks(cfg, run, world)
        rows = gather(world, row)
        report = build_report(cfg, rows)  # on every rank: all of them must agree on the exit code
        if world.is_main:
            folder, name = _split(report_uri)
            folder.write_json(name, report)
            for r in report["ranks"]:
                log.info(
                    "rank %d on %s (%s): matmul %.4g TFLOP/s, rel error %.2g, all-reduce busbw %s GB/s, write %s MB/s",
                    r["rank"], r["host"], r["device"], r["matmul_tflops"] or 0.0, r["matmul_rel_error"] or 0.0,
                    _fmt(r["allreduce_busbw_gbps"]), _fmt(r["write_mbps"]),
                )  # fmt: skip
            if "note" in report:
                log.warning("%s", report["note"])
            for f in report["failures"]:
                log.error("burn-in failure: %s", f["message"])
            log.info("burn-in %s: report at %s", "passed" if report["passed"] else "FAILED", report_uri)
        world.barrier()  # the report is written before any rank exits
    finally:
        close_world()
    if report["passed"]:
        return 0
    if world.local_rank == 0:  # one writer per node: the failure file is the node's
        write_failure(failure_reason(report, report_uri))
    return EXIT_BURN_IN_FAILED


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


if __name__ == "__main__":
    sys.exit(main())
