"""burn-in task: runs the stage's short job on the run's backend, then reads and publishes its report."""

from __future__ import annotations

import logging
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from hlat.core.config import HlatConfig
from hlat.core.layout import BURN_IN_REPORT
from hlat.core.storage import Storage
from hlat.infra.stage_jobs import job_shape, run_stage_job
from hlat.tasks.caching import CACHED_STAGE, artifact_key, stage_cache_key
from hlat.tasks.job_failures import job_ended_badly, log_hint

log = logging.getLogger("hlat.jobs")


class BurnInFailed(RuntimeError):
    """The cluster did not pass burn-in: the message names the failing ranks and checks."""


def burn_in_cache_key(config: HlatConfig, run_uri: str) -> str:
    """What a burn-in's verdict depends on: its checks and thresholds, the precision, and where the jobs run."""
    return stage_cache_key("burn-in", run_uri, config.section_hash("burn_in", "precision"), job_shape(config))


def burn_in_present(run_uri: str, report: dict[str, Any]) -> bool:
    return Storage(run_uri).exists(BURN_IN_REPORT)


@task(name="burn-in-cluster", **CACHED_STAGE)
def burn_in_cluster(config: HlatConfig, run_uri: str, run_id: str, cache_key: str) -> dict[str, Any]:
    """Run the burn-in job on the training's instance type and count; publish its report; raise BurnInFailed
    (unless burn_in.continue_on_failure) when a rank or node failed a check."""
    run = Storage(run_uri)
    record, _ = run_stage_job(config, run_uri, run_id, "burn-in")
    report: dict[str, Any] | None = None
    if run.exists(BURN_IN_REPORT):
        candidate = run.read_json(BURN_IN_REPORT)
        if candidate.get("job") in (None, record.job_name):  # not a report left by an earlier job
            report = candidate
    if report is None:
        raise job_ended_badly("burn-in", record, run, BURN_IN_REPORT, log_hint(config, run, record))
    publish_burn_in_report(report, run_id)
    if not report.get("passed"):
        message = "burn-in failed: " + "; ".join(f["message"] for f in report["failures"])
        if not config.burn_in.continue_on_failure:
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
