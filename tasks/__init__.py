"""Small typed Prefect tasks: each one retryable unit of work calling into `infra/` and `training/`.

Importing this package (the flows import it first) sets what Prefect reads when it loads."""

import logging
import os

# Route the plain `logging` records of infra/ and training/ ("hlat.*") into Prefect's run logs.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "hlat")
# The temporary server that Prefect starts for a flow run without PREFECT_API_URL must not phone home: offline it
# logs an ERROR ("Failed to send telemetry") on a healthy run. Set the variable to true to send it.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# ... and may take longer than Prefect's 20 s to answer on a loaded 2-core machine (seen: "Timed out while
# attempting to connect to ephemeral Prefect API server" while other jobs ran).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
# hlat.* records outside a flow run (a task called alone, a test) go to the terminal only, without a warning each.
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
logging.getLogger("hlat").setLevel(logging.INFO)


def _forward_to_flow_runs() -> None:
    """A worker's flow run configures Prefect's logging (prefect.engine) before the flow's module imports this
    package, so the variable above comes too late there, and the supervisor's progress lines never reached the run's
    logs (`prefect deployment run ... --watch` showed none). Give the `hlat` logger the handlers Prefect gives its
    extra loggers, as its own set-up would have."""
    from prefect.logging.configuration import PROCESS_LOGGING_CONFIG

    if not PROCESS_LOGGING_CONFIG:  # not configured yet: Prefect's own set-up reads the variable
        return
    ours = logging.getLogger("hlat")
    for handler in logging.getLogger("prefect.extra").handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)


_forward_to_flow_runs()

if __name__ != "hlat.tasks":  # one identity per module: pyproject.toml maps this folder to hlat.tasks
    raise ImportError(f"{__name__}: import this folder as hlat.tasks (`pip install -e .` maps it there)")
