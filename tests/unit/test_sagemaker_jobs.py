"""The sagemaker job backend against botocore's Stubber: every request and response is checked against the real
service model, and nothing leaves this machine (a guard fails any socket connection)."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import botocore.loaders
import botocore.session
import pytest
from botocore.awsrequest import AWSResponse
from botocore.stub import ANY, Stubber
from botocore.validate import validate_parameters

from hlat.core.config import JobConfig
from hlat.core.environment import neuron_environment
from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.infra.backends.protocol import (
    Action,
    JobSpec,
    JobState,
    Status,
    SubmitError,
    classify,
    classify_reason,
    job_name,
)
from hlat.infra.backends.sagemaker import LOG_GROUP, LOG_LOOKBACK_MS, SageMakerBackend
from hlat.infra.backends.sagemaker_images import neuron_training_image
from hlat.infra.backends.sagemaker_offline import OfflineAWS
from hlat.infra.backends.sagemaker_request import METRIC_DEFINITIONS
from hlat.infra.backends.sagemaker_source import requirements_of
from hlat.infra.dry_run import dry_run

REGION = "us-west-2"
ROLE = "arn:aws:iam::111122223333:role/hlat-training"
BUCKET = "hlat-runs"
RUN_ID = "hlat-7b-3f9c2a1e"
RUN_URI = f"s3://{BUCKET}/prod/{RUN_ID}"
NAME = job_name(RUN_ID, 3)
CODE_PREFIX = f"{RUN_URI}/code/{NAME}/"
"""Where the SDK uploads the source and its drivers: inside the run."""
IMAGE = (
    f"763104351884.dkr.ecr.{REGION}.amazonaws.com/pytorch-training-neuronx:2.9.0-neuronx-py312-sdk2.28.0-ubuntu24.04"
)


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Fail (and remember) any attempt to open a connection; fake credentials so none are looked up."""
    attempts: list[Any] = []

    def refuse(self: socket.socket, address: Any) -> None:
        attempts.append(address)
        raise ConnectionRefusedError(f"unit tests must not connect anywhere (tried {address})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield attempts
    assert not attempts, f"connections attempted: {attempts}"


def make_job(**overrides: Any) -> JobConfig:
    fields: dict[str, Any] = {
        "backend": "sagemaker",
        "instance_type": "ml.trn1.32xlarge",
        "instance_count": 2,
        "processes_per_node": 32,
        "region": REGION,
        "role_arn": ROLE,
        "volume_size_gb": 512,
        **overrides,
    }
    return JobConfig(**fields)


def make_spec(**overrides: Any) -> JobSpec:
    fields: dict[str, Any] = {
        "name": NAME,
        "run_id": RUN_ID,
        "attempt": 3,
        "run_uri": RUN_URI,
        "config_uri": f"{RUN_URI}/config.json",
        "instance_type": "ml.trn1.32xlarge",
        "instance_count": 2,
        "processes_per_node": 32,
        "max_runtime_s": 86400,
        "environment": {"NEURON_COMPILE_CACHE_URL": f"{RUN_URI}/compile-cache"},
        **overrides,
    }
    return JobSpec(**fields)


_LOADER = botocore.loaders.create_loader()
"""One loader for the tests' sessions: it caches the service models (SageMaker's alone takes a third of a second)."""


def session(region: str = REGION) -> boto3.Session:
    core = botocore.session.Session()
    core.register_component("data_loader", _LOADER)
    return boto3.Session(botocore_session=core, region_name=region)


def plain_client(service: str) -> Any:
    return session().client(service)


@pytest.fixture
def backend() -> SageMakerBackend:
    return SageMakerBackend(make_job(), session())


def expected_create_request() -> dict[str, Any]:
    """CreateTrainingJob as submit must send it for make_job() / make_spec()."""
    s3_prefix = {"S3DataType": "S3Prefix", "S3DataDistributionType": "FullyReplicated"}
    return {
        "TrainingJobName": NAME,
        "AlgorithmSpecification": {
            "TrainingImage": IMAGE,
            "TrainingInputMode": "File",
            # our init (infra/backends/job_init.py) as PID 1, in front of the SDK's command, which runs unchanged
            "ContainerEntrypoint": ["python3", "/opt/ml/input/data/code/job_init.py", "/bin/bash"],
            "ContainerArguments": ["-c", ANY],
            "MetricDefinitions": [{"Name": k, "Regex": v} for k, v in METRIC_DEFINITIONS.items()],
        },
        "HyperParameters": {"config": f"{RUN_URI}/config.json"},
        "InputDataConfig": [
            {
                "ChannelName": "data",
                "DataSource": {"S3DataSource": {**s3_prefix, "S3Uri": f"{RUN_URI}/data/"}},
                "InputMode": "FastFile",
            },
            {
                "ChannelName": "tokenizer",
                "DataSource": {"S3DataSource": {**s3_prefix, "S3Uri": f"{RUN_URI}/tokenizer/"}},
                "InputMode": "File",
            },
            {"ChannelName": "code", "DataSource": {"S3DataSource": {**s3_prefix, "S3Uri": ANY}}, "InputMode": "File"},
            {
                "ChannelName": "sm_drivers",
                "DataSource": {"S3DataSource": {**s3_prefix, "S3Uri": ANY}},
                "InputMode": "File",
            },
        ],
        "ResourceConfig": {"InstanceType": "ml.trn1.32xlarge", "InstanceCount": 2, "VolumeSizeInGB": 512},
        "RoleArn": ROLE,
        "Tags": [
            {"Key": "hlat:run-id", "Value": RUN_ID},
            {"Key": "hlat:stage", "Value": "train"},
            {"Key": "hlat:attempt", "Value": "3"},
        ],
        "StoppingCondition": {"MaxRuntimeInSeconds": 86400},
        "EnableInterContainerTrafficEncryption": True,  # job.encrypt_inter_container_traffic's default
        "OutputDataConfig": {"S3OutputPath": f"{RUN_URI}/sagemaker-output", "CompressionType": "GZIP"},
        "Environment": {
            "NEURON_COMPILE_CACHE_URL": f"{RUN_URI}/compile-cache",
            "HLAT_RUN_ID": RUN_ID,
            "HLAT_JOB_MODULE": "hlat.training.train",
        },
        "TensorBoardOutputConfig": {
            "S3OutputPath": f"{RUN_URI}/tensorboard",
            "LocalPath": "/opt/ml/output/tensorboard",
        },
    }


def describe_response(status: str, secondary: str, **extra: Any) -> dict[str, Any]:
    """A DescribeTrainingJob answer with every member the service model requires."""
    return {
        "TrainingJobName": NAME,
        "TrainingJobArn": f"arn:aws:sagemaker:{REGION}:111122223333:training-job/{NAME}",
        "ModelArtifacts": {"S3ModelArtifacts": f"{RUN_URI}/sagemaker-output/{NAME}/output/model.tar.gz"},
        "TrainingJobStatus": status,
        "SecondaryStatus": secondary,
        "AlgorithmSpecification": {"TrainingImage": IMAGE, "TrainingInputMode": "File"},
        "ResourceConfig": {"InstanceType": "ml.trn1.32xlarge", "InstanceCount": 2, "VolumeSizeInGB": 512},
        "StoppingCondition": {"MaxRuntimeInSeconds": 86400},
        "CreationTime": datetime(2026, 1, 1, tzinfo=UTC),
        **extra,
    }


def not_found(stubber: Stubber, operation: str = "describe_training_job") -> None:
    stubber.add_client_error(
        operation, service_error_code="ValidationException", service_message="Requested resource not found."
    )


# -- submit ------------------------------------------------------------------------------------------------------
@pytest.fixture
def offline_backend() -> tuple[SageMakerBackend, OfflineAWS, Stubber]:
    """A backend whose SDK uploads are answered offline and whose SageMaker client is stubbed."""
    offline = OfflineAWS(REGION, ROLE, [BUCKET])
    backend = SageMakerBackend(make_job(), offline.session)
    backend.sagemaker = plain_client("sagemaker")
    return backend, offline, Stubber(backend.sagemaker)


def test_submit_creates_the_job_under_its_deterministic_name(
    offline_backend: tuple[SageMakerBackend, OfflineAWS, Stubber],
) -> None:
    backend, offline, stubber = offline_backend
    not_found(stubber)
    stubber.add_response(
        "create_training_job",
        {"TrainingJobArn": f"arn:aws:sagemaker:{REGION}:111122223333:training-job/{NAME}"},
        expected_create_request(),
    )
    with stubber:
        backend.submit(make_spec())
    stubber.assert_no_pending_responses()

    uploads = {c["params"]["Key"] for c in offline.requests() if c["operation"] == "PutObject"}
    assert all(f"s3://{BUCKET}/{key}".startswith(CODE_PREFIX) for key in uploads)
    names = {key.split("/input/", 1)[1] for key in uploads}
    assert "sm_drivers/sm_train.sh" in names
    # The source is the hlat package as the wheel holds it, the layers a job imports, each module once (hlat/core/
    # is core/), the entry script and the requirements file: nothing else.
    shipped = {n.removeprefix("code/") for n in names if n.startswith("code/")}
    project = Path(__file__).parents[2]
    modules = {
        f"hlat/{p.relative_to(project)}" for layer in ("core", "training") for p in (project / layer).rglob("*.py")
    }
    assert shipped == {
        "hlat_job.py",
        "job_init.py",
        "hlat/__init__.py",
        *modules,
        "deployments/job-requirements-2.28.0.lock.txt",
    }


def test_submit_refuses_a_name_in_use_before_uploading(
    offline_backend: tuple[SageMakerBackend, OfflineAWS, Stubber],
) -> None:
    backend, offline, stubber = offline_backend
    stubber.add_response(
        "describe_training_job", describe_response("InProgress", "Training"), {"TrainingJobName": NAME}
    )
    with stubber, pytest.raises(SubmitError) as err:
        backend.submit(make_spec())
    assert err.value.code == "ResourceInUse"
    assert classify_reason(str(err.value)).action == Action.FATAL
    assert offline.requests() == []


def test_a_retried_create_that_already_got_through_is_our_job(
    offline_backend: tuple[SageMakerBackend, OfflineAWS, Stubber],
) -> None:
    backend, _, stubber = offline_backend
    not_found(stubber)
    stubber.add_client_error(
        "create_training_job",
        service_error_code="ResourceInUse",
        service_message=f"Training job names must be unique within an AWS account and region, and a training job "
        f"with this name already exists (arn:aws:sagemaker:{REGION}:111122223333:training-job/{NAME})",
    )
    stubber.add_response(
        "describe_training_job", describe_response("InProgress", "Starting"), {"TrainingJobName": NAME}
    )
    with stubber:
        backend.submit(make_spec())
    stubber.assert_no_pending_responses()


class DeniedUploads(OfflineAWS):
    """S3 refuses every upload, as for a role without s3:PutObject on the run's bucket."""

    def _answer(self, model: Any, context: dict[str, Any], **kwargs: Any) -> tuple[AWSResponse, dict[str, Any]]:
        if model.name == "PutObject":
            return AWSResponse("https://denied.invalid", 403, {}, None), {
                "Error": {"Code": "AccessDenied", "Message": "Access Denied"}
            }
        return super()._answer(model, context, **kwargs)


def test_a_refused_upload_is_a_refused_submission() -> None:
    backend = SageMakerBackend(make_job(), DeniedUploads(REGION, ROLE, [BUCKET]).session)
    backend.sagemaker = plain_client("sagemaker")
    stubber = Stubber(backend.sagemaker)
    not_found(stubber)
    with stubber, pytest.raises(SubmitError) as err:
        backend.submit(make_spec())
    assert err.value.code == "AccessDenied"
    assert f"{RUN_URI}/code" in str(err.value)
    assert classify_reason(str(err.value)).action == Action.FATAL


@pytest.mark.parametrize(
    ("code", "message", "action"),
    [
        (
            "ResourceLimitExceeded",
            "The account-level service limit 'ml.trn1.32xlarge for training job usage' is 16 Instances",
            Action.BACKOFF,  # instances still held by a stopping job clear; job.max_attempts_without_progress bounds it
        ),
        ("ValidationException", "1 validation error detected: Value at 'roleArn' failed", Action.FATAL),
        ("ThrottlingException", "Rate exceeded", Action.BACKOFF),
        ("AccessDeniedException", "User is not authorized to perform: sagemaker:CreateTrainingJob", Action.FATAL),
    ],
)
def test_refused_submissions_raise_submit_error(
    offline_backend: tuple[SageMakerBackend, OfflineAWS, Stubber], code: str, message: str, action: Action
) -> None:
    backend, _, stubber = offline_backend
    not_found(stubber)
    stubber.add_client_error("create_training_job", service_error_code=code, service_message=message)
    with stubber, pytest.raises(SubmitError) as err:
        backend.submit(make_spec())
    assert err.value.code == code
    assert message in str(err.value)
    assert classify_reason(str(err.value)).action == action


# -- describe and classify ---------------------------------------------------------------------------------------
START = datetime(2026, 1, 1, 0, 10, tzinfo=UTC)
END = START + timedelta(hours=5)

ENDINGS = [
    ({"TrainingJobStatus": "Completed", "SecondaryStatus": "Completed"}, Action.DONE, "completed"),
    (
        {
            "TrainingJobStatus": "Failed",
            "SecondaryStatus": "Failed",
            "FailureReason": "CapacityError: Unable to provision requested ML compute capacity. "
            "Please retry using a different ML instance type.",
        },
        Action.BACKOFF,
        "capacity",
    ),
    (
        {
            "TrainingJobStatus": "Failed",
            "SecondaryStatus": "Failed",
            "FailureReason": "InternalServerError: We encountered an internal error. Please try again.",
        },
        Action.RESUME,
        "internal",
    ),
    (
        {
            "TrainingJobStatus": "Failed",
            "SecondaryStatus": "Failed",
            "FailureReason": "ClientError: Please ensure the role can read s3://hlat-runs/prod/config.json",
        },
        Action.FATAL,
        "validation",
    ),
    (
        {
            "TrainingJobStatus": "Failed",
            "SecondaryStatus": "Failed",
            "FailureReason": "AlgorithmError: ExecuteUserScriptError: NonFiniteLoss: the loss became NaN or inf; "
            "relaunch from the last checkpoint",
        },
        Action.RESUME,
        "nan",
    ),
    ({"TrainingJobStatus": "Stopped", "SecondaryStatus": "MaxRuntimeExceeded"}, Action.RESUME, "max-runtime"),
]


@pytest.mark.parametrize(("ending", "action", "category"), ENDINGS)
def test_status_sequences_map_to_job_states_and_actions(
    backend: SageMakerBackend, ending: dict[str, Any], action: Action, category: str
) -> None:
    backend.now = lambda: START + timedelta(seconds=90)
    stubber = Stubber(backend.sagemaker)
    timeline = [
        describe_response("InProgress", "Starting"),
        describe_response("InProgress", "Training", TrainingStartTime=START),
        describe_response(
            ending["TrainingJobStatus"],
            ending["SecondaryStatus"],
            TrainingStartTime=START,
            TrainingEndTime=END,
            BillableTimeInSeconds=18000,
            **{k: v for k, v in ending.items() if k == "FailureReason"},
        ),
    ]
    for answer in timeline:
        stubber.add_response("describe_training_job", answer, {"TrainingJobName": NAME})
    with stubber:
        states = [backend.describe(NAME) for _ in timeline]

    starting, training, final = states
    assert starting == JobState(NAME, Status.IN_PROGRESS, None, "Starting", 0.0, 2)
    assert training == JobState(NAME, Status.IN_PROGRESS, None, "Training", 90.0, 2)
    assert final is not None and final.terminal
    assert final.status == Status(ending["TrainingJobStatus"])
    assert final.failure_reason == ending.get("FailureReason")
    assert final.secondary_status == ending["SecondaryStatus"]
    assert final.billable_seconds == 18000
    decision = classify(final)
    assert (decision.action, decision.category) == (action, category)


def test_billable_time_falls_back_to_start_and_end(backend: SageMakerBackend) -> None:
    stubber = Stubber(backend.sagemaker)
    answer = describe_response("Stopped", "Stopped", TrainingStartTime=START, TrainingEndTime=END)
    stubber.add_response("describe_training_job", answer, {"TrainingJobName": NAME})
    with stubber:
        state = backend.describe(NAME)
    assert state is not None and state.billable_seconds == 5 * 3600
    assert classify(state, stop_requested=True).action == Action.FATAL


def test_a_deleted_job_is_over(backend: SageMakerBackend) -> None:
    stubber = Stubber(backend.sagemaker)
    stubber.add_response("describe_training_job", describe_response("Deleting", "Stopped"), {"TrainingJobName": NAME})
    with stubber:
        state = backend.describe(NAME)
    assert state is not None and state.terminal
    assert (state.status, state.secondary_status) == (Status.STOPPED, "Deleting")


def test_describe_unknown_job_is_none_and_other_errors_raise(backend: SageMakerBackend) -> None:
    stubber = Stubber(backend.sagemaker)
    not_found(stubber)
    stubber.add_client_error("describe_training_job", service_error_code="ThrottlingException", http_status_code=400)
    with stubber:
        assert backend.describe("never-submitted") is None
        with pytest.raises(Exception, match="ThrottlingException"):
            backend.describe(NAME)


def test_stop_ignores_a_job_that_already_ended(backend: SageMakerBackend) -> None:
    stubber = Stubber(backend.sagemaker)
    stubber.add_response("stop_training_job", {}, {"TrainingJobName": NAME})
    stubber.add_client_error(
        "stop_training_job",
        service_error_code="ValidationException",
        service_message="The request was rejected because the training job is in status Completed.",
    )
    stubber.add_client_error("stop_training_job", service_error_code="AccessDeniedException")
    with stubber:
        backend.stop(NAME)
        backend.stop(NAME)
        with pytest.raises(Exception, match="AccessDenied"):
            backend.stop(NAME)
    stubber.assert_no_pending_responses()


# -- logs --------------------------------------------------------------------------------------------------------
def event(ts: int, event_id: str, message: str, node: int = 1) -> dict[str, Any]:
    return {
        "logStreamName": f"{NAME}/algo-{node}-1767225600",
        "timestamp": ts,
        "message": message + "\n",
        "ingestionTime": ts + 500,
        "eventId": event_id,
    }


def test_logs_return_each_event_once(backend: SageMakerBackend) -> None:
    stubber = Stubber(backend.logs_client)
    request = {"logGroupName": LOG_GROUP, "logStreamNamePrefix": f"{NAME}/"}
    t0 = 1_767_225_600_000
    # Before the job starts there is no log group (nor stream).
    stubber.add_client_error("filter_log_events", service_error_code="ResourceNotFoundException")
    # First read: two pages.
    stubber.add_response("filter_log_events", {"events": [event(t0, "e1", "starting")], "nextToken": "page-2"}, request)
    stubber.add_response(
        "filter_log_events",
        {"events": [event(t0 + 1000, "e2", "rank0 step 1 loss 10.3 grad_norm 2.1 lr 1.0e-06 900 tok/s")]},
        {**request, "nextToken": "page-2"},
    )
    # Second read looks back LOG_LOOKBACK_MS: e2 again, e3 at the same millisecond, and e0 from another node that
    # reached CloudWatch late.
    stubber.add_response(
        "filter_log_events",
        {
            "events": [
                event(t0 + 500, "e0", "late line", node=2),
                event(t0 + 1000, "e2", "rank0 step 1 loss 10.3 grad_norm 2.1 lr 1.0e-06 900 tok/s"),
                event(t0 + 1000, "e3", "same millisecond"),
            ]
        },
        {**request, "startTime": t0 + 1000 - LOG_LOOKBACK_MS},
    )
    # Third read: nothing new.
    stubber.add_response(
        "filter_log_events",
        {"events": [event(t0 + 1000, "e3", "same millisecond")]},
        {**request, "startTime": t0 + 1000 - LOG_LOOKBACK_MS},
    )
    with stubber:
        lines, cursor = backend.logs(NAME)
        assert (lines, cursor) == ([], None)
        lines, cursor = backend.logs(NAME, cursor)
        assert lines == ["starting", "rank0 step 1 loss 10.3 grad_norm 2.1 lr 1.0e-06 900 tok/s"]
        lines, cursor = backend.logs(NAME, cursor)
        assert lines == ["late line", "same millisecond"]
        lines, cursor = backend.logs(NAME, cursor)
        assert lines == []
    stubber.assert_no_pending_responses()


def test_metric_definitions_read_the_trainer_progress_line() -> None:
    line = "rank0 step 120 loss 5.4321 grad_norm 0.812 lr 1.99e-03 45000 tok/s"
    values = {name: re.search(regex, line).group(1) for name, regex in METRIC_DEFINITIONS.items()}  # type: ignore[union-attr]
    assert values == {"loss": "5.4321", "grad_norm": "0.812", "tokens_per_s": "45000"}


# -- dry run -----------------------------------------------------------------------------------------------------
def test_dry_run_returns_the_requests_and_sends_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_network: list[Any]
) -> None:
    # No credentials anywhere, and an endpoint on a closed port: a request sent would fail.
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "empty").write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "empty"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "empty"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port}")
    backend = SageMakerBackend(make_job())
    requests = backend.dry_run(make_spec())

    assert no_network == []
    assert [r["operation"] for r in requests if r["operation"] != "PutObject"] == ["CreateTrainingJob"]
    create = requests[-1]
    assert create["service"] == "sagemaker"
    params = create["params"]
    model = plain_client("sagemaker").meta.service_model
    validate_parameters(params, model.operation_model("CreateTrainingJob").input_shape)
    assert params == expected_create_request()
    for channel in params["InputDataConfig"][2:]:
        assert channel["DataSource"]["S3DataSource"]["S3Uri"].startswith(CODE_PREFIX)

    uploads = [r for r in requests if r["operation"] == "PutObject"]
    assert uploads and all(set(u["params"]) >= {"Bucket", "Key", "Size"} for u in uploads)
    assert all("Body" not in u["params"] and isinstance(u["params"]["Size"], int) for u in uploads)
    train = next(u for u in uploads if u["params"]["Key"].endswith("/input/code/hlat/training/train.py"))
    assert f"s3://{BUCKET}/{train['params']['Key']}".startswith(CODE_PREFIX)
    assert train["params"]["Size"] == (Path(__file__).parents[2] / "training" / "train.py").stat().st_size


def test_dry_run_carries_every_job_setting() -> None:
    job = make_job(
        sagemaker_retry_attempts=2,
        infra_check=True,
        keep_alive_minutes=30,
        kms_key_id="alias/hlat",
        subnets=["subnet-0a1b2c3d"],
        security_group_ids=["sg-0a1b2c3d"],
        training_plan_arn=f"arn:aws:sagemaker:{REGION}:111122223333:training-plan/hlat-reserved",
        image_uri="111122223333.dkr.ecr.us-west-2.amazonaws.com/hlat-neuron:7",
    )
    params = SageMakerBackend(job).dry_run(make_spec())[-1]["params"]
    assert params["RetryStrategy"] == {"MaximumRetryAttempts": 2}
    assert params["InfraCheckConfig"] == {"EnableInfraCheck": True}
    assert params["VpcConfig"] == {"Subnets": ["subnet-0a1b2c3d"], "SecurityGroupIds": ["sg-0a1b2c3d"]}
    assert params["EnableInterContainerTrafficEncryption"] is True  # the default (issue 51)
    assert params["OutputDataConfig"]["KmsKeyId"] == "alias/hlat"
    assert params["AlgorithmSpecification"]["TrainingImage"] == job.image_uri
    assert params["ResourceConfig"] == {
        "InstanceType": "ml.trn1.32xlarge",
        "InstanceCount": 2,
        "VolumeSizeInGB": 512,
        # No VolumeKmsKeyId: trn1 storage is local NVMe, where SageMaker refuses one.
        "KeepAlivePeriodInSeconds": 1800,
        "TrainingPlanArn": job.training_plan_arn,
    }
    p4 = SageMakerBackend(make_job(instance_type="ml.m5.24xlarge", kms_key_id="alias/hlat"))
    spec = make_spec(instance_type="ml.m5.24xlarge")
    assert p4.dry_run(spec)[-1]["params"]["ResourceConfig"]["VolumeKmsKeyId"] == "alias/hlat"


@pytest.mark.parametrize("sdk", ["2.24.1", "2.28.0"])
@pytest.mark.parametrize("preset", ["hlat-7b", "hlat-70b"])
def test_the_dry_run_of_each_trn1_stage_carries_the_neuron_settings(preset: str, sdk: str) -> None:
    config = load_config(
        preset,
        {
            "job.role_arn": ROLE, "neuron.exec_timeout": 6000, "neuron.env": {"NEURON_RT_LOG_LEVEL": "INFO"},
            "neuron.sdk": sdk,
        },
        storage=f"s3://{BUCKET}/prod",
    )  # fmt: skip
    run_uri = f"s3://{BUCKET}/prod/{config.resolved_run_id()}"
    expected = neuron_environment(config, f"{run_uri}/compile-cache/neuron")
    assert (expected["NEURON_RT_EXEC_TIMEOUT"], expected["NEURON_RT_LOG_LEVEL"]) == ("6000", "INFO")
    inflight = {"hlat-7b": "3", "hlat-70b": "31"}[preset]
    for stage in ("train", "precompile", "burn-in"):
        text = dry_run(config, stage=stage)  # the real CreateTrainingJob request, as submit would send it
        create = json.loads(text.split("sagemaker CreateTrainingJob:\n", 1)[1].split("\n\n", 1)[0])
        environment = create["Environment"]
        assert {k: environment.get(k) for k in expected} == expected, stage
        assert environment["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == inflight
        # HLAT's compiler flags; on 2.28 the BF16 model (7B: bf16-sr) or autocast (70B: bf16-mixed) adds NxDT's
        flags = "--model-type transformer --distribution-strategy=llm-training"
        added = {
            "hlat-7b": " --enable-mixed-precision-accumulation",
            "hlat-70b": " --enable-mixed-precision-accumulation --auto-cast=none",
        }
        assert environment["NEURON_CC_FLAGS"] == flags + (added[preset] if sdk == "2.28.0" else "")
        assert ("RUN_NEURON_PARALLEL_COMPILE" in environment) == (stage == "precompile")
        # The SDK's image and precision: 2.28 sets neither XLA_USE_BF16 nor XLA_DOWNCAST_BF16 (the trainer casts)
        assert create["AlgorithmSpecification"]["TrainingImage"].endswith(
            f"-sdk{sdk}-" + ("ubuntu22.04", "ubuntu24.04")[sdk == "2.28.0"]
        )
        assert ("XLA_USE_BF16" in environment) == (sdk == "2.24.1")
        # No CheckpointConfig: its folder is node-local, and SageMaker would copy the prefix onto every node
        assert "CheckpointConfig" not in create


# -- images and user mistakes -------------------------------------------------------------------------------------
def test_region_gives_the_neuron_training_image() -> None:
    assert neuron_training_image("us-west-2") == IMAGE
    assert neuron_training_image("eu-west-1") == IMAGE.replace("us-west-2", "eu-west-1")
    assert neuron_training_image("xx-nowhere-1") is None
    assert SageMakerBackend(make_job()).training_image(make_spec()) == IMAGE
    # Neuron 2.24.1 (neuron.sdk): its image, and what its jobs install on it; 2.28.0 is the default
    older = make_spec(neuron_sdk="2.24.1")
    assert SageMakerBackend(make_job()).training_image(older) == IMAGE.replace(
        "2.9.0-neuronx-py312-sdk2.28.0-ubuntu24.04", "2.7.0-neuronx-py310-sdk2.24.1-ubuntu22.04"
    )
    assert requirements_of(older) == "deployments/job-requirements-2.24.1.lock.txt"
    assert requirements_of(make_spec()) == "deployments/job-requirements-2.28.0.lock.txt"
    explicit = make_job(image_uri="111122223333.dkr.ecr.us-west-2.amazonaws.com/mine:1")
    assert SageMakerBackend(explicit).training_image(older) == explicit.image_uri
    with pytest.raises(ValueError, match=r"job\.region='af-south-1'.*job\.image_uri=None"):
        _ = SageMakerBackend(make_job(region="af-south-1")).training_image(make_spec())


def test_user_mistakes_are_refused_with_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"storage\.root: .*s3:// storage root \(got '/tmp/runs/r'\); pass --storage s3://"
    ):
        SageMakerBackend(make_job()).dry_run(make_spec(run_uri="/tmp/runs/r"))
    with pytest.raises(ValueError, match=r"job\.role_arn=None"):
        SageMakerBackend(make_job(role_arn=None)).submit(make_spec())
    with pytest.raises(ValueError, match=r"job\.subnets need job\.security_group_ids"):
        SageMakerBackend(make_job(subnets=["subnet-1"])).dry_run(make_spec())
    with pytest.raises(ValueError, match=r"region 'eu-west-1' but job\.region='us-west-2'"):
        SageMakerBackend(make_job(), session("eu-west-1"))


# -- the train stage's supervisor over this backend ------------------------------------------------------------
def test_supervisor_relaunches_through_capacity_and_internal_errors_to_completion(
    offline_backend: tuple[SageMakerBackend, OfflineAWS, Stubber], tmp_path: Path
) -> None:
    """Three jobs through the real request and response shapes: CapacityError (back off), InternalServerError
    after progress (resume at once), Completed. Each job is looked up by name first, created under its
    deterministic name, then polled; its logs are read (none written yet)."""
    from hlat.infra.supervision.supervisor import Supervisor

    backend, _, stubber = offline_backend
    logs = Stubber(backend.logs_client)
    backend.now = lambda: START + timedelta(seconds=3600)
    endings = [
        ({"TrainingJobStatus": "Failed", "SecondaryStatus": "Failed",
          "FailureReason": "CapacityError: Unable to provision requested ML compute capacity."}, 0),
        ({"TrainingJobStatus": "Failed", "SecondaryStatus": "Failed",
          "FailureReason": "InternalServerError: We encountered an internal error. Please try again."}, 400),
        ({"TrainingJobStatus": "Completed", "SecondaryStatus": "Completed"}, 1000),
    ]  # fmt: skip

    def no_logs() -> None:
        logs.add_client_error("filter_log_events", service_error_code="ResourceNotFoundException")

    for attempt, (ending, _) in enumerate(endings, start=1):
        name = job_name(RUN_ID, attempt)
        not_found(stubber)  # the supervisor looks for the job by name (re-attach) ...
        not_found(stubber)  # ... and so does submit, before uploading anything (no duplicate)
        request = expected_create_request()
        request["TrainingJobName"] = name
        request["Tags"] = [*request["Tags"][:2], {"Key": "hlat:attempt", "Value": str(attempt)}]
        stubber.add_response("create_training_job", {"TrainingJobArn": f"arn:aws:sagemaker:::{name}"}, request)
        for answer in (
            describe_response("InProgress", "Training", TrainingJobName=name, TrainingStartTime=START),
            describe_response(
                **{"status": ending["TrainingJobStatus"], "secondary": ending["SecondaryStatus"]},
                TrainingJobName=name,
                TrainingStartTime=START,
                TrainingEndTime=END,
                BillableTimeInSeconds=1800,
                **{k: v for k, v in ending.items() if k == "FailureReason"},
            ),
        ):
            no_logs()
            stubber.add_response("describe_training_job", answer, {"TrainingJobName": name})
        no_logs()

    def current_step() -> int:
        # The newest checkpoint in S3 once a job has ended: what SageMaker's checkpoint sync left there.
        ended = [a for a in supervisor.attempts if a.status in ("Failed", "Completed")]
        return endings[len(ended) - 1][1] if ended else 0

    delays: list[float] = []
    supervisor = Supervisor(
        backend=backend,
        run=Run.at(str(tmp_path)),
        run_id=RUN_ID,
        make_spec=lambda attempt, name: make_spec(name=name, attempt=attempt),
        current_step=current_step,
        target_step=1000,
        tokens_per_step=4_194_304,
        price_per_hour=21.50,
        poll_seconds=60,
        sleep=delays.append,
    )
    with stubber, logs:
        attempts = supervisor.run_to_completion()
    stubber.assert_no_pending_responses()
    logs.assert_no_pending_responses()
    assert [(a.job_name, a.action) for a in attempts] == [
        (job_name(RUN_ID, 1), "backoff"),
        (job_name(RUN_ID, 2), "resume"),
        (job_name(RUN_ID, 3), "done"),
    ]
    assert [a.steps_gained for a in attempts] == [0, 400, 600]
    # 1800 billable seconds x 2 nodes x $21.50/h per job
    assert [a.cost_usd for a in attempts] == [pytest.approx(21.50)] * 3
    assert 60.0 in delays  # the first capacity back-off


def test_the_dry_run_of_a_16_worker_prepare_data_job_is_a_valid_request() -> None:
    """prepare-data on SageMaker: a CPU training job of data.workers / data.workers_per_instance instances running
    training.prepare_data once per instance (it starts the workers), with no input channel of the run."""
    config = load_config(
        "hlat-7b",
        {"job.role_arn": ROLE, "data.workers": 16, "data.workers_per_instance": 8},
        storage=f"s3://{BUCKET}/p",
    )
    text = dry_run(config, stage="prepare-data")
    create = json.loads(text.split("sagemaker CreateTrainingJob:\n", 1)[1].split("\n\n", 1)[0])
    model = plain_client("sagemaker").meta.service_model
    validate_parameters(create, model.operation_model("CreateTrainingJob").input_shape)
    run_uri = f"s3://{BUCKET}/p/{config.resolved_run_id()}"
    assert create["TrainingJobName"] == job_name(config.resolved_run_id(), 1, "prepare-data")
    assert create["ResourceConfig"]["InstanceType"] == "ml.c5.4xlarge"
    assert create["ResourceConfig"]["InstanceCount"] == 2
    # AWS's PyTorch CPU training image; the job's own program and requirements.
    assert re.fullmatch(r"763104351884\.dkr\.ecr\.us-west-2\.amazonaws\.com/pytorch-training:2\.10\.0-cpu-py3\d+",
                        create["AlgorithmSpecification"]["TrainingImage"])  # fmt: skip
    assert create["HyperParameters"]["config"] == f"{run_uri}/config.json"
    assert create["HyperParameters"]["key"] == "<the stage's cache key>"
    channels = [c["ChannelName"] for c in create["InputDataConfig"]]
    assert "data" not in channels and "tokenizer" not in channels
    assert create["StoppingCondition"]["MaxRuntimeInSeconds"] == 24 * 3600
    assert "Neuron" not in json.dumps(create["Environment"]) and "NEURON_CC_FLAGS" not in create["Environment"]
    assert "prepare-data: 7.20 TB of text in" in text and "16 worker(s) (2 x ml.c5.4xlarge)" in text
