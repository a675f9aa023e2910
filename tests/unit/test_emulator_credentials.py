"""The SageMaker emulator's containers run on their role's credentials, never the caller's (issue 51): where the caller
may not assume the role, or STS cannot be reached, the job does not start and the error names what to change."""

from __future__ import annotations

import socket

import pytest

from hlat.infra.backends.emulator import role_credentials

REQUEST = {
    "RoleArn": "arn:aws:iam::123456789012:role/hlat-sagemaker-execution",
    "TrainingJobName": "hlat-7b-1a2b-train-1",
    "StoppingCondition": {"MaxRuntimeInSeconds": 3600},
    "InputDataConfig": [{"DataSource": {"S3DataSource": {"S3Uri": "s3://my-bucket/hlat/run/data/"}}}],
}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_run_on_s3_never_gets_the_callers_keys() -> None:
    caller = {
        "AWS_ACCESS_KEY_ID": "AKIACALLERSOWNKEY000",
        "AWS_SECRET_ACCESS_KEY": "callers-own-secret",
        "AWS_ENDPOINT_URL_STS": f"http://127.0.0.1:{closed_port()}",  # an STS that does not answer
        "AWS_MAX_ATTEMPTS": "1",
    }
    with pytest.raises(RuntimeError) as err:
        role_credentials(REQUEST, caller)
    message = str(err.value)
    assert "run as its role arn:aws:iam::123456789012:role/hlat-sagemaker-execution, never on the caller's" in message
    assert "callers-own-secret" not in message


def test_a_local_run_gets_no_credentials() -> None:
    local = {**REQUEST, "InputDataConfig": [{"DataSource": {"S3DataSource": {"S3Uri": "s3://hlat-local/run/data/"}}}]}
    assert role_credentials(local, {"AWS_ACCESS_KEY_ID": "AKIA"}) == ({}, "none (a local run)")
