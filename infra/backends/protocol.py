"""Training jobs: the protocol both job backends implement, job naming, and failure classification.

Backends (`infra.backends.sagemaker`, `infra.backends.local`) report state in SageMaker's vocabulary. The train stage
classifies
each ending with `classify` and relaunches from the newest checkpoint. docs/jobs.md has the rule table.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from hlat.core.config import DEFAULT_NEURON_SDK
from hlat.core.contract import (
    STOP_BUDGET,
    STOP_DEADLINE,
    STOP_UNSUPERVISED,
    FailureRecord,
    StopRecord,
    failure_records,
    parse_failure_record,
    parse_stop_record,
)
from hlat.core.layout import stop_record_path
from hlat.core.run import Run


class Status(StrEnum):
    IN_PROGRESS = "InProgress"
    COMPLETED = "Completed"
    FAILED = "Failed"
    STOPPING = "Stopping"
    STOPPED = "Stopped"


TERMINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.STOPPED})


@dataclass(frozen=True)
class JobSpec:
    """What a backend needs to launch one attempt of a run's job."""

    name: str
    """Deterministic, so a restarted flow finds its job (`job_name`)."""
    run_id: str
    attempt: int
    run_uri: str
    config_uri: str
    instance_type: str
    instance_count: int
    processes_per_node: int
    max_runtime_s: int
    environment: dict[str, str] = field(default_factory=dict)
    """Extra environment for the job's processes; never secrets, which the job description would show."""
    stage: str = "train"
    checkpoint_prefix: str | None = None
    """A run folder SageMaker syncs with /opt/ml/checkpoints; None for every stage, as training writes checkpoints/
    itself."""
    image_uri: str | None = None
    """Container image (SageMaker); None: the default for the instance type."""
    neuron_sdk: str = DEFAULT_NEURON_SDK
    """neuron.sdk: it picks SageMaker's default image and the requirements."""
    entry: str = "hlat.training.train"
    """The program's module; it takes `--config <config_uri>` and `--<key> <value>` per `args` entry."""
    args: dict[str, str] = field(default_factory=dict)
    python: str | None = None
    """Local backend: the program's Python (None: the backend's own). SageMaker ignores it."""
    reads: tuple[str, ...] = ()
    """Other s3:// prefixes the job reads; its run role may read them too."""
    channels: tuple[str, ...] = ("data", "tokenizer")
    """The run's folders given as input channels."""

    def arguments(self) -> list[str]:
        out = ["--config", self.config_uri]
        for key, value in self.args.items():
            out += [f"--{key}", value]
        return out


@dataclass(frozen=True)
class JobState:
    name: str
    status: Status
    failure_reason: str | None = None
    secondary_status: str | None = None
    """SageMaker's finer status (Starting, Training, MaxRuntimeExceeded, ...)."""
    billable_seconds: float = 0.0
    """Billed seconds per instance so far (BillableTimeInSeconds)."""
    instance_count: int = 1
    ended_at: float | None = None
    """Epoch seconds the job ended, as the backend recorded it; ledgers record this, not when they saw it."""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


class JobBackend(Protocol):
    """Submit, describe, stop and read the logs of training jobs.

    Raise `SubmitError` for a refused submission; `describe` returns None for an unknown job."""

    kind: str

    def submit(self, spec: JobSpec) -> None: ...

    def describe(self, name: str) -> JobState | None: ...

    def stop(self, name: str) -> None: ...

    def logs(self, name: str, cursor: Any = None) -> tuple[list[str], Any]:
        """New log lines since `cursor` (None: from the start), and the next cursor."""
        ...

    def dry_run(self, spec: JobSpec) -> list[dict[str, Any]]:
        """The requests `submit(spec)` would make, without making them."""
        ...


class SubmitError(RuntimeError):
    """A refused submission; `code` is the service's error code, classified like a failure reason."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"{code}: {message}")


MAX_JOB_NAME = 63  # SageMaker: ^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}


JOB_NAME_PREFIX = "hlat-"
"""Prefix of every hlat job name; the account's policies scope jobs and log streams by it."""


def job_name(run_id: str, attempt: int, stage: str = "train") -> str:
    """`hlat-<run id>-<stage>-<attempt>`, made SageMaker-safe; long run ids keep a hash so names stay unique."""
    suffix = f"-{stage}-{attempt}"
    base = re.sub(r"[^a-zA-Z0-9]+", "-", run_id).strip("-") or "run"
    room = MAX_JOB_NAME - len(suffix) - len(JOB_NAME_PREFIX)
    if len(base) > room:
        digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
        base = f"{base[: room - 9].rstrip('-')}-{digest}"
    return f"{JOB_NAME_PREFIX}{base}{suffix}"


# -- failure classification -------------------------------------------------------------------------------


class Action(StrEnum):
    DONE = "done"
    RESUME = "resume"
    BACKOFF = "backoff"
    FATAL = "fatal"


class FailureClass(StrEnum):
    """Whose fault an ending was; it decides what a repeat means (docs/jobs.md: "When a job fails")."""

    FATAL = "fatal"
    """The run's settings, data or account: the stage stops at once."""
    JOB = "job"
    """The job's own failure: relaunched; job.max_repeats same causes in a row without a new checkpoint stop the
    stage."""
    PLATFORM = "platform"
    """The platform's fault (dead host, hardware, interruption, hang): relaunched, with back-off when it repeats."""
    CAPACITY = "capacity"
    """No capacity, throttling, transient quota: relaunched after a growing delay."""


@dataclass(frozen=True)
class Decision:
    action: Action
    category: str
    """Short name of the failure class (e.g. 'capacity', 'nan')."""
    reason: str
    failure_class: FailureClass = FailureClass.JOB
    record: FailureRecord | None = None

    @property
    def cause(self) -> str:
        """What makes two endings one failure: category, record type and step.

        A NaN at step 41 on every resume is one cause; at 41 then 57 it is two."""
        return f"{self.category}: {self.record.cause}" if self.record else self.category


class Source(StrEnum):
    """What a failure rule is judged from."""

    RECORD = "record"
    """The job's failure record (`core.contract.FailureRecord`): its type, and its message where needed."""
    STATUS = "status"
    """SageMaker's own fields, for endings no program recorded."""
    TEXT = "text"
    """Words in the FailureReason or log, for endings with neither (e.g. torchrun's `Signal 9 (SIGKILL)`)."""


@dataclass(frozen=True)
class FailureRule:
    pattern: str
    failure_class: FailureClass
    category: str
    example: str
    """A failure reason this rule takes; docs/jobs.md shows it and the tests classify it."""
    source: Source = Source.TEXT
    message: str | None = None
    """A pattern searched in the record's message, for types such as RuntimeError."""

    @property
    def action(self) -> Action:
        return {
            FailureClass.FATAL: Action.FATAL,
            FailureClass.CAPACITY: Action.BACKOFF,
        }.get(self.failure_class, Action.RESUME)

    def takes(self, record: FailureRecord | None, text: str) -> bool:
        if self.source == Source.RECORD:
            if record is None:
                return False
            qualified = f"{record.module}.{record.type}" if record.module else record.type
            if not (re.fullmatch(self.pattern, record.type) or re.fullmatch(self.pattern, qualified)):
                return False
            return self.message is None or re.search(self.message, record.message) is not None
        if record is not None:
            return False
        if self.source == Source.STATUS:
            return re.match(self.pattern, text) is not None
        return re.search(self.pattern, text) is not None


def _record_example(type_name: str, message: str, module: str | None = None, step: int | None = 41) -> str:
    record = FailureRecord(type_name, message, module=module, step=step, rank=3, host="algo-2")
    return f"AlgorithmError: {record.line()}"


# Ordered: the first rule that takes an ending decides (records first; a record rule never looks at prose, and
# status and text rules only judge endings that carry no record).
F, R, S, T = FailureClass, Source.RECORD, Source.STATUS, Source.TEXT
_RUNTIME = r"(torch\.)?\w*Error"
"""Record types that say little by themselves; their message decides."""
FAILURE_RULES: list[FailureRule] = [
    # -- the job's failure record ---------------------------------------------------------------------------------
    FailureRule(r"BurnInFailed", F.FATAL, "burn-in", _record_example("BurnInFailed", "rank 3 matmul error"), R),
    FailureRule(
        r"DataValidationError|SourceError", F.FATAL, "data", _record_example("DataValidationError", "12% bad rows"), R
    ),
    FailureRule(
        r"ConfigError|LayoutError|ValidationError",
        F.FATAL,
        "validation",
        _record_example("ConfigError", "training.lr must be > 0 (killed by SIGKILL? no: a typo)"),
        R,
    ),
    FailureRule(
        r"NeuronUnavailable|ImportError|ModuleNotFoundError",
        F.FATAL,
        "image",
        _record_example("NeuronUnavailable", "neuronx-distributed exists only in the AWS Neuron training container"),
        R,
    ),
    FailureRule(
        r"TransientStorageError|CheckpointError",
        F.CAPACITY,
        "throttling",
        _record_example(
            "CheckpointError", "rank 5 (algo-2) writing s3://b/run/checkpoints/step-40/rank-5.pt: SlowDown"
        ),
        R,
        message=r"SlowDown|Throttl|TooManyRequests|Rate exceeded",
    ),
    FailureRule(
        r"CheckpointError",
        F.FATAL,
        "validation",
        _record_example("CheckpointError", "checkpoint step-30 was written by 8 ranks with ..., this job has 4 ranks"),
        R,
        message=r"was written by .* this job has",
    ),
    FailureRule(
        r"TransientStorageError|CheckpointError",
        F.PLATFORM,
        "storage",
        _record_example("CheckpointError", "not committing step-40: rank-00005.pt (algo-2) missing after 600s"),
        R,
    ),
    FailureRule(
        r"StorageError|StorageNotFound",
        F.FATAL,
        "access",
        _record_example("StorageError", "access denied to s3://b/run: the AWS credentials in use lack permission"),
        R,
    ),
    FailureRule(r"NonFiniteLoss", F.JOB, "nan", _record_example("NonFiniteLoss", "the loss became NaN or inf"), R),
    FailureRule(
        r"LossSpikes", F.FATAL, "loss-spikes", _record_example("LossSpikes", "steps 41-48 spiked 8 in a row"), R
    ),
    FailureRule(
        r"HangDetected",
        F.PLATFORM,
        "hung",
        _record_example("HangDetected", "no step for 1,530 s (bound 1,500 s); every thread's stack is in the log"),
        R,
    ),
    FailureRule(
        r"UnhealthyCollective",
        F.PLATFORM,
        "hardware",
        _record_example("UnhealthyCollective", "all-reduce 0.2 GB/s"),
        R,
    ),
    FailureRule(
        r"(torch\.)?(cuda\.)?OutOfMemoryError|MemoryError",
        F.JOB,
        "out-of-memory",
        _record_example("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB", module="torch"),
        R,
    ),
    FailureRule(
        _RUNTIME,
        F.JOB,
        "out-of-memory",
        _record_example("RuntimeError", "nrt_tensor_allocate status=4 NRT_RESOURCE: failed to allocate HBM"),
        R,
        message=r"NRT_RESOURCE|RESOURCE_EXHAUSTED|[Oo]ut of (device )?memory|[Ff]ailed to allocate",
    ),
    FailureRule(
        _RUNTIME,
        F.PLATFORM,
        "hardware",
        _record_example("RuntimeError", "nrt_execute status=1006 NRT_EXEC_HW_ERR_COLLECTIVES on NeuronCore 3"),
        R,
        message=r"NRT_EXEC_HW_ERR|NRT_EXEC_COMPLETED_WITH_ERR|NRT_TIMEOUT|NRT_UNINITIALIZED|hardware error|"
        r"uncorrectable|ECC error|Xid \d+",
    ),
    FailureRule(
        r"(torch\.distributed\.)?(DistBackendError|DistNetworkError|DistStoreError)",
        F.PLATFORM,
        "lost-peer",
        _record_example("DistNetworkError", "Connection reset by peer", module="torch.distributed"),
        R,
    ),
    FailureRule(
        _RUNTIME,
        F.PLATFORM,
        "lost-peer",
        _record_example("RuntimeError", "[gloo] Connection closed by peer [10.0.1.7]:41230"),
        R,
        message=r"[Cc]onnection (closed|reset|refused)|[Bb]roken pipe|by peer|NCCL (error|WARN)|EFA|"
        r"[Ss]ocket [Tt]imeout",
    ),
    # -- SageMaker's own status fields and error codes (no record: nothing of the job wrote one) -------------------
    # ResourceLimitExceeded: too many jobs, or instances over quota while an earlier job holds them. It clears as they
    # are released, so it backs off; job.max_attempts_without_progress bounds a quota that never grows.
    # https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_CreateTrainingJob.html#API_CreateTrainingJob_Errors
    FailureRule(
        r"ResourceLimitExceeded",
        F.CAPACITY,
        "resource-limit",
        "ResourceLimitExceeded: The account-level service limit 'ml.trn1.32xlarge for training job usage' is 16",
        S,
    ),
    # ResourceInUse: something this run does not supervise holds a name or resource it needs. Waiting does not
    # release it: fatal, for the user to look at.
    FailureRule(r"ResourceInUse", F.FATAL, "in-use", "ResourceInUse: Resource being accessed is in use", S),
    FailureRule(
        r"AccessDenied|UnauthorizedOperation|ExpiredToken|InvalidClientTokenId|UnrecognizedClient",
        F.FATAL,
        "access",
        "AccessDeniedException: not authorized to perform sagemaker:CreateTrainingJob",
        S,
    ),
    FailureRule(
        r"ValidationException|ClientError",
        F.FATAL,
        "validation",
        "ClientError: Data download failed: please ensure the S3 path s3://b/data/ exists",
        S,
    ),
    FailureRule(
        r"CapacityError|InsufficientCapacity",
        F.CAPACITY,
        "capacity",
        "CapacityError: Unable to provision requested ML compute capacity",
        S,
    ),
    FailureRule(
        r"Throttl|ThrottlingException|TooManyRequests|SlowDown|RequestLimitExceeded",
        F.CAPACITY,
        "throttling",
        "ThrottlingException: Rate exceeded",
        S,
    ),
    FailureRule(
        r"InternalServerError|ServiceUnavailable|InternalFailure",
        F.PLATFORM,
        "internal",
        "InternalServerError: the job's daemon process died",
        S,
    ),
    FailureRule(r"MaxRuntimeExceeded", F.PLATFORM, "max-runtime", "MaxRuntimeExceeded: stopped", S),
    FailureRule(r"Interrupted", F.PLATFORM, "interrupted", "Interrupted: stopped", S),
    # A stop the stage did not ask for (StopTrainingJob from elsewhere): the job checkpointed on its SIGTERM.
    FailureRule(r"Stopp(ed|ing)\b", F.PLATFORM, "stopped-elsewhere", "Stopped: stopped", S),
    # -- words, for endings with neither (a rank killed by a signal writes nothing) -------------------------------
    FailureRule(
        r"Signal \d+ \(SIG[A-Z]+\) received by PID|killed by signal SIG[A-Z]+|exitcode\s*:\s*-\d+ ",
        F.PLATFORM,
        "killed",
        "AlgorithmError: CalledProcessError: Command '['torchrun', ...]' returned non-zero exit status 1.\n"
        "[algo-1] traceback : Signal 9 (SIGKILL) received by PID 4242",
        T,
    ),
    FailureRule(
        r"NonFiniteLoss|non-finite loss", F.JOB, "nan", "AlgorithmError: NonFiniteLoss: loss is nan at step 8", T
    ),
    FailureRule(r"BurnInFailed", F.FATAL, "burn-in", "AlgorithmError: BurnInFailed: rank 3 matmul error", T),
    FailureRule(r"LossSpikes", F.FATAL, "loss-spikes", "AlgorithmError: LossSpikes: steps 41-48 spiked 8 in a row", T),
    FailureRule(r"DataValidationError|SourceError", F.FATAL, "data", "AlgorithmError: DataValidationError: 12% bad", T),
    FailureRule(r"ConfigError", F.FATAL, "validation", "AlgorithmError: ConfigError: training.lr must be > 0", T),
    FailureRule(
        r"NRT_RESOURCE|[Oo]ut of memory|OutOfMemoryError|MemoryError",
        F.JOB,
        "out-of-memory",
        "AlgorithmError: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (of 79.1 GiB total capacity)",
        T,
    ),
    FailureRule(
        r"UnhealthyCollective|NRT_EXEC_HW_ERR|NRT_TIMEOUT|hardware (error|failure)|uncorrectable ECC",
        F.PLATFORM,
        "hardware",
        "AlgorithmError: NRT error: NeuronCore 3 hardware failure",
        T,
    ),
]
del F, R, S, T
UNKNOWN = FailureRule(r"", FailureClass.JOB, "unknown", "AlgorithmError: ExecuteUserScriptError: exit code 1")
"""What no rule takes: the job's own fault (e.g. a RuntimeError of our code)."""


def classify_reason(reason: str, log_tail: str = "", first_record: FailureRecord | None = None) -> Decision:
    """Classify a failure reason (or refused submission's code) and the end of the job's log.

    Order: the failure record; SageMaker's own words, which outrank what ranks logged; the first failed rank's
    record in the log; words in the reason or log."""
    record = parse_failure_record(reason)
    if record is None:
        status = next((r for r in FAILURE_RULES if r.source == Source.STATUS and r.takes(None, reason)), None)
        if status is not None:
            return Decision(status.action, status.category, reason, status.failure_class)
    record = first_failure([r for r in (record, first_record) if r is not None] + failure_records(log_tail))
    text = reason if not log_tail else f"{reason}\n{log_tail}"
    rule = next((r for r in FAILURE_RULES if r.source != Source.STATUS and r.takes(record, text)), UNKNOWN)
    return Decision(rule.action, rule.category, reason, rule.failure_class, record)


def _rule_of(record: FailureRecord) -> FailureRule:
    return next((r for r in FAILURE_RULES if r.source == Source.RECORD and r.takes(record, "")), UNKNOWN)


def is_lost_peer(record: FailureRecord) -> bool:
    """A record of a rank that saw a peer go: a consequence of another rank's end, never its cause."""
    return _rule_of(record).category == "lost-peer"


def first_failure(records: list[FailureRecord]) -> FailureRecord | None:
    """The record of the rank that failed first: the earliest by time.

    Lost-peer records count only if there is no other. Untimed records keep their order, after timed ones."""
    if not records:
        return None
    causes = [r for r in records if not is_lost_peer(r)] or records

    def key(indexed: tuple[int, FailureRecord]) -> tuple[int, float, int]:
        i, r = indexed
        return (0, r.time, i) if r.time is not None else (1, 0.0, i)

    return min(enumerate(causes), key=key)[1]


SELF_STOPS = {
    STOP_BUDGET: (Action.FATAL, FailureClass.FATAL),
    STOP_DEADLINE: (Action.FATAL, FailureClass.FATAL),
    STOP_UNSUPERVISED: (Action.RESUME, FailureClass.PLATFORM),
}
"""A self-stopped job's decision, by stop reason (training/stop_rule.py).

A budget or deadline ends the stage. 'no supervisor heartbeat' is relaunched when a supervisor reads it."""


def self_stop(log_tail: str) -> Decision | None:
    """The decision on a self-stopped job, from the stop record in its log (None: none)."""
    record = parse_stop_record(log_tail)
    if record is None or record.why not in SELF_STOPS:
        return None
    action, failure_class = SELF_STOPS[record.why]
    return Decision(action, record.why, record.message, failure_class)


def stored_self_stop(run: Run, job: str, stage: str = "train") -> Decision | None:
    """The decision from the stop record job `job` left in storage, for a supervisor that missed its log."""
    try:
        kept = run.storage.read_json(stop_record_path(stage)) if run.storage.exists(stop_record_path(stage)) else None
    except Exception:  # unreadable: judged as if absent
        return None
    if not isinstance(kept, dict) or kept.get("job") != job:
        return None
    record = StopRecord(str(kept.get("why")), int(kept.get("step") or 0), str(kept.get("message") or ""))
    return self_stop(record.line())


def classify(
    state: JobState, stop_requested: bool = False, log_tail: str = "", first_record: FailureRecord | None = None
) -> Decision:
    """What to do after a job ended.

    `stop_requested`: we stopped it, no failure. `first_record`: the earliest failure record in the whole log,
    since at 8,192 ranks the tail holds only the last."""
    reason = state.failure_reason or state.secondary_status or state.status.value
    if state.status == Status.COMPLETED:
        return self_stop(log_tail) or Decision(Action.DONE, "completed", reason)
    if state.status == Status.STOPPED:
        if stop_requested:
            return Decision(Action.FATAL, "stopped", "stopped on request")
        return classify_reason(f"{state.secondary_status or 'Stopped'}: {state.failure_reason or 'stopped'}")
    return classify_reason(reason, log_tail, first_record)
