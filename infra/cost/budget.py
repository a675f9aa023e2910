"""The train stage's dollar budget, and the account's ceilings on what one run may spend.

The budget is job.budget_usd, or on SageMaker a margin over the estimate. The ceilings come from the environment
where flow runs start, never from a run's config. Local runs cost nothing and are not checked."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from hlat.core.config import ConfigError, HlatConfig
from hlat.infra.cost.catalog import price_per_hour
from hlat.infra.cost.estimates import estimate

BUDGET_MARGIN = 1.25
"""A SageMaker run without job.budget_usd may spend this multiple of the plan's estimate of its training cost: room
for relaunches and slower steps, never an open-ended bill (a deterministic fault on 256 trn1.32xlarge nodes costs
about $6,300 an hour)."""


@dataclass(frozen=True)
class Budget:
    usd: float | None
    """What the train stage may spend before it stops (None: no limit)."""
    basis: str
    """Where the figure comes from, as the dry run says it."""


def budget(config: HlatConfig) -> Budget:
    """The train stage's dollar budget: job.budget_usd when set; on SageMaker otherwise BUDGET_MARGIN x the plan's
    estimate of the training's cost; a SageMaker run with neither is refused (ConfigError naming the field). Local
    runs cost nothing the catalog knows of and have no default."""
    job = config.job
    if job.budget_usd is not None:
        return Budget(job.budget_usd, f"job.budget_usd = ${job.budget_usd:,.2f}")
    if job.backend != "sagemaker":
        return Budget(None, "none (job.budget_usd is not set)")
    total = estimate(config)["total_usd"]
    if total is None:
        raise ConfigError(
            f"job.budget_usd: no estimate of this run's cost exists ({job.instance_type!r} has no throughput figure "
            "in the instance catalog), and a SageMaker run does not start without a budget: set job.budget_usd to "
            "the most the training may spend"
        )
    usd = BUDGET_MARGIN * total
    return Budget(
        usd,
        f"${usd:,.2f} = {BUDGET_MARGIN:g} x the estimate of ${total:,.0f} (job.budget_usd is unset: set it to change)",
    )


MAX_BUDGET_ENV = "HLAT_MAX_BUDGET_USD"
"""The most one run's training may be budgeted, in dollars: set by the account's administrator where flow runs
start (the work pool's fixed environment, not a run parameter), never by the run's own config."""
MAX_INSTANCES_ENV = "HLAT_MAX_INSTANCES"
"""The most instances one job of a run may ask for (job.instance_count), set the same way."""


def check_spend(config: HlatConfig, env: Mapping[str, str] | None = None) -> None:
    """Refuse a SageMaker run that could spend past what the account allows: a budget over HLAT_MAX_BUDGET_USD
    (job.budget_usd, or the default from the plan's estimate), an instance count over HLAT_MAX_INSTANCES, or a
    node-hour price of 0 (job.price_per_hour_usd=0, or an instance type the catalog does not price), which would
    leave the budget unenforced. Called by `preflight`, which every flow run passes before anything of its run is
    written. Local runs cost nothing and are not checked."""
    env = os.environ if env is None else env
    job = config.job
    if job.backend != "sagemaker":
        return
    if price_per_hour(job.instance_type, job.price_per_hour_usd) <= 0:
        given = "is 0" if job.price_per_hour_usd is not None else f"is unset and {job.instance_type!r} has no price"
        raise ConfigError(
            f"job.price_per_hour_usd {given}: a SageMaker run's budget is enforced through the node-hour price, so "
            "it must be above 0; set the price you pay"
        )
    limits = {name: _limit(env, name) for name in (MAX_BUDGET_ENV, MAX_INSTANCES_ENV)}
    most = limits[MAX_INSTANCES_ENV]
    if most is not None and job.instance_count > most:
        raise ConfigError(
            f"job.instance_count: {job.instance_count} instances is over this account's ceiling of {most:g} "
            f"({MAX_INSTANCES_ENV}, set where flow runs start, not by a run); ask for {most:g} or fewer"
        )
    ceiling = limits[MAX_BUDGET_ENV]
    if ceiling is not None:
        planned = budget(config)
        if planned.usd is None or planned.usd > ceiling:
            raise ConfigError(
                f"job.budget_usd: the training's budget, {planned.basis}, is over this account's ceiling of "
                f"${ceiling:,.2f} ({MAX_BUDGET_ENV}, set where flow runs start, not by a run); set job.budget_usd to "
                f"${ceiling:,.2f} or less"
            )


def _limit(env: Mapping[str, str], name: str) -> float | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={text!r}: the account's ceiling must be a number above 0 (unset: no ceiling)")
    return value
