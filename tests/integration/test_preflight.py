"""The live preflight (infra/checks/preflight.py) against AWS's emulator: moto servers on 127.0.0.1 for STS, IAM, S3,
ECR
and SageMaker's training-job listing; botocore's Stubber for Service Quotas (moto lists VPC's quotas only) and
SageMaker's DescribeTrainingPlan (moto has none).

Each injected fault is named in one line:
- a missing quota: the stubbed ListServiceQuotas gives ml.trn1.32xlarge 0 instances;
- a quota that other runs' jobs use up: training jobs created on moto, one of them set InProgress in moto's
  backend (moto completes every job at creation; the listing, its StatusEquals filter and DescribeTrainingJob's
  ResourceConfig are moto's);
- a caller without PassRole: moto has no policy simulator (SimulatePrincipalPolicy answers 500), so the preflight
  reads the caller's own policies and evaluates them (`passrole_decision`); the caller's policy allows everything
  but iam:PassRole (NotAction);
- a bucket without delete, for the caller or for the job's role only: moto does not enforce bucket policies, so the
  fault is IAM's, on a moto server that enforces IAM (a subprocess: moto's switch is process-wide), which also
  applies an assumed role's own policies to its session and checks the role's trust policy at AssumeRole;
- a caller who may not assume the job's role: the caller's policy denies sts:AssumeRole, or the role's trust does
  not name it. moto evaluates a trust statement's AWS principal only (a statement naming nothing but a Service
  principal makes its AssumeRole answer 500), so the roles on that server trust sagemaker.amazonaws.com and the
  caller in one statement.

And the source checks that run before anything starts or is written: a bad s3:// source and a hub name that does not
resolve fail in seconds with one line and leave no run folder.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from hlat.core.config import HlatConfig
from hlat.core.presets import load_config
from hlat.infra.checks.capacity import instance_needs
from hlat.infra.checks.findings import PreflightFailed
from hlat.infra.checks.preflight import run_preflight
from tests.integration.conftest import REGION, S3Env, free_port, s3_client, set_aws_env, wait_until_up

ACCOUNT = "123456789012"
TRUST = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"}, "Action": "sts:AssumeRole"}],
}
MANIFEST = json.dumps(
    {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json", "layers": []}
)


def allow(*extra: dict[str, Any], not_action: str | None = None) -> str:
    everything: dict[str, Any] = {"Effect": "Allow", "Resource": "*"}
    everything.update({"NotAction": not_action} if not_action else {"Action": "*"})
    return json.dumps({"Version": "2012-10-17", "Statement": [everything, *extra]})


@dataclass(frozen=True)
class Account:
    endpoint: str
    bucket: str
    storage: str
    role_arn: str
    image: str
    key: str
    secret: str


def prepare_account(
    endpoint: str,
    bucket: str,
    admin: tuple[str, str],
    caller_policy: str,
    role_policy: str | None = None,
    *,
    trust_caller: bool = False,
) -> Account:
    """A caller (an IAM user with `caller_policy`, whose keys the test uses), the execution role (trusting
    SageMaker, and the caller too with `trust_caller`; with `role_policy` inline), and the image."""
    suffix = uuid.uuid4().hex[:8]
    iam = s3_client(endpoint, *admin, service="iam")
    user = f"deployer-{suffix}"
    user_arn = iam.create_user(UserName=user)["User"]["Arn"]
    iam.put_user_policy(UserName=user, PolicyName="caller", PolicyDocument=caller_policy)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    trust = json.loads(json.dumps(TRUST))
    if trust_caller:
        trust["Statement"][0]["Principal"]["AWS"] = user_arn
    role = iam.create_role(RoleName=f"hlat-sagemaker-{suffix}", AssumeRolePolicyDocument=json.dumps(trust))
    if role_policy is not None:
        iam.put_role_policy(RoleName=role["Role"]["RoleName"], PolicyName="job", PolicyDocument=role_policy)
    ecr = s3_client(endpoint, *admin, service="ecr")
    repo = f"hlat-train-{suffix}"
    ecr.create_repository(repositoryName=repo)
    ecr.put_image(repositoryName=repo, imageManifest=MANIFEST, imageTag="v1")
    return Account(
        endpoint=endpoint,
        bucket=bucket,
        storage=f"s3://{bucket}/runs",
        role_arn=role["Role"]["Arn"],
        image=f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/{repo}:v1",
        key=key["AccessKeyId"],
        secret=key["SecretAccessKey"],
    )


def sagemaker_config(account: Account, **sets: Any) -> HlatConfig:
    """hlat-7b on SageMaker in the emulator's region, every job's image the account's own, the builtin corpus and a
    tokenizer trained on it (the preset's LLaMA-2 tokenizer is on the hub, which tests do not reach; a pretrained
    tokenizer's check is tested in tests/integration/test_pretrained_tokenizer.py)."""
    changes = {
        "job.backend": "sagemaker",
        "job.region": REGION,
        "job.role_arn": account.role_arn,
        "job.image_uri": account.image,
        "data.image_uri": account.image,
        "evaluation.image_uri": account.image,
        "data.source": "builtin:python-stdlib",
        "tokenizer.pretrained": None,
        **sets,
    }
    return load_config("hlat-7b", changes, storage=account.storage)


def stubbed_quotas(config: HlatConfig, **values: int) -> Any:
    """A Service Quotas client answering one ListServiceQuotas: each needed type's quota at the count it needs,
    or at `values[type with _ for .]`."""
    client = boto3.client("service-quotas", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    quotas = []
    for i, (instance_type, (count, _)) in enumerate(instance_needs(config).items()):
        value = values.get(instance_type.replace(".", "_"), count)
        name = f"{instance_type} for training job usage"
        quotas.append({"QuotaName": name, "QuotaCode": f"L-{i:08d}", "Value": float(value), "ServiceCode": "sagemaker"})
    stubber = Stubber(client)
    stubber.add_response("list_service_quotas", {"Quotas": quotas}, {"ServiceCode": "sagemaker"})
    stubber.activate()
    return client


@pytest.fixture
def account(s3_env: S3Env, monkeypatch: pytest.MonkeyPatch) -> Account:
    made = prepare_account(s3_env.endpoint, s3_env.bucket, ("testing", "testing"), allow())
    set_aws_env(monkeypatch, made.endpoint, made.key, made.secret)
    return made


def probes(account: Account) -> list[str]:
    listed = s3_client(account.endpoint).list_objects_v2(Bucket=account.bucket, Prefix="runs/")
    return [o["Key"] for o in listed.get("Contents", []) if ".hlat-preflight-" in o["Key"]]


def test_a_prepared_account_passes_every_check_and_the_probe_is_removed(account: Account) -> None:
    from hlat.flows.stage import source_shape

    config = sagemaker_config(account)
    result = run_preflight(config, shape=source_shape, clients={"service-quotas": stubbed_quotas(config)})
    assert result.ok, result.lines()
    by_check = {f.check: f for f in result.findings}
    assert set(by_check) == {"source", "caller", "role", "passrole", "storage", "image", "quota"}
    assert by_check["caller"].message.startswith(f"arn:aws:iam::{ACCOUNT}:user/deployer-")
    assert "trusts sagemaker.amazonaws.com" in by_check["role"].message
    assert "(its policies, read here)" in by_check["passrole"].message  # moto has no policy simulator
    # The probe as the caller (the flow writes the run's files) and as the job's role (assumed: this moto server
    # does not enforce IAM, so any caller may).
    where = f"write, read, list and delete under s3://{account.bucket}/runs/{config.resolved_run_id()}/"
    assert [f.message for f in result.findings if f.check == "storage"] == [
        f"{where} as the caller",
        f"{where} as the job's role {account.role_arn}",
    ]
    # No training job of another run holds instances (moto's jobs are Completed at creation).
    (trn1,) = [f.message for f in result.findings if f.message.startswith("ml.trn1.32xlarge")]
    assert trn1.endswith("is 64, none held by other running training jobs: 64 free"), trn1
    assert all(line.startswith("preflight ok ") for line in result.lines()), result.lines()
    assert probes(account) == []


def test_hlat_preflight_prints_one_line_per_check_and_exits_1_on_a_failure(
    account: Account, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from hlat.cli import add_run_options
    from hlat.commands.preflight import preflight_command

    parser = argparse.ArgumentParser()
    add_run_options(parser)
    overrides = {
        "job.backend": "sagemaker", "job.region": REGION, "job.role_arn": account.role_arn,
        "job.image_uri": account.image, "data.image_uri": account.image, "evaluation.image_uri": account.image,
        "data.source": "builtin:python-stdlib", "tokenizer.pretrained": None,
    }  # fmt: skip
    assert preflight_command(parser.parse_args(["--preset", "hlat-7b", "--storage", account.storage]), overrides) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1:3] for line in lines] == [
        ["ok", "run:"], ["ok", "config:"], ["ok", "source:"], ["ok", "caller:"], ["ok", "role:"], ["ok", "passrole:"],
        ["ok", "storage:"], ["ok", "storage:"], ["ok", "image:"],
        # moto has no SageMaker quotas (it answers 500): not verified, not failed.
        ["??", "quota:"],
    ], lines  # fmt: skip
    missing = "s3://hlat-no-such-bucket/runs"
    assert preflight_command(parser.parse_args(["--preset", "hlat-7b", "--storage", missing]), overrides) == 1
    out, err = capsys.readouterr()
    (failure,) = [line for line in out.splitlines() if line.startswith("preflight FAIL")]
    assert failure.startswith("preflight FAIL storage: storage.root: bucket 'hlat-no-such-bucket' does not exist")
    assert err == "hlat: preflight: 1 check(s) failed; nothing was started\n"


def test_a_missing_quota_is_one_line_naming_the_request(account: Account) -> None:
    config = sagemaker_config(account)
    result = run_preflight(config, clients={"service-quotas": stubbed_quotas(config, ml_trn1_32xlarge=0)})
    (failure,) = result.failures
    assert failure.check == "quota"
    assert failure.message.startswith(
        "ml.trn1.32xlarge x 64 (precompile, burn-in, train): 'ml.trn1.32xlarge for training job usage' is 0 in "
        "us-east-1; request 64: aws service-quotas request-service-quota-increase --service-code sagemaker"
    ), failure.message
    assert "\n" not in failure.line()


def test_a_caller_without_passrole_is_one_line_naming_the_statement(
    s3_env: S3Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = prepare_account(s3_env.endpoint, s3_env.bucket, ("testing", "testing"), allow(not_action="iam:PassRole"))
    set_aws_env(monkeypatch, made.endpoint, made.key, made.secret)
    config = sagemaker_config(made)
    result = run_preflight(config, clients={"service-quotas": stubbed_quotas(config)})
    (failure,) = result.failures
    assert failure.check == "passrole"
    assert f"may not iam:PassRole {made.role_arn} (its policies)" in failure.message
    assert '"Action": "iam:PassRole"' in failure.message and "iam:PassedToService" in failure.message


def test_a_role_that_does_not_trust_sagemaker_and_a_missing_image(account: Account) -> None:
    iam = s3_client(account.endpoint, service="iam")
    lambda_trust = json.loads(json.dumps(TRUST).replace("sagemaker", "lambda"))
    role = iam.create_role(RoleName=f"lambda-{uuid.uuid4().hex[:6]}", AssumeRolePolicyDocument=json.dumps(lambda_trust))
    missing = account.image.replace(":v1", ":v9")
    config = sagemaker_config(account, **{"job.role_arn": role["Role"]["Arn"], "job.image_uri": missing})
    result = run_preflight(config, clients={"service-quotas": stubbed_quotas(config)})
    assert sorted(f.check for f in result.failures) == ["image", "role"], result.lines()
    role_line, image_line = sorted(result.failures, key=lambda f: f.check, reverse=True)
    assert "does not trust sagemaker.amazonaws.com" in role_line.message
    assert image_line.message.startswith(f"{missing} (train): no such image in ECR (ImageNotFoundException)")


def test_an_image_in_another_accounts_registry_is_not_verified_rather_than_failed(account: Account) -> None:
    dlc = f"763104351884.dkr.ecr.{REGION}.amazonaws.com/pytorch-training-neuronx:2.9.0"
    config = sagemaker_config(account, **{"job.image_uri": dlc})
    result = run_preflight(config, clients={"service-quotas": stubbed_quotas(config)})
    assert result.ok, result.lines()
    (line,) = [x for x in result.lines() if dlc in x]
    assert line.startswith("preflight ??   image: ") and "may not describe" in line


def test_the_training_plans_capacity(account: Account) -> None:
    arn = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:training-plan/hlat-plan"
    config = sagemaker_config(account, **{"job.training_plan_arn": arn})
    sagemaker = boto3.client("sagemaker", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    stubber = Stubber(sagemaker)
    plan = {
        "TrainingPlanArn": arn, "TrainingPlanName": "hlat-plan", "Status": "Active",
        "TargetResources": ["training-job"], "TotalInstanceCount": 32, "AvailableInstanceCount": 32,
        "ReservedCapacitySummaries": [
            {"ReservedCapacityArn": f"{arn}/rc", "InstanceType": "ml.trn1.32xlarge", "TotalInstanceCount": 32,
             "Status": "Active"}
        ],
    }  # fmt: skip
    stubber.add_response("describe_training_plan", plan, {"TrainingPlanName": arn})
    stubber.activate()
    clients = {"service-quotas": stubbed_quotas(config), "sagemaker": sagemaker}
    (failure,) = run_preflight(config, clients=clients).failures
    assert failure.line() == (
        "preflight FAIL training-plan: hlat-plan reserves 32 x ml.trn1.32xlarge, the run needs 64; use a larger plan "
        "or set job.instance_count"
    )


def test_no_credentials_is_one_line_and_nothing_else_is_asked(s3_no_credentials: S3Env) -> None:
    config = load_config(
        "hlat-7b",
        {"job.backend": "sagemaker", "job.region": REGION, "data.source": "builtin:python-stdlib"},
        storage=s3_no_credentials.url,
    )
    result = run_preflight(config)
    assert [f.check for f in result.failures] == ["caller"]
    assert result.failures[0].message.startswith("no AWS credentials: configure a profile")


# -- a bucket without delete: IAM enforced, on a server of its own ---------------------------------------------------
_ADMIN_SETUP_ACTIONS = 3  # create_user, put_user_policy, create_access_key; every later request is authorized


@pytest.fixture(scope="module")
def iam_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, tuple[str, str]]]:
    """A moto server (subprocess) that enforces IAM, with an admin user allowed everything but s3:DeleteObject."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    script = Path(sys.executable).with_name("moto_server")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "moto.server"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(_ADMIN_SETUP_ACTIONS)
    log = tmp_path_factory.mktemp("iam-moto") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)], env=env, stdout=out, stderr=out)
    try:
        wait_until_up(endpoint, proc=proc)
        iam = s3_client(endpoint, service="iam")
        iam.create_user(UserName="admin")
        no_delete = {"Effect": "Deny", "Action": "s3:DeleteObject", "Resource": "*"}
        iam.put_user_policy(UserName="admin", PolicyName="all-but-delete", PolicyDocument=allow(no_delete))
        key = iam.create_access_key(UserName="admin")["AccessKey"]
        yield endpoint, (key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_bucket_without_delete_is_one_line_naming_the_permission(
    iam_server: tuple[str, tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, admin = iam_server
    bucket = f"hlat-no-delete-{uuid.uuid4().hex[:8]}"
    s3_client(endpoint, *admin).create_bucket(Bucket=bucket)
    made = prepare_account(
        endpoint,
        bucket,
        admin,
        allow({"Effect": "Deny", "Action": "s3:DeleteObject", "Resource": "*"}),
        role_policy=allow(),
        trust_caller=True,
    )
    set_aws_env(monkeypatch, endpoint, made.key, made.secret)
    config = sagemaker_config(made)
    result = run_preflight(config, clients={"service-quotas": stubbed_quotas(config)})
    (failure,) = result.failures
    run_prefix = f"runs/{config.resolved_run_id()}"
    assert failure.line().startswith(
        f"preflight FAIL storage: s3:DeleteObject denied on s3://{bucket}/{run_prefix}/ (AccessDenied); allow "
        f"s3:DeleteObject on arn:aws:s3:::{bucket}/{run_prefix}/* to the caller; the probe s3://{bucket}/{run_prefix}/"
        ".hlat-preflight-"
    ), failure.line()
    # The job's role may delete: its own probe passes.
    storage = [f for f in result.findings if f.check == "storage"]
    assert storage[-1].ok and storage[-1].message.endswith(f"as the job's role {made.role_arn}"), storage


def test_a_job_role_without_delete_fails_where_the_caller_would_pass(
    iam_server: tuple[str, tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller may do everything, the job's role everything but s3:DeleteObject (retention's deletes would fail
    in the job): probed as the caller only, this passed."""
    endpoint, admin = iam_server
    bucket = f"hlat-role-no-delete-{uuid.uuid4().hex[:8]}"
    s3_client(endpoint, *admin).create_bucket(Bucket=bucket)
    no_delete = {"Effect": "Deny", "Action": "s3:DeleteObject", "Resource": "*"}
    made = prepare_account(endpoint, bucket, admin, allow(), role_policy=allow(no_delete), trust_caller=True)
    set_aws_env(monkeypatch, endpoint, made.key, made.secret)
    config = sagemaker_config(made)
    result = run_preflight(config, clients={"service-quotas": stubbed_quotas(config)})
    run_prefix = f"runs/{config.resolved_run_id()}"
    (failure,) = result.failures
    assert failure.line() == (
        f"preflight FAIL storage: s3:DeleteObject denied on s3://{bucket}/{run_prefix}/ (AccessDenied); allow "
        f"s3:DeleteObject on arn:aws:s3:::{bucket}/{run_prefix}/* to the job's role {made.role_arn}"
    )
    caller_probe = next(f for f in result.findings if f.check == "storage")
    assert caller_probe.ok and caller_probe.message.endswith("as the caller")
    # The role's probe was removed by the caller: nothing left under the prefix.
    listed = s3_client(endpoint, *admin).list_objects_v2(Bucket=bucket, Prefix="runs/")
    assert listed.get("KeyCount", 0) == 0, listed.get("Contents")


@pytest.mark.parametrize("refusal", ["caller-policy", "trust"])
def test_a_caller_who_may_not_assume_the_job_role_is_said_so_not_passed_silently(
    iam_server: tuple[str, tuple[str, str]], monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """AssumeRole refused, by the caller's own policy or by a role that trusts SageMaker alone: the storage line
    says the prefix was checked as the caller only, and why (`??`: not verified, not failed)."""
    endpoint, admin = iam_server
    bucket = f"hlat-no-assume-{uuid.uuid4().hex[:8]}"
    s3_client(endpoint, *admin).create_bucket(Bucket=bucket)
    no_assume = {"Effect": "Deny", "Action": "sts:AssumeRole", "Resource": "*"}
    caller_policy = allow(no_assume) if refusal == "caller-policy" else allow()
    # A role that trusts only SageMaker makes moto's AssumeRole answer 500 (see the module docstring); one that
    # trusts another principal is refused by moto as by IAM.
    made = prepare_account(endpoint, bucket, admin, caller_policy, role_policy=allow(), trust_caller=True)
    if refusal == "trust":
        other = {"Effect": "Allow", "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:user/someone-else"},
                 "Action": "sts:AssumeRole"}  # fmt: skip
        s3_client(endpoint, *admin, service="iam").update_assume_role_policy(
            RoleName=made.role_arn.rsplit("/", 1)[-1],
            PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [other]}),
        )
    set_aws_env(monkeypatch, endpoint, made.key, made.secret)
    config = sagemaker_config(made)
    result = run_preflight(config, clients={"service-quotas": stubbed_quotas(config)})
    storage = [f for f in result.findings if f.check == "storage"]
    assert [(f.ok, f.checked) for f in storage] == [(True, True), (True, False)], storage
    assert (
        storage[1]
        .line()
        .startswith(
            f"preflight ??   storage: checked as the caller, not as the job's role: sts:AssumeRole of "
            f"{made.role_arn} denied (AccessDenied); to check as the job's role, allow the caller sts:AssumeRole on "
            "it in sessions named hlat-preflight-* and trust the caller's account"
        )
    ), storage[1].line()
    assert "storage" not in [f.check for f in result.failures]


def test_quotas_less_what_other_runs_jobs_hold(s3_server: str, account: Account) -> None:
    """Three training jobs on moto: another run's, InProgress, on 48 trn1 nodes; a Completed one on 64; this run's
    own train job, InProgress on 64 (the run's own holdings are counted by instance_needs, not as other usage)."""
    from moto.sagemaker.models import sagemaker_backends

    from hlat.infra.backends.protocol import job_name

    config = sagemaker_config(account)
    sagemaker = s3_client(account.endpoint, service="sagemaker")
    suffix = uuid.uuid4().hex[:6]
    jobs = {
        f"other-run-{suffix}-train-2": ("InProgress", 48),
        f"done-run-{suffix}-train-1": ("Completed", 64),
        job_name(config.resolved_run_id(), 3): ("InProgress", 64),
    }
    for name, (_, count) in jobs.items():
        sagemaker.create_training_job(
            TrainingJobName=name,
            AlgorithmSpecification={"TrainingImage": account.image, "TrainingInputMode": "File"},
            RoleArn=account.role_arn,
            OutputDataConfig={"S3OutputPath": f"{account.storage}/out"},
            ResourceConfig={"InstanceType": "ml.trn1.32xlarge", "InstanceCount": count, "VolumeSizeInGB": 50},
            StoppingCondition={"MaxRuntimeInSeconds": 3600},
        )
    backend = sagemaker_backends[ACCOUNT][REGION]
    try:
        for name, (status, _) in jobs.items():
            backend.training_jobs[name].training_job_status = status  # moto completes every job at creation
        short = run_preflight(config, clients={"service-quotas": stubbed_quotas(config, ml_trn1_32xlarge=100)})
        enough = run_preflight(config, clients={"service-quotas": stubbed_quotas(config, ml_trn1_32xlarge=128)})
    finally:
        for name in jobs:
            backend.training_jobs.pop(name, None)
    (failure,) = short.failures
    assert failure.message == (
        "ml.trn1.32xlarge x 64 (precompile, burn-in, train): 'ml.trn1.32xlarge for training job usage' is 100 in "
        f"us-east-1, 48 held by 1 running training job(s) of other runs (other-run-{suffix}-train-2: 48): 52 free, "
        "64 needed; wait for those jobs or stop them, or request 112: aws service-quotas "
        "request-service-quota-increase --service-code sagemaker --quota-code L-00000001 --desired-value 112 "
        "--region us-east-1"
    ), failure.message
    assert enough.ok, enough.lines()
    (line,) = [x for x in enough.lines() if "ml.trn1.32xlarge x 64" in x]
    assert line == (
        "preflight ok   quota: ml.trn1.32xlarge x 64 (precompile, burn-in, train): 'ml.trn1.32xlarge for training "
        f"job usage' is 128, 48 held by 1 running training job(s) of other runs (other-run-{suffix}-train-2: 48): "
        "80 free"
    )


# -- sources: before anything starts or is written ------------------------------------------------------------------
def local_start(tmp_path: Path, source: str, **sets: Any) -> None:
    from hlat.flows.stage import start_run

    start_run("tiny", {"data.source": source, **sets}, None, str(tmp_path / "runs"))


def test_a_bad_s3_source_fails_with_one_line_and_leaves_no_run_folder(s3_env: S3Env, tmp_path: Path) -> None:
    with pytest.raises(PreflightFailed) as failed:
        local_start(tmp_path, f"s3://{s3_env.bucket}/no-such-corpus")
    assert str(failed.value) == (
        f"data.source: nothing at or under s3://{s3_env.bucket}/no-such-corpus; give an s3:// URI that holds the corpus"
    )
    with pytest.raises(PreflightFailed, match=r"^data.source: bucket 'hlat-missing-bucket' does not"):
        local_start(tmp_path, "s3://hlat-missing-bucket/corpus")
    assert not (tmp_path / "runs").exists()


def test_a_hub_name_offline_without_a_cached_copy_fails_naming_hf_hub_offline(tmp_path: Path) -> None:
    from hlat.commands.preflight import check_before_start

    with pytest.raises(PreflightFailed) as failed:
        local_start(tmp_path, "HuggingFaceFW/finewbe")  # the test session is offline (tests/conftest.py)
    # The same line from the CLI's check before its server starts.
    config = load_config("tiny", {"data.source": "HuggingFaceFW/finewbe"}, storage=str(tmp_path / "runs"))
    with pytest.raises(PreflightFailed, match="^" + re.escape(str(failed.value)) + "$"):
        check_before_start(config, reads_source=True)
    assert str(failed.value) == (
        "data.source: 'HuggingFaceFW/finewbe' cannot be resolved offline (HF_HUB_OFFLINE=1) and "
        "has no cached copy; unset HF_HUB_OFFLINE to reach the hub, or copy the data set to s3:// or a local folder"
    )
    assert not (tmp_path / "runs").exists()


class _NoSuchRepo(http.server.BaseHTTPRequestHandler):
    """The hub's answer to a dataset name it does not know."""

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "Repository not found"}')

    def log_message(self, *args: Any) -> None:
        pass


def test_a_hub_typo_fails_with_one_line_and_leaves_no_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        with pytest.raises(PreflightFailed) as failed:
            local_start(tmp_path, "HuggingFaceFW/finewbe")
    finally:
        server.shutdown()
    assert str(failed.value) == (
        "data.source: no Hugging Face dataset named 'HuggingFaceFW/finewbe' (or it is private: set "
        "HF_TOKEN); check the name (namespace/name)"
    )
    assert not (tmp_path / "runs").exists()
