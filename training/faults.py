"""Fault injection for chaos tests, switched on by environment variables only (never by config).

HLAT_FAULT_KILL_BEFORE_COMMIT=<step>: the process SIGKILLs itself while saving the checkpoint of that step,
after its files are written and before the commit marker: the torn checkpoint a crash can leave behind.
HLAT_FAULT_NAN_AT_STEP=<step>: the loss of that step (1-based) becomes NaN, once per run (a flag file in the
run's faults/ folder records it, so the relaunched job gets past it).
HLAT_FAULT_BURN_IN_WRONG_RANK=<rank>: in the burn-in program, that rank perturbs one element of its matmul result
before the checks, as a faulty device would (every burn-in run: the fault is the device's, not a one-off).
"""

from __future__ import annotations

import os
import signal

from hlat.core.layout import CHECKPOINT_MARKER
from hlat.core.storage import Storage
from hlat.training.checkpoint import step_dir

KILL_BEFORE_COMMIT = "HLAT_FAULT_KILL_BEFORE_COMMIT"
NAN_AT_STEP = "HLAT_FAULT_NAN_AT_STEP"
BURN_IN_WRONG_RANK = "HLAT_FAULT_BURN_IN_WRONG_RANK"


class KillBeforeCommit(Storage):
    """Checkpoint storage that dies just before writing the commit marker of one step."""

    def __init__(self, url: str, step: int) -> None:
        super().__init__(url)
        self.folder = f"{step_dir(step)}/"

    def write_bytes(self, rel: str, data: bytes) -> None:
        if rel.startswith(self.folder) and rel.endswith(CHECKPOINT_MARKER):
            os.kill(os.getpid(), signal.SIGKILL)
        super().write_bytes(rel, data)


def checkpoint_storage(storage: Storage) -> Storage:
    step = os.environ.get(KILL_BEFORE_COMMIT)
    return KillBeforeCommit(storage.url, int(step)) if step else storage


def inject_nan(run: Storage, step: int) -> bool:
    """True once per run at the step named by HLAT_FAULT_NAN_AT_STEP."""
    wanted = os.environ.get(NAN_AT_STEP)
    flag = f"faults/nan-{step}"
    if not wanted or int(wanted) != step or run.exists(flag):
        return False
    run.write_text(flag, "injected\n")
    return True


def burn_in_wrong_rank(rank: int) -> bool:
    """True on the rank named by HLAT_FAULT_BURN_IN_WRONG_RANK: its burn-in matmul result is to be corrupted."""
    wanted = os.environ.get(BURN_IN_WRONG_RANK)
    return wanted is not None and wanted != "" and int(wanted) == rank
