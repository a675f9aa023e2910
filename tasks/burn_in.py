"""burn-in task: runs the stage's short job on the run's backend, then reads and publishes its report."""

from __future__ import annotations

import logging
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from hlat.core.layout import BURN_IN_REPORT
from hlat.core.run import Run
from hlat.core.stages import stage
from hlat.infra.stage_jobs import job_shape, run_stage_job
from hlat.tasks.caching import CACHED_STAGE, artifact_key, stage_cache_key
from hlat.tasks.job_failures import job_ended_badly

log = logging.getLogger("hlat.jobs")


class BurnInFailed(RuntimeError):
    """The cluster did not pass burn-in: the message names the failing ranks and checks."""


def burn_in_cache_key(run: Run) -> str:
    """What a burn-in's verdict depends on: its checks and thresholds, the precision, and where the jobs run."""
    config = run.config
    return stage_cache_key(run, "burn-in", config.section_hash("burn_in", "precision"), job_shape(config))


def burn_in_present(run: Run, report: dict[str, Any]) -> bool:
    """A cached verdict counts while the stage is done (core/stages.py)."""
    return stage("burn-in").done(run, run.config)


@task(name="burn-in-cluster", **CACHED_STAGE)
def burn_in_cluster(run: Run, cache_key: str) -> dict[str, Any]:
    """Run the burn-in job on the training's instance type and count; publish its report; raise BurnInFailed
    (unless burn_in.continue_on_failure) when a rank or node failed a check."""
    out = run.storage
    record, _ = run_stage_job(run, "burn-in")
    report: dict[str, Any] | None = None
    if out.exists(BURN_IN_REPORT):
        candidate = out.read_json(BURN_IN_REPORT)
        if candidate.get("job") in (None, record.job_name):  # not a report left by an earlier job
            report = candidate
    if report is None:
        raise job_ended_badly(run, "burn-in", record, BURN_IN_REPORT)
    publish_burn_in_report(report, run.run_id)
    if not report.get("passed"):
        message = "burn-in failed: " + "; ".join(f["message"] for f in report["failures"])
        if not run.config.burn_in.continue_on_failure:
            raise BurnInFailed(f"{message} (set burn_in.continue_on_failure=true to train anyway)")
        log.warning("%s; going on to training (burn_in.continue_on_failure)", message)
    return report


def publish_burn_in_report(report: dict[str, Any], run_id: str) -> None:
    rows = report.get("ranks") or []
    try:
        if rows:
            create_table_artifact(rows, key=artifact_key("burn-in", run_id), description=f"burn-in of {run_id}")
        verdict = "passed" if report.get("passed") else "FAILED"
        lines = [f"# Burn-in {verdict}: {report.get('world_size')} rank(s) on {report.get('instance_type')}", ""]
        lines += [f"- {f['message']}" for f in report["failures"]] or ["No failures."]
        create_markdown_artifact("\n".join(lines), key=artifact_key("burn-in-summary", run_id))
    except Exception as exc:  # publishing never decides the stage
        log.warning("could not publish the burn-in artifacts: %s", exc)
