"""Fault injection for chaos tests: the `JobHooks` that HLAT_JOB_HOOKS=hlat.training.faults installs.

Each fault is switched on by an environment variable only, never by config. No production module imports this one.

    HLAT_FAULT_KILL_BEFORE_COMMIT=<step>      SIGKILL after that step's files, before its commit marker.
    HLAT_FAULT_NAN_AT_STEP=<step>             that step's loss is NaN, once per run (a flag file remembers).
    HLAT_FAULT_BURN_IN_WRONG_RANK=<rank>      that rank's burn-in matmul result is perturbed, every run.
    HLAT_FAULT_STEP_SECONDS=<s>               each step takes about s seconds (a host sleep, no device work).
    HLAT_FAULT_SAVE_SECONDS=<s>               each checkpoint file write starts s seconds later.
    HLAT_FAULT_ALLREDUCE_SECONDS=<s>          each timed health all-reduce takes s seconds longer.
    HLAT_FAULT_HANG_AT_STEP=<step>:<rank>     that rank blocks for good in that step; only the watchdog ends it.
    HLAT_FAULT_SAVE_FAILS=<step>:<rank>       that rank's rank-file write of that step fails with OSError.
    HLAT_PREPARE_FAULTS='{"worker": 1, "life": 1, "after_rows": 200}'
                                              that prepare-data worker SIGKILLs itself after so many rows.
                                              "job" and "unit_at_least" narrow it further.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any

from hlat.core.layout import CHECKPOINT_MARKER
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training.checkpoint import rank_file, step_dir
from hlat.training.hooks import JobHooks

if TYPE_CHECKING:
    import torch

    from hlat.training.data.reader import Unit

log = logging.getLogger(__name__)

KILL_BEFORE_COMMIT = "HLAT_FAULT_KILL_BEFORE_COMMIT"
NAN_AT_STEP = "HLAT_FAULT_NAN_AT_STEP"
BURN_IN_WRONG_RANK = "HLAT_FAULT_BURN_IN_WRONG_RANK"
STEP_SECONDS = "HLAT_FAULT_STEP_SECONDS"
SAVE_SECONDS = "HLAT_FAULT_SAVE_SECONDS"
SAVE_FAILS = "HLAT_FAULT_SAVE_FAILS"
ALLREDUCE_SECONDS = "HLAT_FAULT_ALLREDUCE_SECONDS"
HANG_AT_STEP = "HLAT_FAULT_HANG_AT_STEP"
PREPARE_FAULTS = "HLAT_PREPARE_FAULTS"


class FaultyCheckpoints(Storage):
    """Checkpoint storage with the faults above: kill before a commit, slow each file, or fail one rank file."""

    def __init__(
        self,
        url: str,
        kill_before_commit: int | None = None,
        save_seconds: float = 0.0,
        fail_file: str | None = None,
    ) -> None:
        super().__init__(url)
        self.kill_folder = f"{step_dir(kill_before_commit)}/" if kill_before_commit is not None else None
        self.save_seconds = save_seconds
        self.fail_file = fail_file

    def write_bytes(self, rel: str, data: bytes) -> None:
        if self.kill_folder and rel.startswith(self.kill_folder) and rel.endswith(CHECKPOINT_MARKER):
            os.kill(os.getpid(), signal.SIGKILL)
        super().write_bytes(rel, data)

    @contextmanager
    def atomic_writer(self, rel: str, part_size: int | None = None) -> Iterator[IO[bytes]]:
        if rel == self.fail_file:
            raise OSError(f"{self.uri(rel)}: injected write failure ({SAVE_FAILS})")
        if self.save_seconds:
            time.sleep(self.save_seconds)
        with super().atomic_writer(rel, part_size) as sink:
            yield sink


def checkpoint_storage(storage: Storage, rank: int | None = None) -> Storage:
    """`storage`, or the same place with the environment's faults (`rank`: this process's, by default RANK)."""
    kill = os.environ.get(KILL_BEFORE_COMMIT)
    slow = float(os.environ.get(SAVE_SECONDS) or 0)
    fail_file = None
    if fails := os.environ.get(SAVE_FAILS):
        step, _, which = fails.partition(":")
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        if int(which or 0) == rank:
            fail_file = f"{step_dir(int(step))}/{rank_file(rank)}"
    if not (kill or slow or fail_file):
        return storage
    return FaultyCheckpoints(storage.url, int(kill) if kill else None, slow, fail_file)


def step_seconds() -> float | None:
    """The step time HLAT_FAULT_STEP_SECONDS asks for (None: no slowing)."""
    value = os.environ.get(STEP_SECONDS)
    return float(value) if value else None


def allreduce_delay() -> float:
    """Seconds HLAT_FAULT_ALLREDUCE_SECONDS adds to each timed all-reduce of a health check (0: none)."""
    return float(os.environ.get(ALLREDUCE_SECONDS) or 0)


def hang_at_step(step: int, rank: int) -> None:
    """Block this thread for good when HLAT_FAULT_HANG_AT_STEP names this step and rank (a wait nothing ends)."""
    wanted = os.environ.get(HANG_AT_STEP)
    if not wanted:
        return
    at, _, which = wanted.partition(":")
    if int(at) == step and int(which or 0) == rank:
        log.warning("fault: rank %d hangs in step %d (%s)", rank, step, HANG_AT_STEP)
        threading.Event().wait()


def inject_nan(run: Run, step: int) -> bool:
    """True once per run at the step named by HLAT_FAULT_NAN_AT_STEP."""
    wanted = os.environ.get(NAN_AT_STEP)
    flag = f"faults/nan-{step}"
    if not wanted or int(wanted) != step or run.storage.exists(flag):
        return False
    run.storage.write_text(flag, "injected\n")
    return True


def burn_in_wrong_rank(rank: int) -> bool:
    """True on the rank named by HLAT_FAULT_BURN_IN_WRONG_RANK: its burn-in matmul result is to be corrupted."""
    wanted = os.environ.get(BURN_IN_WRONG_RANK)
    return wanted is not None and wanted != "" and int(wanted) == rank


def prepare_worker_fault(worker: int, life: int, job: str) -> Callable[[Unit, int], None] | None:
    """The per-batch check that SIGKILLs this prepare-data worker as HLAT_PREPARE_FAULTS asks (None: not this one)."""
    fault: dict[str, Any] = json.loads(os.environ.get(PREPARE_FAULTS) or "{}")
    if not (fault.get("worker") == worker and fault.get("life", 1) == life and fault.get("job", job) == job):
        return None

    def check(unit: Unit, rows: int) -> None:
        if unit.index >= int(fault.get("unit_at_least", 0)) and rows >= int(fault.get("after_rows", 0)):
            log.warning("fault: SIGKILL in unit %d after %d rows", unit.index, rows)
            os.kill(os.getpid(), signal.SIGKILL)

    return check


class FaultHooks(JobHooks):
    """The job's hook points, with the faults the environment asks for (see the module docstring)."""

    def checkpoint_storage(self, storage: Storage, rank: int | None = None) -> Storage:
        return checkpoint_storage(storage, rank)

    def step_seconds(self) -> float | None:
        return step_seconds()

    def after_step(self, step: int, rank: int) -> None:
        hang_at_step(step, rank)

    def loss_of_step(self, loss: torch.Tensor, run: Run, step: int) -> torch.Tensor:
        return loss * float("nan") if inject_nan(run, step) else loss

    def collective_delay(self) -> float:
        return allreduce_delay()

    def matmul_corrupted(self, rank: int) -> bool:
        return burn_in_wrong_rank(rank)

    def prepared_batch(self, worker: int, life: int, job: str) -> Callable[[Unit, int], None] | None:
        return prepare_worker_fault(worker, life, job)


def hooks() -> JobHooks:
    """The hooks HLAT_JOB_HOOKS=hlat.training.faults installs (training/hooks.py)."""
    return FaultHooks()
