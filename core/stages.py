"""The pipeline's stages, in DAG order: one row per stage, read by every layer that needs stages.

A stage is its row, its flow (`flows/<module>.py`), its tasks (`tasks/<module>.py`) and maybe a job program. The row
says when it is done, how its output is identified, where its jobs run (`Instances`), and a few flags. Code outside the
row and the stage's modules never compares a stage's name (tests/unit/test_stage_rows.py). docs/stages.md ("Adding a
stage") gives the recipe."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hlat.core.config import HlatConfig
from hlat.core.layout import (
    BURN_IN_REPORT,
    CHECKPOINTS_DIR,
    COMPILE_CACHE_DIR,
    COMPILE_LATEST,
    DATA_DIR,
    EVAL_DIR,
    EVAL_RESULTS,
    METRICS_FILE,
    TOKENIZER_DIR,
    TOKENIZER_MODEL,
    CheckpointIndex,
    tokenizer_defining_files,
    tokenizer_sha256,
)
from hlat.core.run import Run
from hlat.core.shards import MANIFEST_FILE, data_checksum_of


def setting(config: HlatConfig, dotted: str) -> Any:
    """The value of a dotted config setting (`data.instance_type`)."""
    return functools.reduce(getattr, dotted.split("."), config)


@dataclass(frozen=True, eq=False)
class Instances:
    """Where a stage's jobs run: the settings giving instances, image, runtime and price; compared by identity."""

    name: str
    instance_type: Callable[[HlatConfig], str]
    instance_count: Callable[[HlatConfig], int]
    processes_per_node: Callable[[HlatConfig], int]
    settings: Mapping[str, str]
    """The config setting behind each request field: what a refused request or missing price names."""
    pytorch_image: str = "never"
    """When an empty image setting means AWS's PyTorch image: 'never', 'on-gpu' (p and g instances) or 'always'."""
    requirements: str | None = None
    """What a SageMaker job pip-installs first (deployments/...); None: its Neuron SDK's lock."""
    named_for: str = ""
    """The stage the image and quota checks name for these instances."""

    def max_runtime_hours(self, config: HlatConfig) -> float:
        return float(setting(config, self.settings["max_runtime_hours"]))

    def image_setting(self, config: HlatConfig) -> str | None:
        """The image its setting names (None: the default of `pytorch_image`, or the backend's)."""
        image: str | None = setting(config, self.settings["image_uri"])
        return image

    def price_setting(self, config: HlatConfig) -> str | None:
        """The setting that prices its instance type: its own, or job.price_per_hour_usd on the training's type."""
        own = self.settings.get("price_per_hour_usd")
        instance = self.instance_type(config)
        if own is not None and instance == setting(config, self.settings["instance_type"]):
            return own
        return "job.price_per_hour_usd" if instance == config.job.instance_type else None

    def own_price(self, config: HlatConfig) -> float | None:
        """The configured node-hour price of its instance type (None: the instance catalog's)."""
        name = self.price_setting(config)
        return None if name is None else setting(config, name)


def _data_instances(config: HlatConfig) -> int:
    """One locally (the workers are processes), else data.workers spread data.workers_per_instance a node."""
    d = config.data
    return 1 if config.job.backend == "local" else -(-d.workers // d.workers_per_instance)


TRAINING = Instances(
    "training-instances",
    instance_type=lambda c: c.job.instance_type,
    instance_count=lambda c: c.job.instance_count,
    processes_per_node=lambda c: c.job.processes_per_node,
    settings={
        "instance_type": "job.instance_type",
        "instance_count": "job.instance_count",
        "max_runtime_hours": "job.max_runtime_hours",
        "image_uri": "job.image_uri",
        "price_per_hour_usd": "job.price_per_hour_usd",
    },
    named_for="train",
)
"""Jobs on the training's instances and image, with the XLA/Neuron environment when training runs on XLA."""
DATA = Instances(
    "data-instances",
    instance_type=lambda c: c.data.instance_type if c.job.backend == "sagemaker" else c.job.instance_type,
    instance_count=_data_instances,
    processes_per_node=lambda c: 1,
    settings={
        "instance_type": "data.instance_type",
        "instance_count": "data.workers (with data.workers_per_instance)",
        "max_runtime_hours": "data.max_runtime_hours",
        "image_uri": "data.image_uri",
        "price_per_hour_usd": "data.price_per_hour_usd",
    },
    pytorch_image="always",
    requirements="deployments/data-requirements.lock.txt",
    named_for="prepare-data",
)
"""The prepare-data job: data.instance_type, enough instances for data.workers, no input channel."""
EVALUATION = Instances(
    "evaluation-instance",
    instance_type=lambda c: c.evaluation.instance_type or c.job.instance_type,
    instance_count=lambda c: 1,
    processes_per_node=lambda c: 1,
    settings={
        "instance_type": "evaluation.instance_type",
        "max_runtime_hours": "evaluation.max_runtime_hours",
        "image_uri": "evaluation.image_uri",
    },
    pytorch_image="on-gpu",
    requirements="deployments/eval-requirements.lock.txt",
    named_for="evaluate",
)
"""One process on one evaluation.instance_type, with the evaluation's image."""


# -- what each stage's outputs are: its done check, and its checksum where a later stage keys on it -------------
def _data_done(run: Run, config: HlatConfig) -> bool:
    return run.storage.child(DATA_DIR).exists(MANIFEST_FILE)


def _data_checksum(run: Run) -> str:
    """The prepared shards' checksum (from the mixture's manifest)."""
    return data_checksum_of(run.storage.child(DATA_DIR))


def _tokenizer_done(run: Run, config: HlatConfig) -> bool:
    return bool(tokenizer_defining_files(run.storage.child(TOKENIZER_DIR).list()))  # tokenizer.model or tokenizer.json


def _tokenizer_checksum(run: Run) -> str:
    """The tokenizer's identity as the loader records it (`tokenizer_sha256`)."""
    tokenizer = run.storage.child(TOKENIZER_DIR)
    names = tokenizer_defining_files(tokenizer.list())
    if not names:
        tokenizer.require(TOKENIZER_MODEL, what="tokenizer")  # StorageNotFound naming the missing tokenizer
    return tokenizer_sha256({name: tokenizer.read_bytes(name) for name in names})


def _precompile_done(run: Run, config: HlatConfig) -> bool:
    return run.storage.exists(COMPILE_LATEST)


def _burn_in_done(run: Run, config: HlatConfig) -> bool:
    return run.storage.exists(BURN_IN_REPORT)


def _train_done(run: Run, config: HlatConfig) -> bool:
    newest = CheckpointIndex(run.storage.child(CHECKPOINTS_DIR)).latest_step()
    return newest is not None and newest >= config.training.max_steps


def _evaluate_done(run: Run, config: HlatConfig) -> bool:
    return run.storage.exists(EVAL_RESULTS)


@dataclass(frozen=True)
class Stage:
    """One stage of the DAG."""

    name: str
    """The flow's name, `hlat run <name>`, the job's stage and its ledger (jobs/<name>-attempts.json)."""
    summary: str
    """What it does, in a line."""
    writes: tuple[str, ...]
    """What it writes into the run (core/layout.py); a job stage also writes its ledger under jobs/."""
    done: Callable[[Run, HlatConfig], bool]
    """Whether its outputs are in the run: status shows it done and its tasks trust the cache."""
    runs_on: Instances | None = None
    """Where its job runs: TRAINING, DATA or EVALUATION; None: in the flow's own process (no job)."""
    cap_hours: float | None = None
    """A cap on its job's runtime below its instances' setting; None: the setting's alone."""
    inputs: tuple[str, ...] = ()
    """The upstream stages whose outputs (their checksums) enter its cache key."""
    checksum: Callable[[Run], str] | None = None
    """The identity of its output, for the cache keys of the stages that name it in `inputs`."""
    switch: str | None = None
    """A boolean setting that turns the stage on (None: always); off, its jobs need no quota."""
    beside: str | None = None
    """A setting that, when set, also runs its jobs during training (beside the training's jobs)."""
    prepares_sources: bool = False
    """It reads data.source into the shared sources, and its job gets the stage's cache key."""
    trains: bool = False
    """Its job trains to training.max_steps: the run's stop terms, tracking, and checkpoint progress in status."""
    compiles: bool = False
    """Its job builds compiled graphs (on trn1: under neuron_parallel_compile)."""
    takes_checkpoint: bool = False
    """`hlat run <name>` takes --step and --averaged (the checkpoint it reads)."""

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
        return self.runs_on is TRAINING

    def enabled(self, config: HlatConfig) -> bool:
        """Whether the config runs it (its `switch`)."""
        return self.switch is None or bool(setting(config, self.switch))

    def output_checksum(self, run: Run) -> str:
        """The checksum of what it wrote into `run`; ValueError for a stage whose output nothing keys on."""
        if self.checksum is None:
            raise ValueError(f"the {self.name} stage's output has no checksum: no stage may name it in its inputs")
        return self.checksum(run)


STAGES: tuple[Stage, ...] = (
    Stage(
        "prepare-data",
        "download or build, validate and shard the corpus (a job of data.workers workers)",
        (f"{DATA_DIR}/",),
        _data_done,
        runs_on=DATA,
        checksum=_data_checksum,
        prepares_sources=True,
    ),
    Stage(
        "train-tokenizer",
        "train the SentencePiece tokenizer on a sample of the shards",
        (f"{TOKENIZER_DIR}/",),
        _tokenizer_done,
        inputs=("prepare-data",),
        checksum=_tokenizer_checksum,
    ),
    Stage(
        "precompile",
        "build the training step's compiled graphs into the run's compile cache",
        (f"{COMPILE_CACHE_DIR}/",),
        _precompile_done,
        runs_on=TRAINING,
        cap_hours=6.0,
        inputs=("train-tokenizer",),
        switch="precompile.enabled",
        compiles=True,
    ),
    Stage(
        "burn-in",
        "check every device, the collectives and the checkpoint store before training",
        (BURN_IN_REPORT,),
        _burn_in_done,
        runs_on=TRAINING,
        cap_hours=1.0,
        switch="burn_in.enabled",
    ),
    Stage(
        "train",
        "train, relaunching from the newest checkpoint until training.max_steps",
        (f"{CHECKPOINTS_DIR}/", METRICS_FILE),
        _train_done,
        runs_on=TRAINING,
        inputs=("prepare-data", "train-tokenizer"),
        trains=True,
    ),
    Stage(
        "evaluate",
        "perplexity, lm-eval tasks and the report of a checkpoint",
        (f"{EVAL_DIR}/",),
        _evaluate_done,
        runs_on=EVALUATION,
        beside="evaluation.every_steps",
        takes_checkpoint=True,
    ),
)
"""The table. Read it through the functions below, so a test may extend it."""


def stages() -> tuple[Stage, ...]:
    """The rows, in DAG order."""
    return STAGES


def stage_names() -> tuple[str, ...]:
    return tuple(s.name for s in STAGES)


def job_stages() -> tuple[str, ...]:
    """The stages that run jobs (each with a ledger in jobs/)."""
    return tuple(s.name for s in STAGES if s.runs_on is not None)


def stage(name: str) -> Stage:
    """The row of stage `name`; ValueError naming the stages otherwise."""
    for s in STAGES:
        if s.name == name:
            return s
    raise ValueError(f"unknown stage {name!r}; the stages are {', '.join(stage_names())}")


def training_stage() -> Stage:
    """The row whose job trains (`trains`)."""
    return next(s for s in STAGES if s.trains)
