"""What a stage task says when its job ended without its output: the error, and where the job's own log is."""

from __future__ import annotations

from hlat.core.layout import job_log_path
from hlat.core.run import Run
from hlat.infra.backends.protocol import Action
from hlat.infra.supervision.errors import JobFailed
from hlat.infra.supervision.ledger import Attempt, Ledger


def job_ended_badly(run: Run, stage: str, record: Attempt, output: str) -> JobFailed:
    """The stage's error for a job that ended without its output.

    A failed job says why. A job that reported success without the file names the file's full path. Its attempt
    is then marked fatal in the stage's ledger, since 'done' there would be untrue."""
    hint = log_hint(run, record)
    if record.status != "Completed":
        return JobFailed(f"{stage}: job {record.job_name} ended {record.ending} ({hint})", [record])
    record.reason = f"completed without writing {output}"
    record.action = Action.FATAL.value
    Ledger(run, stage).update(record)
    return JobFailed(
        f"{stage}: job {record.job_name} ended Completed but wrote no {run.storage.uri(output)}: the job's program "
        f"exited successfully without its output ({hint})",
        [record],
    )


def log_hint(run: Run, record: Attempt) -> str:
    """Where the job's own output can be read."""
    if run.config.job.backend == "local":
        return f"its log: {run.storage.uri(job_log_path(record.job_name))}"
    return f"its log: CloudWatch /aws/sagemaker/TrainingJobs, streams {record.job_name}/*"
