"""The spike tests' job hooks (HLAT_JOB_HOOKS=tests.spike_hooks): training/faults.py's faults, and a loss spike at the
steps HLAT_TEST_SPIKE_STEPS names ("8,9,10": the loss of each of those steps times SPIKE_FACTOR, at every run of the
step, as a bad batch would spike again after a resume). Installed through the hook point the NaN faults use
(training/hooks.py `loss_of_step`): no code that trains knows of it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hlat.core.run import Run
from hlat.training.faults import FaultHooks
from hlat.training.hooks import JobHooks

if TYPE_CHECKING:
    import torch


MODULE = "tests.spike_hooks"
SPIKE_STEPS = "HLAT_TEST_SPIKE_STEPS"
SPIKE_FACTOR = 10.0


def spike_steps() -> set[int]:
    return {int(s) for s in os.environ.get(SPIKE_STEPS, "").split(",") if s.strip()}


class SpikeHooks(FaultHooks):
    def loss_of_step(self, loss: torch.Tensor, run: Run, step: int) -> torch.Tensor:
        loss = super().loss_of_step(loss, run, step)
        return loss * SPIKE_FACTOR if step in spike_steps() else loss


def hooks() -> JobHooks:
    return SpikeHooks()
