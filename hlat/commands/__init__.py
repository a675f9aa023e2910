"""The CLI's commands, a few per module; `hlat.cli` parses and imports a command's module when it runs.

Each module imports what its commands need at its top. No module here imports `hlat.cli`.
"""

from __future__ import annotations


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a flow, with what the user needs to know: where the run stands, and how to go on."""
