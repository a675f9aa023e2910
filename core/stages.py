"""The pipeline's stages, in DAG order: one row per stage, read by every layer that needs to know about stages.

A stage is one Prefect flow (`flows/<module>.py`, the function of the same name), its tasks (`tasks/<module>.py`)
and, when it runs a job, the job's program (`training/<module>.py`, run as `python -m hlat.training.<module>`). From
this table come the CLI's `hlat run <stage>` choices, the parent flow's chain and its progress ("stage k of 6"), each
job's program, shape and runtime cap (infra/stage_jobs.py), the stages `hlat status` lists and `hlat stop` and a
cancelled flow run stop, which upstream outputs enter a stage's cache key (tasks/caching.py), and the stage
deployments that tests/unit/test_stages.py expects in deployments/prefect.yaml. Adding a stage is one row here plus
its three files.
"""

from __future__ import annotations

from dataclasses import dataclass

from hlat.core.layout import (
    BURN_IN_REPORT,
    CHECKPOINTS_DIR,
    COMPILE_CACHE_DIR,
    DATA_DIR,
    EVAL_DIR,
    METRICS_FILE,
    TOKENIZER_DIR,
)

TRAINING = "training-instances"
"""Jobs on the training's instances (job.instance_type x job.instance_count, job.processes_per_node ranks each),
its image, and the XLA/Neuron environment when training runs on XLA."""
DATA = "data-instances"
"""The prepare-data job: data.instance_type, enough instances for data.workers, no input channel."""
EVALUATION = "evaluation-instance"
"""One process on one evaluation.instance_type, with the evaluation's image."""


@dataclass(frozen=True)
class Stage:
    """One stage of the DAG."""

    name: str
    """The flow's name, `hlat run <name>`, the job's stage and its ledger (jobs/<name>-attempts.json)."""
    summary: str
    """What it does, in a line."""
    writes: tuple[str, ...]
    """What it writes into the run (core/layout.py); a stage with a job also writes its ledger under jobs/."""
    runs_on: str | None = None
    """Where its job runs: TRAINING, DATA or EVALUATION; None: in the flow's own process (no job)."""
    cap_hours: float | None = None
    """A cap on its job's runtime below the config's (job.max_runtime_hours, data.max_runtime_hours or
    evaluation.max_runtime_hours); None: the config's alone."""
    inputs: tuple[str, ...] = ()
    """The upstream stages whose outputs (their checksums) enter its cache key."""

    @property
    def module(self) -> str:
        """Its files' name: flows/<module>.py, tasks/<module>.py, training/<module>.py."""
        return self.name.replace("-", "_")

    @property
    def program(self) -> str | None:
        """The module its jobs run (`python -m ...`), or None when it runs no job."""
        return None if self.runs_on is None else f"hlat.training.{self.module}"

    @property
    def on_training_instances(self) -> bool:
        """Its jobs run where training runs, and need what the training's jobs need (XLA, Neuron flags, caches)."""
        return self.runs_on == TRAINING


STAGES: tuple[Stage, ...] = (
    Stage(
        "prepare-data",
        "download or build, validate and shard the corpus (a job of data.workers workers)",
        (f"{DATA_DIR}/",),
        runs_on=DATA,
    ),
    Stage(
        "train-tokenizer",
        "train the SentencePiece tokenizer on a sample of the shards",
        (f"{TOKENIZER_DIR}/",),
        inputs=("prepare-data",),
    ),
    Stage(
        "precompile",
        "build the training step's compiled graphs into the run's compile cache",
        (f"{COMPILE_CACHE_DIR}/",),
        runs_on=TRAINING,
        cap_hours=6.0,
        inputs=("train-tokenizer",),
    ),
    Stage(
        "burn-in",
        "check every device, the collectives and the checkpoint store before training",
        (BURN_IN_REPORT,),
        runs_on=TRAINING,
        cap_hours=1.0,
    ),
    Stage(
        "train",
        "train, relaunching from the newest checkpoint until training.max_steps",
        (f"{CHECKPOINTS_DIR}/", METRICS_FILE),
        runs_on=TRAINING,
        inputs=("prepare-data", "train-tokenizer"),
    ),
    Stage(
        "evaluate",
        "perplexity, lm-eval tasks and the report of a checkpoint",
        (f"{EVAL_DIR}/",),
        runs_on=EVALUATION,
    ),
)

STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
JOB_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.runs_on is not None)
"""The stages that run jobs (each with a ledger in jobs/)."""


def stage(name: str) -> Stage:
    """The row of stage `name`; ValueError naming the stages otherwise."""
    for s in STAGES:
        if s.name == name:
            return s
    raise ValueError(f"unknown stage {name!r}; the stages are {', '.join(STAGE_NAMES)}")
