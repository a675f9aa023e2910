"""What every stage flow starts with: resolve the config and claim the run's storage prefix."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.runtime import flow_run

from hlat.core.config import ConfigError, HlatConfig
from hlat.core.presets import load_config
from hlat.flows.params import overrides_dict
from hlat.infra.backends import job_python
from hlat.infra.runs import Run, open_run
from hlat.tasks import aws
from hlat.tasks.common import TRANSIENT_RETRIES


@task(name="open-run", **TRANSIENT_RETRIES)
def open_run_task(config: HlatConfig) -> Run:
    """Write <run>/config.json once, or check it matches."""
    return open_run(config)


def deployment_overrides(deployment_id: Any = None) -> dict[str, Any]:
    """The `overrides` parameter of the deployment this flow run (or `deployment_id`) comes from; {} for a run
    started without a deployment."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import deployment

    deployment_id = deployment_id or deployment.id
    if not deployment_id:
        return {}
    with get_client(sync_client=True) as client:
        parameters = client.read_deployment(deployment_id).parameters
    return overrides_dict(parameters.get("overrides"))


def merged_overrides(overrides: Any, deployment_id: Any = None) -> dict[str, Any]:
    """A flow run's overrides over its deployment's (see resolve_config)."""
    return {**deployment_overrides(deployment_id), **overrides_dict(overrides)}


def resolve_config(
    preset: str, overrides: Any, run_id: str | None, storage: str | None, deployment_id: Any = None
) -> HlatConfig:
    """A flow run's config from its parameters (the overrides model, or the dict a flow run stores), with the
    AwsCredentials block it names, if any, made this process's AWS credentials.

    A deployment run's `overrides` are merged over the deployment's own: `--param overrides='{...}'` changes the
    paths it names and keeps the deployment's others (its job.role_arn_secret, say), where Prefect would replace
    the whole parameter."""
    changes = merged_overrides(overrides, deployment_id)
    given = {"run_id": run_id, "storage": storage, **{f"overrides[{k!r}]": v for k, v in changes.items()}}
    unfilled = [f"{name}={value!r}" for name, value in given.items() if isinstance(value, str) and "{{" in value]
    if unfilled:
        raise ConfigError(
            f"{', '.join(unfilled)}: a deployment placeholder was never filled in; set the variable it names before "
            "`hlat deploy` (deployments/prefect.yaml lists them), or give the value as a parameter of this run"
        )
    config = load_config(preset, changes, run_id=run_id, storage=storage)
    job_python(config, "train")  # training.device=xla without the XLA environment: say so before any stage runs
    aws.activate(config.job)  # before the first AWS call (the run's storage)
    return config


def resolve(preset: str, overrides: Any, run_id: str | None, storage: str | None) -> tuple[HlatConfig, Run]:
    """The run's config and its run; the SageMaker role is read from its Secret block after config.json is written
    (which keeps the block's name, not its value)."""
    config = resolve_config(preset, overrides, run_id, storage)
    from hlat.infra.backends import preflight

    preflight(config)  # what SageMaker would refuse (an instance type's typo...): before any stage, and config.json
    run = open_run_task(config)
    return aws.with_role(config).model_copy(update={"run_id": run.run_id}), run


def stop_jobs_on_cancel(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation hook of every flow that runs jobs: a job must not outlive a cancelled flow run (a crash,
    by contrast, leaves it running for the next flow run to re-attach to)."""
    import logging

    from hlat.infra.backends import stop_live_jobs

    params = flow_run.parameters
    config = resolve_config(
        params.get("preset", "tiny"),
        params.get("overrides"),
        params.get("run_id"),
        params.get("storage"),
        deployment_id=flow_run.deployment_id,
    )
    stopped = stop_live_jobs(config)
    logging.getLogger("hlat.jobs").warning("flow run cancelled: stopped %s", ", ".join(stopped) or "no running job")


def run_name() -> str:
    """Flow-run name: '<flow>/<run id or preset>' so the UI lists runs by what they build."""
    params = flow_run.parameters
    return f"{flow_run.flow_name}/{params.get('run_id') or params.get('preset', 'run')}"
