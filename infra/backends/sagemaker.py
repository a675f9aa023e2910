"""The `sagemaker` job backend: a run's training jobs as SageMaker training jobs on trn1 nodes.

Requests are built with the SageMaker SDK v3 `ModelTrainer` (the Neuron PyTorch DLC, the `Torchrun` driver,
`CheckpointConfig` pinned to the run's checkpoints/ prefix) and sent with boto3, under the job name the train
stage chose (`infra.backends.protocol.job_name`): a restarted flow then finds the job it launched instead of launching a
duplicate. Describe, stop and logs are plain boto3 calls (SageMaker and CloudWatch Logs).

`dry_run` builds the very same requests with a boto3 session that answers every AWS call itself (`OfflineAWS`)
and returns what `submit` would send, so a 64-node launch can be reviewed, and tested, without an AWS account.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import logging
import os
import re
import shutil
import tempfile
import urllib.parse
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
from boto3.exceptions import S3UploadFailedError
from botocore.awsrequest import AWSResponse
from botocore.config import Config
from botocore.exceptions import ClientError, ParamValidationError

from hlat.core.config import DEFAULT_NEURON_SDK, JobConfig, TrackingConfig, closest_match
from hlat.core.contract import SAGEMAKER_CHECKPOINT_DIR, SAGEMAKER_TENSORBOARD_DIR, STEP_LINE_METRICS
from hlat.core.environment import NEURON_SDKS
from hlat.core.stages import TRAINING, Instances, stage
from hlat.infra.backends.protocol import TERMINAL, JobSpec, JobState, Status, SubmitError
from hlat.infra.backends.run_roles import RunRoleError, RunRoles, ensure_run_role, retry_while_new, run_role_arn

log = logging.getLogger("hlat.sagemaker")

NEURON_DLC_REPOSITORY = "pytorch-training-neuronx"
"""The Neuron PyTorch training images used when `job.image_uri` is None, one tag per Neuron SDK release
(`NeuronSdk.image_tag`: 2.9.0-neuronx-py312-sdk2.28.0-ubuntu24.04 by default, neuron.sdk=2.28.0)."""

PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The project's checkout: deployments/ holds the requirements files the jobs install."""
GPU_DLC_VERSION = "2.10.0"
"""PyTorch version of the GPU training image that evaluation jobs on GPU instances use by default."""

JOB_LAYERS = ("core", "training")
"""The layers of `hlat` a job imports (hlat.core, hlat.training: the job programs import nothing else of the
project), shipped as the job's source code."""
ENTRY_SCRIPT = "hlat_job.py"
"""The script SageMaker's drivers run by path, at the top of the uploaded source (infra/backends/job_entry.py): it runs
the
module HLAT_JOB_MODULE names."""
JOB_MODULE_ENV = "HLAT_JOB_MODULE"
SOURCE_DIR = "/opt/ml/input/data/code"
"""Where SageMaker puts the uploaded source on each instance (the SDK's code channel)."""

INIT_SCRIPT = "job_init.py"
"""The container's PID 1 (infra/backends/job_init.py), at the top of the uploaded source beside the entry script."""
JOB_INIT = ["python3", f"{SOURCE_DIR}/{INIT_SCRIPT}"]
"""Put in front of the SDK's ContainerEntrypoint (/bin/bash): the container's PID 1, run by path from the source code
channel, which SageMaker downloads before the container starts."""


def stage_source(folder: Path, requirements: str | None) -> None:
    """Lay out a job's source code in the empty `folder`, as SageMaker will run it: the `hlat` package as the wheel
    holds it (hlat/__init__.py, hlat/core/..., hlat/training/...: each module once, copied from where this
    installation imports it), the entry script and the container's init at the top (the entry script's folder is
    first on the program's sys.path, so the program imports the uploaded code and needs no path set-up of its own),
    and the requirements file."""
    import hlat

    package = folder / "hlat"
    package.mkdir(parents=True)
    shutil.copy2(Path(hlat.__file__), package / "__init__.py")
    for layer in JOB_LAYERS:
        source = Path(importlib.import_module(f"hlat.{layer}").__file__ or "").parent
        shutil.copytree(source, package / layer, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(Path(__file__).with_name("job_entry.py"), folder / ENTRY_SCRIPT)
    shutil.copy2(Path(__file__).with_name("job_init.py"), folder / INIT_SCRIPT)
    if requirements is not None:
        (folder / requirements).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PROJECT_ROOT / requirements, folder / requirements)


LOG_GROUP = "/aws/sagemaker/TrainingJobs"
LOG_LOOKBACK_MS = 60_000
"""How far back each `logs` call looks again for events that reached CloudWatch late (64 nodes' streams are
shipped independently, so an event can arrive after a newer one from another node was already read)."""
LOG_MAX_PAGES = 20
"""FilterLogEvents pages (up to 10,000 events each) read per `logs` call; the rest is read on the next call."""

METRIC_DEFINITIONS = STEP_LINE_METRICS
"""The trainer's progress line (`core.contract.format_step_line`) as SageMaker metrics."""

# SageMaker rejects a VolumeKmsKeyId for instance types whose storage is local NVMe (encrypted by the
# hardware instead), and ignores VolumeSizeInGB for them.
_LOCAL_STORAGE_FAMILIES = ("ml.trn1.", "ml.trn1n.", "ml.trn2.", "ml.p4d.", "ml.p4de.", "ml.p5.", "ml.p5e.", "ml.p5en.")

_READ_OPERATIONS = ("Get", "List", "Describe", "Head", "Simulate", "Search")
"""Operation name prefixes of calls that change nothing; dry_run reports the others."""

LogCursor = tuple[int, tuple[tuple[int, str], ...]]
"""(newest event timestamp seen in ms, (timestamp, event id) of every event seen within LOG_LOOKBACK_MS of it)."""


def _import_sdk() -> Any:
    """The SageMaker SDK modules, imported on first use: importing them costs about two seconds that local runs
    should not pay."""
    try:
        from sagemaker.core import image_uris
        from sagemaker.core.common_utils import get_domain_for_region
        from sagemaker.core.helper.iam_role_resolver import RoleValidationError
        from sagemaker.core.helper.session_helper import Session
        from sagemaker.core.training import configs
        from sagemaker.train import ModelTrainer
        from sagemaker.train.distributed import Torchrun
    except ImportError as exc:
        raise ImportError(
            f"the sagemaker job backend needs the SageMaker SDK ({exc}): reinstall with scripts/install.sh"
        ) from exc

    return SimpleNamespace(
        image_uris=image_uris,
        get_domain_for_region=get_domain_for_region,
        RoleValidationError=RoleValidationError,
        Session=Session,
        configs=configs,
        ModelTrainer=ModelTrainer,
        Torchrun=Torchrun,
    )


def neuron_training_image(region: str, neuron_sdk: str = DEFAULT_NEURON_SDK) -> str | None:
    """The Neuron PyTorch training DLC of a Neuron SDK release in `region`, or None where AWS publishes none. The
    registry account of each region comes from the SageMaker SDK's own image table (`pytorch-neuron`), so new
    regions arrive with the SDK."""
    sdk = _import_sdk()
    registries: dict[str, str] = {}
    for version in sdk.image_uris.config_for_framework("pytorch-neuron")["training"]["versions"].values():
        registries.update(version.get("registries", {}))
    account = registries.get(region)
    if account is None:
        return None
    domain = sdk.get_domain_for_region(region)
    return f"{account}.dkr.ecr.{region}.{domain}/{NEURON_DLC_REPOSITORY}:{NEURON_SDKS[neuron_sdk].image_tag}"


def pytorch_training_image(region: str, instance_type: str) -> str:
    """AWS's PyTorch training image (the SDK's own image table) for `instance_type`: the GPU build for an evaluation
    job on a GPU instance, the CPU build for the prepare-data job."""
    sdk = _import_sdk()
    image: str = sdk.image_uris.retrieve(
        "pytorch", region, version=GPU_DLC_VERSION, instance_type=instance_type, image_scope="training"
    )
    return image


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


EGRESS_ENV = "HLAT_JOB_EGRESS"
"""`aws-endpoints` where the account stack's JobEgress keeps jobs off the internet (the ECS pool's environment)."""
DLC_ACCOUNT = "763104351884"
"""AWS's deep-learning-container images' account (most regions): the default images, which lack hlat's requirements."""


def endpoints_only() -> bool:
    """Whether the jobs of this account reach AWS's endpoints only (no package index)."""
    return os.environ.get(EGRESS_ENV, "").strip() == "aws-endpoints"


def requirements_of(spec: JobSpec) -> str:
    """What the job's instances pip-install before its program runs: its instances' own lock (`Instances.requirements`:
    the evaluation's lm-eval and transformers, the data job's great-expectations and datasets), else the lock of
    its Neuron SDK's image (deployments/job-requirements-<release>.lock.txt). Every file a job installs is a lock
    with hashes (scripts/job_locks.py), made from the requirements file beside it."""
    own = instances_of(spec).requirements
    return own or f"deployments/{NEURON_SDKS[spec.neuron_sdk].job_requirements.removesuffix('.txt')}.lock.txt"


def instances_of(spec: JobSpec) -> Instances:
    """Where the job's stage runs (its row's `runs_on`)."""
    return stage(spec.stage).runs_on or TRAINING


def split_s3_uri(uri: str) -> tuple[str, str]:
    """('bucket', 'key/prefix') of an s3:// URI, without trailing slashes."""
    without = uri.split("://", 1)[1]
    bucket, _, key = without.partition("/")
    return bucket, key.strip("/")


def _error(exc: ClientError) -> tuple[str, str]:
    err = exc.response.get("Error", {})
    return str(err.get("Code", "Unknown")), str(err.get("Message", exc))


def _not_found(exc: ClientError) -> bool:
    """DescribeTrainingJob answers an unknown name with a ValidationException ('Requested resource not found.';
    moto: "Could not find training job ..."), other APIs with ResourceNotFound."""
    code, message = _error(exc)
    if code in ("ResourceNotFound", "ResourceNotFoundException"):
        return True
    return code == "ValidationException" and bool(re.search(r"not found|could not find", message, re.IGNORECASE))


@functools.cache
def sagemaker_service_model() -> Any:
    """botocore's SageMaker service model (the JSON botocore ships): the source of the limits checked below."""
    import botocore.session

    return botocore.session.get_session().get_service_model("sagemaker")


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str] | None:
    try:
        return re.compile(pattern)
    except re.error:  # a construct Python's re does not know (none today): that pattern is left to SageMaker
        return None


def request_problems(operation: str, params: Mapping[str, Any], partial: bool = False) -> list[tuple[str, str]]:
    """(path, problem) of every value of `params` that `operation`'s input shape in the service model refuses.

    botocore's own check before sending (ParamValidationError) covers types, required members and minimums (of
    numbers and lengths), but not enums, patterns or maximums: SageMaker applies those, after the source was
    uploaded. They are applied here from the same model. `partial`: `params` is only part of a request (what a
    run's config decides, checked before any stage runs), so absent required members are not problems."""
    shape = sagemaker_service_model().operation_model(operation).input_shape
    problems: list[tuple[str, str]] = []
    _walk(shape, params, "", partial, problems)
    return problems


def _walk(shape: Any, value: Any, path: str, partial: bool, problems: list[tuple[str, str]]) -> None:
    meta = shape.metadata
    kind = shape.type_name
    if kind == "structure":
        if not isinstance(value, Mapping):
            return  # a wrong type: botocore's own validation names it
        if not partial:
            for name in shape.required_members:
                if value.get(name) is None:
                    problems.append((f"{path}{name}", "is required"))
        for name, member in value.items():
            if name in shape.members and member is not None:
                _walk(shape.members[name], member, f"{path}{name}.", partial, problems)
        return
    here = path.rstrip(".")
    if kind == "list" and isinstance(value, list | tuple):
        _length(meta, len(value), here, "items", problems)
        for i, item in enumerate(value):
            _walk(shape.member, item, f"{here}[{i}].", partial, problems)
    elif kind == "map" and isinstance(value, Mapping):
        _length(meta, len(value), here, "entries", problems)
        for key, item in value.items():
            _walk(shape.key, key, f"{here} key {key!r}.", partial, problems)
            _walk(shape.value, item, f"{here}[{key!r}].", partial, problems)
    elif kind == "string" and isinstance(value, str):
        if shape.enum and value not in shape.enum:
            close = closest_match(value, list(shape.enum))
            hint = f"; did you mean {close!r}?" if close else ""
            # A long enum (225 instance types) is shown as the values of the same family ('ml.trn1...').
            family = value.rsplit(".", 1)[0] if value.count(".") > 1 else value
            shown = [v for v in shape.enum if v.startswith(family)] if len(shape.enum) > 20 else []
            allowed = ", ".join(shown or shape.enum) if shown or len(shape.enum) <= 20 else ""
            listing = (
                f"of the {len(shape.enum)} allowed values, those like it are {allowed}"
                if shown
                else f"the allowed values are {allowed}"
                if allowed
                else f"none of the {len(shape.enum)} allowed values is like it; botocore's SageMaker model lists them"
            )
            problems.append((here, f"{value!r} is not an allowed value ({listing}){hint}"))
            return
        _length(meta, len(value), here, "characters", problems)
        pattern = meta.get("pattern")
        compiled = _compiled(pattern) if pattern else None
        if compiled is not None and not compiled.fullmatch(value):
            problems.append((here, f"{_short(value)} does not match the pattern {pattern}"))
    elif kind in ("integer", "long", "float", "double") and isinstance(value, int | float):
        if "min" in meta and value < meta["min"]:
            problems.append((here, f"{value} is below the minimum {meta['min']}"))
        if "max" in meta and value > meta["max"]:
            problems.append((here, f"{value} is above the maximum {meta['max']}"))


def _length(meta: Mapping[str, Any], n: int, path: str, unit: str, problems: list[tuple[str, str]]) -> None:
    if "min" in meta and n < meta["min"]:
        problems.append((path, f"has {n} {unit}, fewer than the minimum {meta['min']}"))
    if "max" in meta and n > meta["max"]:
        problems.append((path, f"has {n:,} {unit}, more than SageMaker's limit of {meta['max']:,}"))


def _short(value: str) -> str:
    return repr(value) if len(value) <= 120 else repr(value[:60] + "..." + value[-40:])


def _config_field(path: str, name: str) -> str:
    """The config setting a request member comes from, so that a problem names what to change."""
    if path.endswith(("S3Uri", "S3OutputPath")) or path.startswith(("HyperParameters", "Environment['NEURON_COMP")):
        return "storage.root (the run's URI is <storage.root>/<run id>)"
    if path.startswith("Environment"):
        return "neuron.env (or the Neuron settings the job's environment is made of)"
    where = stage(name).runs_on or TRAINING
    settings = {**TRAINING.settings, **where.settings}
    fields = {
        "ResourceConfig.InstanceType": settings["instance_type"],
        "ResourceConfig.InstanceCount": settings["instance_count"],
        "ResourceConfig.VolumeSizeInGB": "job.volume_size_gb",
        "ResourceConfig.VolumeKmsKeyId": "job.kms_key_id",
        "OutputDataConfig.KmsKeyId": "job.kms_key_id",
        "RoleArn": "job.role_arn",
        "TrainingJobName": "run_id",
        # A training job's is also capped by what is left of the budget and before job.deadline (stage_jobs).
        "StoppingCondition.MaxRuntimeInSeconds": settings["max_runtime_hours"],
        "AlgorithmSpecification.TrainingImage": settings["image_uri"],
        "VpcConfig.Subnets": "job.subnets",
        "VpcConfig.SecurityGroupIds": "job.security_group_ids",
        "Tags": "run_id",
    }
    for prefix, field in fields.items():
        if path.startswith(prefix):
            return field
    return "the request"


def check_request(operation: str, params: Mapping[str, Any], stage: str = "train", partial: bool = False) -> None:
    """Raise ValueError naming each config field whose value `operation`'s service model refuses (see
    `request_problems`), with the limit or the allowed values."""
    problems = request_problems(operation, params, partial)
    if not problems:
        return
    by_field: dict[str, list[tuple[str, str]]] = {}
    for path, problem in problems:
        by_field.setdefault(_config_field(path, stage), []).append((path, problem))
    lines = []
    for field, found in by_field.items():
        # One line per setting: a long storage root makes every S3 URI of the request too long, say so once.
        path, problem = found[0]
        more = f" (and {len(found) - 1} more member(s) of the request)" if len(found) > 1 else ""
        if field == "job.role_arn":
            problem = (
                f"{_short(str(params.get('RoleArn')))} is not an IAM role ARN: SageMaker needs the full ARN, "
                "arn:aws:iam::<account>:role/<name> (a bare role name is not expanded: its account would be a guess), "
                "or job.role_arn_secret=<a Prefect Secret block holding it>"
            )
            more = ""
        lines.append(f"{field}: {operation} {path} {problem}{more}")
    raise ValueError("SageMaker would refuse this job: " + "; ".join(lines))


class OfflineAWS:
    """A boto3 session that sends nothing: every API call it makes is recorded and answered here.

    Handlers on botocore's event system do it: 'before-parameter-build' sees each call's API parameters (after the
    caller built them, before validation against the service model), and a 'before-call' handler that returns a
    (response, parsed) pair makes botocore skip the HTTP request. Reads the SageMaker SDK makes while building a
    request get plausible answers (the caller's identity, the role and its trust policy, the run's bucket, an
    allowed policy simulation); writes (S3 uploads, CreateTrainingJob) are only recorded. Clients must be created
    from `session` after construction: each client copies the session's handlers when it is created.

    `store(bucket, key, data)`, when given, receives the bytes of every upload (PutObject, or a multipart upload
    once completed): how the local backend's SageMaker emulator gets the source and driver channels a request names.
    """

    def __init__(
        self,
        region: str,
        role_arn: str,
        buckets: list[str],
        store: Callable[[str, str, bytes], None] | None = None,
    ) -> None:
        self.region = region
        self.store = store
        self._parts: dict[str, dict[int, bytes]] = {}
        self.role_arn = role_arn
        arn = role_arn.split(":")  # arn:aws:iam::<account>:role/<name>
        self.account = arn[4] if len(arn) > 5 and arn[4] else "123456789012"
        self.buckets = buckets
        self.calls: list[dict[str, Any]] = []
        # Static made-up credentials: nothing is signed, and no credential provider (SSO, instance metadata)
        # is ever consulted.
        self.session = boto3.Session(
            aws_access_key_id="hlat-dry-run", aws_secret_access_key="hlat-dry-run", region_name=region
        )
        self.session.events.register("before-parameter-build", self._record)
        self.session.events.register("before-call", self._answer)

    def requests(self) -> list[dict[str, Any]]:
        """The calls that would have changed something, in the order they were made."""
        return [c for c in self.calls if not c["operation"].startswith(_READ_OPERATIONS)]

    def _record(self, params: dict[str, Any], model: Any, context: dict[str, Any], **_: Any) -> None:
        # The request context travels from this event to 'before-call': it carries the parameters to _answer
        # (uploads run on several threads, so "the last call recorded" would not do).
        context["hlat_params"] = params
        recorded = {k: v for k, v in params.items() if k != "Body"}
        if "Body" in params:
            # Uploads are summarised: their bodies are the project's files, not worth repeating.
            recorded["Size"] = _body_size(params["Body"])
            if self.store is not None:
                self._keep(model.name, params)
        elif self.store is not None and model.name == "CompleteMultipartUpload":
            parts = self._parts.pop(str(params["UploadId"]), {})
            self.store(str(params["Bucket"]), str(params["Key"]), b"".join(parts[n] for n in sorted(parts)))
        self.calls.append(
            {
                "service": model.service_model.service_name,
                "operation": model.name,
                "params": copy.deepcopy(recorded),
            }
        )

    def _keep(self, operation: str, params: dict[str, Any]) -> None:
        assert self.store is not None
        body = params["Body"]
        data = bytes(body) if isinstance(body, bytes | bytearray) else body.read()
        if hasattr(body, "seek"):
            body.seek(0)
        if operation == "PutObject":
            self.store(str(params["Bucket"]), str(params["Key"]), data)
        elif operation == "UploadPart":
            self._parts.setdefault(str(params["UploadId"]), {})[int(params["PartNumber"])] = data

    def _answer(self, model: Any, context: dict[str, Any], **_: Any) -> tuple[AWSResponse, dict[str, Any]]:
        answer = self._canned(model.service_model.service_name, model.name, context.get("hlat_params", {}))
        return AWSResponse("https://hlat-dry-run.invalid", 200, {}, None), answer

    def _canned(self, service: str, operation: str, params: dict[str, Any]) -> dict[str, Any]:
        if operation == "GetCallerIdentity":
            return {
                "Account": self.account,
                "Arn": f"arn:aws:sts::{self.account}:assumed-role/hlat-dry-run/hlat",
                "UserId": "AROAHLATDRYRUN:hlat",
            }
        if operation == "GetRole":
            trust = {
                "Version": "2012-10-17",
                "Statement": [
                    {"Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"}, "Action": "sts:AssumeRole"}
                ],
            }
            name = params.get("RoleName", "hlat")
            arn = self.role_arn if self.role_arn.endswith(f"/{name}") else f"arn:aws:iam::{self.account}:role/{name}"
            return {
                "Role": {
                    "Path": "/",
                    "RoleName": name,
                    "RoleId": "AROAHLATDRYRUN",
                    "Arn": arn,
                    "CreateDate": datetime(2024, 1, 1, tzinfo=UTC),
                    # IAM returns the trust policy URL-encoded.
                    "AssumeRolePolicyDocument": urllib.parse.quote(json.dumps(trust)),
                }
            }
        if operation == "SimulatePrincipalPolicy":
            return {
                "EvaluationResults": [
                    {"EvalActionName": action, "EvalResourceName": "*", "EvalDecision": "allowed"}
                    for action in params.get("ActionNames", [])
                ],
                "IsTruncated": False,
            }
        if operation == "ListBuckets":
            created = datetime(2024, 1, 1, tzinfo=UTC)
            return {"Buckets": [{"Name": b, "CreationDate": created} for b in self.buckets], "Owner": {"ID": "hlat"}}
        if operation == "ListObjectsV2":
            return {"IsTruncated": False, "KeyCount": 0, "Name": params.get("Bucket", "")}
        if operation in ("PutObject", "UploadPart", "CompleteMultipartUpload"):
            return {"ETag": '"hlat-dry-run"'}
        if operation == "CreateMultipartUpload":
            # One id per object: s3transfer uploads several files at once, each in its own threads.
            upload_id = f"hlat-dry-run/{params.get('Bucket')}/{params.get('Key')}"
            return {"Bucket": params.get("Bucket"), "Key": params.get("Key"), "UploadId": upload_id}
        if operation == "CreateTrainingJob":
            name = params.get("TrainingJobName", "")
            return {"TrainingJobArn": f"arn:aws:sagemaker:{self.region}:{self.account}:training-job/{name}"}
        log.debug("dry run: no canned answer for %s %s; answering with an empty response", service, operation)
        return {}


def _body_size(body: Any) -> int | None:
    """Bytes in an upload's body: bytes, s3transfer's ReadFileChunk (both have a length) or a seekable file."""
    try:
        return len(body)
    except TypeError:
        pass
    try:
        here = body.tell()
        body.seek(0, 2)
        end = int(body.tell())
        body.seek(here)
        return end - int(here)
    except (AttributeError, OSError, ValueError):
        return None


def training_image(spec: JobSpec, job: JobConfig) -> str:
    """The image a job runs on SageMaker: job.image_uri, else the Neuron PyTorch training image of the job's
    region and Neuron SDK."""
    if job.image_uri:
        return job.image_uri
    image = neuron_training_image(job.region, spec.neuron_sdk)
    if image is None:
        raise ValueError(
            f"job.region={job.region!r}: AWS publishes no Neuron PyTorch training image there and "
            f"job.image_uri={job.image_uri!r}; set job.image_uri to a training image in that region, "
            "or use a region with trn1 capacity (e.g. us-east-1, us-west-2)"
        )
    return image


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


def validate_request(request: Mapping[str, Any], stage: str = "train", validated_as: str | None = None) -> None:
    """Raise SubmitError('ValidationException') for anything in the whole CreateTrainingJob `request`, as the SDK
    built it, that SageMaker would refuse: what botocore's client-side validation checks (types, required members)
    and what it lets through (enums, patterns, maximums: `check_request`). `validated_as`: see `build_request`."""
    import botocore.validate

    judged_request = judged(request, validated_as)
    try:
        check_request("CreateTrainingJob", judged_request, stage)
        shape = sagemaker_service_model().operation_model("CreateTrainingJob").input_shape
        botocore.validate.validate_parameters(judged_request, shape)
    except (ValueError, ParamValidationError) as exc:
        raise SubmitError("ValidationException", str(exc)) from exc


def judged(request: Mapping[str, Any], validated_as: str | None) -> dict[str, Any]:
    """`request` as the service model should judge it: with `validated_as`, the 'local' instance type (the
    emulator's hosts) stands as that SageMaker one; every other member is judged as it is."""
    checked = copy.deepcopy(dict(request))
    resources = checked.get("ResourceConfig") or {}
    if validated_as is not None and resources.get("InstanceType") == "local":
        resources["InstanceType"] = validated_as
    return checked


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
    sdk = _import_sdk()
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
        raise SubmitError(*_error(exc)) from exc
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


class SageMakerBackend:
    """Training jobs as SageMaker training jobs (see the module docstring).

    `sagemaker` and `logs_client` are the boto3 clients of describe, stop, CreateTrainingJob and logs: attributes,
    so tests can stub them (botocore's Stubber) or replace them. The SDK's uploads go through `boto_session`.
    """

    kind = "sagemaker"

    def __init__(self, job: JobConfig, boto_session: boto3.Session | None = None) -> None:
        if boto_session is not None and boto_session.region_name not in (None, job.region):
            raise ValueError(
                f"the boto session is for region {boto_session.region_name!r} but job.region={job.region!r}: "
                "make them the same (jobs, buckets and images are regional)"
            )
        self.job = job
        self.boto_session = boto_session or boto3.Session(region_name=job.region)
        # Standard retries absorb the throttling that polling 64-node jobs every minute can meet.
        config = Config(retries={"mode": "standard", "max_attempts": 5}, user_agent_extra="hlat")
        self.sagemaker: Any = self.boto_session.client("sagemaker", region_name=job.region, config=config)
        self.logs_client: Any = self.boto_session.client("logs", region_name=job.region, config=config)
        self.now: Callable[[], datetime] = lambda: datetime.now(UTC)

    # -- the JobBackend protocol ----------------------------------------------------------------------------
    def submit(self, spec: JobSpec) -> None:
        """Upload the source, then create the training job named `spec.name`. A name already in use is refused
        (SubmitError 'ResourceInUse') before anything is uploaded: the caller should re-attach to that job."""
        self._check(spec)
        try:
            existing = self.describe(spec.name)
        except ClientError as exc:  # e.g. throttled: classified like a refused submission
            raise SubmitError(*_error(exc)) from exc
        if existing is not None:
            raise SubmitError(
                "ResourceInUse",
                f"a training job named {spec.name} already exists ({existing.status.value}); "
                "describe it to re-attach instead of submitting it again",
            )
        job, just_created = self.job, False
        roles = RunRoles.from_environment()
        if (
            roles is not None
        ):  # the run's own role (infra/backends/run_roles.py), in place of the stack's execution role
            assert job.role_arn is not None  # _check refused it otherwise
            try:
                arn, just_created = ensure_run_role(
                    self.boto_session, roles, spec.run_uri, spec.stage, job.role_arn, spec.reads
                )
            except RunRoleError as exc:
                raise SubmitError("AccessDeniedException", str(exc)) from exc
            job = job.model_copy(update={"role_arn": arn})
        request = build_request(spec, job, self.boto_session, requirements=self.requirements(spec))
        try:
            retry_while_new(lambda: self._create(request, stage=spec.stage), just_created)
        except SubmitError as exc:
            # The job did not exist a moment ago: if it does now, this is our own request, retried by botocore
            # after a first try that got through (a timeout, say). It is the job we launched.
            if exc.code != "ResourceInUse" or self.describe(spec.name) is None:
                raise
            log.warning("%s was created by an earlier try of this request: %s", spec.name, exc)
        log.info("created training job %s (%s x %d)", spec.name, spec.instance_type, spec.instance_count)

    def describe(self, name: str) -> JobState | None:
        try:
            desc = self.sagemaker.describe_training_job(TrainingJobName=name)
        except ClientError as exc:
            if _not_found(exc):
                return None
            raise
        return self._state(desc)

    def stop(self, name: str) -> None:
        """Ask SageMaker to stop the job (it gets SIGTERM, then SIGKILL 120 s later). A job that already ended,
        or never existed, has nothing to stop: SageMaker's ValidationException for it is ignored."""
        try:
            self.sagemaker.stop_training_job(TrainingJobName=name)
        except ClientError as exc:
            code, message = _error(exc)
            if code == "ValidationException" or _not_found(exc):
                log.debug("stop %s: nothing to stop (%s: %s)", name, code, message)
                return
            raise

    def logs(self, name: str, cursor: LogCursor | None = None) -> tuple[list[str], LogCursor | None]:
        """New lines of the job's CloudWatch log streams (`<name>/algo-N-...`, one per node) since `cursor`.

        Each event is returned once: the cursor keeps the ids of the events seen in the last LOG_LOOKBACK_MS,
        and each call reads that window again to pick up events that arrived late. Before the job starts there
        is no log group or stream, hence no lines."""
        newest, seen_pairs = cursor if cursor else (0, ())
        seen = {event_id for _, event_id in seen_pairs}
        request: dict[str, Any] = {"logGroupName": LOG_GROUP, "logStreamNamePrefix": f"{name}/"}
        if cursor:
            request["startTime"] = max(0, newest - LOG_LOOKBACK_MS)
        events: list[dict[str, Any]] = []
        try:
            for _ in range(LOG_MAX_PAGES):
                page = self.logs_client.filter_log_events(**request)
                events.extend(page.get("events", []))
                token = page.get("nextToken")
                if not token:
                    break
                request["nextToken"] = token
        except ClientError as exc:
            if _error(exc)[0] != "ResourceNotFoundException":
                raise
            return [], cursor  # the job has not started logging yet
        unseen = {e["eventId"]: e for e in events if e["eventId"] not in seen}
        fresh = sorted(unseen.values(), key=lambda e: e["timestamp"])
        pairs = [*seen_pairs, *((int(e["timestamp"]), str(e["eventId"])) for e in fresh)]
        newest = max([newest, *(ts for ts, _ in pairs)])
        kept = tuple((ts, event_id) for ts, event_id in pairs if ts >= newest - LOG_LOOKBACK_MS)
        lines = [str(e.get("message", "")).rstrip("\n") for e in fresh]
        return lines, (newest, kept)

    def dry_run(self, spec: JobSpec) -> list[dict[str, Any]]:
        """The requests `submit(spec)` would send: S3 uploads of the source (summarised as bucket, key and size)
        and CreateTrainingJob with its full parameters, validated against the service model. Sends nothing."""
        bucket, _ = self._check(spec)
        assert self.job.role_arn is not None  # _check raised otherwise
        job = self.job
        roles = RunRoles.from_environment()
        if roles is not None:  # the run's own role, as submit makes it (nothing is made here)
            job = job.model_copy(update={"role_arn": run_role_arn(roles, self.job.role_arn, spec.run_uri, spec.stage)})
        offline = OfflineAWS(self.job.region, self.job.role_arn, [bucket])
        request = build_request(spec, job, offline.session, requirements=self.requirements(spec))
        self._create(request, offline.session.client("sagemaker", region_name=self.job.region), spec.stage)
        return offline.requests()

    # -- building requests ----------------------------------------------------------------------------------
    def requirements(self, spec: JobSpec) -> str | None:
        """The requirements file each instance installs before the job's program runs (None: none, in an account
        whose jobs reach no package index: the image holds them, `check_spec`)."""
        return None if endpoints_only() else requirements_of(spec)

    def training_image(self, spec: JobSpec) -> str:
        return training_image(spec, self.job)

    def config_request(self, spec: JobSpec) -> dict[str, Any]:
        return config_request(spec, self.job)

    def _check(self, spec: JobSpec) -> tuple[str, str]:
        return check_spec(spec, self.job, self.requirements(spec))

    def _create(self, request: Mapping[str, Any], client: Any = None, stage: str = "train") -> None:
        validate_request(request, stage)
        try:
            (client or self.sagemaker).create_training_job(**request)
        except ClientError as exc:
            raise SubmitError(*_error(exc)) from exc
        except ParamValidationError as exc:
            raise SubmitError("ValidationException", str(exc)) from exc

    # -- describing ---------------------------------------------------------------------------------------------
    def _state(self, desc: Mapping[str, Any]) -> JobState:
        raw = desc["TrainingJobStatus"]
        # 'Deleting' (DeleteTrainingJob) is not in the protocol's vocabulary: for the train stage the job is over.
        status = Status.STOPPED if raw == "Deleting" else Status(raw)
        billable = desc.get("BillableTimeInSeconds")
        if billable is None:
            start, end = desc.get("TrainingStartTime"), desc.get("TrainingEndTime")
            if start is not None and end is not None:
                billable = (end - start).total_seconds()
            elif start is not None and status == Status.IN_PROGRESS:
                billable = (self.now() - start).total_seconds()
            else:
                billable = 0.0
        return JobState(
            name=str(desc["TrainingJobName"]),
            status=status,
            failure_reason=desc.get("FailureReason"),
            secondary_status="Deleting" if raw == "Deleting" else desc.get("SecondaryStatus"),
            billable_seconds=max(0.0, float(billable)),
            instance_count=int(desc.get("ResourceConfig", {}).get("InstanceCount") or 1),
            ended_at=end.timestamp() if (end := desc.get("TrainingEndTime")) and status in TERMINAL else None,
        )
