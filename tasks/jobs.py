"""precompile and burn-in tasks: each runs its stage's short job on the run's backend, then reads and publishes
what the job wrote (the compile cache's manifest, the burn-in report)."""

from __future__ import annotations

import logging
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from hlat.core.config import HlatConfig
from hlat.core.layout import BURN_IN_REPORT, COMPILE_LATEST, JOBS_DIR
from hlat.core.storage import Storage
from hlat.infra.backends import job_shape, on_neuron, run_stage_job
from hlat.infra.jobs import Action
from hlat.infra.supervisor import Attempt, JobFailed, Ledger
from hlat.tasks.common import CACHED_STAGE, artifact_key, stage_cache_key
from hlat.tasks.tokenizer import read_tokenizer_checksum

log = logging.getLogger("hlat.jobs")


class BurnInFailed(RuntimeError):
    """The cluster did not pass burn-in: the message names the failing ranks and checks."""


def job_ended_badly(stage: str, record: Attempt, run: Storage, output: str, log_hint: str) -> JobFailed:
    """The stage's error for a job without its output. A job that failed says why; one that reported success
    without writing the file is named as such, with the file's full path, and its attempt is marked fatal in the
    stage's ledger (a 'done' there would be untrue)."""
    if record.status != "Completed":
        return JobFailed(f"{stage}: job {record.job_name} ended {record.ending} ({log_hint})", [record])
    record.reason = f"completed without writing {output}"
    record.action = Action.FATAL.value
    Ledger(run, stage).update(record)
    return JobFailed(
        f"{stage}: job {record.job_name} ended Completed but wrote no {run.uri(output)}: the job's program exited "
        f"successfully without its output ({log_hint})",
        [record],
    )


def log_hint(config: HlatConfig, run: Storage, record: Attempt) -> str:
    """Where the job's own output can be read."""
    if config.job.backend == "local":
        return f"its log: {run.uri(JOBS_DIR, record.job_name, 'output.log')}"
    return f"its log: CloudWatch /aws/sagemaker/TrainingJobs, streams {record.job_name}/*"


def precompile_needed(config: HlatConfig) -> str | None:
    """Why the precompile stage has nothing to do, or None when it has work."""
    if not config.precompile.enabled:
        return "precompile.enabled is false"
    if on_neuron(config) or config.training.device == "xla":  # XLA:CPU: torch-xla's persistent compile cache
        return None
    if not config.training.compile:
        return "training.compile is off: eager PyTorch on CPU/CUDA has no graphs to build"
    return None


def precompile_cache_key(config: HlatConfig, run_uri: str) -> str:
    """What the compiled graphs depend on: model, parallelism, precision, the precompile and Neuron settings, the
    step's shape, where the jobs run, and the run's tokenizer."""
    t = config.training
    return stage_cache_key(
        "precompile",
        run_uri,
        config.section_hash("model", "parallelism", "precision", "precompile", "neuron"),
        [t.seq_len, t.micro_batch_size, t.compile, t.device],
        job_shape(config),
        read_tokenizer_checksum(run_uri),
    )


def precompile_present(run_uri: str, result: dict[str, Any]) -> bool:
    """A cached precompile counts while its cache's latest.json is there (or it had nothing to build)."""
    return result.get("status") == "skipped" or Storage(run_uri).exists(COMPILE_LATEST)


def burn_in_cache_key(config: HlatConfig, run_uri: str) -> str:
    """What a burn-in's verdict depends on: its checks and thresholds, the precision, and where the jobs run."""
    return stage_cache_key("burn-in", run_uri, config.section_hash("burn_in", "precision"), job_shape(config))


def burn_in_present(run_uri: str, report: dict[str, Any]) -> bool:
    return Storage(run_uri).exists(BURN_IN_REPORT)


@task(name="precompile-graphs", **CACHED_STAGE)
def precompile_graphs(config: HlatConfig, run_uri: str, run_id: str, cache_key: str) -> dict[str, Any]:
    """Run the precompile job (a few training steps: torch.compile, or neuron_parallel_compile on trn1) so the
    compiled graphs land in compile-cache/ before training starts."""
    skip = precompile_needed(config)
    if skip:
        log.info("precompile: skipped (%s)", skip)
        return {"status": "skipped", "reason": skip}
    record, state = run_stage_job(config, run_uri, run_id, "precompile")
    run = Storage(run_uri)
    if state is None or state.status.value != "Completed" or not run.exists(COMPILE_LATEST):
        raise job_ended_badly("precompile", record, run, COMPILE_LATEST, log_hint(config, run, record))
    latest: dict[str, Any] = run.read_json(COMPILE_LATEST)
    return {"status": "built", "job": record.job_name, **latest}


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
