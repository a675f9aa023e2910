"""The capacity checks: SageMaker training-job quotas, less other runs' running jobs, and the training plan.

`instance_needs` says what the run's stages hold at once. A quota too small, or taken by other jobs, fails with the
request that raises it. A job.training_plan_arn's reserved instances are checked instead of the quota.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from botocore.exceptions import ClientError

from hlat.core.config import HlatConfig
from hlat.core.stages import job_stages, setting, training_stage
from hlat.core.stages import stages as stage_rows
from hlat.infra.backends.protocol import job_name
from hlat.infra.checks.aws_clients import DENIED, ClientFactory, error_code
from hlat.infra.checks.findings import Finding

QUOTA_NAME = "{instance_type} for training job usage"
"""Service Quotas' name of one instance type's SageMaker training-job quota (its code is read from the listing)."""


def instance_needs(config: HlatConfig) -> dict[str, tuple[int, list[str]]]:
    """The most instances of each type the run's jobs hold at once, and the stages needing them. Stages run in turn,
    except those set to run beside training."""
    job, trainer = config.job, training_stage()
    uses: list[tuple[str, int, str]] = []
    for row in stage_rows():
        if row.runs_on is None or not row.enabled(config):
            continue
        where = row.runs_on
        instance_type, count, what = where.instance_type(config), where.instance_count(config), row.name
        if row.beside is not None and setting(config, row.beside) is not None and instance_type == job.instance_type:
            count, what = count + job.instance_count, f"{row.name} beside {trainer.name}"
        uses.append((instance_type, count, what))
    needs: dict[str, tuple[int, list[str]]] = {}
    for instance_type, count, stage in uses:
        most, stages = needs.get(instance_type, (0, []))
        needs[instance_type] = (max(most, count), [*stages, stage])
    return needs


def quota_findings(client: ClientFactory, config: HlatConfig) -> list[Finding]:
    """Each needed type's training-job quota, less other jobs' use, against instance_needs."""
    quotas = client("service-quotas")
    region = config.job.region
    try:
        listed = _all_quotas(quotas, "list_service_quotas")
    except ClientError as exc:
        if error_code(exc) in DENIED:
            return [Finding("quota", True, "servicequotas:ListServiceQuotas denied: quotas not checked", checked=False)]
        raise
    defaults: dict[str, dict[str, Any]] | None = None
    usage: dict[str, list[tuple[str, int]]] | None = None
    usage_unread = ""
    findings = []
    for instance_type, (count, stages) in instance_needs(config).items():
        name = QUOTA_NAME.format(instance_type=instance_type)
        quota = listed.get(name)
        if quota is None:
            if defaults is None:
                try:
                    defaults = _all_quotas(quotas, "list_aws_default_service_quotas")
                except ClientError:
                    defaults = {}
            quota = defaults.get(name)
        what = f"{instance_type} x {count} ({', '.join(stages)})"
        if quota is None:
            findings.append(Finding("quota", True, f"{what}: no quota named {name!r} in {region}", checked=False))
            continue
        value = int(quota.get("Value") or 0)
        planned = config.job.training_plan_arn and instance_type == config.job.instance_type
        if planned:  # the plan's reserved instances are checked instead (its AvailableInstanceCount)
            if value >= count:
                findings.append(Finding("quota", True, f"{what}: {name!r} is {value}"))
            else:
                findings.append(
                    Finding(
                        "quota",
                        True,
                        f"{what}: {name!r} is {value}; the training plan's capacity is checked instead",
                        checked=False,
                    )
                )
            continue
        if usage is None and not usage_unread:
            try:
                usage = instances_in_use(client("sagemaker"), own_job_names(config.resolved_run_id()))
            except ClientError as exc:
                if error_code(exc) not in DENIED:
                    raise
                usage_unread = f"sagemaker:ListTrainingJobs or DescribeTrainingJob denied ({error_code(exc)})"
        held = (usage or {}).get(instance_type, [])
        in_use = sum(n for _, n in held)
        free = max(value - in_use, 0)
        jobs = _held_by(held)
        desired = count + in_use
        fix = (
            f"request {desired}: aws service-quotas request-service-quota-increase --service-code sagemaker "
            f"--quota-code {quota.get('QuotaCode')} --desired-value {desired} --region {region}"
        )
        if value < count:
            findings.append(Finding("quota", False, f"{what}: {name!r} is {value} in {region}{jobs}; {fix}"))
        elif free < count:
            findings.append(
                Finding(
                    "quota",
                    False,
                    f"{what}: {name!r} is {value} in {region}{jobs}: {free} free, {count} needed; wait for those "
                    f"jobs or stop them, or {fix}",
                )
            )
        elif usage_unread:
            findings.append(
                Finding(
                    "quota",
                    True,
                    f"{what}: {name!r} is {value}; what running jobs hold is not counted: {usage_unread}",
                    checked=False,
                )
            )
        else:
            held_line = jobs or ", none held by other running training jobs"
            findings.append(Finding("quota", True, f"{what}: {name!r} is {value}{held_line}: {free} free"))
    return findings


def _held_by(held: list[tuple[str, int]]) -> str:
    """', N held by K running training job(s) of other runs (...)', or '' when none."""
    if not held:
        return ""
    shown = ", ".join(f"{name}: {n}" for name, n in held[:3]) + (f", {len(held) - 3} more" if len(held) > 3 else "")
    return f", {sum(n for _, n in held)} held by {len(held)} running training job(s) of other runs ({shown})"


def own_job_names(run_id: str) -> Callable[[str], bool]:
    """Whether a training job name is one of run `run_id`'s own."""

    def own(name: str) -> bool:
        match = re.fullmatch(r".+-(\d+)", name)
        return match is not None and any(name == job_name(run_id, int(match[1]), s) for s in job_stages())

    return own


def instances_in_use(sagemaker: Any, own: Callable[[str], bool]) -> dict[str, list[tuple[str, int]]]:
    """Instances held by the account's running training jobs in this region, by type: [(job, count)]. Jobs `own` accepts
    are left out."""
    held: dict[str, list[tuple[str, int]]] = {}
    token: str | None = None
    while True:
        page = sagemaker.list_training_jobs(
            StatusEquals="InProgress", MaxResults=100, **({"NextToken": token} if token else {})
        )
        for summary in page.get("TrainingJobSummaries", []):
            name = str(summary["TrainingJobName"])
            if own(name):
                continue
            try:
                job = sagemaker.describe_training_job(TrainingJobName=name)
            except ClientError as exc:
                if error_code(exc) in ("ValidationException", "ResourceNotFound"):
                    continue
                raise
            if job.get("TrainingJobStatus", "InProgress") != "InProgress":
                continue  # ended since the listing
            resources = job.get("ResourceConfig") or {}
            for group in resources.get("InstanceGroups") or [resources]:
                if group.get("InstanceType") and group.get("InstanceCount"):
                    held.setdefault(str(group["InstanceType"]), []).append((name, int(group["InstanceCount"])))
        token = page.get("NextToken")
        if not token:
            return held


def _all_quotas(quotas: Any, operation: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    token: str | None = None
    while True:
        page = getattr(quotas, operation)(ServiceCode="sagemaker", **({"NextToken": token} if token else {}))
        out.update({q["QuotaName"]: q for q in page.get("Quotas", [])})
        token = page.get("NextToken")
        if not token:
            return out


# -- the training plan ------------------------------------------------------------------------------------------
def training_plan_findings(client: ClientFactory, config: HlatConfig) -> list[Finding]:
    job = config.job
    arn = job.training_plan_arn
    if not arn:
        return []
    try:
        plan = client("sagemaker").describe_training_plan(TrainingPlanName=arn)
    except ClientError as exc:
        if error_code(exc) in ("ResourceNotFound", "ValidationException"):
            return [Finding("training-plan", False, f"job.training_plan_arn: {arn} not found in {job.region}; fix it")]
        if error_code(exc) in DENIED:
            return [Finding("training-plan", True, f"{arn}: DescribeTrainingPlan denied, not checked", checked=False)]
        raise
    status = plan.get("Status")
    name = plan.get("TrainingPlanName", arn)
    if status not in ("Active", "Scheduled"):
        return [
            Finding(
                "training-plan",
                False,
                f"{name} is {status}: use an Active or Scheduled plan, or unset job.training_plan_arn",
            )
        ]
    if "training-job" not in plan.get("TargetResources", ["training-job"]):
        return [
            Finding(
                "training-plan", False, f"{name} reserves capacity for {plan.get('TargetResources')}, not training jobs"
            )
        ]
    reserved = sum(
        int(r.get("TotalInstanceCount") or 0)
        for r in plan.get("ReservedCapacitySummaries", [])
        if r.get("InstanceType") == job.instance_type
    )
    if reserved < job.instance_count:
        return [
            Finding(
                "training-plan",
                False,
                f"{name} reserves {reserved} x {job.instance_type}, the run needs "
                f"{job.instance_count}; use a larger plan or set job.instance_count",
            )
        ]
    available = plan.get("AvailableInstanceCount")
    if status == "Active" and available is not None and int(available) < job.instance_count:
        return [
            Finding(
                "training-plan",
                False,
                f"{name} has {available} of {reserved} x {job.instance_type} free now "
                f"({plan.get('InUseInstanceCount', 0)} in use), the run needs {job.instance_count}",
            )
        ]
    when = "" if status == "Active" else f"; jobs queue until it starts at {plan.get('StartTime')}"
    return [Finding("training-plan", True, f"{name} ({status}): {reserved} x {job.instance_type} reserved{when}")]
