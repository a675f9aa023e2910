"""AWS credentials from a prefect-aws AwsCredentials block and the SageMaker role from a Secret block, saved on the
session's Prefect test server; S3 on moto servers on 127.0.0.1 (one of them enforcing IAM, so a request works only
when signed with the block's own key and secret)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from hlat.core.config import ConfigError, JobConfig
from hlat.core.presets import load_config
from hlat.core.run import open_run
from hlat.core.storage import Storage, StorageError
from hlat.infra.checks import aws
from hlat.infra.dry_run import PLACEHOLDER_ROLE, dry_run
from hlat.tasks.aws import activate, role_arn, with_role
from tests.integration.conftest import AWS_CREDENTIAL_VARS, FAKE_KEY, REGION, IamS3, S3Env, free_port

ROLE = "arn:aws:iam::123456789012:role/hlat-training"


@pytest.fixture
def no_aws_env(prefect_server: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No AWS credentials, profile, region or endpoint anywhere botocore looks; the environment `activate` changes
    is restored after the test (monkeypatch would not unset a variable that was absent when it deleted it)."""
    saved = dict(os.environ)
    for name in {*AWS_CREDENTIAL_VARS, *aws.managed_variables()}:
        monkeypatch.delenv(name, raising=False)
    empty = tmp_path / "aws-empty"
    empty.write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield
    os.environ.clear()
    os.environ.update(saved)


def block_name(kind: str) -> str:
    return f"hlat-test-{kind}-{uuid.uuid4().hex[:8]}"


def save_credentials(**fields: object) -> str:
    from prefect_aws import AwsCredentials

    name = block_name("aws")
    AwsCredentials(**fields).save(name)
    return name


def save_secret(value: str) -> str:
    from prefect.blocks.system import Secret

    name = block_name("role")
    Secret(value=value).save(name)
    return name


def sagemaker_job(**fields: object) -> JobConfig:
    base: dict[str, object] = {"backend": "sagemaker", "instance_type": "ml.trn1.32xlarge", "region": REGION}
    return JobConfig(**{**base, **fields})


def test_the_blocks_keys_sign_s3_requests_and_override_a_stale_environment(
    no_aws_env: None, iam_s3_server: IamS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = save_credentials(
        aws_access_key_id=iam_s3_server.key,
        aws_secret_access_key=iam_s3_server.secret,
        region_name=REGION,
        aws_client_parameters={"endpoint_url": iam_s3_server.endpoint},
    )
    # Left over from another setup: each would spoil the block's keys (a profile that does not exist fails every
    # client; a token from other keys fails the signature; a service endpoint beats AWS_ENDPOINT_URL).
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    monkeypatch.setenv("AWS_DEFAULT_PROFILE", "no-such-profile")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "stale-token")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")

    activate(JobConfig(aws_credentials_block=name, region=REGION))

    credentials = boto3.Session().get_credentials()
    assert credentials is not None and credentials.access_key == iam_s3_server.key
    assert credentials.token is None
    store = Storage(f"s3://{iam_s3_server.allowed_bucket}/runs")
    store.write_text("probe.txt", "hello")
    assert store.read_text("probe.txt") == "hello"
    # IAM is enforced: the key is the restricted user's, allowed that bucket only.
    with pytest.raises(StorageError):
        Storage(f"s3://{iam_s3_server.denied_bucket}/runs").write_text("probe.txt", "no")
    # The processes a run starts (local jobs, their training ranks) inherit the environment, hence the block.
    child = subprocess.run(
        [sys.executable, "-c", "import boto3; print(boto3.Session().get_credentials().access_key)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert child.stdout.strip() == iam_s3_server.key


def test_without_a_block_the_default_chain_is_used(s3_env: S3Env) -> None:
    activate(JobConfig(region=REGION))  # no block: nothing is loaded or changed

    credentials = boto3.Session().get_credentials()
    assert credentials is not None and credentials.access_key == FAKE_KEY  # from the environment
    store = Storage(s3_env.url)
    store.write_text("probe.txt", "default chain")
    assert store.read_text("probe.txt") == "default chain"


def test_a_block_with_a_profile_beats_the_environments_keys(
    no_aws_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    credentials_file = tmp_path / "credentials"
    credentials_file.write_text("[hlat-profile]\naws_access_key_id = AKIAPROFILE\naws_secret_access_key = s\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials_file))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFROMENV")  # botocore reads these before any profile
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "from-env")
    name = save_credentials(profile_name="hlat-profile")

    activate(JobConfig(aws_credentials_block=name, region=REGION))

    credentials = boto3.Session().get_credentials()
    assert credentials is not None and credentials.access_key == "AKIAPROFILE"


def test_a_missing_block_says_how_to_create_it(no_aws_env: None) -> None:
    job = JobConfig(aws_credentials_block="hlat-no-such-block")
    with pytest.raises(ConfigError) as err:
        activate(job)
    text = str(err.value)
    assert "job.aws_credentials_block='hlat-no-such-block'" in text
    assert "prefect block register -m prefect_aws" in text and "AwsCredentials(" in text


def test_the_secret_key_reaches_no_message_log_or_run_config(
    no_aws_env: None, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    secret = f"hlat-secret-{uuid.uuid4().hex}"
    caplog.set_level(logging.DEBUG)
    good = save_credentials(aws_access_key_id="AKIAHLAT", aws_secret_access_key=secret, region_name="eu-west-1")
    half = save_credentials(aws_secret_access_key=secret)
    assume = save_credentials(aws_access_key_id="AKIAHLAT", aws_secret_access_key=secret, assume_role_arn=ROLE)

    config = load_config("tiny", {"job.aws_credentials_block": good}, run_id="secret-check", storage=str(tmp_path))
    activate(config.job)
    errors = []
    for name in (half, assume):
        with pytest.raises(ConfigError) as err:
            activate(JobConfig(aws_credentials_block=name))
        errors.append(str(err.value))
    open_run(config)

    assert "aws_access_key_id is empty" in errors[0] and "assume_role_arn" in errors[1]
    assert f"AwsCredentials block {good!r} (access key)" in caplog.text
    assert "job.region=us-west-2" in caplog.text  # the block's region differs: a warning says which is used
    saved = (tmp_path / "secret-check" / "config.json").read_text()
    assert json.loads(saved)["job"]["aws_credentials_block"] == good
    for text in (*errors, caplog.text, saved):
        assert secret not in text


def test_the_dry_run_request_carries_the_role_from_the_secret_block_and_no_credentials(no_aws_env: None) -> None:
    secret = f"hlat-secret-{uuid.uuid4().hex}"
    block = save_credentials(aws_access_key_id="AKIAHLAT", aws_secret_access_key=secret)
    activate(JobConfig(aws_credentials_block=block))

    def request(overrides: dict[str, object]) -> tuple[dict[str, Any], str]:
        config = with_role(load_config("hlat-7b", overrides, storage="s3://hlat-runs/prod"))
        text = dry_run(config)  # the real CreateTrainingJob request, validated against botocore's service model
        return json.loads(text.split("sagemaker CreateTrainingJob:\n", 1)[1].split("\n\n", 1)[0]), text

    create, text = request({"job.role_arn_secret": save_secret(ROLE)})
    assert create["RoleArn"] == ROLE and "placeholder" not in text
    # SageMaker jobs run as the role: the run's credentials never travel in the request.
    assert not [k for k in create["Environment"] if k.startswith("AWS_")]
    assert secret not in text and "AKIAHLAT" not in text

    with pytest.raises(ConfigError, match=r"job\.role_arn_secret='hlat-no-such-secret': no Secret block named"):
        request({"job.role_arn_secret": "hlat-no-such-secret"})
    unresolved = load_config("hlat-7b", {"job.role_arn_secret": "hlat-role"}, storage="s3://hlat-runs/prod")
    assert f"job.role_arn is not set; shown with {PLACEHOLDER_ROLE}" in dry_run(unresolved)


def test_a_secret_that_is_not_a_role_arn_is_refused_without_repeating_it(no_aws_env: None) -> None:
    password = f"hunter2-{uuid.uuid4().hex}"
    job = sagemaker_job(role_arn_secret=save_secret(password))
    with pytest.raises(ConfigError, match="not an IAM role ARN") as err:
        role_arn(job)
    assert password not in str(err.value)
    assert role_arn(sagemaker_job(role_arn=ROLE)) == ROLE  # no block read: role_arn is used as is
    assert role_arn(sagemaker_job()) is None


def test_role_arn_and_its_secret_together_are_refused_and_neither_block_field_changes_the_run_id() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny", {"job.role_arn": ROLE, "job.role_arn_secret": "hlat-role"})
    assert "job.role_arn and job.role_arn_secret are both set" in str(err.value)
    with pytest.raises(ConfigError, match="not a Prefect block name"):
        load_config("tiny", {"job.aws_credentials_block": "My Creds"})
    plain = load_config("tiny")
    named = load_config("tiny", {"job.role_arn_secret": "hlat-role", "job.aws_credentials_block": "hlat-aws"})
    assert named.resolved_run_id() == plain.resolved_run_id()
