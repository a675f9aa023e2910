"""The preflight of a SageMaker run's requests and spend, before any stage runs.

The requests its jobs would send are checked against the service model; nothing is sent or uploaded. Then the
budget and the account's ceilings. A typo then fails the flow run at once, not after data preparation."""

from __future__ import annotations

import dataclasses

from hlat.core.config import HlatConfig
from hlat.core.run import run_for
from hlat.infra.backends.sagemaker import SageMakerBackend
from hlat.infra.backends.sagemaker_validation import check_request
from hlat.infra.cost.budget import budget, check_spend
from hlat.infra.stage_jobs import job_spec


def preflight(config: HlatConfig) -> None:
    """Check the values of a SageMaker run's config that its jobs' requests carry (instance types, role ARN, the
    S3 URIs under storage.root...) against the service model, before any stage runs: a typo then fails the flow
    run at once, not after data preparation. Settings not given yet (no role) are left to the stage that needs
    them; nothing is sent or uploaded. Then the budget: a SageMaker run with no job.budget_usd and no estimate to
    default one from is refused here, and so is one over the account's ceiling (`check_spend`)."""
    if config.job.backend != "sagemaker":
        return
    if config.storage.root.startswith("s3://"):
        _check_requests(config)
    budget(config)  # refuses a run with neither a budget nor an estimate to default one from
    check_spend(config)  # the account's ceiling, whatever the run's parameters say


def _check_requests(config: HlatConfig) -> None:
    backend = SageMakerBackend(config.job)  # boto3 clients are made, nothing is called
    spec = job_spec(run_for(config), attempt=1)
    check_request("CreateTrainingJob", backend.config_request(spec), "train", partial=True)
    # The evaluation job's own instance type and image, without job_spec's default GPU image (which would import
    # the SageMaker SDK: seconds, for a value AWS's own table made).
    e = config.evaluation
    evaluating = dataclasses.replace(
        spec, stage="evaluate", instance_type=e.instance_type or config.job.instance_type, image_uri=e.image_uri
    )
    check_request("CreateTrainingJob", backend.config_request(evaluating), "evaluate", partial=True)
