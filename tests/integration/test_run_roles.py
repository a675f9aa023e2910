"""A role per run (infra/backends/run_roles.py, issue 51): one run's job credentials cannot write, overwrite, delete or
read
under another run's prefix, nor write the shared sources unless the job is a prepare-data one.

On a moto server of its own with IAM enforced: the roles are made by hlat's own `ensure_run_role` (as the flow run
does before a job), each role's session is taken with STS as SageMaker would take it for the job, and every request
after that is signed with the session's credentials and judged by moto against the role's policies. moto evaluates
actions and resources, not conditions nor permissions boundaries: the ListBucket statement's prefix condition and
the boundary are checked against the template by `tests/integration/test_account_template.py`'s evaluator. The
SageMaker backend's use of the role is checked on the session's plain moto server.
"""

from __future__ import annotations

import contextlib
import json
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from hlat.infra.backends.run_roles import RunRoles, ensure_run_role, role_name, storage_policy
from tests.integration.conftest import REGION, S3Env, moto_process

STACK = "hlat"
ACCOUNT = "123456789012"  # moto's


class _Session:
    """A boto3 session whose clients all reach one moto server."""

    def __init__(self, endpoint: str, key: str = "testing", secret: str = "testing", token: str | None = None) -> None:
        self.endpoint = endpoint
        self.session = boto3.Session(
            aws_access_key_id=key, aws_secret_access_key=secret, aws_session_token=token, region_name=REGION
        )

    def client(self, service: str, **kwargs: Any) -> Any:
        return self.session.client(service, endpoint_url=self.endpoint, **kwargs)


@dataclass(frozen=True)
class Runs:
    endpoint: str
    bucket: str
    a: _Session
    """Run A's training job (access 'run')."""
    b_data: _Session
    """Run B's prepare-data job (access 'data')."""
    a_uri: str
    b_uri: str


def _enforce(endpoint: str, after: int) -> None:
    """moto's IAM: grant `after` more unauthenticated actions, then judge every request."""
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=str(after).encode(),
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=10) as answer:
        assert json.loads(answer.read())["status"] == "ok"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    with moto_process(tmp_path_factory.mktemp("run-roles-moto")) as endpoint:
        _enforce(endpoint, 10**9)  # the set-up below is the account administrator's
        admin = _Session(endpoint)
        bucket = f"runs-{uuid.uuid4().hex[:8]}"
        s3, iam = admin.client("s3"), admin.client("iam")
        s3.create_bucket(Bucket=bucket)
        ecr = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "ecr:BatchGetImage", "Resource": "*"}],
        }
        common = iam.create_policy(PolicyName=f"{STACK}-job-common", PolicyDocument=json.dumps(ecr))["Policy"]["Arn"]
        other = iam.create_policy(PolicyName="someone-elses", PolicyDocument=json.dumps(ecr))["Policy"]["Arn"]
        boundary = iam.create_policy(PolicyName=f"{STACK}-run-role-boundary", PolicyDocument=json.dumps(ecr))
        trust = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"}, "Action": "sts:AssumeRole"}
        ]}  # fmt: skip
        execution = iam.create_role(RoleName=f"{STACK}-sagemaker-execution", AssumeRolePolicyDocument=json.dumps(trust))
        for arn in (common, other):
            iam.attach_role_policy(RoleName=f"{STACK}-sagemaker-execution", PolicyArn=arn)
        roles = RunRoles(boundary["Policy"]["Arn"], f"/hlat-runs/{STACK}/")
        a_uri, b_uri = f"s3://{bucket}/hlat/run-a", f"s3://{bucket}/hlat/run-b"
        sessions = []
        for uri, stage in ((a_uri, "train"), (b_uri, "prepare-data")):
            arn, created = ensure_run_role(admin, roles, uri, stage, execution["Role"]["Arn"])
            assert created and f":role/hlat-runs/{STACK}/hlat-run-" in arn
            assert ensure_run_role(admin, roles, uri, stage, execution["Role"]["Arn"]) == (arn, False)  # idempotent
            name = arn.rsplit("/", 1)[1]
            attached = iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]
            assert [p["PolicyArn"] for p in attached] == [common]  # the stack's job policies only
            assert (
                iam.get_role(RoleName=name)["Role"]["PermissionsBoundary"]["PermissionsBoundaryArn"]
                == roles.boundary_arn
            )
            creds = admin.client("sts").assume_role(RoleArn=arn, RoleSessionName="SageMaker")["Credentials"]
            sessions.append(_Session(endpoint, creds["AccessKeyId"], creds["SecretAccessKey"], creds["SessionToken"]))
        # What the runs already hold: B's checkpoint, a shared source.
        s3.put_object(Bucket=bucket, Key="hlat/run-b/checkpoints/step-000000100/model.pt", Body=b"B's weights")
        s3.put_object(Bucket=bucket, Key="hlat/sources/web-0123/shard-00000.parquet", Body=b"shared shard")
        _enforce(endpoint, 0)  # from here on every request is judged by IAM
        yield Runs(endpoint, bucket, sessions[0], sessions[1], a_uri, b_uri)


def _denied(call: Any, **kwargs: Any) -> bool:
    try:
        call(**kwargs)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        assert code in ("AccessDenied", "403"), exc
        return True
    return False


def test_a_runs_job_reaches_its_own_prefix_and_reads_the_shared_sources(runs: Runs) -> None:
    s3 = runs.a.client("s3")
    key = "hlat/run-a/checkpoints/step-000000001/model.pt"
    s3.put_object(Bucket=runs.bucket, Key=key, Body=b"A's weights")
    assert s3.get_object(Bucket=runs.bucket, Key=key)["Body"].read() == b"A's weights"
    s3.delete_object(Bucket=runs.bucket, Key=key)
    shard = s3.get_object(Bucket=runs.bucket, Key="hlat/sources/web-0123/shard-00000.parquet")
    assert shard["Body"].read() == b"shared shard"


def test_a_runs_job_cannot_write_overwrite_delete_or_read_another_runs_prefix(runs: Runs) -> None:
    s3 = runs.a.client("s3")
    theirs = "hlat/run-b/checkpoints/step-000000100/model.pt"
    assert _denied(s3.put_object, Bucket=runs.bucket, Key=theirs, Body=b"poisoned")  # overwrite
    assert _denied(s3.put_object, Bucket=runs.bucket, Key="hlat/run-b/checkpoints/step-000000101/x", Body=b"planted")
    assert _denied(s3.put_object, Bucket=runs.bucket, Key="hlat/run-b/code/job/hlat_job.py", Body=b"import os")
    assert _denied(s3.delete_object, Bucket=runs.bucket, Key=theirs)
    assert _denied(s3.get_object, Bucket=runs.bucket, Key=theirs)
    # A prefix that only starts like A's is another run's too.
    assert _denied(s3.put_object, Bucket=runs.bucket, Key="hlat/run-a2/x", Body=b"x")
    # The shared sources are read-only to a training job; the root's other folders are closed.
    assert _denied(s3.put_object, Bucket=runs.bucket, Key="hlat/sources/web-0123/shard-00000.parquet", Body=b"x")
    assert _denied(s3.delete_object, Bucket=runs.bucket, Key="hlat/sources/web-0123/shard-00000.parquet")
    assert _denied(s3.put_object, Bucket=runs.bucket, Key="hlat/imports/abc/model.safetensors", Body=b"x")
    # B's checkpoint is as it was.
    b = runs.b_data.client("s3")
    assert b.get_object(Bucket=runs.bucket, Key=theirs)["Body"].read() == b"B's weights"


def test_a_prepare_data_job_writes_the_shared_sources_and_its_own_run_only(runs: Runs) -> None:
    s3 = runs.b_data.client("s3")
    s3.put_object(Bucket=runs.bucket, Key="hlat/sources/books-4567/shard-00000.parquet", Body=b"new source")
    s3.put_object(Bucket=runs.bucket, Key="hlat/run-b/data/manifest.json", Body=b"{}")
    assert _denied(s3.put_object, Bucket=runs.bucket, Key="hlat/run-a/data/manifest.json", Body=b"{}")
    assert _denied(s3.put_object, Bucket=runs.bucket, Key="hlat/run-a/checkpoints/step-000000009/x", Body=b"x")


def test_the_storage_policy_names_the_run_the_shared_folders_and_the_configs_reads_only() -> None:
    policy = storage_policy(
        "s3://bkt/root/run-a", "run", reads=["s3://bkt/root/run-x/checkpoints/step-000000500/", "s3://other/corpus"]
    )
    by_sid = {s["Sid"]: s for s in policy["Statement"]}
    assert by_sid["OwnPrefix"]["Resource"] == ["arn:aws:s3:::bkt/root/run-a/*"]
    assert by_sid["SharedReads"]["Action"] == "s3:GetObject"
    assert by_sid["SharedReads"]["Resource"] == [
        "arn:aws:s3:::bkt/root/imports/*",
        "arn:aws:s3:::bkt/root/run-x/checkpoints/step-000000500/*",  # model.init_from: another run's, read-only
        "arn:aws:s3:::bkt/root/sources/*",
    ]  # another bucket is the stack's corpus-bucket policy's, not this one's
    assert "root/run-a/*" in by_sid["ListOwnAndShared"]["Condition"]["StringLike"]["s3:prefix"]
    data = storage_policy("s3://bkt/root/run-a", "data")
    assert {s["Sid"]: s for s in data["Statement"]}["OwnPrefix"]["Resource"] == [
        "arn:aws:s3:::bkt/root/run-a/*",
        "arn:aws:s3:::bkt/root/sources/*",
    ]
    assert len(role_name("s3://" + "b" * 63 + "/" + "k" * 900, "data")) <= 64


def test_the_sagemaker_backend_runs_each_job_as_its_runs_role(s3_env: S3Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the pool's HLAT_RUN_ROLE_BOUNDARY set, CreateTrainingJob names the run's own role (made just before),
    not job.role_arn; a job of the same run later reuses it."""
    from tests.integration.test_sagemaker_moto import make

    monkeypatch.setenv("SAGEMAKER_VALIDATE_ROLE", "false")
    iam = s3_env.client("iam")
    ecr = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "ecr:BatchGetImage", "Resource": "*"}]}
    suffix = uuid.uuid4().hex[:6]
    boundary = iam.create_policy(PolicyName=f"b-{suffix}", PolicyDocument=json.dumps(ecr))["Policy"]["Arn"]
    backend, spec = make(s3_env, f"roles-{suffix}")
    base = backend.job.role_arn.rsplit("/", 1)[1]
    with contextlib.suppress(ClientError):
        iam.create_role(RoleName=base, AssumeRolePolicyDocument="{}")
    monkeypatch.setenv("HLAT_RUN_ROLE_BOUNDARY", boundary)
    monkeypatch.setenv("HLAT_RUN_ROLE_PATH", "/hlat-runs/test/")
    (dry,) = [r for r in backend.dry_run(spec) if r["operation"] == "CreateTrainingJob"]
    backend.submit(spec)
    described = backend.sagemaker.describe_training_job(TrainingJobName=spec.name)
    assert described["RoleArn"] == f"arn:aws:iam::{ACCOUNT}:role/hlat-runs/test/{role_name(spec.run_uri, 'run')}"
    assert dry["params"]["RoleArn"] == described["RoleArn"]  # the dry run shows the run's role
    policy = iam.get_role_policy(RoleName=role_name(spec.run_uri, "run"), PolicyName="run-storage")["PolicyDocument"]
    resources = json.dumps(policy)
    assert f"{spec.run_uri.removeprefix('s3://')}/*" in resources and "sources/*" in resources
