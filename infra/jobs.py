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

from hlat.core.layout import CHECKPOINTS_DIR


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
    checkpoint_prefix: str = CHECKPOINTS_DIR
    """Folder of the run that the job's checkpoint folder (/opt/ml/checkpoints) is synced with."""
    image_uri: str | None = None
    """Container image (SageMaker); None: the backend's default for the instance type."""
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
    """Relaunch from the newest checkpoint after a growing delay (capacity, throttling)."""
    FATAL = "fatal"
    """Stop the stage with the reason: relaunching would fail the same way."""


@dataclass(frozen=True)
class Decision:
    action: Action
    category: str
    """Short name of the failure class (e.g. 'capacity', 'hardware', 'nan', 'validation')."""
    reason: str


# Ordered: the first pattern that matches a failure reason (or a submission error code) decides.
_RULES: list[tuple[str, Action, str]] = [
    (r"BurnInFailed", Action.FATAL, "burn-in"),
    (r"DataValidationError|SourceError", Action.FATAL, "data"),
    (r"ResourceLimitExceeded|ResourceInUse|quota", Action.FATAL, "quota"),
    (r"AccessDenied|UnauthorizedOperation|not authorized|ExpiredToken|InvalidClientTokenId", Action.FATAL, "access"),
    (r"CapacityError|InsufficientCapacity|insufficient capacity|capacity", Action.BACKOFF, "capacity"),
    (r"Throttl|SlowDown|TooManyRequests|Rate exceeded", Action.BACKOFF, "throttling"),
    (r"NonFiniteLoss|\bNaN\b|non-finite loss", Action.RESUME, "nan"),
    (r"MaxRuntimeExceeded|max runtime", Action.RESUME, "max-runtime"),
    (r"Interrupted|spot", Action.RESUME, "interrupted"),
    (r"Neuron|NRT|NCCL|nccom|EFA|hardware|ECC|XID|device|UnhealthyCollective", Action.RESUME, "hardware"),
    (r"InternalServerError|ServiceUnavailable|InternalFailure", Action.RESUME, "internal"),
    (r"[Kk]illed|signal|SIGKILL|SIGTERM|OOM|[Oo]ut of memory|hung|no step", Action.RESUME, "killed"),
    (r"ValidationException|ValidationError|ClientError|ConfigError|InvalidParameter", Action.FATAL, "validation"),
]


def classify_reason(reason: str) -> Decision:
    """Classify a failure reason or a submission error. Unknown failures (e.g. an AlgorithmError with no better
    clue) resume: the supervisor turns a repeat with no step gained into a fatal error."""
    for pattern, action, category in _RULES:
        if re.search(pattern, reason):
            return Decision(action, category, reason)
    return Decision(Action.RESUME, "unknown", reason)


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
