"""Small typed Prefect tasks: each one retryable unit of work calling into `infra/` and `training/`."""

import logging
import os

# Route the plain `logging` records of infra/ and training/ ("hlat.*") into Prefect's run logs.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "hlat")
logging.getLogger("hlat").setLevel(logging.INFO)
