"""The `hlat` logger reaches a flow run's logs even when Prefect set its logging up first, as a worker's flow run
does (prefect.engine configures logging before the flow's module imports hlat.tasks)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, os
os.environ.pop("PREFECT_LOGGING_EXTRA_LOGGERS", None)
from prefect.logging.configuration import setup_logging
from prefect.logging.handlers import APILogHandler
setup_logging()  # what the engine does before it loads the flow
assert not any(isinstance(h, APILogHandler) for h in logging.getLogger("hlat").handlers)
import hlat.tasks  # noqa: F401
handlers = logging.getLogger("hlat").handlers
assert sum(isinstance(h, APILogHandler) for h in handlers) == 1, handlers
setup_logging()  # a later set-up (incremental) adds no second copy
assert sum(isinstance(h, APILogHandler) for h in logging.getLogger("hlat").handlers) == 1
print("ok")
"""


def test_the_hlat_logger_gets_the_api_handler_when_prefect_configured_logging_first() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
