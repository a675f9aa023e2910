"""Loading a process's hook object: the no-op defaults, or the ones a module named by an environment variable gives.

Used by the training job's hook points (training/hooks.py, HLAT_JOB_HOOKS) and the local backend's (infra/job_daemon.py,
HLAT_BACKEND_HOOKS); tests name their fault modules there, production names none.
"""

from __future__ import annotations

import importlib
import os
from typing import TypeVar

H = TypeVar("H")


def load_hooks(variable: str, base: type[H]) -> H:
    """`base()` when `variable` is unset, else the `hooks()` of the module it names, which must return a `base`;
    a RuntimeError in one line otherwise."""
    name = os.environ.get(variable, "").strip()
    if not name:
        return base()
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise RuntimeError(f"{variable}={name}: cannot import it ({exc})") from None
    made = getattr(module, "hooks", None)
    installed = made() if callable(made) else None
    if not isinstance(installed, base):
        raise RuntimeError(f"{variable}={name}: the module has no hooks() returning a {base.__name__}")
    return installed
