"""A run's AWS credentials as boto3's default chain reads them, and the SageMaker role's check. No Prefect here.

`credential_environment` turns a prefect-aws `AwsCredentials` block into environment variables, and `apply_environment`
exports them. Every client the run makes, and every local job it starts, then uses the block. Without a block boto3's
default chain applies. A block's values win; variables that would override or spoil them are removed
(docs/deployments.md). `check_role_arn` accepts only an IAM role ARN. Jobs get the role, never credentials; secret
values are never logged.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from hlat.core.config import ConfigError

log = logging.getLogger("hlat.aws")

CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
"""The environment's access keys (AWS_SECURITY_TOKEN is botocore's older name for the session token)."""
PROFILE_VARIABLES = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE")
SETTING_VARIABLES = ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_CA_BUNDLE")
_SERVICE_ENDPOINT = re.compile(r"AWS_ENDPOINT_URL_[A-Z0-9_]+")
_ROLE_ARN = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+")


class AwsBlockError(ConfigError):
    """A block named in job.* is missing or unusable; the message names the field, the block and the fix."""


def managed_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """Every variable `activate` may set or remove, for tests that must restore them."""
    env = os.environ if environ is None else environ
    service = sorted(name for name in env if _SERVICE_ENDPOINT.fullmatch(name))
    return [*CREDENTIAL_VARIABLES, *PROFILE_VARIABLES, *SETTING_VARIABLES, *service]


def apply_environment(env: Mapping[str, str | None]) -> None:
    """Set (a value) or remove (None) each variable in this process's environment."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def credential_environment(block: Any, name: str) -> dict[str, str | None]:
    """The variables that make boto3's default chain use `block`: a value to set, or None to remove.

    `name` is the block's, for messages. assume_role_arn is refused; other client parameters warn."""
    if block.assume_role_arn:
        raise AwsBlockError(
            f"job.aws_credentials_block={name!r}: the block sets assume_role_arn, which hlat cannot hand to the "
            "processes a run starts (its temporary credentials would expire during the run); put the role in an "
            "AWS profile instead (role_arn and source_profile in ~/.aws/config) and set the block's profile_name"
        )
    key_id = block.aws_access_key_id
    secret = block.aws_secret_access_key.get_secret_value() if block.aws_secret_access_key else None
    if bool(key_id) != bool(secret):
        missing = "aws_secret_access_key" if key_id else "aws_access_key_id"
        raise AwsBlockError(
            f"job.aws_credentials_block={name!r}: the block has one half of an access key ({missing} is empty); "
            "set both aws_access_key_id and aws_secret_access_key, or neither to use its profile or the default chain"
        )
    env: dict[str, str | None] = {}
    if key_id:
        env.update(
            AWS_DEFAULT_PROFILE=None,
            AWS_ACCESS_KEY_ID=key_id,
            AWS_SECRET_ACCESS_KEY=secret,
            AWS_SESSION_TOKEN=block.aws_session_token or None,
            AWS_SECURITY_TOKEN=None,
            AWS_PROFILE=block.profile_name or None,
        )
    elif block.profile_name:
        env.update(dict.fromkeys(CREDENTIAL_VARIABLES), AWS_DEFAULT_PROFILE=None, AWS_PROFILE=block.profile_name)
    if block.region_name:
        env.update(AWS_DEFAULT_REGION=block.region_name, AWS_REGION=block.region_name)
    params = block.aws_client_parameters
    if params.endpoint_url:
        env.update(dict.fromkeys(var for var in os.environ if _SERVICE_ENDPOINT.fullmatch(var)))
        env["AWS_ENDPOINT_URL"] = params.endpoint_url
    bundle = params.verify_cert_path or (params.verify if not isinstance(params.verify, bool) else None)
    if bundle:
        env["AWS_CA_BUNDLE"] = str(bundle)
    ignored = [
        field
        for field, is_set in (
            ("api_version", params.api_version is not None),
            ("use_ssl", not params.use_ssl and not params.endpoint_url),  # an endpoint URL names its scheme
            ("verify", params.verify is False),
            ("config", bool(params.config)),
        )
        if is_set
    ]
    if ignored:
        log.warning(
            "job.aws_credentials_block=%r: aws_client_parameters %s have no environment variable and are ignored",
            name, ", ".join(ignored),
        )  # fmt: skip
    source = "access key" if key_id else f"profile {block.profile_name!r}" if block.profile_name else "default chain"
    log.info("AWS credentials: AwsCredentials block %r (%s)", name, source)
    return env


def check_role_arn(value: object, secret_name: str) -> str:
    """The IAM role ARN a Secret block named `secret_name` held.

    Anything else, such as a password saved by mistake, is refused without being repeated."""
    if not isinstance(value, str) or not _ROLE_ARN.fullmatch(value.strip()):
        raise AwsBlockError(
            f"job.role_arn_secret={secret_name!r}: the Secret block's value is not an IAM role ARN; save one like "
            f'Secret(value="arn:aws:iam::<account>:role/<role trusted by sagemaker.amazonaws.com>").save('
            f'"{secret_name}", overwrite=True)'
        )
    return value.strip()
