"""The `sagemaker` job backend: a run's training jobs as SageMaker training jobs on trn1 nodes.

Requests are built by `sagemaker_request` and sent with boto3, under the job name the train stage chose: a
restarted flow then finds the job it launched instead of launching a duplicate. Describe, stop and logs are plain
boto3 calls (SageMaker and CloudWatch Logs).

`dry_run` builds the very same requests with a boto3 session that answers every AWS call itself (`OfflineAWS`)
and returns what `submit` would send, so a 64-node launch can be reviewed, and tested, without an AWS account.

Its siblings: `sagemaker_source` (the job's code and requirements), `sagemaker_images`, `sagemaker_request`,
`sagemaker_validation` (the service model's checks) and `sagemaker_offline` (`OfflineAWS`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError, ParamValidationError

from hlat.core.config import JobConfig
from hlat.infra.backends.protocol import TERMINAL, JobSpec, JobState, Status, SubmitError
from hlat.infra.backends.run_roles import RunRoleError, RunRoles, ensure_run_role, retry_while_new, run_role_arn
from hlat.infra.backends.sagemaker_images import training_image
from hlat.infra.backends.sagemaker_offline import OfflineAWS
from hlat.infra.backends.sagemaker_request import build_request, check_spec, client_error, config_request
from hlat.infra.backends.sagemaker_source import endpoints_only, requirements_of
from hlat.infra.backends.sagemaker_validation import validate_request

log = logging.getLogger("hlat.sagemaker")

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
LOG_LOOKBACK_MS = 60_000
"""How far back each `logs` call looks again for events that reached CloudWatch late (64 nodes' streams are
shipped independently, so an event can arrive after a newer one from another node was already read)."""
LOG_MAX_PAGES = 20
"""FilterLogEvents pages (up to 10,000 events each) read per `logs` call; the rest is read on the next call."""

LogCursor = tuple[int, tuple[tuple[int, str], ...]]
"""(newest event timestamp seen in ms, (timestamp, event id) of every event seen within LOG_LOOKBACK_MS of it)."""


def _not_found(exc: ClientError) -> bool:
    """DescribeTrainingJob answers an unknown name with a ValidationException ('Requested resource not found.';
    moto: "Could not find training job ..."), other APIs with ResourceNotFound."""
    code, message = client_error(exc)
    if code in ("ResourceNotFound", "ResourceNotFoundException"):
        return True
    return code == "ValidationException" and bool(re.search(r"not found|could not find", message, re.IGNORECASE))


class SageMakerBackend:
    """Training jobs as SageMaker training jobs (see the module docstring).

    `sagemaker` and `logs_client` are the boto3 clients of describe, stop, CreateTrainingJob and logs: attributes,
    so tests can stub them (botocore's Stubber) or replace them. The SDK's uploads go through `boto_session`.
    """

    kind = "sagemaker"

    def __init__(self, job: JobConfig, boto_session: boto3.Session | None = None) -> None:
        if boto_session is not None and boto_session.region_name not in (None, job.region):
            raise ValueError(
                f"the boto session is for region {boto_session.region_name!r} but job.region={job.region!r}: "
                "make them the same (jobs, buckets and images are regional)"
            )
        self.job = job
        self.boto_session = boto_session or boto3.Session(region_name=job.region)
        # Standard retries absorb the throttling that polling 64-node jobs every minute can meet.
        config = Config(retries={"mode": "standard", "max_attempts": 5}, user_agent_extra="hlat")
        self.sagemaker: Any = self.boto_session.client("sagemaker", region_name=job.region, config=config)
        self.logs_client: Any = self.boto_session.client("logs", region_name=job.region, config=config)
        self.now: Callable[[], datetime] = lambda: datetime.now(UTC)

    # -- the JobBackend protocol ----------------------------------------------------------------------------
    def submit(self, spec: JobSpec) -> None:
        """Upload the source, then create the training job named `spec.name`. A name already in use is refused
        (SubmitError 'ResourceInUse') before anything is uploaded: the caller should re-attach to that job."""
        self._check(spec)
        try:
            existing = self.describe(spec.name)
        except ClientError as exc:  # e.g. throttled: classified like a refused submission
            raise SubmitError(*client_error(exc)) from exc
        if existing is not None:
            raise SubmitError(
                "ResourceInUse",
                f"a training job named {spec.name} already exists ({existing.status.value}); "
                "describe it to re-attach instead of submitting it again",
            )
        job, just_created = self.job, False
        roles = RunRoles.from_environment()
        if (
            roles is not None
        ):  # the run's own role (infra/backends/run_roles.py), in place of the stack's execution role
            assert job.role_arn is not None  # _check refused it otherwise
            try:
                arn, just_created = ensure_run_role(
                    self.boto_session, roles, spec.run_uri, spec.stage, job.role_arn, spec.reads
                )
            except RunRoleError as exc:
                raise SubmitError("AccessDeniedException", str(exc)) from exc
            job = job.model_copy(update={"role_arn": arn})
        request = build_request(spec, job, self.boto_session, requirements=self.requirements(spec))
        try:
            retry_while_new(lambda: self._create(request, stage=spec.stage), just_created)
        except SubmitError as exc:
            # The job did not exist a moment ago: if it does now, this is our own request, retried by botocore
            # after a first try that got through (a timeout, say). It is the job we launched.
            if exc.code != "ResourceInUse" or self.describe(spec.name) is None:
                raise
            log.warning("%s was created by an earlier try of this request: %s", spec.name, exc)
        log.info("created training job %s (%s x %d)", spec.name, spec.instance_type, spec.instance_count)

    def describe(self, name: str) -> JobState | None:
        try:
            desc = self.sagemaker.describe_training_job(TrainingJobName=name)
        except ClientError as exc:
            if _not_found(exc):
                return None
            raise
        return self._state(desc)

    def stop(self, name: str) -> None:
        """Ask SageMaker to stop the job (it gets SIGTERM, then SIGKILL 120 s later). A job that already ended,
        or never existed, has nothing to stop: SageMaker's ValidationException for it is ignored."""
        try:
            self.sagemaker.stop_training_job(TrainingJobName=name)
        except ClientError as exc:
            code, message = client_error(exc)
            if code == "ValidationException" or _not_found(exc):
                log.debug("stop %s: nothing to stop (%s: %s)", name, code, message)
                return
            raise

    def logs(self, name: str, cursor: LogCursor | None = None) -> tuple[list[str], LogCursor | None]:
        """New lines of the job's CloudWatch log streams (`<name>/algo-N-...`, one per node) since `cursor`.

        Each event is returned once: the cursor keeps the ids of the events seen in the last LOG_LOOKBACK_MS,
        and each call reads that window again to pick up events that arrived late. Before the job starts there
        is no log group or stream, hence no lines."""
        newest, seen_pairs = cursor if cursor else (0, ())
        seen = {event_id for _, event_id in seen_pairs}
        request: dict[str, Any] = {"logGroupName": LOG_GROUP, "logStreamNamePrefix": f"{name}/"}
        if cursor:
            request["startTime"] = max(0, newest - LOG_LOOKBACK_MS)
        events: list[dict[str, Any]] = []
        try:
            for _ in range(LOG_MAX_PAGES):
                page = self.logs_client.filter_log_events(**request)
                events.extend(page.get("events", []))
                token = page.get("nextToken")
                if not token:
                    break
                request["nextToken"] = token
        except ClientError as exc:
            if client_error(exc)[0] != "ResourceNotFoundException":
                raise
            return [], cursor  # the job has not started logging yet
        unseen = {e["eventId"]: e for e in events if e["eventId"] not in seen}
        fresh = sorted(unseen.values(), key=lambda e: e["timestamp"])
        pairs = [*seen_pairs, *((int(e["timestamp"]), str(e["eventId"])) for e in fresh)]
        newest = max([newest, *(ts for ts, _ in pairs)])
        kept = tuple((ts, event_id) for ts, event_id in pairs if ts >= newest - LOG_LOOKBACK_MS)
        lines = [str(e.get("message", "")).rstrip("\n") for e in fresh]
        return lines, (newest, kept)

    def dry_run(self, spec: JobSpec) -> list[dict[str, Any]]:
        """The requests `submit(spec)` would send: S3 uploads of the source (summarised as bucket, key and size)
        and CreateTrainingJob with its full parameters, validated against the service model. Sends nothing."""
        bucket, _ = self._check(spec)
        assert self.job.role_arn is not None  # _check raised otherwise
        job = self.job
        roles = RunRoles.from_environment()
        if roles is not None:  # the run's own role, as submit makes it (nothing is made here)
            job = job.model_copy(update={"role_arn": run_role_arn(roles, self.job.role_arn, spec.run_uri, spec.stage)})
        offline = OfflineAWS(self.job.region, self.job.role_arn, [bucket])
        request = build_request(spec, job, offline.session, requirements=self.requirements(spec))
        self._create(request, offline.session.client("sagemaker", region_name=self.job.region), spec.stage)
        return offline.requests()

    # -- building requests ----------------------------------------------------------------------------------
    def requirements(self, spec: JobSpec) -> str | None:
        """The requirements file each instance installs before the job's program runs (None: none, in an account
        whose jobs reach no package index: the image holds them, `check_spec`)."""
        return None if endpoints_only() else requirements_of(spec)

    def training_image(self, spec: JobSpec) -> str:
        return training_image(spec, self.job)

    def config_request(self, spec: JobSpec) -> dict[str, Any]:
        return config_request(spec, self.job)

    def _check(self, spec: JobSpec) -> tuple[str, str]:
        return check_spec(spec, self.job, self.requirements(spec))

    def _create(self, request: Mapping[str, Any], client: Any = None, stage: str = "train") -> None:
        validate_request(request, stage)
        try:
            (client or self.sagemaker).create_training_job(**request)
        except ClientError as exc:
            raise SubmitError(*client_error(exc)) from exc
        except ParamValidationError as exc:
            raise SubmitError("ValidationException", str(exc)) from exc

    # -- describing ---------------------------------------------------------------------------------------------
    def _state(self, desc: Mapping[str, Any]) -> JobState:
        raw = desc["TrainingJobStatus"]
        # 'Deleting' (DeleteTrainingJob) is not in the protocol's vocabulary: for the train stage the job is over.
        status = Status.STOPPED if raw == "Deleting" else Status(raw)
        billable = desc.get("BillableTimeInSeconds")
        if billable is None:
            start, end = desc.get("TrainingStartTime"), desc.get("TrainingEndTime")
            if start is not None and end is not None:
                billable = (end - start).total_seconds()
            elif start is not None and status == Status.IN_PROGRESS:
                billable = (self.now() - start).total_seconds()
            else:
                billable = 0.0
        return JobState(
            name=str(desc["TrainingJobName"]),
            status=status,
            failure_reason=desc.get("FailureReason"),
            secondary_status="Deleting" if raw == "Deleting" else desc.get("SecondaryStatus"),
            billable_seconds=max(0.0, float(billable)),
            instance_count=int(desc.get("ResourceConfig", {}).get("InstanceCount") or 1),
            ended_at=end.timestamp() if (end := desc.get("TrainingEndTime")) and status in TERMINAL else None,
        )
