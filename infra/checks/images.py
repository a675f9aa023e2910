"""The image check: each SageMaker stage's image is in ECR, in the job's region.

Images are resolved as the backend resolves them. An image in another account's registry that this account may not
describe (AWS's own containers) is unchecked; SageMaker pulls it with the execution role.
"""

from __future__ import annotations

import re

from botocore.exceptions import ClientError

from hlat.core.config import ConfigError, HlatConfig
from hlat.core.stages import stages as stage_rows
from hlat.infra.backends.sagemaker_images import neuron_training_image
from hlat.infra.checks.aws_clients import DENIED, ClientFactory, error_code
from hlat.infra.checks.findings import Finding
from hlat.infra.stage_jobs import job_image

_IMAGE = re.compile(
    r"^(?P<account>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?/"
    r"(?P<repo>[^:@]+)(?::(?P<tag>[^@]+)|@(?P<digest>sha256:[0-9a-f]+))?$"
)


def stage_images(config: HlatConfig) -> dict[str, list[str]]:
    """The image each SageMaker stage job runs, as the backend resolves it: {image URI: [what runs it]}."""
    job = config.job
    train = job.image_uri
    if train is None:
        train = neuron_training_image(job.region, config.neuron.sdk)
        if train is None:
            raise ConfigError(
                f"job.region={job.region!r}: AWS publishes no Neuron PyTorch training image there; set job.image_uri "
                "to a training image in that region"
            )
    images: dict[str, list[str]] = {}
    places = list(dict.fromkeys(row.runs_on for row in stage_rows() if row.runs_on is not None))
    for where in places:
        images.setdefault(job_image(config, where) or train, []).append(where.named_for)
    return images


def image_findings(client: ClientFactory, config: HlatConfig, account: str) -> list[Finding]:
    try:
        images = stage_images(config)
    except (ConfigError, ValueError) as exc:
        return [Finding("image", False, str(exc))]
    findings = []
    for image, stages in images.items():
        what = f"{image} ({', '.join(stages)})"
        match = _IMAGE.match(image)
        if match is None:
            findings.append(Finding("image", True, f"{what}: not an ECR image; not checked", checked=False))
            continue
        if match["region"] != config.job.region:
            findings.append(
                Finding(
                    "image",
                    False,
                    f"{what} is in {match['region']}, job.region is {config.job.region}: SageMaker "
                    "pulls images of its own region; push it to ECR there",
                )
            )
            continue
        ident = {"imageTag": match["tag"] or "latest"} if not match["digest"] else {"imageDigest": match["digest"]}
        own = match["account"] == account
        try:
            client("ecr").describe_images(registryId=match["account"], repositoryName=match["repo"], imageIds=[ident])
            findings.append(Finding("image", True, f"{what} exists"))
        except ClientError as exc:
            code = error_code(exc)
            if code == "ImageNotFoundException" or (own and code == "RepositoryNotFoundException"):
                findings.append(
                    Finding(
                        "image",
                        False,
                        f"{what}: no such image in ECR ({code}); build and push it (docker push "
                        f"{image}) or fix the image setting",
                    )
                )
            elif not own and (code in DENIED or code == "RepositoryNotFoundException"):
                findings.append(
                    Finding(
                        "image",
                        True,
                        f"{what}: in account {match['account']}'s registry (AWS's own for its deep "
                        "learning containers), which this account may not describe; SageMaker pulls it with the "
                        "execution role",
                        checked=False,
                    )
                )
            elif code in DENIED:
                findings.append(
                    Finding("image", True, f"{what}: ecr:DescribeImages denied, not checked", checked=False)
                )
            else:
                raise
    return findings
