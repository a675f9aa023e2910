"""Checks of SageMaker requests against botocore's SageMaker service model, before anything is sent.

botocore validates types and required members itself; enums, patterns and maximums are applied here from the
same model. A problem is named by the config setting it comes from (`check_request`).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Mapping
from typing import Any

import botocore.session
import botocore.validate
from botocore.exceptions import ParamValidationError

from hlat.core.config import closest_match
from hlat.core.stages import TRAINING, stage
from hlat.infra.backends.protocol import SubmitError


@functools.cache
def sagemaker_service_model() -> Any:
    """botocore's SageMaker service model (the JSON botocore ships): the source of the limits checked below."""
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


def validate_request(request: Mapping[str, Any], stage: str = "train", validated_as: str | None = None) -> None:
    """Raise SubmitError('ValidationException') for anything in the whole CreateTrainingJob `request`, as the SDK
    built it, that SageMaker would refuse: what botocore's client-side validation checks (types, required members)
    and what it lets through (enums, patterns, maximums: `check_request`). `validated_as`: see
    `sagemaker_request.build_request`."""
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
