"""The dry run: what a stage's first job would send and cost, shown and never sent.

It prints the layout, the data mixture, the job's requests, the price, the estimate and the stop rule. It writes
nothing; settings not given yet are shown with placeholders."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from hlat.core.config import ConfigError, HlatConfig
from hlat.core.mixture import draws_table, source_draws
from hlat.core.run import Run
from hlat.core.stages import TRAINING
from hlat.infra.backends.protocol import JobSpec
from hlat.infra.cost.budget import budget
from hlat.infra.cost.catalog import CATALOG, price_per_hour
from hlat.infra.cost.estimates import data_estimate, estimate, stop_fit
from hlat.infra.inputs.init_from import model_notes
from hlat.infra.stage_jobs import backend_for, job_spec, stage_row, stop_terms

PLACEHOLDER_ROOT = "s3://YOUR-BUCKET/hlat"
PLACEHOLDER_ROLE = "arn:aws:iam::111122223333:role/YOUR-SAGEMAKER-ROLE"


def stop_rule_line(config: HlatConfig, spec: JobSpec) -> str:
    """The dry run's account of what stops a training job by itself, and of its max runtime."""
    terms, job = stop_terms(config), config.job
    parts = []
    if terms.budget_usd is not None and terms.price_per_hour_usd > 0:
        hours = (terms.budget_usd - terms.spent_usd) / terms.price_per_hour_usd
        parts.append(f"the budget (${terms.budget_usd:,.2f} at ${terms.price_per_hour_usd:,.2f}/h: {hours:,.1f} h)")
    if job.deadline is not None:
        parts.append(f"job.deadline ({job.deadline.isoformat()})")
    if job.unsupervised_stop_minutes:
        parts.append(f"{job.unsupervised_stop_minutes:g} min without a supervisor heartbeat")
    if not parts:
        return "stop rule: none (no budget, deadline or job.unsupervised_stop_minutes)"
    return (
        f"stop rule: the job stops itself at a checkpoint at {' or '.join(parts)}; MaxRuntimeInSeconds="
        f"{spec.max_runtime_s:,} backs it up"
    )


def source_lines(config: HlatConfig) -> list[str]:
    """The data mixture as the dry run and `hlat plan` show it: per source (core.mixture), its share of the run's
    training tokens, the tokens drawn, its size and the epochs of it that makes, against its max_epochs."""
    return [
        f"data: {config.training.max_steps:,} steps x {config.tokens_per_step:,} tokens drawn from "
        f"{len(config.data.mixture)} source(s); epochs count against each source's declared size "
        "(data.sources[].tokens) until prepare-data measures it",
        *(f"  {line}" for line in draws_table(source_draws(config))),
    ]


def _describe_requests(requests: list[dict[str, Any]]) -> list[str]:
    """Uploads summarised (count, bytes, common prefix); every other request printed in full."""
    uploads = [r["params"] for r in requests if r.get("operation") == "PutObject"]
    lines = []
    if uploads:
        keys = [f"s3://{u['Bucket']}/{u['Key']}" for u in uploads]
        prefix = os.path.commonpath(keys).replace("s3:/", "s3://", 1) if len(keys) > 1 else keys[0]
        size = sum(int(u.get("Size") or 0) for u in uploads)
        lines.append(
            f"S3 PutObject x {len(uploads)} ({size / 1024:,.0f} KiB of code and SageMaker drivers) under {prefix}/"
        )
    for request in requests:
        if request.get("operation") != "PutObject":
            lines.append(f"{request.get('service', '')} {request.get('operation', '')}".strip() + ":")
            lines.append(json.dumps(request.get("params", request), indent=2, default=str))
    return lines


def describe_layout(config: HlatConfig) -> str:
    """How a training job splits the model and the batch, in one line (what the dry run shows)."""
    p, t, dims = config.parallelism, config.training, config.parallel_dims
    parts = [
        f"{config.world_size} ranks = TP {dims.tensor} x PP {dims.pipeline} x DP {dims.data}",
        f"micro-batch {t.micro_batch_size} x {config.gradient_accumulation}"
        + (" pipeline micro-batches" if p.pipeline > 1 else " accumulation steps"),
    ]
    if p.sequence_parallel:
        parts.append("sequence parallel")
    if p.zero1:
        parts.append("ZeRO-1" + (" with FP32 master weights" if config.precision.mode == "bf16-mixed" else ""))
    parts.append(f"{p.activation_checkpointing} activation checkpointing")
    parts.append(f"precision {config.precision.mode}")
    return ", ".join(parts)


def chaining(config: HlatConfig, hours: float, max_runtime_s: int) -> list[str]:
    """How a training longer than one job's max runtime is split into jobs. A job that reaches its
    MaxRuntimeInSeconds ends 'MaxRuntimeExceeded', which the supervisor classifies as resume-at-once
    (infra.backends.protocol.classify): the next attempt resumes from the newest checkpoint. Each counts against
    job.max_restarts."""
    job_hours = max_runtime_s / 3600
    if hours <= job_hours:
        return []
    jobs = math.ceil(hours / job_hours)
    days, cap = hours / 24, job_hours / 24
    why = "SageMaker's 28-day cap" if job_hours >= 24 * 28 else "job.max_runtime_hours"
    lines = [
        f"chaining: {days:,.1f} days > {cap:g}-day max runtime ({why}): {jobs} jobs of at most "
        f"MaxRuntimeInSeconds={max_runtime_s:,}, each resuming from the newest checkpoint (every "
        f"{config.training.checkpoint_every:,} steps) when the previous one stops at its max runtime"
    ]
    if jobs - 1 > config.job.max_restarts:
        lines.append(
            f"  warning: that is {jobs - 1} relaunches and job.max_restarts is {config.job.max_restarts}: the run "
            f"would stop early; set job.max_restarts to at least {jobs - 1} plus a margin for failures"
        )
    return lines


def dry_run(config: HlatConfig, stage: str = "train") -> str:
    """What training this config would send, and what it would cost; sends nothing, writes nothing."""
    run_id = config.resolved_run_id()
    notes: list[str] = []
    root = config.storage.root.rstrip("/")
    if config.job.backend == "sagemaker":
        if not root.startswith("s3://"):
            notes.append(f"storage.root is {root!r}: SageMaker needs s3://; shown with {PLACEHOLDER_ROOT}")
            root = PLACEHOLDER_ROOT
        if not config.job.role_arn:  # job.role_arn_secret is read by the caller (tasks/aws.py: with_role)
            notes.append(f"job.role_arn is not set; shown with {PLACEHOLDER_ROLE}")
            config = config.model_copy(update={"job": config.job.model_copy(update={"role_arn": PLACEHOLDER_ROLE})})
    run, row = Run.at(f"{root}/{run_id}", config, run_id), stage_row(stage)
    # The key of the stage that prepares the sources hashes their listing, read only when the stage runs.
    args = {"key": "<the stage's cache key>"} if row.prepares_sources else None
    spec = job_spec(run, attempt=1, stage=stage, args=args)
    where = row.runs_on or TRAINING
    requests = backend_for(run).dry_run(spec)
    est = estimate(config)
    job = config.job
    lines = [f"dry run: {stage} of run {run_id} on the {job.backend} backend (nothing is sent)"]
    lines.append(f"layout: {describe_layout(config)}")
    lines += [f"  placeholder: {n}" for n in notes]
    lines += model_notes(config)
    if row.trains or row.prepares_sources:
        lines += source_lines(config)
    lines.append("")
    lines.append(f"requests of attempt 1 (job {spec.name}):")
    lines += _describe_requests(requests)
    lines.append("")
    # The job's own instances (its row's `runs_on`), priced by their own setting where they have one.
    own_price, price_setting = where.own_price(config), where.price_setting(config)
    if own_price is None and spec.instance_type not in CATALOG:
        # An instance type the catalog does not price: saying $0.00 would be a wrong figure, not an unknown one.
        field = price_setting or where.settings.get("price_per_hour_usd") or "a catalog entry"
        lines.append(
            f"cost: {spec.instance_count} x {spec.instance_type}: no price in the instance "
            "catalog (infra/cost/catalog.py); "
            f"set {field} to see costs and enforce job.budget_usd"
        )
        hourly = None
    else:
        node_price = price_per_hour(spec.instance_type, own_price)
        hourly = node_price * spec.instance_count
        lines.append(
            f"cost: {spec.instance_count} x {spec.instance_type} at ${node_price:,.3f}/node-hour = ${hourly:,.2f}/hour"
        )
        known = CATALOG.get(spec.instance_type)
        if own_price is not None:
            lines.append(f"price: {price_setting}")
        elif known is not None and known.price is not None:
            lines.append(f"price: {known.price.describe()}")
    if not row.trains:
        hours = spec.max_runtime_s / 3600
        bound = f": at most ${hours * hourly:,.2f}" if hourly is not None else ""
        lines.append(f"bound: the {stage} job stops by its max runtime of {hours:g} h{bound}")
        if row.prepares_sources:
            lines.append("estimate: " + data_estimate(config).line() + " for the text of the run's training tokens")
    elif est["hours"] is not None:
        lines.append(
            f"estimate: {config.training.max_steps:,} steps x {config.tokens_per_step:,} tokens = "
            f"{est['tokens'] / 1e9:,.1f}B tokens in {est['hours']:,.0f} h ({est['hours'] / 24:,.1f} days) at "
            f"{est['tokens_per_s']:,.0f} tokens/s ({est['basis']}), about ${est['total_usd']:,.0f} (`hlat plan` ranks "
            "the other layouts)"
        )
        # Chained by job.max_runtime_hours; the budget's cap on MaxRuntimeInSeconds stops the run, it does not chain.
        lines += chaining(config, est["hours"], int(job.max_runtime_hours * 3600))
        lines.append(data_estimate(config).line())
    else:
        lines.append(f"estimate: no throughput figure for {job.instance_type!r} in the instance catalog")
    if row.trains:
        lines.append(stop_fit(config, est["tokens_per_s"]))
        try:
            lines.append(f"budget: {budget(config).basis}")
        except ConfigError as exc:
            lines.append(f"budget: refused: {exc}")
        lines.append(stop_rule_line(config, spec))
    elif job.budget_usd is not None:
        lines.append(f"budget: job.budget_usd = ${job.budget_usd:,.2f}")
    return "\n".join(lines)
