"""The storage check: the run prefix is written, read, listed and deleted, as the caller and as the job's role.

The probe object (`PROBE_NAME`) is removed again; one that cannot be removed is named in the finding. The job's role
is assumed in a short session named `PROBE_SESSION`*; where the caller may not assume it, the check is unverified.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

from hlat.core.config import HlatConfig
from hlat.infra.checks.aws_clients import DENIED, ClientFactory, error_code, error_message, unexpected
from hlat.infra.checks.findings import Finding

PROBE_NAME = ".hlat-preflight-"
"""Name prefix of the probe object written (and removed) under the run's prefix."""
PROBE_SESSION = "hlat-preflight-"
"""Session-name prefix of the probe's AssumeRole; deployments/account.yaml allows only sessions so named."""
PROBE_SESSION_S = 900
"""The assumed session's lifetime: STS's minimum (the probe takes seconds)."""
RoleAssumer = Callable[[str], Any]
"""Assumes a role (its ARN) and returns an S3 client with its credentials; raises ClientError when STS refuses."""


def storage_findings(client: ClientFactory, config: HlatConfig, caller: str, assume: RoleAssumer) -> list[Finding]:
    """Probe the run prefix as the caller and as the job's role (assumed where the caller may)."""
    root = config.storage.root.rstrip("/")
    if not root.startswith("s3://"):
        return [Finding("storage", False, f"storage.root: SageMaker needs s3://bucket/prefix, not {root!r}")]
    bucket, _, prefix = root[len("s3://") :].partition("/")
    run_prefix = "/".join(p for p in (prefix, config.resolved_run_id()) if p)
    s3 = client("s3")
    findings: list[Finding] = []
    try:
        location = s3.get_bucket_location(Bucket=bucket).get("LocationConstraint") or "us-east-1"
        if location != config.job.region:
            findings.append(
                Finding(
                    "storage",
                    False,
                    f"bucket {bucket!r} is in {location}, job.region is {config.job.region}: "
                    f"SageMaker reads and writes buckets of its own region; use a bucket in {config.job.region} "
                    f"or set job.region={location}",
                )
            )
    except ClientError as exc:
        if error_code(exc) == "NoSuchBucket":
            return [
                Finding(
                    "storage",
                    False,
                    f"storage.root: bucket {bucket!r} does not exist; create it "
                    f"(aws s3 mb s3://{bucket} --region {config.job.region}) or fix the URI",
                )
            ]
        if error_code(exc) not in DENIED:
            raise

    findings.append(_probe(s3, bucket, run_prefix, "the caller", cleanup=s3))
    try:  # an unexpected answer to the job's role's probe keeps the caller's finding
        findings.append(_probe_as_job_role(s3, bucket, run_prefix, config, caller, assume))
    except (ClientError, BotoCoreError, ResponseParserError) as exc:
        findings.append(unexpected("storage", exc))
    return findings


def _probe(s3: Any, bucket: str, run_prefix: str, who: str, cleanup: Any) -> Finding:
    """The four S3 calls every stage makes under the run prefix, as `who`; `cleanup` removes a stray probe."""
    key = f"{run_prefix}/{PROBE_NAME}{uuid.uuid4().hex[:12]}"
    where = f"s3://{bucket}/{key}"
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("s3:PutObject", lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"hlat preflight probe\n")),
        ("s3:GetObject", lambda: s3.get_object(Bucket=bucket, Key=key)["Body"].read()),
        ("s3:ListBucket", lambda: s3.list_objects_v2(Bucket=bucket, Prefix=key).get("Contents", [])),
        ("s3:DeleteObject", lambda: s3.delete_object(Bucket=bucket, Key=key)),
    ]
    for action, step in steps:
        try:
            answer = step()
        except ClientError as exc:
            left = ""
            if action != "s3:PutObject":
                removed = _remove_quietly(cleanup, bucket, key)
                left = "" if removed else f"; the probe {where} is left: remove it by hand"
            resource = f"arn:aws:s3:::{bucket}" + ("" if action == "s3:ListBucket" else f"/{run_prefix}/*")
            return Finding(
                "storage",
                False,
                f"{action} denied on s3://{bucket}/{run_prefix}/ ({error_code(exc)}); allow {action} on {resource} "
                f"to {who}{left}",
            )
        if action == "s3:ListBucket" and key not in [o["Key"] for o in answer]:
            _remove_quietly(cleanup, bucket, key)
            return Finding("storage", False, f"the probe {where} was written by {who} but is not listed")
    return Finding("storage", True, f"write, read, list and delete under s3://{bucket}/{run_prefix}/ as {who}")


def _probe_as_job_role(
    caller_s3: Any, bucket: str, run_prefix: str, config: HlatConfig, caller: str, assume: RoleAssumer
) -> Finding:
    """The probe as job.role_arn, whose rights the jobs use; not verified where the caller may not assume it."""
    role_arn = config.job.role_arn

    def as_caller(why: str) -> Finding:
        return Finding("storage", True, f"checked as the caller, not as the job's role: {why}", checked=False)

    if not role_arn:
        return as_caller("job.role_arn is not set")
    name = role_arn.rsplit("/", 1)[-1]
    parts = caller.split(":", 5)
    if len(parts) == 6 and parts[5].startswith(f"assumed-role/{name}/") and parts[4] == role_arn.split(":")[4]:
        return _probe(caller_s3, bucket, run_prefix, f"the job's role {role_arn} (the caller)", cleanup=caller_s3)
    try:
        role_s3 = assume(role_arn)
    except ClientError as exc:
        code = error_code(exc)
        fix = (
            f"to check as the job's role, allow the caller sts:AssumeRole on it in sessions named "
            f"{PROBE_SESSION}* and trust the caller's account in the role's trust policy (deployments/account.yaml: "
            "PreflightAssumesExecutionRole)"
        )
        if code in DENIED:
            return as_caller(f"sts:AssumeRole of {role_arn} denied ({code}); {fix}")
        return as_caller(f"sts:AssumeRole of {role_arn}: {code}: {error_message(exc)}; {fix}")
    except (BotoCoreError, ResponseParserError) as exc:  # no usable answer from STS
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return as_caller(f"sts:AssumeRole of {role_arn}: no answer ({type(exc).__name__}: {text[:160]})")
    return _probe(role_s3, bucket, run_prefix, f"the job's role {role_arn}", cleanup=caller_s3)


def _remove_quietly(s3: Any, bucket: str, key: str) -> bool:
    """Delete the probe; whether that was allowed."""
    try:
        s3.delete_object(Bucket=bucket, Key=key)
        return True
    except (ClientError, BotoCoreError):
        return False
