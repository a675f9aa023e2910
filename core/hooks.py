"""Loading a process's hook object: the no-op defaults, or those of a module an environment variable names.

The training job reads HLAT_JOB_HOOKS (training/hooks.py), the local backend HLAT_BACKEND_HOOKS
(infra/backends/local_daemon.py).
Tests name their fault modules there; production names none.
"""

from __future__ import annotations

import importlib
import os
from typing import TypeVar

H = TypeVar("H")


def load_hooks(variable: str, base: type[H]) -> H:
    """`base()` when `variable` is unset, else the named module's `hooks()`, which must return a `base`.
    Anything else raises a one-line RuntimeError."""
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
