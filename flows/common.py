"""What every stage flow starts with: resolve the config and claim the run's storage prefix."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.runtime import flow_run

from flows.params import overrides_dict
from infra import aws
from infra.runs import Run, open_run
from tasks.common import TRANSIENT_RETRIES
from training.config import ConfigError, HlatConfig
from training.presets import load_config


@task(name="open-run", **TRANSIENT_RETRIES)
def open_run_task(config: HlatConfig) -> Run:
    """Write <run>/config.json once, or check it matches."""
    return open_run(config)


def resolve(preset: str, overrides: Any, run_id: str | None, storage: str | None) -> tuple[HlatConfig, Run]:
    """The run's config (preset, then the overrides model or dict of dotted paths, run id, storage) and its run."""
    changes = overrides_dict(overrides)
    given = {"run_id": run_id, "storage": storage, **{f"overrides[{k!r}]": v for k, v in changes.items()}}
    unfilled = [f"{name}={value!r}" for name, value in given.items() if isinstance(value, str) and "{{" in value]
    if unfilled:
        raise ConfigError(
            f"{', '.join(unfilled)}: a deployment placeholder was never filled in; set the variable it names before "
            "`hlat deploy` (deployments/prefect.yaml lists them), or give the value as a parameter of this run"
        )
    config = load_config(preset, changes, run_id=run_id, storage=storage)
    aws.activate(config.job)  # the AwsCredentials block, if any, before the first AWS call (the run's storage)
    run = open_run_task(config)
    return config.model_copy(update={"run_id": run.run_id}), run


def stop_jobs_on_cancel(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation hook of every flow that runs jobs: a job must not outlive a cancelled flow run (a crash,
    by contrast, leaves it running for the next flow run to re-attach to)."""
    import logging

    from infra.backends import stop_live_jobs

    params = flow_run.parameters
    preset, overrides = params.get("preset", "tiny"), overrides_dict(params.get("overrides"))
    config = load_config(preset, overrides, run_id=params.get("run_id"), storage=params.get("storage"))
    aws.activate(config.job)  # a hook runs in a fresh context: the run's credentials again, to stop its jobs
    stopped = stop_live_jobs(config)
    logging.getLogger("hlat.jobs").warning("flow run cancelled: stopped %s", ", ".join(stopped) or "no running job")


def run_name() -> str:
    """Flow-run name: '<flow>/<run id or preset>' so the UI lists runs by what they build."""
    params = flow_run.parameters
    return f"{flow_run.flow_name}/{params.get('run_id') or params.get('preset', 'run')}"
