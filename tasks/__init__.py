"""Small typed Prefect tasks: each one retryable unit of work calling into `infra/` and `training/`."""

import logging
import os

# Route the plain `logging` records of infra/ and training/ ("hlat.*") into Prefect's run logs.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "hlat")
# The temporary server that Prefect starts for a flow run without PREFECT_API_URL must not phone home: offline it
# logs an ERROR ("Failed to send telemetry") on a healthy run. Set the variable to true to send it.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
logging.getLogger("hlat").setLevel(logging.INFO)
