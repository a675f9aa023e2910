"""The training images SageMaker jobs run on, and the SageMaker SDK that knows them.

Images come from the SDK's own image table, so new regions arrive with the SDK. The SDK is imported on first
use (`import_sdk`): local runs should not pay for it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hlat.core.config import DEFAULT_NEURON_SDK, JobConfig
from hlat.core.environment import NEURON_SDKS
from hlat.infra.backends.protocol import JobSpec

NEURON_DLC_REPOSITORY = "pytorch-training-neuronx"
"""The Neuron PyTorch training images used when `job.image_uri` is None, one tag per Neuron SDK release
(`NeuronSdk.image_tag`: 2.9.0-neuronx-py312-sdk2.28.0-ubuntu24.04 by default, neuron.sdk=2.28.0)."""

GPU_DLC_VERSION = "2.10.0"
"""PyTorch version of the GPU training image that evaluation jobs on GPU instances use by default."""

DLC_ACCOUNT = "763104351884"
"""AWS's deep-learning-container images' account (most regions): the default images, which lack hlat's requirements."""


def import_sdk() -> Any:
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
    sdk = import_sdk()
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
    sdk = import_sdk()
    image: str = sdk.image_uris.retrieve(
        "pytorch", region, version=GPU_DLC_VERSION, instance_type=instance_type, image_scope="training"
    )
    return image


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
