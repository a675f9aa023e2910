"""What a stage task says when its job ended without its output: the error, and where the job's own log is."""

from __future__ import annotations

from hlat.core.config import HlatConfig
from hlat.core.layout import JOBS_DIR
from hlat.core.storage import Storage
from hlat.infra.jobs import Action
from hlat.infra.supervisor import Attempt, JobFailed, Ledger


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
