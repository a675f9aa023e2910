"""The Prefect side of a run's AWS access: load the blocks named in job.* and hand them to infra/checks/aws.py.

`activate` exports the credentials block into this process, so every client and local job uses it. `with_role` reads the
role secret per flow run, so a rotated secret applies to the next one.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect.exceptions import ObjectNotFound

from hlat.core.config import HlatConfig, JobConfig
from hlat.infra.checks.aws import AwsBlockError, apply_environment, check_role_arn, credential_environment

log = logging.getLogger("hlat.aws")


def activate(job: JobConfig) -> None:
    """Make the block `job.aws_credentials_block` this process's AWS credentials; nothing when None."""
    name = job.aws_credentials_block
    if name is None:
        return
    from prefect_aws import AwsCredentials

    example = 'AwsCredentials(aws_access_key_id="...", aws_secret_access_key="...", region_name="us-west-2")'
    env = credential_environment(_load(AwsCredentials, name, "aws_credentials_block", example), name)
    apply_environment(env)
    region = env.get("AWS_DEFAULT_REGION")
    if region and region != job.region:
        log.warning(
            "the AwsCredentials block %r is for region %s but job.region=%s: SageMaker jobs and their logs use "
            "job.region, other clients (S3) default to %s",
            name, region, job.region, region,
        )  # fmt: skip


def role_arn(job: JobConfig) -> str | None:
    """The IAM role SageMaker jobs assume: job.role_arn, else the Secret block job.role_arn_secret, else None."""
    if job.role_arn or not job.role_arn_secret:
        return job.role_arn or None
    from prefect.blocks.system import Secret

    name = job.role_arn_secret
    secret = _load(Secret, name, "role_arn_secret", 'Secret(value="arn:aws:iam::<account>:role/<role>")')
    return check_role_arn(secret.get(), name)


def with_role(config: HlatConfig) -> HlatConfig:
    if config.job.role_arn or not config.job.role_arn_secret:
        return config
    job = config.job.model_copy(update={"role_arn": role_arn(config.job), "role_arn_secret": None})
    return config.model_copy(update={"job": job})


def _load(block_type: Any, name: str, field: str, example: str) -> Any:
    """`block_type.load(name)`, synchronous even inside an async flow.

    A missing block raises AwsBlockError saying how to create it."""
    try:
        return block_type.load(name, _sync=True)
    except ValueError as exc:
        if isinstance(exc.__cause__, ObjectNotFound):
            raise AwsBlockError(
                f"job.{field}={name!r}: no {block_type.__name__} block named {name!r} on the Prefect server; "
                f"create it in the UI (Blocks; `prefect block register -m prefect_aws` adds the AWS types), or with "
                f'`{example}.save("{name}")` in Python'
            ) from None
        # e.g. a block saved with another schema: its pydantic error could quote the stored (secret) values.
        raise AwsBlockError(
            f"job.{field}={name!r}: the {block_type.__name__} block could not be loaded ({type(exc).__name__}); "
            "open it in the Prefect UI and save it again"
        ) from None
