"""The stage flows' one template (`stage_flow`: parameters, the run, cancel hook), and what every stage starts
with: its run (id, storage and config, built once)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from prefect import Flow, flow, task
from prefect.runtime import flow_run
from prefect.utilities.hashing import file_hash

from hlat.core.config import DataConfig, HlatConfig
from hlat.core.run import Run, check_run, continued, open_run
from hlat.core.stages import stage
from hlat.flows.params import (
    OVERRIDES,
    PRESET,
    RUN_ID,
    STORAGE,
    OptionalText,
    Overrides,
    PresetName,
    build_config,
    overrides_dict,
)
from hlat.infra.checks.preflight import require_aws, require_sources
from hlat.infra.stage_jobs import job_python
from hlat.infra.supervision.lease import set_identity
from hlat.tasks import aws
from hlat.tasks.caching import TRANSIENT_RETRIES


@task(name="open-run", **TRANSIENT_RETRIES)
def open_run_task(config: HlatConfig) -> Run:
    """Write <run>/config.json once, or check it matches."""
    return open_run(config)


# How a run's config travels: it is built once, from a preset and overrides, by `build_config` (flows/params.py):
# the CLI builds it (a bad --set fails before a server starts) and hands it to the flow it starts; that flow (the
# parent `hlat`, or a stage started alone) opens the run with it, writing <run>/config.json, and holds the Run (id,
# storage, config); the parent's stages are handed that Run (`stages_of`). Its tasks and jobs get the Run; a job reads
# config.json. A flow started without the CLI (a deployment, the UI, a test) builds the config itself, through the
# same function.
_OPEN_RUN: ContextVar[Run | None] = ContextVar("hlat_open_run", default=None)


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
    """A flow run's overrides over its deployment's (see resolve)."""
    return {**deployment_overrides(deployment_id), **overrides_dict(overrides)}


@contextmanager
def stages_of(run: Run) -> Iterator[None]:
    """While the parent flow runs its stages: they take `run` (opened by the parent) instead of building the config
    again."""
    token = _OPEN_RUN.set(run)
    try:
        yield
    finally:
        _OPEN_RUN.reset(token)


def _activate(config: HlatConfig) -> None:
    job_python(config, "train")  # training.device=xla without the XLA environment: say so before any stage runs
    aws.activate(config.job)  # before the first AWS call (the run's storage)


def resolve(preset: str, overrides: Any, run_id: str | None, storage: str | None, *, reads_source: bool = False) -> Run:
    """What every stage flow starts with: its run. A stage of the parent flow is handed the run the parent opened
    (`stages_of`); a stage started on its own starts the run itself (start_run).

    A deployment run's `overrides` are merged over the deployment's own: `--param overrides='{...}'` changes the
    paths it names and keeps the deployment's others (its job.role_arn_secret, say), where Prefect would replace
    the whole parameter."""
    opened = _OPEN_RUN.get()
    if opened is not None and opened.run_id == run_id:
        return opened
    return start_run(preset, merged_overrides(overrides), run_id, storage, reads_source=reads_source)


def source_shape(data: DataConfig) -> str:
    """data.source's kind ('builtin', 'local', 's3', 'hub') once its shape is checked without reading it: the
    preflight's `shape` (infra cannot import training/)."""
    from hlat.training.data.sources import check_source, source_kind

    check_source(data)
    return source_kind(data.source)


def start_run(
    preset: str, changes: dict[str, Any], run_id: str | None, storage: str | None, *, reads_source: bool = True
) -> Run:
    """Build the config (build_config), check before anything is written what would fail later, and open the run
    (its config.json written once, or checked):
    - what SageMaker would refuse (an instance type's typo...), and a config the run's config.json refuses
      (`check_run`); a default run that was extended in place is continued (`continued`);
    - the live preflight (infra/checks/preflight.py): the data source can be read (when the flow reads it,
      `reads_source`), and for a SageMaker run the caller, role, PassRole, storage, images, quotas and training
      plan. A failure raises PreflightFailed, one line per failure.
    The SageMaker role is read from its Secret block for the preflight, and config.json keeps the block's name,
    not its value: the Run returned holds the live config (the role read, the run id filled in)."""
    config = continued(build_config(preset, changes, run_id, storage))
    _activate(config)
    from hlat.infra.checks.requests import preflight

    preflight(config)
    check_run(config)
    live = aws.with_role(config)
    if reads_source:
        require_sources(config, source_shape)
    require_aws(live)
    run = open_run_task(config)
    return run.with_config(live)


def stop_jobs_on_cancel(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation hook of every flow that runs jobs: a job must not outlive a cancelled flow run (a crash,
    by contrast, leaves it running for the next flow run to re-attach to)."""
    import logging

    from hlat.infra.stage_jobs import stop_live_jobs

    params = flow_run.parameters
    changes = merged_overrides(params.get("overrides"), flow_run.deployment_id)
    config = build_config(params.get("preset", "tiny"), changes, params.get("run_id"), params.get("storage"))
    aws.activate(config.job)
    stopped = stop_live_jobs(config)
    logging.getLogger("hlat.jobs").warning("flow run cancelled: stopped %s", ", ".join(stopped) or "no running job")


def flow_run_identity() -> tuple[str | None, str | None]:
    """Who supervises, for the heartbeat of a stage's supervisor (infra.supervision.supervisor): this flow run, and the
    deployment it came from ('deployment pretrain-7b'); the `hlat` command replaces this with its own name."""
    from prefect.runtime import deployment

    name = deployment.name
    return (flow_run.id or None), (f"deployment {name}" if name else None)


set_identity(flow_run_identity)


def run_name() -> str:
    """Flow-run name: '<flow>/<run id or preset>' so the UI lists runs by what they build."""
    params = flow_run.parameters
    return f"{flow_run.flow_name}/{params.get('run_id') or params.get('preset', 'run')}"


R = TypeVar("R")

# The parameters every flow takes, in this order (flows/params.py: their types and the UI's descriptions).
STAGE_PARAMETERS = tuple(
    inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)
    for name, default, annotation in (
        ("preset", PRESET, PresetName),
        ("run_id", RUN_ID, OptionalText),
        ("storage", STORAGE, OptionalText),
        ("overrides", OVERRIDES, Overrides),
    )
)


def stage_flow(name: str, *, stops_jobs: bool = True) -> Callable[[Callable[..., R]], Flow[..., R]]:
    """Decorator: the Prefect flow of stage `name` (a row of core/stages.py) from its body, `body(run, *extra)`.

    The flow takes the four parameters every flow takes (STAGE_PARAMETERS), then the body's own after `run`
    (evaluate's `step`); Prefect reads that signature for the UI's form and the parameters' validation. It resolves
    the run (`resolve`) and calls the body with it. Its runs are named for the run they build (`run_name`), print to
    the run's log, and when `stops_jobs`, a cancelled run stops the stage's jobs. The flow's version is the hash of
    the body's file, as Prefect gives a flow written by hand."""

    # A stage the table does not know fails at import; the stage that reads data.source checks it first.
    reads_source = stage(name).prepares_sources

    def make(body: Callable[..., R]) -> Flow[..., R]:
        declared = inspect.signature(body, eval_str=True)
        own = list(declared.parameters.values())
        if [p.name for p in own[:1]] != ["run"]:
            raise TypeError(f"{body.__qualname__}: a stage body takes (run, ...), not {own[:1]}")
        signature = inspect.Signature([*STAGE_PARAMETERS, *own[1:]], return_annotation=declared.return_annotation)

        def stage_run(*args: Any, **kwargs: Any) -> R:
            given = signature.bind(*args, **kwargs).arguments  # Prefect passes every parameter, defaults resolved
            run = resolve(
                given["preset"], given["overrides"], given["run_id"], given["storage"], reads_source=reads_source
            )
            return body(run, *(given[p.name] for p in own[1:]))

        stage_run.__name__, stage_run.__qualname__, stage_run.__doc__ = body.__name__, body.__qualname__, body.__doc__
        stage_run.__module__ = body.__module__
        stage_run.__signature__ = signature  # type: ignore[attr-defined]
        source = inspect.getsourcefile(body)
        return flow(
            name=name,
            flow_run_name=run_name,
            log_prints=True,
            on_cancellation=[stop_jobs_on_cancel] if stops_jobs else None,
            version=file_hash(source) if source else None,
        )(stage_run)

    return make


def not_a_command(name: str) -> str:
    """What `python -m hlat.flows.<module>` says: the flows are run by the `hlat` command, which sits above them
    (its log file, its one-line errors, its temporary Prefect server), not by their own modules."""
    command = "hlat pretrain" if name == "hlat" else f"hlat run {name}"
    return (
        f"hlat: a flow module is not a command: run `{command} [--preset P] [--run-id R] [--storage S] "
        f"[--set PATH=VALUE ...]` (`{command} --help`), or deploy it (`hlat deploy`)"
    )
