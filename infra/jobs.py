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
    reads: tuple[str, ...] = ()
    """s3:// prefixes beyond the run and the shared sources that the job reads (`model.init_from`,
    `tokenizer.pretrained`, `data.sources`): what a run role (infra/run_roles.py) may read besides its own."""
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
    ended_at: float | None = None
    """When the job ended, as the backend recorded it (epoch seconds; SageMaker's TrainingEndTime, the local job's
    status.json): a ledger written after the fact records this, not the time its writer saw the end."""

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


JOB_NAME_PREFIX = "hlat-"
"""Every job hlat names starts with it, so that the account's policies can scope hlat's jobs and their log streams
by name (deployments/account.yaml: `training-job/hlat-*`, log streams `hlat-*`). A re-attached attempt keeps the
name its ledger recorded, whatever scheme named it."""


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
    """Relaunch at once from the newest complete checkpoint."""
    BACKOFF = "backoff"
    """Relaunch from the newest checkpoint after a growing delay (capacity, throttling, a platform fault that
    repeats)."""
    FATAL = "fatal"
    """Stop the stage with the reason: relaunching would fail the same way."""


class FailureClass(StrEnum):
    """Whose fault an ending was, which decides what a repeat of it means (docs/jobs.md: "When a job fails")."""

    FATAL = "fatal"
    """A mistake of the run's settings, data or account: relaunching fails the same way, so the stage stops at once."""
    JOB = "job"
    """The job's own failure (its code, its numbers, its exit): relaunched from the newest checkpoint; the same cause
    ending job.max_repeats attempts in a row with no newer checkpoint committed stops the stage (it repeats
    deterministically)."""
    PLATFORM = "platform"
    """The platform's fault (a dead host or daemon, an internal error, hardware, an interruption, a hang): relaunched
    at once, and after a growing delay when it repeats with no checkpoint gained; job.max_attempts_without_progress
    attempts in a row gaining none stop the stage (as for every class)."""
    CAPACITY = "capacity"
    """No capacity, throttled, a transient quota refusal: relaunched after a growing delay, until
    job.max_attempts_without_progress attempts in a row gained nothing, job.max_restarts or the budget."""


@dataclass(frozen=True)
class Decision:
    action: Action
    category: str
    """Short name of the failure class (e.g. 'capacity', 'hardware', 'nan', 'validation')."""
    reason: str
    failure_class: FailureClass = FailureClass.JOB
    record: FailureRecord | None = None
    """The job's own failure record, when the ending was judged from one."""

    @property
    def cause(self) -> str:
        """What makes two endings the same failure: the category, and the record's type and step when there is one
        (a NaN at step 41 on every resume is one cause; at 41 then at 57 it is two)."""
        return f"{self.category}: {self.record.cause}" if self.record else self.category


class Source(StrEnum):
    """What a failure rule is judged from (the table in docs/jobs.md names it for each row)."""

    RECORD = "record"
    """The job's failure record (core/contract.py `FailureRecord`): its exception type (`pattern`, matched whole
    against the type or module.type) and, where the type alone does not decide, its message (`message`)."""
    STATUS = "status"
    """SageMaker's own fields, for endings no program of the job wrote down: the start of its FailureReason
    (CapacityError, InternalServerError, ClientError), its SecondaryStatus (MaxRuntimeExceeded, Interrupted,
    Stopped) and the error code of a refused request (ThrottlingException, ResourceLimitExceeded...)."""
    TEXT = "text"
    """Words in the FailureReason or the job's log, for endings with neither: a rank killed by a signal (torchrun's
    own account, `Signal 9 (SIGKILL) received by PID`; the local backend's), and reasons written before records."""


@dataclass(frozen=True)
class FailureRule:
    pattern: str
    failure_class: FailureClass
    category: str
    example: str
    """A failure reason this rule takes (with its record, for a record rule): the table in docs/jobs.md shows it, the
    tests classify it."""
    source: Source = Source.TEXT
    message: str | None = None
    """A record rule's pattern for the record's message too (searched): for types that say little by themselves
    (RuntimeError carries a Neuron runtime error, an out-of-memory and a code bug alike)."""

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
"""A record's type that says little by itself: its message decides (RuntimeError, torch.AcceleratorError...)."""
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
    # ResourceLimitExceeded at CreateTrainingJob: "too many training jobs", or instances over the account's quota
    # while an earlier job still holds them (one stopping, a warm pool): it clears as they are released, so it backs
    # off, bounded like every class by job.max_attempts_without_progress (a quota that never grows stops the stage
    # after that many refusals, its message naming the quota).
    # https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_CreateTrainingJob.html#API_CreateTrainingJob_Errors
    FailureRule(
        r"ResourceLimitExceeded",
        F.CAPACITY,
        "resource-limit",
        "ResourceLimitExceeded: The account-level service limit 'ml.trn1.32xlarge for training job usage' is 16",
        S,
    ),
    # ResourceInUse ("Resource being accessed is in use"): a name or resource the request needs is held by something
    # this run does not supervise (its job names are deterministic and the stage's lease admits one supervisor, so
    # not a job of its own). Waiting does not release it: fatal, for the user to look at.
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
        "InternalServerError: the job's supervisor process died",
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
"""Anything no rule takes: the job's own (a record of a type no rule names, e.g. a RuntimeError of our code; an
AlgorithmError with no better clue)."""


def classify_reason(reason: str, log_tail: str = "", first_record: FailureRecord | None = None) -> Decision:
    """Classify a failure reason (or a refused submission's error) and the end of the job's log. By the job's failure
    record when the reason holds one (or an earlier record the supervisor saw in the job's log, `first_record`:
    see `first_failure`); else by SageMaker's own words at the start of the reason (CapacityError,
    InternalServerError...: the platform's judgement comes before whatever a rank logged as a consequence); else by
    the record of the rank that failed first in the log (another host's failure file may be the one reported);
    else by words in the reason or the log."""
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
    """A record of a rank that saw a peer go ('connection closed by peer', a store or collective error): a
    consequence of another rank's end, never its cause."""
    return _rule_of(record).category == "lost-peer"


def first_failure(records: list[FailureRecord]) -> FailureRecord | None:
    """The record of the rank that failed first, of several (the FailureReason's, the ones in the job's log): the
    earliest by its time, a record of a lost peer only when there is no other (every rank of a job whose rank 17 hit
    a bug sees its peers close their connections, and any of their records may be the one SageMaker reports; a host
    lost to the platform writes nothing, so its peers' lost-peer records are all there is). Records without a time
    (written before records had one) keep their order: the first of them, after any timed one."""
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
"""A job that stopped itself at a checkpoint and exited 0 (training/stop_rule.py), by its stop record's reason: the
run's budget or deadline ends the stage (relaunching would stop again at once; the record names the setting to
raise); 'no supervisor heartbeat' is relaunched when a supervisor is there to read it (it is alive after all)."""


def self_stop(log_tail: str) -> Decision | None:
    """The decision on a job that stopped itself, from the stop record in its log (None: it wrote none)."""
    record = parse_stop_record(log_tail)
    if record is None or record.why not in SELF_STOPS:
        return None
    action, failure_class = SELF_STOPS[record.why]
    return Decision(action, record.why, record.message, failure_class)


def stored_self_stop(run: Run, job: str, stage: str = "train") -> Decision | None:
    """The decision on job `job` from the stop record it left in run storage (`core.contract.stop_record_path`),
    for a supervisor that did not see the job's log (one re-attaching after the job ended); None: it left none."""
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
    """What to do after a job ended. `stop_requested`: we stopped it (cancel, budget), so it is not a failure;
    `log_tail`: the last lines of the job's log (a record another host wrote, torchrun's account of a signal, the
    stop record of a job that stopped itself); `first_record`: the earliest failure record the supervisor saw in
    the whole of the job's log (at 8,192 ranks the tail holds only the last of them)."""
    reason = state.failure_reason or state.secondary_status or state.status.value
    if state.status == Status.COMPLETED:
        return self_stop(log_tail) or Decision(Action.DONE, "completed", reason)
    if state.status == Status.STOPPED:
        if stop_requested:
            return Decision(Action.FATAL, "stopped", "stopped on request")
        return classify_reason(f"{state.secondary_status or 'Stopped'}: {state.failure_reason or 'stopped'}")
    return classify_reason(reason, log_tail, first_record)
