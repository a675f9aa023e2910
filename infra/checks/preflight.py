"""The live preflight of a run: what AWS and the data source answer, asked before anything is spent.

`run_preflight` gives the source checks (sources.py) and, for a SageMaker run, the AWS checks: the caller, role,
storage, images, quotas and plan (iam.py, storage_probe.py, images.py, capacity.py). `require_sources` and
`require_aws` raise `PreflightFailed` instead. A pass is not asked again for PASSED_TTL_S in one process. Clients
come from boto3's default chain in `job.region`. No Prefect here. docs/deployments.md ("Preflight") lists every
check."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
from botocore.parsers import ResponseParserError

from hlat.core.config import HlatConfig
from hlat.infra.checks.aws_clients import boto_session, client_config, error_code, error_message, unexpected
from hlat.infra.checks.capacity import quota_findings, training_plan_findings
from hlat.infra.checks.findings import Finding, PreflightFailed, PreflightResult
from hlat.infra.checks.iam import role_findings
from hlat.infra.checks.images import image_findings
from hlat.infra.checks.sources import SourceShape, source_findings
from hlat.infra.checks.storage_probe import PROBE_SESSION, PROBE_SESSION_S, storage_findings

PASSED_TTL_S = 600.0
"""Seconds a passed check is not repeated in one process (the CLI and the flow it starts share it)."""


# -- what passed recently (one answer for the CLI and the flow it starts) ----------------------------------------
_passed: dict[str, float] = {}


def _recently_passed(key: str) -> bool:
    at = _passed.get(key)
    return at is not None and time.monotonic() - at < PASSED_TTL_S


def _source_key(config: HlatConfig) -> str:
    readers = [[s.source, s.hf_config, s.revision] for s in config.data.mixture]
    return json.dumps(["source", readers, config.tokenizer.pretrained, os.environ.get("HF_HUB_OFFLINE")])


def _aws_key(config: HlatConfig) -> str:
    body = config.model_dump(mode="json", include={"job", "storage", "data", "evaluation", "precompile", "burn_in"})
    return json.dumps(["aws", config.resolved_run_id(), body], sort_keys=True, default=str)


# -- the AWS checks ---------------------------------------------------------------------------------------------
def aws_findings(config: HlatConfig, clients: Mapping[str, Any] | None = None) -> list[Finding]:
    """The AWS checks of a SageMaker run. `clients` replaces a service's boto3 client by name (for tests)."""
    session = boto_session(config.job.region)
    made: dict[str, Any] = dict(clients or {})

    def client(service: str) -> Any:
        if service not in made:
            # IAM's few reads are not retried: a simulator that is not there (moto) answers 500 at once.
            attempts = 1 if service == "iam" else 2
            made[service] = session.client(service, region_name=config.job.region, config=client_config(attempts))
        return made[service]

    try:
        identity = client("sts").get_caller_identity()
    except NoCredentialsError:
        return [
            Finding(
                "caller",
                False,
                "no AWS credentials: configure a profile (aws configure; AWS_PROFILE), environment "
                "keys, or job.aws_credentials_block",
            )
        ]
    except (ClientError, BotoCoreError) as exc:
        return [
            Finding(
                "caller",
                False,
                f"STS GetCallerIdentity failed ({error_code(exc)}: {error_message(exc)}); fix the credentials",
            )
        ]
    caller, account = str(identity["Arn"]), str(identity["Account"])
    findings = [Finding("caller", True, f"{caller} (account {account}, region {config.job.region})")]

    def assume(role_arn: str) -> Any:
        session_name = f"{PROBE_SESSION}{uuid.uuid4().hex[:12]}"
        answer = client("sts").assume_role(
            RoleArn=role_arn, RoleSessionName=session_name, DurationSeconds=PROBE_SESSION_S
        )
        credentials = answer["Credentials"]
        role_session = boto3.Session(
            aws_access_key_id=credentials["AccessKeyId"],
            aws_secret_access_key=credentials["SecretAccessKey"],
            aws_session_token=credentials["SessionToken"],
            region_name=config.job.region,
        )
        return role_session.client("s3", config=client_config())

    checks: list[tuple[str, Callable[[], list[Finding]]]] = [
        ("role", lambda: role_findings(client, config, caller, account)),
        ("storage", lambda: storage_findings(client, config, caller, assume)),
        ("image", lambda: image_findings(client, config, account)),
        ("quota", lambda: quota_findings(client, config)),
        ("training-plan", lambda: training_plan_findings(client, config)),
    ]
    for name, check in checks:
        try:
            findings += check()
        except (ClientError, BotoCoreError, ResponseParserError) as exc:
            findings.append(unexpected(name, exc))
    return findings


# -- the whole preflight ----------------------------------------------------------------------------------------
def run_preflight(
    config: HlatConfig,
    *,
    shape: SourceShape | None = None,
    clients: Mapping[str, Any] | None = None,
    aws: bool | None = None,
) -> PreflightResult:
    """The source checks and, for a SageMaker run (or `aws`), the AWS checks; credentials are already active."""
    findings: list[Finding] = []
    if shape is not None:
        findings += source_findings(config, shape)
    if aws if aws is not None else config.job.backend == "sagemaker":
        findings += aws_findings(config, clients)
    return PreflightResult(findings)


def require_sources(config: HlatConfig, shape: SourceShape) -> None:
    """Raise PreflightFailed (one line per failure) unless data.source can be read; what passed is not asked again
    for PASSED_TTL_S."""
    _require(_source_key(config), lambda: source_findings(config, shape))


def require_aws(config: HlatConfig, *, clients: Mapping[str, Any] | None = None) -> None:
    """For a SageMaker run, the AWS checks; raise PreflightFailed listing failures. Passes are cached PASSED_TTL_S."""
    if config.job.backend != "sagemaker":
        return
    _require(_aws_key(config), lambda: aws_findings(config, clients))


def _require(key: Any, check: Callable[[], list[Finding]]) -> None:
    """Run `check` unless it passed for `key` within PASSED_TTL_S; raise PreflightFailed with its failures."""
    if _recently_passed(key):
        return
    failures = [f for f in check() if not f.ok]
    if failures:
        raise PreflightFailed(failures)
    _passed[key] = time.monotonic()
