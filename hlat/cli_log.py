"""Where the CLI's logs go: a quiet terminal, and the whole story in a log file.

The terminal shows Prefect's one-line records without tracebacks, since a nested failure would print one per level.
Every record also goes to one file per command under `$HLAT_LOG_DIR`; `--verbose` keeps tracebacks on the terminal.
Ctrl-C and `hlat stop` are no failure: `Interruptions` holds back Prefect's crash and failure records for them, and
`cancel()` marks those runs `Cancelled`.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from pathlib import Path
from uuid import UUID

# Prefect is imported in the functions that use it: `hlat.cli` imports this module for every command, --help included.

KEEP = 50  # the newest log files kept; older ones are removed when a new one is made
_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
INTERRUPTED = "Execution was aborted by an interrupt signal."
"""Prefect's message for a run ended by KeyboardInterrupt (prefect.states.exception_to_crashed_state)."""
CANCELLED_MESSAGE = "Interrupted (Ctrl-C): its job was stopped at a checkpoint; run the same command to resume"
USER_STOP = "StoppedByUser"
"""The exception a stage raises when `hlat stop` stopped its job (infra.supervision.errors.StoppedByUser)."""
USER_STOP_MESSAGE = "Stopped by hlat stop at a checkpoint; run the same command to go on"


class Interruptions(logging.Filter):
    """On Prefect's run loggers: drops the records of a run crashed by Ctrl-C or failed by `hlat stop`.

    It keeps each such run's id for `cancel`."""

    LOGGERS = ("prefect.flow_runs", "prefect.task_runs")

    def __init__(self) -> None:
        super().__init__()
        self.flow_runs: list[str] = []
        self.task_runs: list[str] = []
        self.user_stop = False

    def install(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        interrupted = INTERRUPTED in message and (message.startswith("Crash detected!") or "Crashed(" in message)
        stopped = USER_STOP in message
        if not (interrupted or stopped):
            return True
        self.user_stop = self.user_stop or stopped
        for attr, ids in (("flow_run_id", self.flow_runs), ("task_run_id", self.task_runs)):
            run_id = getattr(record, attr, None)
            if run_id is not None and attr[:4] in record.name and str(run_id) not in ids:
                ids.append(str(run_id))
        return False

    def cancel(self) -> None:
        """Set the interrupted runs Cancelled (Prefect marked them Crashed); a failure is a line in the log file."""
        if not (self.flow_runs or self.task_runs):
            return
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled

        message = USER_STOP_MESSAGE if self.user_stop else CANCELLED_MESSAGE
        try:
            with get_client(sync_client=True) as client:
                for task_run in self.task_runs:
                    client.set_task_run_state(UUID(task_run), Cancelled(message=message), force=True)
                for flow_run in self.flow_runs:
                    client.set_flow_run_state(UUID(flow_run), Cancelled(message=message), force=True)
        except Exception as exc:  # the API may be gone with the interruption: the run stays Crashed
            logging.getLogger("hlat.cli").debug("could not mark the interrupted runs Cancelled: %s", exc)


def log_dir() -> Path:
    if env := os.environ.get("HLAT_LOG_DIR"):
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "hlat" / "logs"


class _WithoutTraceback(logging.Formatter):
    """Formats a record as `inner` does, less its traceback and stack; the record is left untouched."""

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
        self.interruptions = Interruptions()

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
        # Prefect reads its settings once, at first import, so the flows' environment defaults are set before it.
        importlib.import_module("hlat.flows")
        from prefect.logging.configuration import ensure_logging_setup
        from prefect.logging.handlers import PrefectConsoleHandler

        # Prefect's own set-up first: made later, it would see the file handler as the user's and drop its console.
        ensure_logging_setup()

        handler = logging.FileHandler(self.path, encoding="utf-8")
        handler.setFormatter(logging.Formatter(_FORMAT))
        self._handler = handler
        logging.getLogger().addHandler(handler)  # Prefect's run loggers and "hlat" propagate to the root
        self.interruptions.install()
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
