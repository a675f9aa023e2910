"""From a run's config to its job backend, job specs and supervisor; and the dry run of a training job.

The job's environment is built here, the same for both backends: the run id, and on trn1 the Neuron flags
for the precision mode plus the run's compile cache (`compile-cache/`); a training job's also holds the run's stop
terms (budget, what was spent, its price, the deadline, the supervision timeout: `stop_terms`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hlat.core.config import ConfigError, HlatConfig
from hlat.core.contract import STOP_DEADLINE, TRACKED_BY_STAGE_ENV, StopTerms
from hlat.core.layout import JOBS_DIR, NEURON_CACHE
from hlat.core.mixture import draws_table, source_draws
from hlat.core.run import Run, run_for
from hlat.core.stages import DATA, TRAINING, Instances, Stage, job_stages, stage
from hlat.core.stop_timeline import stop_timeline
from hlat.infra.backends.protocol import JobBackend, JobSpec, JobState, job_name
from hlat.infra.cost.catalog import CATALOG, Instance, measured, price_per_hour
from hlat.infra.supervision.accounts import STARTUP_FLOOR_S
from hlat.infra.supervision.lease import stop_live_job
from hlat.infra.supervision.ledger import Attempt, Ledger
from hlat.infra.supervision.progress import Progress
from hlat.infra.supervision.supervisor import Supervisor, run_job

PLACEHOLDER_ROOT = "s3://YOUR-BUCKET/hlat"
PLACEHOLDER_ROLE = "arn:aws:iam::111122223333:role/YOUR-SAGEMAKER-ROLE"


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
        from hlat.infra.backends.sagemaker import SageMakerBackend

        return SageMakerBackend(job)
    from hlat.infra.backends.local import LocalBackend

    return LocalBackend(jobs_dir(run), stop_grace_seconds=job.stop_grace_seconds, job=job)


def job_shape(config: HlatConfig) -> list[Any]:
    """What a stage job's results depend on about where it ran: backend, image, instance type, count, ranks, device."""
    job = config.job
    return [
        job.backend, job.image_uri, job.instance_type, job.instance_count, job.processes_per_node,
        config.training.device,
    ]  # fmt: skip


def on_neuron(config: HlatConfig) -> bool:
    from hlat.core.environment import on_trainium

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
    config, env, row = run.config, {"HLAT_RUN_ID": run.run_id}, _stage(stage)
    if row.trains:  # SageMaker's managed MLflow: the request's MlflowConfig is made from these
        from hlat.infra.backends.sagemaker import tracking_environment

        env.update(tracking_environment(config.tracking))
        if stage_tracks_metrics(config):
            env[TRACKED_BY_STAGE_ENV] = "1"
    if not row.on_training_instances:
        return env
    if on_neuron(config) or config.training.device == "xla":
        from hlat.core.environment import xla_job_environment

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
    if job.backend != "local" or not _stage(stage).on_training_instances:
        return None
    if job.python:
        return job.python
    if config.training.device != "xla":
        return None
    from hlat.core.environment import neuron_sdk
    from hlat.infra.backends.local import PROJECT_ROOT

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
        from hlat.infra.backends.sagemaker import pytorch_training_image

        return pytorch_training_image(job.region, instance)
    return job.image_uri


def _stage(name: str) -> Stage:
    """The stage's row (core/stages.py), raised as a ConfigError for an unknown name."""
    try:
        return stage(name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _job_stage(name: str) -> tuple[Stage, str]:
    """The row of a stage that runs jobs, and its jobs' program."""
    row = _stage(name)
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


def stop_rule_line(config: HlatConfig, spec: JobSpec) -> str:
    """The dry run's account of what stops a training job by itself, and of its max runtime."""
    terms, job = stop_terms(config), config.job
    parts = []
    if terms.budget_usd is not None and terms.price_per_hour_usd > 0:
        hours = (terms.budget_usd - terms.spent_usd) / terms.price_per_hour_usd
        parts.append(f"the budget (${terms.budget_usd:,.2f} at ${terms.price_per_hour_usd:,.2f}/h: {hours:,.1f} h)")
    if job.deadline is not None:
        parts.append(f"job.deadline ({job.deadline.isoformat()})")
    if job.unsupervised_stop_minutes:
        parts.append(f"{job.unsupervised_stop_minutes:g} min without a supervisor heartbeat")
    if not parts:
        return "stop rule: none (no budget, deadline or job.unsupervised_stop_minutes)"
    return (
        f"stop rule: the job stops itself at a checkpoint at {' or '.join(parts)}; MaxRuntimeInSeconds="
        f"{spec.max_runtime_s:,} backs it up"
    )


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


def estimate(config: HlatConfig) -> dict[str, Any]:
    """Hourly cost, and time and cost to train to max_steps with where its throughput comes from
    (`infra.cost.planner.run_cost`: the figure `hlat plan` prints too); hours None when no throughput is known."""
    from hlat.infra.cost.planner import run_cost

    job = config.job
    hourly = price_per_hour(job.instance_type, job.price_per_hour_usd) * job.instance_count
    out: dict[str, Any] = {"hourly_usd": hourly, "tokens": config.training.max_steps * config.tokens_per_step}
    cost = run_cost(config)
    out.update(
        hours=None if cost is None else cost.hours,
        total_usd=None if cost is None else cost.usd,
        tokens_per_s=None if cost is None else cost.tokens_per_s,
        basis=None if cost is None else cost.basis,
    )
    return out


BUDGET_MARGIN = 1.25
"""A SageMaker run without job.budget_usd may spend this multiple of the plan's estimate of its training cost: room
for relaunches and slower steps, never an open-ended bill (a deterministic fault on 256 trn1.32xlarge nodes costs
about $6,300 an hour)."""


@dataclass(frozen=True)
class Budget:
    usd: float | None
    """What the train stage may spend before it stops (None: no limit)."""
    basis: str
    """Where the figure comes from, as the dry run says it."""


def budget(config: HlatConfig) -> Budget:
    """The train stage's dollar budget: job.budget_usd when set; on SageMaker otherwise BUDGET_MARGIN x the plan's
    estimate of the training's cost; a SageMaker run with neither is refused (ConfigError naming the field). Local
    runs cost nothing the catalog knows of and have no default."""
    job = config.job
    if job.budget_usd is not None:
        return Budget(job.budget_usd, f"job.budget_usd = ${job.budget_usd:,.2f}")
    if job.backend != "sagemaker":
        return Budget(None, "none (job.budget_usd is not set)")
    total = estimate(config)["total_usd"]
    if total is None:
        raise ConfigError(
            f"job.budget_usd: no estimate of this run's cost exists ({job.instance_type!r} has no throughput figure "
            "in the instance catalog), and a SageMaker run does not start without a budget: set job.budget_usd to "
            "the most the training may spend"
        )
    usd = BUDGET_MARGIN * total
    return Budget(
        usd,
        f"${usd:,.2f} = {BUDGET_MARGIN:g} x the estimate of ${total:,.0f} (job.budget_usd is unset: set it to change)",
    )


MAX_BUDGET_ENV = "HLAT_MAX_BUDGET_USD"
"""The most one run's training may be budgeted, in dollars: set by the account's administrator where flow runs
start (the work pool's fixed environment, not a run parameter), never by the run's own config."""
MAX_INSTANCES_ENV = "HLAT_MAX_INSTANCES"
"""The most instances one job of a run may ask for (job.instance_count), set the same way."""


def check_spend(config: HlatConfig, env: Mapping[str, str] | None = None) -> None:
    """Refuse a SageMaker run that could spend past what the account allows: a budget over HLAT_MAX_BUDGET_USD
    (job.budget_usd, or the default from the plan's estimate), an instance count over HLAT_MAX_INSTANCES, or a
    node-hour price of 0 (job.price_per_hour_usd=0, or an instance type the catalog does not price), which would
    leave the budget unenforced. Called by `preflight`, which every flow run passes before anything of its run is
    written. Local runs cost nothing and are not checked."""
    env = os.environ if env is None else env
    job = config.job
    if job.backend != "sagemaker":
        return
    if price_per_hour(job.instance_type, job.price_per_hour_usd) <= 0:
        given = "is 0" if job.price_per_hour_usd is not None else f"is unset and {job.instance_type!r} has no price"
        raise ConfigError(
            f"job.price_per_hour_usd {given}: a SageMaker run's budget is enforced through the node-hour price, so "
            "it must be above 0; set the price you pay"
        )
    limits = {name: _limit(env, name) for name in (MAX_BUDGET_ENV, MAX_INSTANCES_ENV)}
    most = limits[MAX_INSTANCES_ENV]
    if most is not None and job.instance_count > most:
        raise ConfigError(
            f"job.instance_count: {job.instance_count} instances is over this account's ceiling of {most:g} "
            f"({MAX_INSTANCES_ENV}, set where flow runs start, not by a run); ask for {most:g} or fewer"
        )
    ceiling = limits[MAX_BUDGET_ENV]
    if ceiling is not None:
        planned = budget(config)
        if planned.usd is None or planned.usd > ceiling:
            raise ConfigError(
                f"job.budget_usd: the training's budget, {planned.basis}, is over this account's ceiling of "
                f"${ceiling:,.2f} ({MAX_BUDGET_ENV}, set where flow runs start, not by a run); set job.budget_usd to "
                f"${ceiling:,.2f} or less"
            )


def _limit(env: Mapping[str, str], name: str) -> float | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={text!r}: the account's ceiling must be a number above 0 (unset: no ceiling)")
    return value


def checkpoint_write_seconds(config: HlatConfig) -> float:
    """Estimated time of one synchronous checkpoint save, from the bytes each rank's files hold (FP32 master
    weights and moments where the format saves them): the copy to host memory, the paced writes at the assumed
    per-rank and per-host S3 rates, and rank 0's commit (`core.stop_timeline`, where the figures and their
    sources are; the job logs the save time it measures)."""
    timeline = stop_timeline(config, None, in_flight=False)
    return timeline.seconds("staging") + timeline.seconds("writes") + timeline.seconds("commit")


def stop_fit(config: HlatConfig, tokens_per_s: float | None) -> str:
    """Whether a stop (StopTrainingJob, max runtime, the budget) checkpoints inside the grace between SIGTERM and
    SIGKILL, in the worst case and phase by phase (`core.stop_timeline`): up to two steps to the stop's boundary,
    an async save in flight superseded, the save's staging, paced writes and commit."""
    step = config.tokens_per_step / tokens_per_s if tokens_per_s else None
    return stop_timeline(config, step).line()


BYTES_PER_TOKEN = 4.0
"""UTF-8 bytes of raw text per token of a LLaMA-style 32k BPE on English web text (HLAT's 1.8T tokens are about
7 TB of text); what prepare-data reads per training token, before duplicates and bad rows are dropped."""


@dataclass(frozen=True)
class DataEstimate:
    """Time and cost of the prepare-data job for the text behind a token budget."""

    bytes: float
    workers: int
    instances: int
    instance_type: str
    mb_per_s_per_worker: float
    usd_per_node_hour: float | None
    basis: str
    curation_mb_per_s_per_worker: float | None = None
    """The curation phases' rate (data.curation: any rule on), after the units' validation; None: no curation."""

    @property
    def hours(self) -> float:
        seconds_per_mb = 1 / self.mb_per_s_per_worker + (
            1 / self.curation_mb_per_s_per_worker if self.curation_mb_per_s_per_worker else 0
        )
        return self.bytes / 1e6 * seconds_per_mb / self.workers / 3600

    @property
    def usd(self) -> float | None:
        return None if self.usd_per_node_hour is None else self.hours * self.instances * self.usd_per_node_hour

    def line(self) -> str:
        price = (
            f"${self.usd:,.2f} at ${self.usd_per_node_hour:,.3f}/node-hour"
            if self.usd is not None
            else f"no price for {self.instance_type} in the catalog: set data.price_per_hour_usd"
        )
        return (
            f"prepare-data: {self.bytes / 1e12:,.2f} TB of text in {self.hours:,.2f} h on {self.workers} worker(s) "
            f"({self.instances} x {self.instance_type}) at {self.mb_per_s_per_worker:g} MB/s per worker"
            + (
                f" to validate and {self.curation_mb_per_s_per_worker:g} MB/s to curate"
                if self.curation_mb_per_s_per_worker
                else ""
            )
            + f", {price} ({self.basis})"
        )


def data_estimate(config: HlatConfig, tokens: float | None = None) -> DataEstimate:
    """The prepare-data job for `tokens` (None: the run's training tokens) at BYTES_PER_TOKEN, with the per-worker
    throughput benchmarks/bench_prepare_data measured (infra/cost/measured.json)."""
    d = config.data
    tokens = config.training.max_steps * config.tokens_per_step if tokens is None else tokens
    figures = measured("prepare_data")
    sagemaker = config.job.backend == "sagemaker"
    instance_type = d.instance_type if sagemaker else "local"
    price = d.price_per_hour_usd if d.price_per_hour_usd is not None else CATALOG.get(instance_type, None)
    hourly = price.price_per_hour_usd if isinstance(price, Instance) else price
    return DataEstimate(
        bytes=tokens * BYTES_PER_TOKEN,
        workers=d.workers,
        instances=DATA.instance_count(config),
        instance_type=instance_type,
        mb_per_s_per_worker=float(figures["mb_per_s_per_worker"]),
        usd_per_node_hour=hourly,
        basis=f"{BYTES_PER_TOKEN:g} bytes/token; throughput measured {figures['measured']} on {figures['machine']}",
        curation_mb_per_s_per_worker=(
            float(measured("curation")["mb_per_s_per_worker"]) if d.curation.any_rule else None
        ),
    )


def for_tokens(config: HlatConfig, tokens: float) -> HlatConfig:
    """`config` trained for `tokens` (`hlat plan --tokens`): training.max_steps the steps that draw them."""
    steps = max(1, math.ceil(tokens / config.tokens_per_step))
    return config.model_copy(update={"training": config.training.model_copy(update={"max_steps": steps})})


def source_lines(config: HlatConfig) -> list[str]:
    """The data mixture as the dry run and `hlat plan` show it: per source (core.mixture), its share of the run's
    training tokens, the tokens drawn, its size and the epochs of it that makes, against its max_epochs."""
    return [
        f"data: {config.training.max_steps:,} steps x {config.tokens_per_step:,} tokens drawn from "
        f"{len(config.data.mixture)} source(s); epochs count against each source's declared size "
        "(data.sources[].tokens) until prepare-data measures it",
        *(f"  {line}" for line in draws_table(source_draws(config))),
    ]


def _describe_requests(requests: list[dict[str, Any]]) -> list[str]:
    """Uploads summarised (count, bytes, common prefix); every other request printed in full."""
    uploads = [r["params"] for r in requests if r.get("operation") == "PutObject"]
    lines = []
    if uploads:
        keys = [f"s3://{u['Bucket']}/{u['Key']}" for u in uploads]
        prefix = os.path.commonpath(keys).replace("s3:/", "s3://", 1) if len(keys) > 1 else keys[0]
        size = sum(int(u.get("Size") or 0) for u in uploads)
        lines.append(
            f"S3 PutObject x {len(uploads)} ({size / 1024:,.0f} KiB of code and SageMaker drivers) under {prefix}/"
        )
    for request in requests:
        if request.get("operation") != "PutObject":
            lines.append(f"{request.get('service', '')} {request.get('operation', '')}".strip() + ":")
            lines.append(json.dumps(request.get("params", request), indent=2, default=str))
    return lines


def describe_layout(config: HlatConfig) -> str:
    """How a training job splits the model and the batch, in one line (what the dry run shows)."""
    p, t, dims = config.parallelism, config.training, config.parallel_dims
    parts = [
        f"{config.world_size} ranks = TP {dims.tensor} x PP {dims.pipeline} x DP {dims.data}",
        f"micro-batch {t.micro_batch_size} x {config.gradient_accumulation}"
        + (" pipeline micro-batches" if p.pipeline > 1 else " accumulation steps"),
    ]
    if p.sequence_parallel:
        parts.append("sequence parallel")
    if p.zero1:
        parts.append("ZeRO-1" + (" with FP32 master weights" if config.precision.mode == "bf16-mixed" else ""))
    parts.append(f"{p.activation_checkpointing} activation checkpointing")
    parts.append(f"precision {config.precision.mode}")
    return ", ".join(parts)


def chaining(config: HlatConfig, hours: float, max_runtime_s: int) -> list[str]:
    """How a training longer than one job's max runtime is split into jobs. A job that reaches its
    MaxRuntimeInSeconds ends 'MaxRuntimeExceeded', which the supervisor classifies as resume-at-once
    (infra.backends.protocol.classify): the next attempt resumes from the newest checkpoint. Each counts against
    job.max_restarts."""
    job_hours = max_runtime_s / 3600
    if hours <= job_hours:
        return []
    jobs = math.ceil(hours / job_hours)
    days, cap = hours / 24, job_hours / 24
    why = "SageMaker's 28-day cap" if job_hours >= 24 * 28 else "job.max_runtime_hours"
    lines = [
        f"chaining: {days:,.1f} days > {cap:g}-day max runtime ({why}): {jobs} jobs of at most "
        f"MaxRuntimeInSeconds={max_runtime_s:,}, each resuming from the newest checkpoint (every "
        f"{config.training.checkpoint_every:,} steps) when the previous one stops at its max runtime"
    ]
    if jobs - 1 > config.job.max_restarts:
        lines.append(
            f"  warning: that is {jobs - 1} relaunches and job.max_restarts is {config.job.max_restarts}: the run "
            f"would stop early; set job.max_restarts to at least {jobs - 1} plus a margin for failures"
        )
    return lines


def preflight(config: HlatConfig) -> None:
    """Check the values of a SageMaker run's config that its jobs' requests carry (instance types, role ARN, the
    S3 URIs under storage.root...) against the service model, before any stage runs: a typo then fails the flow
    run at once, not after data preparation. Settings not given yet (no role) are left to the stage that needs
    them; nothing is sent or uploaded. Then the budget: a SageMaker run with no job.budget_usd and no estimate to
    default one from is refused here, and so is one over the account's ceiling (`check_spend`)."""
    if config.job.backend != "sagemaker":
        return
    if config.storage.root.startswith("s3://"):
        _check_requests(config)
    budget(config)  # refuses a run with neither a budget nor an estimate to default one from
    check_spend(config)  # the account's ceiling, whatever the run's parameters say


def _check_requests(config: HlatConfig) -> None:
    from hlat.infra.backends.sagemaker import SageMakerBackend, check_request

    backend = SageMakerBackend(config.job)  # boto3 clients are made, nothing is called
    spec = job_spec(run_for(config), attempt=1)
    check_request("CreateTrainingJob", backend.config_request(spec), "train", partial=True)
    # The evaluation job's own instance type and image, without job_spec's default GPU image (which would import
    # the SageMaker SDK: seconds, for a value AWS's own table made).
    e = config.evaluation
    evaluating = dataclasses.replace(
        spec, stage="evaluate", instance_type=e.instance_type or config.job.instance_type, image_uri=e.image_uri
    )
    check_request("CreateTrainingJob", backend.config_request(evaluating), "evaluate", partial=True)


def dry_run(config: HlatConfig, stage: str = "train") -> str:
    """What training this config would send, and what it would cost; sends nothing, writes nothing."""
    run_id = config.resolved_run_id()
    notes: list[str] = []
    root = config.storage.root.rstrip("/")
    if config.job.backend == "sagemaker":
        if not root.startswith("s3://"):
            notes.append(f"storage.root is {root!r}: SageMaker needs s3://; shown with {PLACEHOLDER_ROOT}")
            root = PLACEHOLDER_ROOT
        if not config.job.role_arn:  # job.role_arn_secret is read by the caller (tasks/aws.py: with_role)
            notes.append(f"job.role_arn is not set; shown with {PLACEHOLDER_ROLE}")
            config = config.model_copy(update={"job": config.job.model_copy(update={"role_arn": PLACEHOLDER_ROLE})})
    run, row = Run.at(f"{root}/{run_id}", config, run_id), _stage(stage)
    # The key of the stage that prepares the sources hashes their listing, read only when the stage runs.
    args = {"key": "<the stage's cache key>"} if row.prepares_sources else None
    spec = job_spec(run, attempt=1, stage=stage, args=args)
    where = row.runs_on or TRAINING
    requests = backend_for(run).dry_run(spec)
    est = estimate(config)
    job = config.job
    lines = [f"dry run: {stage} of run {run_id} on the {job.backend} backend (nothing is sent)"]
    lines.append(f"layout: {describe_layout(config)}")
    lines += [f"  placeholder: {n}" for n in notes]
    from hlat.infra.inputs.init_from import model_notes

    lines += model_notes(config)
    if row.trains or row.prepares_sources:
        lines += source_lines(config)
    lines.append("")
    lines.append(f"requests of attempt 1 (job {spec.name}):")
    lines += _describe_requests(requests)
    lines.append("")
    # The job's own instances (its row's `runs_on`), priced by their own setting where they have one.
    own_price, price_setting = where.own_price(config), where.price_setting(config)
    if own_price is None and spec.instance_type not in CATALOG:
        # An instance type the catalog does not price: saying $0.00 would be a wrong figure, not an unknown one.
        field = price_setting or where.settings.get("price_per_hour_usd") or "a catalog entry"
        lines.append(
            f"cost: {spec.instance_count} x {spec.instance_type}: no price in the instance "
            "catalog (infra/cost/catalog.py); "
            f"set {field} to see costs and enforce job.budget_usd"
        )
        hourly = None
    else:
        node_price = price_per_hour(spec.instance_type, own_price)
        hourly = node_price * spec.instance_count
        lines.append(
            f"cost: {spec.instance_count} x {spec.instance_type} at ${node_price:,.3f}/node-hour = ${hourly:,.2f}/hour"
        )
        known = CATALOG.get(spec.instance_type)
        if own_price is not None:
            lines.append(f"price: {price_setting}")
        elif known is not None and known.price is not None:
            lines.append(f"price: {known.price.describe()}")
    if not row.trains:
        hours = spec.max_runtime_s / 3600
        bound = f": at most ${hours * hourly:,.2f}" if hourly is not None else ""
        lines.append(f"bound: the {stage} job stops by its max runtime of {hours:g} h{bound}")
        if row.prepares_sources:
            lines.append("estimate: " + data_estimate(config).line() + " for the text of the run's training tokens")
    elif est["hours"] is not None:
        lines.append(
            f"estimate: {config.training.max_steps:,} steps x {config.tokens_per_step:,} tokens = "
            f"{est['tokens'] / 1e9:,.1f}B tokens in {est['hours']:,.0f} h ({est['hours'] / 24:,.1f} days) at "
            f"{est['tokens_per_s']:,.0f} tokens/s ({est['basis']}), about ${est['total_usd']:,.0f} (`hlat plan` ranks "
            "the other layouts)"
        )
        # Chained by job.max_runtime_hours; the budget's cap on MaxRuntimeInSeconds stops the run, it does not chain.
        lines += chaining(config, est["hours"], int(job.max_runtime_hours * 3600))
        lines.append(data_estimate(config).line())
    else:
        lines.append(f"estimate: no throughput figure for {job.instance_type!r} in the instance catalog")
    if row.trains:
        lines.append(stop_fit(config, est["tokens_per_s"]))
        try:
            lines.append(f"budget: {budget(config).basis}")
        except ConfigError as exc:
            lines.append(f"budget: refused: {exc}")
        lines.append(stop_rule_line(config, spec))
    elif job.budget_usd is not None:
        lines.append(f"budget: job.budget_usd = ${job.budget_usd:,.2f}")
    return "\n".join(lines)
