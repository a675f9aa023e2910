"""From a run's config to its jobs: the backend, each stage's job spec and environment, and the supervisor.

The job's environment is built here, the same for both backends: the run id, and on trn1 the Neuron flags
for the precision mode plus the run's compile cache (`compile-cache/`); a training job's also holds the run's stop
terms (budget, what was spent, its price, the deadline, the supervision timeout: `stop_terms`). The dry run is in
`infra.dry_run`, the estimates and the budget in `infra.cost`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from typing import Any

from hlat.core.config import ConfigError, HlatConfig
from hlat.core.contract import STOP_DEADLINE, TRACKED_BY_STAGE_ENV, StopTerms
from hlat.core.environment import neuron_sdk, on_trainium, xla_job_environment
from hlat.core.layout import JOBS_DIR, NEURON_CACHE
from hlat.core.run import Run, run_for
from hlat.core.stages import TRAINING, Instances, Stage, job_stages, stage
from hlat.infra.backends.local import PROJECT_ROOT, LocalBackend
from hlat.infra.backends.protocol import JobBackend, JobSpec, JobState, job_name
from hlat.infra.backends.sagemaker import SageMakerBackend
from hlat.infra.backends.sagemaker_images import pytorch_training_image
from hlat.infra.backends.sagemaker_request import tracking_environment
from hlat.infra.cost.budget import budget
from hlat.infra.cost.catalog import price_per_hour
from hlat.infra.cost.estimates import estimate
from hlat.infra.supervision.accounts import STARTUP_FLOOR_S
from hlat.infra.supervision.lease import stop_live_job
from hlat.infra.supervision.ledger import Attempt, Ledger
from hlat.infra.supervision.progress import Progress
from hlat.infra.supervision.supervisor import Supervisor, run_job


def jobs_dir(run: Run) -> str:
    """Where the local backend keeps its job folders: inside the run when the run is local, else in a cache."""
    if run.storage.is_local:
        return run.storage.path(JOBS_DIR)
    cache = os.environ.get("HLAT_JOBS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hlat", "jobs")
    return os.path.join(cache, run.run_id)


def backend_for(run: Run) -> JobBackend:
    """The backend the run's jobs run on (job.backend)."""
    job = run.config.job
    if job.backend == "sagemaker":
        return SageMakerBackend(job)
    return LocalBackend(jobs_dir(run), stop_grace_seconds=job.stop_grace_seconds, job=job)


def job_shape(config: HlatConfig) -> list[Any]:
    """What a stage job's results depend on about where it ran: backend, image, instance type, count, ranks, device."""
    job = config.job
    return [
        job.backend, job.image_uri, job.instance_type, job.instance_count, job.processes_per_node,
        config.training.device,
    ]  # fmt: skip


def on_neuron(config: HlatConfig) -> bool:
    return on_trainium(config)


def stage_tracks_metrics(config: HlatConfig) -> bool:
    """Whether the train stage, not the training job, logs the metrics into the tracked run (tracking.backend): for
    SageMaker jobs, whose Neuron images cannot install MLflow's client beside their pins (tensorboard 2.6.0) and
    whose environment SageMaker shows (no W&B key there). Local jobs log at their own flushes."""
    return config.tracking.backend != "none" and config.job.backend == "sagemaker"


def job_environment(run: Run, stage: str = "train") -> dict[str, str]:
    """A stage job's environment: the run id, and for the jobs on the training's instances (train, precompile,
    burn-in) what XLA needs: on trn1 the precision flags, the `neuron` section's compiler and runtime settings and
    the run's Neuron compile cache; with training.device=xla elsewhere, XLA:CPU's (precision flags, PJRT_DEVICE).
    The evaluation job runs Hugging Face transformers on its own instance: none of it. A training job with
    tracking.mlflow_tracking_server_arn also gets MLflow's variables (`sagemaker_jobs.tracking_environment`)."""
    config, env, row = run.config, {"HLAT_RUN_ID": run.run_id}, stage_row(stage)
    if row.trains:  # SageMaker's managed MLflow: the request's MlflowConfig is made from these
        env.update(tracking_environment(config.tracking))
        if stage_tracks_metrics(config):
            env[TRACKED_BY_STAGE_ENV] = "1"
    if not row.on_training_instances:
        return env
    if on_neuron(config) or config.training.device == "xla":
        # The compile cache's key is computed from the same function (training.compile_cache.cache_key).
        env.update(xla_job_environment(config, compile_cache=run.storage.uri(NEURON_CACHE)))
    if on_neuron(config) and row.compiles:
        # SageMaker's Torchrun driver then wraps torchrun in neuron_parallel_compile: graphs are extracted
        # from a few steps and compiled in parallel into NEURON_COMPILE_CACHE_URL.
        env["RUN_NEURON_PARALLEL_COMPILE"] = "1"
    return env


def job_python(config: HlatConfig, stage: str) -> str | None:
    """The interpreter of a local stage job: job.python, else the XLA environment when the jobs run on XLA outside
    trn1, else None (the flow's own). Evaluation and prepare-data always run in the flow's environment (transformers,
    lm-eval, great-expectations)."""
    job = config.job
    if job.backend != "local" or not stage_row(stage).on_training_instances:
        return None
    if job.python:
        return job.python
    if config.training.device != "xla":
        return None
    sdk = neuron_sdk(config)
    path = PROJECT_ROOT / sdk.local_python
    if not path.exists():
        raise ConfigError(
            f"training.device=xla runs the local jobs in the XLA environment of neuron.sdk={sdk.version}, and {path} "
            f"does not exist: run `scripts/install.sh {sdk.install_target}` first, or set job.python to an "
            f"interpreter that has torch-xla {sdk.torch_xla}"
        )
    return str(path)


def job_image(config: HlatConfig, where: Instances) -> str | None:
    """The image of the jobs on `where` (a row's `runs_on`): its image setting; else on SageMaker AWS's PyTorch
    training image where `where.pytorch_image` says so (the GPU build on a GPU instance, the CPU build on a CPU
    one), else the training's image (None: the backend's default)."""
    own, job = where.image_setting(config), config.job
    if own or job.backend != "sagemaker":
        return own
    instance = where.instance_type(config)
    gpu = instance.startswith(("ml.p", "ml.g"))
    if where.pytorch_image == "always" or (where.pytorch_image == "on-gpu" and gpu):
        return pytorch_training_image(job.region, instance)
    return job.image_uri


def stage_row(name: str) -> Stage:
    """The stage's row (core/stages.py), raised as a ConfigError for an unknown name."""
    try:
        return stage(name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _job_stage(name: str) -> tuple[Stage, str]:
    """The row of a stage that runs jobs, and its jobs' program."""
    row = stage_row(name)
    if row.program is None:
        raise ConfigError(f"the {name} stage runs in the flow's own process, not in a job")
    return row, row.program


def job_spec(
    run: Run,
    attempt: int,
    stage: str = "train",
    step: int | None = None,
    args: dict[str, str] | None = None,
    spent_usd: float = 0.0,
    submitted_at: float | None = None,
) -> JobSpec:
    """The job of `stage`'s `attempt`, on its row's instances (`runs_on`: their type, count, ranks, image and
    runtime). An evaluation job scores checkpoint `step` (None: the newest). A training job (`trains`) also carries
    the run's stop terms (`stop_terms`: `spent_usd` is what the run's earlier jobs were billed, `submitted_at` when
    this one is submitted), and its max runtime ends shortly after the budget or deadline would stop it
    (`runtime_cap`): a backstop if its own stop rule fails. The prepare-data job has no input channel."""
    row, program = _job_stage(stage)
    where = row.runs_on or TRAINING
    config, run_id, run_uri = run.config, run.run_id, run.uri
    hours = where.max_runtime_hours(config)
    if row.cap_hours is not None:
        hours = min(hours, row.cap_hours)
    max_runtime_s = int(hours * 3600)
    environment = job_environment(run, stage)
    if row.trains:
        terms = stop_terms(config, spent_usd, submitted_at)
        environment.update(terms.environment())
        max_runtime_s = runtime_cap(config, terms, max_runtime_s)
    spec = JobSpec(
        name=job_name(run_id, attempt, stage),
        run_id=run_id,
        attempt=attempt,
        run_uri=run_uri,
        config_uri=f"{run_uri}/config.json",
        instance_type=where.instance_type(config),
        instance_count=where.instance_count(config),
        processes_per_node=where.processes_per_node(config),
        max_runtime_s=max_runtime_s,
        environment=environment,
        stage=stage,
        image_uri=job_image(config, where),
        neuron_sdk=config.neuron.sdk,
        entry=program,
        # The checkpoint an evaluation job scores: its step, and `args` (e.g. {"from": "averaged"}: `hlat average`'s).
        args={**({"step": str(step)} if step is not None else {}), **(args or {})},
        python=job_python(config, stage),
        reads=config_reads(config),
    )
    # The stage that prepares the sources has no run folder to read yet: no input channel.
    return dataclasses.replace(spec, channels=()) if row.prepares_sources else spec


def config_reads(config: HlatConfig) -> tuple[str, ...]:
    """The s3:// prefixes the run's config names for reading: the checkpoint it starts from, the tokenizer it reuses,
    its corpora (a job's run role may read them: infra/backends/run_roles.py)."""
    named = [config.model.init_from, config.tokenizer.pretrained, config.data.source]
    named += [s.source for s in config.data.sources]
    return tuple(sorted({uri for uri in named if uri and uri.startswith("s3://")}))


def stop_terms(config: HlatConfig, spent_usd: float = 0.0, submitted_at: float | None = None) -> StopTerms:
    """What a training job keeps to by itself (training/stop_rule.py): the run's budget (the supervisor's figure,
    `budget`), what its earlier jobs were billed, its own price per hour (node-hour price x instance count), the
    run's deadline and how long it may go without a supervisor's heartbeat."""
    job = config.job
    try:
        usd = budget(config).usd
    except ConfigError:  # refused by the preflight and by the supervisor before any job is submitted
        usd = None
    return StopTerms(
        budget_usd=usd,
        spent_usd=spent_usd,
        price_per_hour_usd=price_per_hour(job.instance_type, job.price_per_hour_usd) * job.instance_count,
        deadline=job.deadline.timestamp() if job.deadline is not None else None,
        submitted_at=submitted_at,
        unsupervised_stop_s=job.unsupervised_stop_minutes * 60 if job.unsupervised_stop_minutes else None,
    )


def runtime_cap(config: HlatConfig, terms: StopTerms, max_runtime_s: int, now: float | None = None) -> int:
    """A training job's max runtime (SageMaker's MaxRuntimeInSeconds; the local daemon's too): `max_runtime_s`
    (job.max_runtime_hours), or, when sooner, what is left of the budget or before the deadline plus
    job.stop_grace_seconds, so that the platform stops the job shortly after its own stop rule should have. A
    budget already spent or a deadline already past is refused here, before anything is submitted."""
    now = time.time() if now is None else now
    limit = terms.limit_at(terms.submitted_at if terms.submitted_at is not None else now)
    if limit is None:
        return max_runtime_s
    end, why = limit
    left = end - now
    if left <= 0:
        if why == STOP_DEADLINE:
            when = config.job.deadline.isoformat() if config.job.deadline else "?"
            raise ConfigError(f"job.deadline={when} has passed: set a later job.deadline to go on")
        raise ConfigError(
            f"job.budget_usd: the run's budget of ${terms.budget_usd or 0:,.2f} is spent (${terms.spent_usd:,.2f} "
            "billed): raise job.budget_usd to go on from the last checkpoint"
        )
    return max(1, min(max_runtime_s, math.ceil(left + config.job.stop_grace_seconds)))


def billed_usd(run: Run, stage: str = "train") -> float:
    """What the stage's ended jobs were billed, from its ledger (jobs/<stage>-attempts.json)."""
    return sum(a.cost_usd for a in Ledger(run, stage).load() if a.ended)


def run_stage_job(
    run: Run, stage: str, step: int | None = None, args: dict[str, str] | None = None
) -> tuple[Attempt, JobState | None]:
    """Run a stage's short job (prepare-data, precompile, burn-in, evaluate) on the run's backend until it ends."""
    job = run.config.job
    return run_job(
        backend_for(run),
        run,
        run.run_id,
        stage,
        make_spec=lambda attempt, name: job_spec(run, attempt, stage, step, args),
        poll_seconds=job.poll_seconds,
        backoff_seconds=list(job.backoff_seconds),
    )


def stop_live_jobs(config: HlatConfig) -> list[str]:
    """Stop every unfinished job of the run's stages (a flow run was cancelled); returns their names."""
    run = run_for(config)
    backend = backend_for(run)
    stopped = [stop_live_job(backend, run, name) for name in job_stages()]
    return [name for name in stopped if name]


def supervisor_for(
    run: Run,
    current_step: Callable[[], int | None],
    on_progress: Callable[[Progress], None] = lambda p: None,
    on_attempts: Callable[[list[Attempt]], None] = lambda a: None,
) -> Supervisor:
    """The train stage's supervisor: training jobs relaunched from the newest checkpoint until the run's last step
    (training.max_steps), within job.max_restarts, job.max_repeats and the budget."""
    config = run.config
    job = config.job
    # What a SageMaker attempt must be able to buy before it is submitted: a start-up and one checkpoint interval at
    # the plan's step time (a local job's start-up is seconds, and its price notional: not checked).
    planned_tps = estimate(config)["tokens_per_s"] if job.backend == "sagemaker" else None
    return Supervisor(
        backend=backend_for(run),
        run=run,
        run_id=run.run_id,
        # Read at each submission: what the run's earlier jobs cost is part of the new job's stop terms.
        make_spec=lambda attempt, name: job_spec(run, attempt, spent_usd=billed_usd(run), submitted_at=time.time()),
        current_step=current_step,
        target_step=config.training.max_steps,
        tokens_per_step=config.tokens_per_step,
        max_restarts=job.max_restarts,
        max_repeats=job.max_repeats,
        budget_usd=budget(config).usd,
        price_per_hour=price_per_hour(job.instance_type, job.price_per_hour_usd),
        poll_seconds=job.poll_seconds,
        hang_timeout_s=job.hang_timeout_minutes * 60 if job.hang_timeout_minutes else None,
        backoff_seconds=list(job.backoff_seconds),
        on_progress=on_progress,
        on_attempts=on_attempts,
        max_attempts_without_progress=job.max_attempts_without_progress,
        startup_timeout_s=job.startup_timeout_minutes * 60 if job.startup_timeout_minutes else None,
        deadline=job.deadline.timestamp() if job.deadline else None,
        startup_floor_s=STARTUP_FLOOR_S if job.backend == "sagemaker" else None,
        checkpoint_interval_s=config.training.checkpoint_every * config.tokens_per_step / planned_tps
        if planned_tps
        else None,
    )
