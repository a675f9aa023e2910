"""plan-parallelism: rank the run's layouts before training (infra/cost/planner.py), publish them, warn if slow.

Advice only: it never fails the train stage. Runs it cannot judge get a note; a planner error becomes a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact

from hlat.core.config import HlatConfig
from hlat.core.run import Run
from hlat.infra.cost import perf_model, planner
from hlat.tasks.caching import artifact_key

log = logging.getLogger("hlat.plan")  # "hlat.*" records reach the Prefect run logs (tasks/__init__.py)

TOP_ROWS = 20


def not_applicable(config: HlatConfig) -> str | None:
    """Why the planner has nothing to say about this run, or None when it has."""
    if not config.planner.enabled:
        return "planner.enabled is false"
    if config.job.backend == "local" or not perf_model.plannable(config.job.instance_type):
        return (
            f"not applicable: the planner models Trainium nodes; this run uses the {config.job.backend} backend on "
            f"{config.job.instance_type!r}"
        )
    return None


@task(name="plan-parallelism")
def plan_parallelism(run: Run) -> dict[str, Any]:
    config = run.config
    reason = not_applicable(config)
    if reason:
        log.info("plan-parallelism: %s", reason)
        return {"applicable": False, "note": reason}
    try:
        the_plan = planner.plan(config)
    except Exception as exc:  # advice must not stop a run that is otherwise ready to train
        log.warning("plan-parallelism: the planner failed, training goes on without its advice: %s", exc)
        return {"applicable": False, "note": f"planner failed: {exc}"}

    summary = the_plan.to_dict(top=TOP_ROWS)
    warning = configured_warning(the_plan, config.planner.warn_if_slower_than)
    summary.update(applicable=True, warning=warning)
    if warning:
        log.warning("plan-parallelism: %s", warning)
    elif the_plan.ranked:
        log.info("plan-parallelism: best %s at %.0f tokens/s", the_plan.best.layout.label(), the_plan.best.tokens_per_s)
    _publish(the_plan, run.run_id)
    return summary


def configured_warning(the_plan: planner.Plan, threshold: float) -> str | None:
    """The warning for a configured layout that cannot run, or runs over `threshold` slower than the best."""
    configured = the_plan.configured
    if not the_plan.ranked:
        return f"no layout fits {the_plan.preset} on {the_plan.nodes} x {the_plan.instance_type}"
    best = the_plan.best
    if isinstance(configured, planner.Rejected):
        return (
            f"the configured parallelism ({configured.layout.label()}) cannot run: {configured.reason}; "
            f"the planner's best is {best.layout.label()}"
        )
    if isinstance(configured, planner.Estimate) and the_plan.gap(configured) > threshold:
        return (
            f"the configured parallelism ({configured.layout.label()}) is predicted {the_plan.gap(configured):.0%} "
            f"slower than {best.layout.label()} ({configured.tokens_per_s:,.0f} vs {best.tokens_per_s:,.0f} tokens/s; "
            f"planner.warn_if_slower_than = {threshold:.0%})"
        )
    return None


def _publish(the_plan: planner.Plan, run_id: str) -> None:
    """The ranked table as a Prefect table artifact; failing to publish never stops the stage."""
    rows = [
        {"rank": the_plan.rank_of(e), **e.row(), "gap": round(the_plan.gap(e), 4)} for e in the_plan.ranked[:TOP_ROWS]
    ]
    rejected = ", ".join(f"{n} {planner.REJECTION_KINDS.get(k, k)}" for k, n, _ in the_plan.rejection_summary())
    description = (
        f"parallelism plan of {the_plan.preset} on {the_plan.nodes} x {the_plan.instance_type}: "
        f"{len(the_plan.ranked)} layouts fit (top {len(rows)} shown); {len(the_plan.rejected)} do not ({rejected})"
    )
    try:
        create_table_artifact(rows, key=artifact_key("parallelism-plan", run_id), description=description)
    except Exception as exc:
        log.warning("could not publish the parallelism plan artifact: %s", exc)
