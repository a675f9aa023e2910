"""Which failures the CLI shows as one line: the user-facing errors of every layer.

`hlat.cli` imports this module only when a command fails: the layers it names are heavy.
"""

from __future__ import annotations

from hlat.core.storage import StorageError
from hlat.deploy import DeployError
from hlat.infra.supervision.errors import StoppedByUser, SupervisorError
from hlat.tasks.burn_in import BurnInFailed
from hlat.training.checkpoint import CheckpointError
from hlat.training.data.sources import SourceError
from hlat.training.data.validation import DataValidationError

KNOWN_ERRORS = (
    DeployError,
    SourceError,
    StorageError,
    DataValidationError,
    SupervisorError,
    BurnInFailed,
    CheckpointError,
    ValueError,
)


def stopped_by_user(exc: BaseException) -> bool:
    """`hlat stop` from another terminal ended the command: a deliberate end, not a failure."""
    return isinstance(exc, StoppedByUser)


def known_error(exc: BaseException) -> str | None:
    """User-facing errors print as one line; anything else keeps its traceback."""
    if isinstance(exc, KNOWN_ERRORS):
        return str(exc)
    return None
