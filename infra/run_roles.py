"""A role per run: each SageMaker job of a run gets an IAM role that reaches that run's own prefix and nothing of
another run's, so code inside one job (a compromised package installed at its start, say) cannot read, overwrite or
delete another run's checkpoints, data or job code.

The account stack (deployments/account.yaml) turns this on: its ECS pool's environment holds `HLAT_RUN_ROLE_BOUNDARY`
(the permissions boundary every run role must carry, `<stack>-run-role-boundary`) and `HLAT_RUN_ROLE_PATH` (the IAM
path the flow-run role may create roles under, `/hlat-runs/<stack>/`); a run cannot change either (the pool fixes its
environment). With them set, the SageMaker backend makes, before each job, the role of the run and the job's access:

- `run` (every stage but prepare-data): read, write and delete under `<root>/<run_id>/`; read `<root>/sources/` (the
  prepared sources the run's data manifest names), `<root>/imports/` (imported checkpoints) and whatever other
  prefix of the bucket the run's config names for reading (`model.init_from`, `tokenizer.pretrained`,
  `data.sources`);
- `data` (prepare-data, which writes the shared sources): the same, plus write and delete under `<root>/sources/`.

Its other rights are the managed policies of the stack's execution role (`job.role_arn`) whose names start with
`<stack>-job-` (ECR pulls, logs, metrics; the bucket's KMS key, the corpus bucket and the VPC's interfaces where the
stack has them): IAM itself refuses any other (the flow-run policy's AttachRolePolicy condition), and the boundary
caps whatever is attached. Making or updating a role is idempotent: the same run gets the same role each attempt.

IAM does not show SageMaker a new role at once: a job created in the seconds after its role was gets "could not assume
role" (`just_created` tells the backend to retry). Role names are global to the account (64 characters): the name
is a digest of the run's storage and id. The roles stay after the run (IAM's default quota is 1,000 roles per
account): `aws iam list-roles --path-prefix /hlat-runs/` lists them.
https://docs.aws.amazon.com/IAM/latest/UserGuide/access_policies_boundaries.html
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

BOUNDARY_ENV = "HLAT_RUN_ROLE_BOUNDARY"
PATH_ENV = "HLAT_RUN_ROLE_PATH"
POLICY_NAME = "run-storage"
DATA_STAGE = "prepare-data"
JOB_POLICY_INFIX = "-job-"
"""The stack's managed policies a run role may carry: `<stack>-job-*`."""


class RunRoleError(RuntimeError):
    """A run role could not be made (the message names the IAM call and the fix)."""


@dataclass(frozen=True)
class RunRoles:
    """Where run roles are made: the boundary every one carries and the IAM path they live under."""

    boundary_arn: str
    path: str

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> RunRoles | None:
        """The settings the pool's environment holds; None when run roles are off (no boundary set)."""
        env = os.environ if environ is None else environ
        boundary = env.get(BOUNDARY_ENV, "").strip()
        if not boundary:
            return None
        path = env.get(PATH_ENV, "").strip() or "/hlat-runs/"
        if not (path.startswith("/") and path.endswith("/")):
            raise RunRoleError(f"{PATH_ENV}={path!r}: an IAM path starts and ends with '/', e.g. /hlat-runs/hlat/")
        return cls(boundary, path)


def access_of(stage: str) -> str:
    """'data' for the prepare-data job (it writes the shared sources), 'run' for every other stage's."""
    return "data" if stage == DATA_STAGE else "run"


def role_name(run_uri: str, access: str) -> str:
    """The run's role for `access`: `hlat-run-<digest of the run's storage and id>-<access>`, at most 64 characters."""
    digest = hashlib.sha256(run_uri.rstrip("/").encode()).hexdigest()[:24]
    return f"hlat-run-{digest}-{access}"


def run_role_arn(roles: RunRoles, base_role_arn: str, run_uri: str, stage: str) -> str:
    """The ARN `ensure_run_role` gives the run's role for `stage` (what a dry run shows)."""
    parts = base_role_arn.split(":")
    return f"arn:{parts[1]}:iam::{parts[4]}:role{roles.path}{role_name(run_uri, access_of(stage))}"


def _split(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key.strip("/")


def storage_policy(run_uri: str, access: str, reads: Iterable[str] = (), partition: str = "aws") -> dict[str, Any]:
    """The run role's S3 policy: the run's own prefix, the shared sources (read; write too for `data`), the imports
    (read) and `reads` (s3:// prefixes of the same bucket the config reads: read); nothing else of the bucket."""
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
    """SageMaker's training jobs of this account, and no one else, may assume a run role."""
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
    """The execution role's managed policies a run role carries too: the stack's `<stack>-job-*` ones."""
    base = base_role_arn.rsplit("/", 1)[-1]
    arns: list[str] = []
    for page in iam.get_paginator("list_attached_role_policies").paginate(RoleName=base):
        arns += [p["PolicyArn"] for p in page["AttachedPolicies"] if JOB_POLICY_INFIX in p["PolicyArn"].rsplit("/")[-1]]
    return sorted(arns)


def ensure_run_role(
    session: Any, roles: RunRoles, run_uri: str, stage: str, base_role_arn: str, reads: Iterable[str] = ()
) -> tuple[str, bool]:
    """Make (or bring up to date) the role of the run at `run_uri` for `stage`'s access; returns its ARN and whether
    it was created just now (SageMaker may not see it for some seconds)."""
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
"""How long a job of a just-made role is retried while SageMaker cannot assume it yet."""


def not_yet_assumable(code: str, message: str) -> bool:
    """Whether CreateTrainingJob's refusal is SageMaker not seeing a role made a moment ago."""
    return code == "ValidationException" and "assume" in message.lower() and "role" in message.lower()


def retry_while_new(create: Any, just_created: bool, sleep: Any = time.sleep) -> None:
    """Call `create()`; while the role is new (`just_created`) and SageMaker cannot assume it yet, retry every 5 s
    for `ROLE_VISIBLE_SECONDS`."""
    from hlat.infra.jobs import SubmitError

    deadline = time.monotonic() + ROLE_VISIBLE_SECONDS
    while True:
        try:
            create()
            return
        except SubmitError as exc:
            if not (just_created and not_yet_assumable(exc.code, str(exc))) or time.monotonic() > deadline:
                raise
        sleep(5)
