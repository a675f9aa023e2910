"""Where the CLI's logs go: a quiet terminal, and the whole story in a log file.

The terminal shows Prefect's one-line records (run starts, stage headers, progress, states) but not the
tracebacks that Prefect attaches to a failed task or flow run: a failure inside a nested stage would otherwise
print one traceback per level (88 to 320 lines for one cause). Every record, tracebacks included, also goes to a
log file, `$HLAT_LOG_DIR` (default `~/.cache/hlat/logs`), one file per command; the CLI names it when a command
fails. `--verbose` keeps the tracebacks on the terminal as well.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from pathlib import Path

KEEP = 50  # the newest log files kept; older ones are removed when a new one is made
_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def log_dir() -> Path:
    if env := os.environ.get("HLAT_LOG_DIR"):
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "hlat" / "logs"


class _WithoutTraceback(logging.Formatter):
    """Formats a record as `inner` does, less its traceback and stack (the record itself is left untouched)."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        if not (record.exc_info or record.exc_text or record.stack_info):
            return self.inner.format(record)
        bare = logging.makeLogRecord(record.__dict__)
        bare.exc_info = bare.exc_text = bare.stack_info = None
        return self.inner.format(bare)


class CommandLog:
    """The log file of one CLI command, made on first use."""

    def __init__(self, command: str) -> None:
        self.command = command
        self._path: Path | None = None
        self._handler: logging.Handler | None = None

    @property
    def path(self) -> Path:
        if self._path is None:
            folder = log_dir()
            folder.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self._path = folder / f"{stamp}-{os.getpid()}-{self.command}.log"
            self._path.touch()
            _prune(folder)
        return self._path

    def attach(self, verbose: bool) -> None:
        """Send every log record to the file; unless `verbose`, strip tracebacks from the terminal's records."""
        # Prefect reads its settings once, when first imported: the flows' environment defaults (the ephemeral
        # server's start-up timeout, no telemetry) must be set before (seen: a fresh clone's first `hlat pretrain`
        # timed out after Prefect's default 20 s).
        importlib.import_module("hlat.flows")
        from prefect.logging.configuration import ensure_logging_setup
        from prefect.logging.handlers import PrefectConsoleHandler

        # Prefect's own set-up first: made later, it would see the file handler as the user's and drop its console.
        ensure_logging_setup()

        handler = logging.FileHandler(self.path, encoding="utf-8")
        handler.setFormatter(logging.Formatter(_FORMAT))
        self._handler = handler
        logging.getLogger().addHandler(handler)  # Prefect's run loggers and "hlat" propagate to the root
        if verbose:
            return
        for logger in _all_loggers():
            for h in logger.handlers:
                if isinstance(h, PrefectConsoleHandler) and not isinstance(h.formatter, _WithoutTraceback):
                    h.setFormatter(_WithoutTraceback(h.formatter or logging.Formatter()))

    def write(self, text: str) -> None:
        """Append text (a traceback) to the log file."""
        if self._handler is not None:
            self._handler.flush()
        with self.path.open("a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")


def _all_loggers() -> list[logging.Logger]:
    named = [v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)]
    return [logging.getLogger(), *named]


def _prune(folder: Path) -> None:
    logs = sorted(folder.glob("*.log"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in logs[KEEP:]:
        old.unlink(missing_ok=True)
