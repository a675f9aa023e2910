"""A role per run: each SageMaker job gets an IAM role that reaches its own run's prefix and no other run's.

So code in one job cannot touch another run's files. The account stack enables it through the pool's fixed environment.
Other rights are the stack's `<stack>-job-*` policies, capped by a permissions boundary
(https://docs.aws.amazon.com/IAM/latest/UserGuide/access_policies_boundaries.html). Roles stay after the run
(docs/deployments.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hlat.core.layout import IMPORTS_DIR, SOURCES_DIR
from hlat.core.stages import stage

BOUNDARY_ENV = "HLAT_RUN_ROLE_BOUNDARY"
PATH_ENV = "HLAT_RUN_ROLE_PATH"
POLICY_NAME = "run-storage"
JOB_POLICY_INFIX = "-job-"


class RunRoleError(RuntimeError):
    """A run role could not be made; the message names the IAM call and the fix."""


@dataclass(frozen=True)
class RunRoles:
    """Where run roles are made: the boundary each carries and their IAM path."""

    boundary_arn: str
    path: str

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> RunRoles | None:
        """The pool environment's settings; None when run roles are off."""
        env = os.environ if environ is None else environ
        boundary = env.get(BOUNDARY_ENV, "").strip()
        if not boundary:
            return None
        path = env.get(PATH_ENV, "").strip() or "/hlat-runs/"
        if not (path.startswith("/") and path.endswith("/")):
            raise RunRoleError(f"{PATH_ENV}={path!r}: an IAM path starts and ends with '/', e.g. /hlat-runs/hlat/")
        return cls(boundary, path)


def access_of(name: str) -> str:
    """'data' for the job of the stage that prepares the shared sources (it writes them), 'run' for the others'."""
    return "data" if stage(name).prepares_sources else "run"


def role_name(run_uri: str, access: str) -> str:
    """`hlat-run-<digest of storage and id>-<access>`: role names are account-global and at most 64 characters."""
    digest = hashlib.sha256(run_uri.rstrip("/").encode()).hexdigest()[:24]
    return f"hlat-run-{digest}-{access}"


def run_role_arn(roles: RunRoles, base_role_arn: str, run_uri: str, stage: str) -> str:
    """The ARN `ensure_run_role` gives the run's role for `stage`."""
    parts = base_role_arn.split(":")
    return f"arn:{parts[1]}:iam::{parts[4]}:role{roles.path}{role_name(run_uri, access_of(stage))}"


def _split(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key.strip("/")


def storage_policy(run_uri: str, access: str, reads: Iterable[str] = (), partition: str = "aws") -> dict[str, Any]:
    """The run role's S3 policy: its run's prefix, the shared sources (write for `data`), imports and `reads`."""
    bucket, run_key = _split(run_uri)
    root = run_key.rpartition("/")[0]
    under = f"{root}/" if root else ""
    arn = f"arn:{partition}:s3:::{bucket}"
    read_prefixes = [f"{under}{SOURCES_DIR}", f"{under}{IMPORTS_DIR}"]
    for uri in reads:
        other_bucket, key = _split(uri)
        if other_bucket == bucket and key and not key.startswith(run_key):
            read_prefixes.append(key)
    write_prefixes = [run_key] + ([f"{under}{SOURCES_DIR}"] if access == "data" else [])
    writes = [
        "s3:GetObject",
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:AbortMultipartUpload",
        "s3:ListMultipartUploadParts",
    ]
    listed = sorted({p for prefix in write_prefixes + read_prefixes for p in (prefix, f"{prefix}/*")})
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "OwnPrefix", "Effect": "Allow", "Action": writes,
             "Resource": [f"{arn}/{p}/*" for p in write_prefixes]},
            {"Sid": "SharedReads", "Effect": "Allow", "Action": "s3:GetObject",
             "Resource": sorted({f"{arn}/{p}/*" for p in read_prefixes})},
            {"Sid": "ListOwnAndShared", "Effect": "Allow", "Action": "s3:ListBucket", "Resource": arn,
             "Condition": {"StringLike": {"s3:prefix": listed}}},
            {"Sid": "BucketRegion", "Effect": "Allow",
             "Action": ["s3:GetBucketLocation", "s3:ListBucketMultipartUploads"], "Resource": arn},
        ],
    }  # fmt: skip


def trust_policy(account: str, partition: str = "aws") -> dict[str, Any]:
    """Only this account's SageMaker training jobs may assume a run role."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"Service": "sagemaker.amazonaws.com"},
                "Action": "sts:AssumeRole",
                "Condition": {
                    "StringEquals": {"aws:SourceAccount": account},
                    "ArnLike": {"aws:SourceArn": f"arn:{partition}:sagemaker:*:{account}:training-job/*"},
                },
            }
        ],
    }


def _stack_policies(iam: Any, base_role_arn: str) -> list[str]:
    base = base_role_arn.rsplit("/", 1)[-1]
    arns: list[str] = []
    for page in iam.get_paginator("list_attached_role_policies").paginate(RoleName=base):
        arns += [p["PolicyArn"] for p in page["AttachedPolicies"] if JOB_POLICY_INFIX in p["PolicyArn"].rsplit("/")[-1]]
    return sorted(arns)


def ensure_run_role(
    session: Any, roles: RunRoles, run_uri: str, stage: str, base_role_arn: str, reads: Iterable[str] = ()
) -> tuple[str, bool]:
    """Make or update the run's role for `stage`; return its ARN and whether it was just created."""
    from botocore.exceptions import BotoCoreError, ClientError

    iam = session.client("iam")
    access = access_of(stage)
    name = role_name(run_uri, access)
    account, partition = base_role_arn.split(":")[4], base_role_arn.split(":")[1]
    created = False
    try:
        try:
            arn = iam.get_role(RoleName=name)["Role"]["Arn"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "NoSuchEntity":
                raise
            arn = iam.create_role(
                RoleName=name,
                Path=roles.path,
                AssumeRolePolicyDocument=json.dumps(trust_policy(account, partition)),
                PermissionsBoundary=roles.boundary_arn,
                Description=f"hlat run {run_uri} ({access} jobs): its own prefix only"[:1000],
                MaxSessionDuration=43200,
                Tags=[{"Key": "hlat:run", "Value": run_uri[-256:]}, {"Key": "hlat:access", "Value": access}],
            )["Role"]["Arn"]
            created = True
        policy = storage_policy(run_uri, access, reads, partition)
        iam.put_role_policy(RoleName=name, PolicyName=POLICY_NAME, PolicyDocument=json.dumps(policy))
        for policy_arn in _stack_policies(iam, base_role_arn):
            iam.attach_role_policy(RoleName=name, PolicyArn=policy_arn)
    except (BotoCoreError, ClientError) as exc:
        raise RunRoleError(
            f"cannot make the run's IAM role {name} under {roles.path} ({type(exc).__name__}: {exc}): the flow-run "
            f"role needs the account stack's FlowRunPolicy (RunRoles), and {BOUNDARY_ENV} must be the stack's "
            "RunRoleBoundaryArn"
        ) from exc
    return arn, created


ROLE_VISIBLE_SECONDS = 60.0
"""Seconds a job of a just-made role is retried while SageMaker cannot assume it yet."""


def not_yet_assumable(code: str, message: str) -> bool:
    """Whether CreateTrainingJob refused because SageMaker cannot see a just-made role yet."""
    return code == "ValidationException" and "assume" in message.lower() and "role" in message.lower()


def retry_while_new(create: Any, just_created: bool, sleep: Any = time.sleep) -> None:
    """Call `create()`, retrying every 5 s for `ROLE_VISIBLE_SECONDS` while a new role is not assumable."""
    from hlat.infra.backends.protocol import SubmitError

    deadline = time.monotonic() + ROLE_VISIBLE_SECONDS
    while True:
        try:
            create()
            return
        except SubmitError as exc:
            if not (just_created and not_yet_assumable(exc.code, str(exc))) or time.monotonic() > deadline:
                raise
        sleep(5)
