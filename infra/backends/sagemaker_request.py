"""The CreateTrainingJob request of a SageMaker job, built with the SageMaker SDK's `ModelTrainer`.

The Neuron PyTorch DLC, the `Torchrun` driver, and `CheckpointConfig` pinned to the run's checkpoints/ prefix. The
job's name is the one the train stage chose (`infra.backends.protocol.job_name`), not the SDK's. What the config
decides is checked (`check_spec`) before anything is uploaded. The sagemaker backend and the local backend's
emulator both build their requests here.
"""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path
from typing import Any

import boto3
from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import ClientError

from hlat.core.config import JobConfig, TrackingConfig
from hlat.core.contract import SAGEMAKER_CHECKPOINT_DIR, SAGEMAKER_TENSORBOARD_DIR, STEP_LINE_METRICS
from hlat.infra.backends.protocol import JobSpec, SubmitError
from hlat.infra.backends.sagemaker_images import DLC_ACCOUNT, import_sdk, training_image
from hlat.infra.backends.sagemaker_source import (
    EGRESS_ENV,
    ENTRY_SCRIPT,
    JOB_INIT,
    JOB_MODULE_ENV,
    PROJECT_ROOT,
    endpoints_only,
    instances_of,
    requirements_of,
    stage_source,
)
from hlat.infra.backends.sagemaker_validation import check_request, judged

log = logging.getLogger("hlat.sagemaker")

METRIC_DEFINITIONS = STEP_LINE_METRICS
"""The trainer's progress line (`core.contract.format_step_line`) as SageMaker metrics."""

# SageMaker rejects a VolumeKmsKeyId for instance types whose storage is local NVMe (encrypted by the
# hardware instead), and ignores VolumeSizeInGB for them.
_LOCAL_STORAGE_FAMILIES = ("ml.trn1.", "ml.trn1n.", "ml.trn2.", "ml.p4d.", "ml.p4de.", "ml.p5.", "ml.p5e.", "ml.p5en.")


def request_environment(spec: JobSpec) -> dict[str, str]:
    """The Environment member of the job's CreateTrainingJob request: the job's own variables, the run id, and the
    program the entry script runs."""
    return {**spec.environment, "HLAT_RUN_ID": spec.run_id, JOB_MODULE_ENV: spec.entry}


MLFLOW_URI_ENV = "MLFLOW_TRACKING_URI"
MLFLOW_EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"
_MLFLOW_ARN = re.compile(r"arn:aws[a-z\-]*:sagemaker:[a-z0-9\-]*:[0-9]{12}:mlflow-[a-zA-Z-]*/.+")
"""A SageMaker managed MLflow resource (MlflowConfig.MlflowResourceArn's pattern in botocore's service model)."""


def tracking_environment(tracking: TrackingConfig) -> dict[str, str]:
    """A training job's variables for SageMaker's managed MLflow (tracking.backend=mlflow with
    tracking.mlflow_tracking_server_arn): MLflow's own MLFLOW_TRACKING_URI (the ARN, which the sagemaker-mlflow
    plugin resolves) and MLFLOW_EXPERIMENT_NAME. From them the request carries MlflowConfig (`mlflow_config`)."""
    if tracking.backend != "mlflow" or not tracking.mlflow_tracking_server_arn:
        return {}
    return {MLFLOW_URI_ENV: tracking.mlflow_tracking_server_arn, MLFLOW_EXPERIMENT_ENV: tracking.experiment}


def mlflow_config(spec: JobSpec) -> dict[str, str] | None:
    """CreateTrainingJob's MlflowConfig for a job whose environment names a SageMaker MLflow tracking server
    (`tracking_environment`): the server, the experiment, and the hlat run id as the run's name (the job's tracker
    finds that run: training/tracking.py). None otherwise.
    https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_CreateTrainingJob.html#sagemaker-CreateTrainingJob-request-MlflowConfig"""
    arn = spec.environment.get(MLFLOW_URI_ENV, "")
    if not _MLFLOW_ARN.fullmatch(arn):
        return None
    config = {"MlflowResourceArn": arn, "MlflowRunName": spec.run_id}
    experiment = spec.environment.get(MLFLOW_EXPERIMENT_ENV)
    if experiment:
        config["MlflowExperimentName"] = experiment
    return config


def split_s3_uri(uri: str) -> tuple[str, str]:
    """('bucket', 'key/prefix') of an s3:// URI, without trailing slashes."""
    without = uri.split("://", 1)[1]
    bucket, _, key = without.partition("/")
    return bucket, key.strip("/")


def client_error(exc: ClientError) -> tuple[str, str]:
    """(code, message) of an AWS error answer."""
    err = exc.response.get("Error", {})
    return str(err.get("Code", "Unknown")), str(err.get("Message", exc))


def check_spec(
    spec: JobSpec, job: JobConfig, requirements: str | None, validated_as: str | None = None
) -> tuple[str, str]:
    """Refuse, with the fix, what SageMaker would refuse later; returns the run's (bucket, key prefix).
    `requirements`: the file the job installs (None: none); `validated_as`: see `build_request`."""
    if not spec.run_uri.startswith("s3://"):
        raise ValueError(
            f"storage.root: the sagemaker backend needs an s3:// storage root (got {spec.run_uri!r}); "
            "pass --storage s3://bucket/prefix"
        )
    if not job.role_arn:
        raise ValueError(
            f"job.role_arn={job.role_arn!r}: the sagemaker backend needs the IAM role SageMaker assumes to "
            "run the job; set job.role_arn=arn:aws:iam::<account>:role/<role trusted by sagemaker.amazonaws.com>, "
            "or job.role_arn_secret=<a Prefect Secret block holding it>, which the flows read before submitting"
        )
    if job.subnets and not job.security_group_ids:
        raise ValueError("job.subnets need job.security_group_ids: SageMaker requires both for a VPC")
    if endpoints_only() and (spec.image_uri is None or f"{DLC_ACCOUNT}.dkr.ecr." in spec.image_uri):
        field = instances_of(spec).settings["image_uri"]
        raise ValueError(
            f"{field}: the account's jobs reach AWS's endpoints only ({EGRESS_ENV}=aws-endpoints), so they cannot "
            f"pip-install {requirements_of(spec)} at start: build an image of your own on "
            f"{spec.image_uri or 'the default image'} with that file installed, push it to ECR and name it here"
        )
    check_request("CreateTrainingJob", judged(config_request(spec, job), validated_as), spec.stage, partial=True)
    if requirements is not None and not (PROJECT_ROOT / requirements).is_file():
        raise ValueError(
            f"the sagemaker backend uploads the job's requirements file {requirements}, which is not under "
            f"{PROJECT_ROOT}: run from a checkout of the project (pip install -e .)"
        )
    return split_s3_uri(spec.run_uri)


def config_request(spec: JobSpec, job: JobConfig) -> dict[str, Any]:
    """The members of `spec`'s CreateTrainingJob request that the run's config decides, as `build_request`
    sets them (the SDK adds the rest): what can be checked against the service model before anything is
    uploaded, or before any stage of a flow runs."""
    run = spec.run_uri.rstrip("/")
    request: dict[str, Any] = {
        "TrainingJobName": spec.name,
        "RoleArn": job.role_arn,
        "ResourceConfig": {
            "InstanceType": spec.instance_type,
            "InstanceCount": spec.instance_count,
            "VolumeSizeInGB": job.volume_size_gb,
        },
        "StoppingCondition": {"MaxRuntimeInSeconds": spec.max_runtime_s},
        "OutputDataConfig": {"S3OutputPath": f"{run}/sagemaker-output", "KmsKeyId": job.kms_key_id},
        "TensorBoardOutputConfig": {"S3OutputPath": f"{run}/tensorboard"},
        "HyperParameters": {"config": spec.config_uri, **spec.args},
        "Environment": request_environment(spec),
    }
    if spec.checkpoint_prefix is not None:
        request["CheckpointConfig"] = {"S3Uri": f"{run}/{spec.checkpoint_prefix}"}
    if spec.channels:  # (the SDK adds its code channels; a request's list, when given, may not be empty)
        request["InputDataConfig"] = [
            {"ChannelName": c, "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": f"{run}/{c}/"}}}
            for c in spec.channels
        ]
    if spec.image_uri or job.image_uri:
        request["AlgorithmSpecification"] = {"TrainingImage": spec.image_uri or job.image_uri}
    if job.subnets:
        request["VpcConfig"] = {"Subnets": list(job.subnets), "SecurityGroupIds": list(job.security_group_ids)}
    mlflow = mlflow_config(spec)
    if mlflow is not None:
        request["MlflowConfig"] = mlflow
    return request


def build_request(
    spec: JobSpec,
    job: JobConfig,
    boto_session: boto3.Session,
    *,
    requirements: str | None,
    validated_as: str | None = None,
) -> dict[str, Any]:
    """The CreateTrainingJob request for `spec` (PascalCase, as boto3 takes it), made by the SageMaker SDK's
    ModelTrainer with `job`'s settings; checked (`check_spec`) before anything is staged or uploaded, and not sent.
    Building it uploads the job's source (`stage_source`) and the SDK's container drivers to
    `<run>/code/<job name>/...` through `boto_session`: a real session, or `OfflineAWS.session` to only record them.

    `requirements`: the file the instances pip-install before the program runs (`requirements_of(spec)`; None: the
    image holds all the job needs). `validated_as`: the SageMaker instance type the service model judges in place of
    the 'local' one (the local backend's emulated hosts). The image is `spec.image_uri`, else
    `training_image(spec, job)`. The sagemaker backend and the local backend's emulator both build their requests
    here; `validate_request` checks the whole result."""
    checked = check_spec(spec, job, requirements, validated_as)
    with tempfile.TemporaryDirectory(prefix="hlat-source-") as source:
        stage_source(Path(source), requirements)
        return _request_with_source(spec, job, boto_session, source, checked, requirements)


def _request_with_source(
    spec: JobSpec,
    job: JobConfig,
    boto_session: boto3.Session,
    source: str,
    checked: tuple[str, str],
    requirements: str | None,
) -> dict[str, Any]:
    bucket, prefix = checked
    image = spec.image_uri or training_image(spec, job)
    sdk = import_sdk()
    cfg = sdk.configs
    run = spec.run_uri.rstrip("/")
    session = sdk.Session(
        boto_session=boto_session, default_bucket=bucket, default_bucket_prefix=f"{prefix}/code".strip("/")
    )
    volume_kms = job.kms_key_id
    if volume_kms and spec.instance_type.startswith(_LOCAL_STORAGE_FAMILIES):
        log.warning(
            "job.kms_key_id is not used for the volumes of %s: its storage is local NVMe, encrypted by the "
            "hardware (SageMaker refuses a VolumeKmsKeyId there); it still encrypts the job's output",
            spec.instance_type,
        )
        volume_kms = None
    compute = cfg.Compute(
        instance_type=spec.instance_type,
        instance_count=spec.instance_count,
        volume_size_in_gb=job.volume_size_gb,
        volume_kms_key_id=volume_kms,
        keep_alive_period_in_seconds=job.keep_alive_minutes * 60 if job.keep_alive_minutes else None,
        training_plan_arn=job.training_plan_arn,
    )
    networking = cfg.Networking(
        subnets=list(job.subnets) or None,
        security_group_ids=list(job.security_group_ids) or None,
        enable_inter_container_traffic_encryption=job.encrypt_inter_container_traffic,
    )
    try:
        trainer = sdk.ModelTrainer(
            sagemaker_session=session,
            role=job.role_arn,
            base_job_name=spec.name,
            training_image=image,
            source_code=cfg.SourceCode(source_dir=source, entry_script=ENTRY_SCRIPT, requirements=requirements),
            distributed=sdk.Torchrun(process_count_per_node=spec.processes_per_node),
            compute=compute,
            networking=networking,
            stopping_condition=cfg.StoppingCondition(max_runtime_in_seconds=spec.max_runtime_s),
            checkpoint_config=cfg.CheckpointConfig(
                s3_uri=f"{run}/{spec.checkpoint_prefix}", local_path=SAGEMAKER_CHECKPOINT_DIR
            )
            if spec.checkpoint_prefix is not None
            else None,
            output_data_config=cfg.OutputDataConfig(
                s3_output_path=f"{run}/sagemaker-output", kms_key_id=job.kms_key_id
            ),
            environment=request_environment(spec),
            # The Torchrun driver passes hyperparameters as arguments: `--config <uri>` (+ the program's own).
            # The config travels by URI, not as hyperparameters (at most 100 of 256 characters each).
            hyperparameters={"config": spec.config_uri, **spec.args},
            tags=[
                cfg.Tag(key="hlat:run-id", value=spec.run_id),
                cfg.Tag(key="hlat:stage", value=spec.stage),
                cfg.Tag(key="hlat:attempt", value=str(spec.attempt)),
            ],
        )
    except sdk.RoleValidationError as exc:
        raise SubmitError("ValidationException", f"job.role_arn={job.role_arn!r}: {exc}") from exc
    trainer.with_tensorboard_output_config(
        cfg.TensorBoardOutputConfig(s3_output_path=f"{run}/tensorboard", local_path=SAGEMAKER_TENSORBOARD_DIR)
    )
    trainer.with_metric_definitions(
        [cfg.MetricDefinition(name=name, regex=regex) for name, regex in METRIC_DEFINITIONS.items()]
    )
    if job.sagemaker_retry_attempts > 0:
        trainer.with_retry_strategy(cfg.RetryStrategy(maximum_retry_attempts=job.sagemaker_retry_attempts))
    if job.infra_check:
        trainer.with_infra_check_config(cfg.InfraCheckConfig(enable_infra_check=True))
    # FastFile mounts the prefix and streams what is read: the trainer reads its shards from run storage itself,
    # and File mode would first copy the whole corpus onto every node. (prepare-data has no input channel: its
    # workers read the source themselves, each its own units.)
    modes = {"data": "FastFile", "tokenizer": "File"}
    channels = [_channel(cfg, name, f"{run}/{name}/", modes[name]) for name in spec.channels]
    try:
        # A private method, on purpose: ModelTrainer.train() names each job `<base>-<timestamp>`, and the
        # name must be ours (run id + attempt) so that a restarted flow re-attaches to the job it launched
        # instead of launching a duplicate. Only the job name is replaced: uploads still go under the SDK's
        # timestamped key, inside the run's code/ prefix.
        request: dict[str, Any] = trainer._create_training_job_args(input_data_config=channels, boto3=True)
    except ClientError as exc:
        raise SubmitError(*client_error(exc)) from exc
    except S3UploadFailedError as exc:
        found = re.search(r"\((\w+)\) when calling", str(exc))
        raise SubmitError(
            found.group(1) if found else "S3UploadFailed",
            f"uploading the job's source code under {run}/code: {exc}",
        ) from exc
    request["TrainingJobName"] = spec.name
    # Our init in front of the SDK's container command, which runs unchanged: it passes StopTrainingJob's
    # SIGTERM on to the ranks (infra/backends/job_init.py says why the SDK's shell never would).
    algorithm = request["AlgorithmSpecification"]
    algorithm["ContainerEntrypoint"] = [*JOB_INIT, *algorithm["ContainerEntrypoint"]]
    mlflow = mlflow_config(spec)  # (ModelTrainer has no MLflow setting: the member is added to its request)
    if mlflow is not None:
        request["MlflowConfig"] = mlflow
    return request


def _channel(cfg: Any, name: str, s3_uri: str, mode: str) -> Any:
    source = cfg.S3DataSource(s3_data_type="S3Prefix", s3_uri=s3_uri, s3_data_distribution_type="FullyReplicated")
    return cfg.Channel(channel_name=name, data_source=cfg.DataSource(s3_data_source=source), input_mode=mode)
