"""Hook points of a job's processes: the places where a test may change what a job does, with no-op defaults.

Production code calls `hooks().<point>(...)` and gets `JobHooks`, whose every method leaves the job as it is. A test
session sets HLAT_JOB_HOOKS to a module's name (read once per process); that module's `hooks()` returns a `JobHooks`
subclass, which every process of the jobs the session starts uses instead (the variable is inherited, and emulated
hosts pass HLAT_* variables on). `hlat.training.faults` is the one the tests use: its faults (a torn checkpoint, a
NaN loss, a slow step or link, a wrong matmul) live there, never in the code that trains.

The points are named for what they let a hook change, not for any fault.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from hlat.core.hooks import load_hooks
from hlat.core.run import Run
from hlat.core.storage import Storage

if TYPE_CHECKING:
    import torch

    from hlat.training.data.reader import Unit

HOOKS_ENV = "HLAT_JOB_HOOKS"
"""The module whose `hooks()` this process uses (unset: the no-op `JobHooks`)."""


class JobHooks:
    """The hook points, each a no-op: a subclass overrides the ones it needs."""

    def checkpoint_storage(self, storage: Storage, rank: int | None = None) -> Storage:
        """Where the training job writes its checkpoints: `storage`, or a Storage of the same place that writes
        differently (`rank`: this process's, by default torchrun's RANK)."""
        return storage

    def step_seconds(self) -> float | None:
        """The least time an optimizer step takes, the loop sleeping on the host after the step's work is launched
        (None: as long as the step takes)."""
        return None

    def after_step(self, step: int, rank: int) -> None:
        """Called on rank `rank` once optimizer step `step` (1-based) is launched, before its boundary: a hook may
        hold the rank there (nothing by default)."""

    def loss_of_step(self, loss: torch.Tensor, run: Run, step: int) -> torch.Tensor:
        """The loss of optimizer step `step` (1-based) of `run`, on the main rank, before it is averaged and used."""
        return loss

    def collective_delay(self) -> float:
        """Seconds added, on the host, to each timed all-reduce of a health check (0: none)."""
        return 0.0

    def matmul_corrupted(self, rank: int) -> bool:
        """Whether the burn-in matmul check of `rank` perturbs one element of its result, as a faulty device would."""
        return False

    def prepared_batch(self, worker: int, life: int, job: str) -> Callable[[Unit, int], None] | None:
        """What a prepare-data worker (`worker`, in its `life`-th process, of job `job`) calls after each batch it
        reads, with the unit and the rows read in it so far (None: nothing)."""
        return None


@functools.cache
def hooks() -> JobHooks:
    """This process's hooks: the no-op defaults, or those of the module HLAT_JOB_HOOKS names (read once)."""
    return load_hooks(HOOKS_ENV, JobHooks)
