"""The sagemaker job backend against a moto server on 127.0.0.1: the SDK uploads the source over real HTTP and the
job is created and described through SageMaker's API. moto marks every job Completed at once (status transitions
and failures are covered with Stubber in tests/unit/test_sagemaker_jobs.py)."""

from __future__ import annotations

import pytest

from hlat.core.config import JobConfig
from hlat.infra.backends.protocol import JobSpec, Status, SubmitError, job_name
from hlat.infra.backends.sagemaker import SageMakerBackend
from tests.integration.conftest import REGION, S3Env

ROLE = "arn:aws:iam::123456789012:role/hlat-training"


@pytest.fixture
def moto_env(s3_env: S3Env, monkeypatch: pytest.MonkeyPatch) -> S3Env:
    # moto has no real IAM roles for the SDK's read-only role validation to inspect.
    monkeypatch.setenv("SAGEMAKER_VALIDATE_ROLE", "false")
    return s3_env


def make(env: S3Env, run_id: str) -> tuple[SageMakerBackend, JobSpec]:
    job = JobConfig(
        backend="sagemaker",
        instance_type="ml.trn1.32xlarge",
        instance_count=2,
        processes_per_node=32,
        region=REGION,
        role_arn=ROLE,
    )
    run_uri = f"{env.url}/{run_id}"
    spec = JobSpec(
        name=job_name(run_id, 1),
        run_id=run_id,
        attempt=1,
        run_uri=run_uri,
        config_uri=f"{run_uri}/config.json",
        instance_type=job.instance_type,
        instance_count=job.instance_count,
        processes_per_node=job.processes_per_node,
        max_runtime_s=3600,
    )
    return SageMakerBackend(job), spec


def keys(env: S3Env, prefix: str) -> list[str]:
    pages = env.client().get_paginator("list_objects_v2").paginate(Bucket=env.bucket, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def test_submit_creates_the_job_and_uploads_the_code_into_the_run(moto_env: S3Env) -> None:
    backend, spec = make(moto_env, "moto-run")
    assert backend.describe(spec.name) is None
    backend.submit(spec)

    state = backend.describe(spec.name)
    assert state is not None
    assert (state.name, state.status, state.instance_count) == (spec.name, Status.COMPLETED, 2)
    described = backend.sagemaker.describe_training_job(TrainingJobName=spec.name)
    assert "CheckpointConfig" not in described  # the ranks write to the run's checkpoints/ themselves
    assert described["AlgorithmSpecification"]["ContainerEntrypoint"][1] == "/opt/ml/input/data/code/job_init.py"
    assert described["HyperParameters"] == {"config": spec.config_uri}

    uploaded = keys(moto_env, "prefix/moto-run/")
    assert uploaded and all(k.startswith(f"prefix/moto-run/code/{spec.name}/") for k in uploaded)
    shipped = {k.split("/input/", 1)[1] for k in uploaded}
    assert {
        "code/hlat_job.py",
        "code/hlat/training/train.py",
        "code/job_init.py",
        "code/deployments/job-requirements-2.28.0.lock.txt",  # the default neuron.sdk's
        "sm_drivers/sm_train.sh",
    } <= shipped
    assert not [k for k in shipped if k.startswith(("code/tests/", "code/.venv/", "code/runs/"))]

    # The same name again (a restarted flow that did not re-attach) is refused, and nothing more is uploaded.
    with pytest.raises(SubmitError) as err:
        backend.submit(spec)
    assert err.value.code == "ResourceInUse"
    assert keys(moto_env, "prefix/moto-run/") == uploaded

    lines, _ = backend.logs(spec.name)  # moto's jobs write no CloudWatch logs: no group, no lines
    assert lines == []


def test_dry_run_sends_nothing_to_the_server(moto_env: S3Env) -> None:
    backend, spec = make(moto_env, "moto-dry-run")
    requests = backend.dry_run(spec)
    assert requests[-1]["operation"] == "CreateTrainingJob"
    assert requests[-1]["params"]["TrainingJobName"] == spec.name
    assert keys(moto_env, "prefix/moto-dry-run/") == []
    assert backend.describe(spec.name) is None
