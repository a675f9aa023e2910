"""The SageMaker training-container contract, where a job honours it.

Inside SageMaker (SM_* variables set), checkpoints go to the local folder SageMaker keeps in sync with the
job's CheckpointConfig S3 URI (`/opt/ml/checkpoints`, or SM_CHECKPOINT_DIR), which the job backend pins to
the run's checkpoints/ prefix; TensorBoard events go to /opt/ml/output/tensorboard, SageMaker's default.
Elsewhere both live in run storage (TensorBoard only when run storage is local).
"""

from __future__ import annotations

import os

from infra.storage import Storage

SAGEMAKER_CHECKPOINT_DIR = "/opt/ml/checkpoints"
SAGEMAKER_TENSORBOARD_DIR = "/opt/ml/output/tensorboard"


def in_sagemaker() -> bool:
    return "SM_TRAINING_ENV" in os.environ or "SM_CURRENT_HOST" in os.environ


def checkpoint_location(run: Storage) -> Storage:
    if "HLAT_CHECKPOINT_DIR" in os.environ:
        return Storage(os.environ["HLAT_CHECKPOINT_DIR"])
    if in_sagemaker():
        return Storage(os.environ.get("SM_CHECKPOINT_DIR", SAGEMAKER_CHECKPOINT_DIR))
    return run.child("checkpoints")


def tensorboard_location(run: Storage) -> str | None:
    if in_sagemaker():
        return os.environ.get("SM_TENSORBOARD_DIR", SAGEMAKER_TENSORBOARD_DIR)
    return run.path("tensorboard") if run.is_local else None
