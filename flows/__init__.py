"""Thin Prefect flows chaining the tasks of each stage; the parent flow `hlat`; the `hlat` CLI."""

import logging
import os

# Route the plain `logging` records of infra/ and training/ ("hlat.*") into Prefect's run logs.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "hlat")
logging.getLogger("hlat").setLevel(logging.INFO)
