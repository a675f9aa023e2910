"""Training jobs: the one protocol both job backends implement, job naming, and failure classification.

A backend runs a job described by a `JobSpec` and reports its state in SageMaker's vocabulary (InProgress,
Completed, Failed with a FailureReason, Stopping, Stopped), whether the job is a SageMaker training job
(`infra.sagemaker_jobs`) or a process group on this machine (`infra.local_jobs`). The train stage above them
(`infra.supervisor`) submits, polls, classifies each ending with `classify` and relaunches from the newest
checkpoint.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from hlat.core.config import DEFAULT_NEURON_SDK


class Status(StrEnum):
    IN_PROGRESS = "InProgress"
    COMPLETED = "Completed"
    FAILED = "Failed"
    STOPPING = "Stopping"
    STOPPED = "Stopped"


TERMINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.STOPPED})


@dataclass(frozen=True)
class JobSpec:
    """Everything a backend needs to launch one attempt of a run's training (or precompile) job."""

    name: str
    """Deterministic job name (`job_name(run_id, attempt)`): a restarted flow finds the job it launched."""
    run_id: str
    attempt: int
    run_uri: str
    """The run's storage root (local folder or s3:// prefix); the job reads data/ and tokenizer/ from it."""
    config_uri: str
    """The run's config.json, passed to the entrypoint as `--config` (not as hyperparameters)."""
    instance_type: str
    instance_count: int
    processes_per_node: int
    max_runtime_s: int
    environment: dict[str, str] = field(default_factory=dict)
    """Extra environment for the job's processes (never secrets: it is visible in the job description)."""
    stage: str = "train"
    """What the job does (tagged on the job): 'train', 'precompile', 'burn-in'."""
    checkpoint_prefix: str | None = None
    """A folder of the run that SageMaker keeps the job's node-local /opt/ml/checkpoints in sync with
    (CheckpointConfig); None (every stage's job): no CheckpointConfig. Training writes its checkpoints to the run's
    checkpoints/ itself: /opt/ml/checkpoints is local to each instance, so rank 0 could not commit a checkpoint
    whose files other hosts wrote, and SageMaker would copy the whole prefix onto every host at each start."""
    image_uri: str | None = None
    """Container image (SageMaker); None: the backend's default for the instance type."""
    neuron_sdk: str = DEFAULT_NEURON_SDK
    """The Neuron SDK release of a training, precompile or burn-in job (neuron.sdk): SageMaker's default image and
    the requirements installed on it (`core.environment.NEURON_SDKS`)."""
    entry: str = "hlat.training.train"
    """The program's module; it takes `--config <config_uri>` and `--<key> <value>` for each of `args`."""
    args: dict[str, str] = field(default_factory=dict)
    python: str | None = None
    """Local backend: the Python interpreter that runs the program (None: the backend's own); SageMaker ignores it
    (the image decides)."""
    channels: tuple[str, ...] = ("data", "tokenizer")
    """The run's folders the job gets as input channels (SageMaker InputDataConfig; local: links): none for
    prepare-data, which writes data/."""

    def arguments(self) -> list[str]:
        """The program's command-line arguments."""
        out = ["--config", self.config_uri]
        for key, value in self.args.items():
            out += [f"--{key}", value]
        return out


@dataclass(frozen=True)
class JobState:
    """A job's state as the backend last saw it."""

    name: str
    status: Status
    failure_reason: str | None = None
    secondary_status: str | None = None
    """SageMaker's finer status (Starting, Downloading, Training, MaxRuntimeExceeded, Interrupted...)."""
    billable_seconds: float = 0.0
    """Wall-clock seconds billed per instance so far (SageMaker's BillableTimeInSeconds, or elapsed while running)."""
    instance_count: int = 1

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


class JobBackend(Protocol):
    """Submit, describe, stop and read the logs of training jobs. Implementations raise `SubmitError` when a
    submission is refused, and return None from `describe` for a job that does not exist."""

    kind: str

    def submit(self, spec: JobSpec) -> None: ...

    def describe(self, name: str) -> JobState | None: ...

    def stop(self, name: str) -> None: ...

    def logs(self, name: str, cursor: Any = None) -> tuple[list[str], Any]:
        """New log lines since `cursor` (None: from the start), and the cursor to pass next time."""
        ...

    def dry_run(self, spec: JobSpec) -> list[dict[str, Any]]:
        """The requests `submit(spec)` would make, without making them."""
        ...


class SubmitError(RuntimeError):
    """A submission was refused: `code` is the service's error code (ValidationException, ResourceLimitExceeded,
    ThrottlingException...), classified like a failure reason."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"{code}: {message}")


MAX_JOB_NAME = 63  # SageMaker: ^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}


def job_name(run_id: str, attempt: int, stage: str = "train") -> str:
    """`<run id>-<stage>-<attempt>`, made SageMaker-safe; long run ids keep a hash so names stay unique."""
    suffix = f"-{stage}-{attempt}"
    base = re.sub(r"[^a-zA-Z0-9]+", "-", run_id).strip("-") or "run"
    room = MAX_JOB_NAME - len(suffix)
    if len(base) > room:
        digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
        base = f"{base[: room - 9].rstrip('-')}-{digest}"
    return f"{base}{suffix}"


# -- failure classification -------------------------------------------------------------------------------


class Action(StrEnum):
    DONE = "done"
    RESUME = "resume"
    """Relaunch at once from the newest complete checkpoint."""
    BACKOFF = "backoff"
    """Relaunch from the newest checkpoint after a growing delay (capacity, throttling, a platform fault that
    repeats)."""
    FATAL = "fatal"
    """Stop the stage with the reason: relaunching would fail the same way."""


class FailureClass(StrEnum):
    """Whose fault an ending was, which decides what a repeat of it means (README: "When a job fails")."""

    FATAL = "fatal"
    """A mistake of the run's settings, data or account: relaunching fails the same way, so the stage stops at once."""
    JOB = "job"
    """The job's own failure (its code, its numbers, its exit): relaunched from the newest checkpoint; the same
    failure twice in a row with no step gained stops the stage (it repeats deterministically)."""
    PLATFORM = "platform"
    """The platform's fault (a dead host or daemon, an internal error, hardware, an interruption, a hang): relaunched
    at once, and after a growing delay when it repeats with no step gained; it never stops the stage by repeating,
    only job.max_restarts or the budget do."""
    CAPACITY = "capacity"
    """No capacity, or throttled: relaunched after a growing delay, until job.max_restarts or the budget."""


@dataclass(frozen=True)
class Decision:
    action: Action
    category: str
    """Short name of the failure class (e.g. 'capacity', 'hardware', 'nan', 'validation')."""
    reason: str
    failure_class: FailureClass = FailureClass.JOB


@dataclass(frozen=True)
class FailureRule:
    pattern: str
    failure_class: FailureClass
    category: str
    example: str
    """A failure reason this rule takes: the README's table shows it, the tests classify it."""

    @property
    def action(self) -> Action:
        return {
            FailureClass.FATAL: Action.FATAL,
            FailureClass.CAPACITY: Action.BACKOFF,
        }.get(self.failure_class, Action.RESUME)


# Ordered: the first pattern that matches a failure reason (or a submission error code) decides.
F = FailureClass
FAILURE_RULES: list[FailureRule] = [
    FailureRule(r"BurnInFailed", F.FATAL, "burn-in", "AlgorithmError: BurnInFailed: rank 3 matmul error"),
    FailureRule(r"DataValidationError|SourceError", F.FATAL, "data", "AlgorithmError: DataValidationError: 12% bad"),
    FailureRule(r"ResourceLimitExceeded|ResourceInUse|quota", F.FATAL, "quota", "ResourceLimitExceeded: quota"),
    FailureRule(
        r"AccessDenied|UnauthorizedOperation|not authorized|ExpiredToken|InvalidClientTokenId",
        F.FATAL,
        "access",
        "AccessDeniedException: not authorized to perform sagemaker:CreateTrainingJob",
    ),
    FailureRule(
        r"CapacityError|InsufficientCapacity|insufficient capacity|capacity",
        F.CAPACITY,
        "capacity",
        "CapacityError: Unable to provision requested ML compute capacity",
    ),
    FailureRule(
        r"Throttl|SlowDown|TooManyRequests|Rate exceeded",
        F.CAPACITY,
        "throttling",
        "ThrottlingException: Rate exceeded",
    ),
    FailureRule(
        r"NonFiniteLoss|\bNaN\b|non-finite loss", F.JOB, "nan", "AlgorithmError: NonFiniteLoss: loss is nan at step 8"
    ),
    FailureRule(r"MaxRuntimeExceeded|max runtime", F.PLATFORM, "max-runtime", "MaxRuntimeExceeded: stopped"),
    FailureRule(r"Interrupted|spot", F.PLATFORM, "interrupted", "Interrupted: stopped"),
    # A stop the stage did not ask for (StopTrainingJob from elsewhere): the job checkpointed on its SIGTERM.
    FailureRule(r"^Stopp(ed|ing)\b", F.PLATFORM, "stopped-elsewhere", "Stopped: stopped"),
    FailureRule(
        r"Neuron|NRT|NCCL|nccom|EFA|hardware|ECC|XID|device|UnhealthyCollective",
        F.PLATFORM,
        "hardware",
        "AlgorithmError: NRT error: NeuronCore 3 hardware failure",
    ),
    FailureRule(
        r"InternalServerError|ServiceUnavailable|InternalFailure",
        F.PLATFORM,
        "internal",
        "InternalServerError: the job's supervisor process died",
    ),
    FailureRule(
        r"OOM|[Oo]ut of memory|MemoryError", F.JOB, "out-of-memory", "AlgorithmError: RuntimeError: CUDA out of memory"
    ),
    FailureRule(
        r"[Kk]illed|signal|SIGKILL|SIGTERM|hung|no step|[Cc]onnection (closed|reset)|peer",
        F.PLATFORM,
        "killed",
        "AlgorithmError: training process killed by signal SIGKILL (exit code 137)",
    ),
    FailureRule(
        r"ValidationException|ValidationError|ClientError|ConfigError|InvalidParameter",
        F.FATAL,
        "validation",
        "AlgorithmError: ConfigError: training.lr must be > 0",
    ),
]
del F
UNKNOWN = FailureRule(r"", FailureClass.JOB, "unknown", "AlgorithmError: ExecuteUserScriptError: exit code 1")
"""Anything no rule names: the job's own (an AlgorithmError with no better clue)."""


def classify_reason(reason: str) -> Decision:
    """Classify a failure reason or a submission error by the first rule of FAILURE_RULES whose pattern it matches."""
    rule = next((r for r in FAILURE_RULES if re.search(r.pattern, reason)), UNKNOWN)
    return Decision(rule.action, rule.category, reason, rule.failure_class)


def classify(state: JobState, stop_requested: bool = False) -> Decision:
    """What to do after a job ended. `stop_requested`: we stopped it (cancel, budget), so it is not a failure."""
    reason = state.failure_reason or state.secondary_status or state.status.value
    if state.status == Status.COMPLETED:
        return Decision(Action.DONE, "completed", reason)
    if state.status == Status.STOPPED:
        if stop_requested:
            return Decision(Action.FATAL, "stopped", "stopped on request")
        return classify_reason(f"{state.secondary_status or 'Stopped'}: {state.failure_reason or 'stopped'}")
    return classify_reason(reason)
