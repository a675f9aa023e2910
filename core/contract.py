"""The job contract: what a job program and its launcher (SageMaker, or the local job backend) agree on.

Exit codes tell the launcher what happened; the failure reason (at most MAX_FAILURE_REASON characters, written to
the failure file) tells it why. Jobs honour SageMaker's training-container contract (on SageMaker, or under the
local job backend, which plays SageMaker's part). Checkpoints go straight to the run's checkpoints/ (S3, or a
shared file system), from every rank of every host, inside a job as outside: SageMaker's own checkpoint folder
(`/opt/ml/checkpoints`, CheckpointConfig) is local to each instance, so rank 0 on the first host would never see
the files the other hosts' ranks write there, and every start would copy the whole checkpoint history onto every
host. Data and tokenizer are read from the job's input channels (SM_CHANNEL_DATA, SM_CHANNEL_TOKENIZER);
TensorBoard events go to /opt/ml/output/tensorboard, SageMaker's default; and the reason of a failure is written
to /opt/ml/output/failure, which SageMaker reports as the job's FailureReason (so the train stage can tell a NaN
exit from a bug even when torchrun hides the exit code). Elsewhere everything lives in run storage (TensorBoard
only when run storage is local).

Imported by the job programs (`training/`) and by the control plane (`infra/`): no torch, no Prefect.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone

from hlat.core.config import HlatConfig, validate_config
from hlat.core.layout import CHECKPOINTS_DIR, TOKENIZER_DIR, TOKENIZER_FILES, tokenizer_defining_files
from hlat.core.run import Run
from hlat.core.storage import Storage, StorageNotFound

EXIT_NAN = 3
"""The loss became NaN or inf with training.nan_policy=exit: relaunch from the last checkpoint (HLAT)."""

EXIT_BURN_IN_FAILED = 4
"""The burn-in program (`training.burn_in`) found a rank below its instance type's floors or computing wrong results;
its report (burn-in/report.json) and the failure reason (`BurnInFailed: ...`) name the ranks."""

EXIT_UNHEALTHY = 5
"""A periodic health check inside training (burn_in.health_check_every) found the all-reduce wrong or below its
bandwidth floor (`UnhealthyCollective: ...`): relaunch, on other nodes if it repeats, from the last checkpoint."""

EXIT_DATA_INVALID = 6
"""The prepare-data job (`training.prepare_data`) met data its policy refuses (data.validation.policy=fail, an empty
source, too many duplicates...): not worth relaunching; the failure reason (`DataValidationError: ...`) says where."""

EXIT_LOSS_SPIKES = 7
"""training.spike_skip skipped training.spike_max_consecutive steps in a row: the run diverged. Deterministic (the same
data and weights spike again), so not relaunched; the failure reason (`LossSpikes: ...`) names the steps."""

EXIT_HUNG = 8
"""The job's hang watchdog (`training/watchdog.py`) saw no progress for longer than its bound: every thread's stack is
in the log and the failure reason (`HangDetected: ...`) names the step and the bound; relaunch from the last
checkpoint."""

TRACKED_BY_STAGE_ENV = "HLAT_TRACKED_BY_STAGE"
"""Set in a training job whose metrics the train stage logs into the tracked run (`tasks.tracking.MetricsMirror`:
SageMaker's): the job then opens no tracker of its own."""

SAGEMAKER_CHECKPOINT_DIR = "/opt/ml/checkpoints"
SAGEMAKER_TENSORBOARD_DIR = "/opt/ml/output/tensorboard"
SAGEMAKER_FAILURE_FILE = "/opt/ml/output/failure"
MAX_FAILURE_REASON = 1024  # SageMaker's FailureReason limit

log = logging.getLogger("hlat.train")


def in_sagemaker() -> bool:
    return "SM_TRAINING_ENV" in os.environ or "SM_CURRENT_HOST" in os.environ


def checkpoint_location(run: Run) -> Storage:
    """Where the job's checkpoints go: the run's checkpoints/, whichever host a rank is on (HLAT_CHECKPOINT_DIR
    overrides it, e.g. a shared FSx path)."""
    if "HLAT_CHECKPOINT_DIR" in os.environ:
        return Storage(os.environ["HLAT_CHECKPOINT_DIR"])
    return run.storage.child(CHECKPOINTS_DIR)


def channel_location(run: Run, channel: str) -> Storage:
    """The run's `channel`/ folder, or the job's local copy of it when the job has that input channel."""
    local = os.environ.get(f"SM_CHANNEL_{channel.upper()}")
    return Storage(local) if local else run.storage.child(channel)


def tensorboard_location(run: Run) -> str | None:
    if in_sagemaker():
        return os.environ.get("SM_TENSORBOARD_DIR", SAGEMAKER_TENSORBOARD_DIR)
    return run.storage.path("tensorboard") if run.storage.is_local else None


def failure_file() -> str | None:
    if "HLAT_FAILURE_FILE" in os.environ:
        return os.environ["HLAT_FAILURE_FILE"]
    return SAGEMAKER_FAILURE_FILE if in_sagemaker() else None


# -- the failure record: why a job failed, in a form the control plane reads without guessing from prose -----------
RECORD_TAG = "hlat-failure"
"""Marks a failure record inside any text: SageMaker's FailureReason (the failure file, after its own prefix) or a
line of the job's log, whichever reaches the control plane (`infra.backends.protocol.classify`)."""
_RECORD = re.compile(r"\[" + RECORD_TAG + r" (\{[^{}]*\})\]")
_current_step: int | None = None


FAILURE_FILE_BUDGET = MAX_FAILURE_REASON - 160
"""Characters a failure record may take in the failure file. SageMaker reports the file as its FailureReason after
its own prefix ("AlgorithmError: ") and cuts the whole at MAX_FAILURE_REASON; the room left over also takes the
words a launcher may put before the file's text (the SageMaker SDK's driver, torchrun's summary). A record written
within it, its fields first, reaches the control plane whole."""


@dataclass(frozen=True)
class FailureRecord:
    """Why a job program failed: the exception's type (and module, for library errors), the step the job had
    reached, the rank and host that failed and when (epoch seconds by that host's clock), and the message. Written
    as one line, `[hlat-failure {"type": ..., "step": ..., "rank": ..., "host": ..., "time": ...}] <type>:
    <message>`: the fields first, so a cut (SageMaker's 1,024-character FailureReason, after its prefix) only
    shortens the message, and the line stays readable. Lines of the older form, the fields last, still parse."""

    type: str
    message: str
    module: str | None = None
    step: int | None = None
    rank: int | None = None
    host: str | None = None
    time: float | None = None
    """When the failing process wrote it (epoch seconds, its host's clock): of several ranks' records, the earliest
    names the rank that failed first (the others saw its peers leave). None in records written before times."""

    def line(self, limit: int = FAILURE_FILE_BUDGET) -> str:
        fields = {
            "type": self.type, "module": self.module, "step": self.step, "rank": self.rank, "host": self.host,
            "time": None if self.time is None else round(self.time, 3),
        }  # fmt: skip
        # No braces inside the record (the pattern above matches a flat object): a host or module name has none.
        head = f"[{RECORD_TAG} {json.dumps({k: v for k, v in fields.items() if v is not None}, sort_keys=True)}]"
        text = f"{head} {self.type}: {' '.join(self.message.split())}"
        if len(text) > limit:
            text = text[: max(len(head), limit - 3)] + "..."
        return text

    @property
    def cause(self) -> str:
        """What makes two failures the same: the type and the step it happened at."""
        return f"{self.type} at step {self.step}" if self.step is not None else self.type


def parse_failure_record(text: str | None) -> FailureRecord | None:
    """The last failure record in `text` (None: there is none, or it does not parse)."""
    records = failure_records(text)
    return records[-1] if records else None


def failure_records(text: str | None) -> list[FailureRecord]:
    """Every failure record in `text`, in order (one per line at most: a record is one line)."""
    if not text:
        return []
    out = []
    for line in text.splitlines():
        if RECORD_TAG in line and (record := _parse_line(line)) is not None:
            out.append(record)
    return out


def _parse_line(line: str) -> FailureRecord | None:
    for match in reversed(list(_RECORD.finditer(line))):
        try:
            fields = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(fields, dict) or not isinstance(fields.get("type"), str):
            continue
        kind = fields["type"]
        after, before = line[match.end() :].strip(), line[: match.start()].strip()
        # The message follows '<type>: ' after the record (this form) or before it (the older one, fields last),
        # with any prefix (SageMaker's 'AlgorithmError: ', a log line's rank) in front.
        if after.startswith(f"{kind}: ") or after == f"{kind}:":
            message = after[len(kind) + 1 :].strip()
        else:
            _, sep, message = before.partition(f"{kind}: ")
            message = message if sep else (after or before)
        step, rank, when = fields.get("step"), fields.get("rank"), fields.get("time")
        return FailureRecord(
            type=kind,
            message=message,
            module=fields.get("module"),
            step=step if isinstance(step, int) else None,
            rank=rank if isinstance(rank, int) else None,
            host=fields.get("host") if isinstance(fields.get("host"), str) else None,
            time=float(when) if isinstance(when, int | float) and not isinstance(when, bool) else None,
        )
    return None


def note_step(step: int) -> None:
    """Remember the step the job has reached (the training loop calls this after each step): a failure record
    written later names it, so a failure that repeats at the same step on every resume is seen to."""
    global _current_step
    _current_step = step


def current_host() -> str:
    """This process's host as the job knows it: SageMaker's host name (algo-N), else the machine's."""
    return os.environ.get("SM_CURRENT_HOST") or socket.gethostname()


def failure_record(type_name: str, message: str, module: str | None = None) -> FailureRecord:
    """A record of this process's failure: the step noted last, its rank and its host."""
    rank = os.environ.get("RANK")
    return FailureRecord(
        type=type_name,
        message=message,
        module=module,
        step=_current_step,
        rank=int(rank) if rank is not None and rank.isdigit() else None,
        host=current_host(),
        time=time.time(),
    )


def write_failure(reason: str, module: str | None = None) -> FailureRecord:
    """Record why the job failed, as a failure record (`FailureRecord`), where its backend reports it from (the
    failure file: SageMaker's FailureReason), and as one line of the job's log (which reaches the control plane
    even when another host's failure file is the one reported). `reason` is '<Type>: <message>'; text without a
    type is recorded as JobFailure. The first reason stays: every process of an instance shares the file, and the
    rank that failed first says why; the others only see the collective it left (as the SageMaker SDK's driver,
    which writes the file only when it does not exist)."""
    kind, sep, message = reason.partition(": ")
    if not sep or not kind.replace("_", "").replace(".", "").isalnum():
        kind, message = "JobFailure", reason
    record = failure_record(kind, message, module)
    line = record.line()
    path = failure_file()
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "x", encoding="utf-8") as fh:
                fh.write(line)
        except FileExistsError:
            return record  # another rank of this host said why first, and logged it: one line per host, not 32
        except OSError as exc:  # never mask the failure being reported
            log.warning("could not write the failure reason to %s: %s", path, exc)
    log.error("%s", line)
    return record


# -- what every job program (train, precompile, burn_in, evaluate, prepare_data) starts and ends with -----------
def job_arguments(
    prog: str, description: str | None, argv: list[str] | None, more: Callable[[argparse.ArgumentParser], None] | None
) -> argparse.Namespace:
    """Parse `--config <uri> [--device ...]` (plus the program's own options) and set up per-rank logging."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=True, help="path or s3:// URI of the run's config.json")
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda", "xla"],
        help="the job's device (default: the config's training.device; see training/parallel/distributed.py)",
    )
    if more:
        more(parser)
    args = parser.parse_args(argv)
    args.config = args.config.rstrip("/")
    # force: a library imported first (NxD configures logging at import) must not decide the job's log format.
    logging.basicConfig(level=logging.INFO, format="rank" + os.environ.get("RANK", "0") + " %(message)s", force=True)
    return args


def read_job_config(config_uri: str) -> Run:
    """The run whose config.json `config_uri` names (data/, tokenizer/, checkpoints/ are its folder's children),
    its config validated once here."""
    folder, _, name = config_uri.rstrip("/").rpartition("/")
    storage = Storage(folder or ".")
    return Run.at(storage.url, validate_config(storage.read_json(name)))


def fetch_tokenizer(run: Run, folder: str) -> str:
    """Copy the tokenizer's files (from the job's tokenizer channel, or the run) into `folder`; the path of the file
    that defines it (tokenizer.model where there is one, else tokenizer.json: what `Tokenizer.load` reads)."""
    source = channel_location(run, TOKENIZER_DIR)
    present = [name for name in source.list() if name in TOKENIZER_FILES]
    defining = tokenizer_defining_files(present)
    if not defining:
        raise StorageNotFound(
            f"{source.uri()} holds no tokenizer (tokenizer.model or tokenizer.json): run the train-tokenizer stage"
        )
    os.makedirs(folder, exist_ok=True)
    for name in present:
        source.get_file(name, os.path.join(folder, name))
    return os.path.join(folder, defining[0])


def model_follows_tokenizer(cfg: HlatConfig, tokenizer_vocab: int) -> tuple[HlatConfig, str | None]:
    """The config a job trains with, given the size of the run's tokenizer (ids 0 .. tokenizer_vocab - 1), and a line
    saying what changed (None: nothing did).

    With tokenizer.pretrained, model.vocab_size becomes the tokenizer's (the model's embedding is then padded to
    model.vocab_multiple, and the config's checks run again on the new size); the stored config keeps what the user
    wrote, so this runs wherever a job builds its model. A trained tokenizer has model.vocab_size pieces: the config
    stays, and one with more ids than the model has rows is refused (its ids would index past the embedding)."""
    m = cfg.model
    if cfg.tokenizer.pretrained is None:
        if tokenizer_vocab > m.vocab_size:
            raise ValueError(
                f"the run's tokenizer has {tokenizer_vocab} ids but model.vocab_size={m.vocab_size}: re-run the "
                "train-tokenizer stage for this model.vocab_size"
            )
        return cfg, None
    if tokenizer_vocab == m.vocab_size:
        return cfg, None
    data = cfg.model_dump(mode="json")
    data["model"]["vocab_size"] = tokenizer_vocab
    followed = validate_config(data)
    padded = followed.model.padded_vocab_size
    rows = (
        f", padded to {padded} rows by model.vocab_multiple={m.vocab_multiple}"
        if padded != tokenizer_vocab
        else f" ({padded} rows: model.vocab_multiple={m.vocab_multiple} adds none)"
    )
    return followed, f"model.vocab_size {m.vocab_size} -> {tokenizer_vocab} (the tokenizer's){rows}"


def reporting_failure(program: Callable[[], int]) -> int:
    """Run a job program; an exception becomes the job's failure record (its type, module, step, rank, host and
    message), then propagates."""
    try:
        return program()
    except Exception as exc:
        module = type(exc).__module__
        write_failure(f"{type(exc).__name__}: {exc}", module=None if module == "builtins" else module)
        raise


# -- the stop rule: what a training job is told of the run's budget, deadline and supervision ----------------------
# The train stage puts these in the job's environment (infra/stage_jobs.py); the job's stop rule reads them
# (training/stop_rule.py) and stops the job at a checkpoint, whether or not anything still watches it.
BUDGET_ENV = "HLAT_BUDGET_USD"
"""The run's training budget in dollars, the figure the supervisor enforces (job.budget_usd, or on SageMaker 1.25 x
the plan's estimate); absent: no budget."""
SPENT_ENV = "HLAT_SPENT_USD"
"""Dollars the run's earlier training jobs were billed (the ended attempts of jobs/train-attempts.json at submit)."""
PRICE_ENV = "HLAT_PRICE_PER_HOUR_USD"
"""What this job costs per hour: the node-hour price x its instance count."""
DEADLINE_ENV = "HLAT_DEADLINE"
"""The run's deadline (job.deadline), ISO 8601 with a time zone; absent: none."""
SUBMITTED_ENV = "HLAT_SUBMITTED_AT"
"""When the job was submitted, in seconds since the epoch: where its bill is counted from (on SageMaker a little
before billing starts, so the job stops early rather than late), and the last sign of life of the supervisor that
submitted it."""
UNSUPERVISED_ENV = "HLAT_UNSUPERVISED_STOP_S"
"""Seconds without a supervisor heartbeat after which the job stops itself (job.unsupervised_stop_minutes); absent:
never."""

STOP_BUDGET, STOP_DEADLINE, STOP_UNSUPERVISED = "budget", "deadline", "unsupervised"
"""Why a job stopped itself (`StopRecord.why`)."""


def _number(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "").strip()
    return float(raw) if raw else None


@dataclass(frozen=True)
class StopTerms:
    """When a training job must stop, whoever watches it: the run's budget (what is left of it at this job's price)
    and its deadline, and how long it may go without a supervisor's heartbeat. Travels in the job's environment."""

    budget_usd: float | None = None
    spent_usd: float = 0.0
    price_per_hour_usd: float = 0.0
    deadline: float | None = None
    """Epoch seconds."""
    submitted_at: float | None = None
    unsupervised_stop_s: float | None = None

    def environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        if self.budget_usd is not None:
            env[BUDGET_ENV] = repr(float(self.budget_usd))
            env[SPENT_ENV] = repr(float(self.spent_usd))
            env[PRICE_ENV] = repr(float(self.price_per_hour_usd))
        if self.deadline is not None:
            env[DEADLINE_ENV] = datetime.fromtimestamp(self.deadline, timezone.utc).isoformat()
        if self.submitted_at is not None:
            env[SUBMITTED_ENV] = repr(float(self.submitted_at))
        if self.unsupervised_stop_s is not None:
            env[UNSUPERVISED_ENV] = repr(float(self.unsupervised_stop_s))
        return env

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> StopTerms:
        env = os.environ if env is None else env
        deadline = env.get(DEADLINE_ENV, "").strip()
        return cls(
            budget_usd=_number(env, BUDGET_ENV),
            spent_usd=_number(env, SPENT_ENV) or 0.0,
            price_per_hour_usd=_number(env, PRICE_ENV) or 0.0,
            deadline=datetime.fromisoformat(deadline).timestamp() if deadline else None,
            submitted_at=_number(env, SUBMITTED_ENV),
            unsupervised_stop_s=_number(env, UNSUPERVISED_ENV),
        )

    @property
    def any(self) -> bool:
        """Whether there is anything to enforce."""
        budget = self.budget_usd is not None and self.price_per_hour_usd > 0
        return budget or self.deadline is not None or self.unsupervised_stop_s is not None

    def budget_end(self, start: float) -> float | None:
        """When the budget is spent if this job is billed from `start` (None: no budget, or a job costing nothing)."""
        if self.budget_usd is None or self.price_per_hour_usd <= 0:
            return None
        return start + (self.budget_usd - self.spent_usd) / self.price_per_hour_usd * 3600.0

    def limit_at(self, start: float) -> tuple[float, str] | None:
        """The earliest of the budget's end and the deadline, and which it is ('budget', 'deadline'); None: neither."""
        ends = ((self.budget_end(start), STOP_BUDGET), (self.deadline, STOP_DEADLINE))
        known = [(t, why) for t, why in ends if t is not None]
        return min(known) if known else None


STOP_TAG = "hlat-stop"
"""Marks a stop record in a job's log: how the supervisor tells a job that stopped itself from one that finished
short (`infra.backends.protocol.classify`)."""
_STOP = re.compile(r"\[" + STOP_TAG + r" (\{[^{}]*\})\]")


@dataclass(frozen=True)
class StopRecord:
    """Why a job stopped itself at a checkpoint (and exited 0): 'budget', 'deadline' or 'unsupervised', the step it
    saved, and one line for the user naming the setting to change. Logged as `StoppedItself: <message> [hlat-stop
    {"step": ..., "why": ...}]` and kept in run storage (`stop_record_path`)."""

    why: str
    step: int
    message: str

    def line(self) -> str:
        tail = json.dumps({"why": self.why, "step": self.step}, sort_keys=True)
        return f"StoppedItself: {' '.join(self.message.split())} [{STOP_TAG} {tail}]"


def parse_stop_record(text: str | None) -> StopRecord | None:
    """The last stop record in `text` (None: none)."""
    for line in reversed((text or "").splitlines()):
        match = _STOP.search(line)
        if not match:
            continue
        try:
            fields = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(fields, dict) or not isinstance(fields.get("why"), str):
            continue
        head = line[: match.start()].strip()
        _, sep, message = head.partition("StoppedItself: ")
        step = fields.get("step")
        return StopRecord(fields["why"], step if isinstance(step, int) else 0, message if sep else head)
    return None


STEP_LINE = re.compile(
    r"\bstep (?P<step>\d+) loss (?P<loss>\S+) grad_norm (?P<grad_norm>\S+) lr (?P<lr>\S+) (?P<tps>[\d.]+) tok/s"
)
"""The trainer's progress line, as the supervisor reads it from the job's log (`parse_step_line`)."""

STEP_LINE_METRICS = {
    "loss": r"step \d+ loss (\S+) grad_norm",
    "grad_norm": r"grad_norm (\S+) lr",
    "tokens_per_s": r"lr \S+ ([0-9.]+) tok/s",
}
"""SageMaker's metric definitions: each value's regex in the progress line (CloudWatch metrics)."""


@dataclass(frozen=True)
class StepLine:
    """One logged step of a training job: the supervisor's progress, ETA, hang timeout and throughput come from it.

    The loop writes it at each logged step (`format_step_line`). The supervisor parses it (`parse_step_line`).
    A value that is not a finite number parses as None.
    """

    step: int
    loss: float | None
    grad_norm: float | None
    lr: float | None
    tokens_per_s: float | None


def format_step_line(step: int, loss: float, grad_norm: float, lr: float, tokens_per_s: float) -> str:
    """The progress line of `step`: "step 120 loss 5.4321 grad_norm 0.812 lr 1.99e-03 45000 tok/s"."""
    return f"step {step} loss {loss:.4f} grad_norm {grad_norm:.3f} lr {lr:.2e} {tokens_per_s:.0f} tok/s"


def parse_step_line(line: str) -> StepLine | None:
    """The progress line found in `line` (a log line may carry a prefix); None when it holds none."""
    match = STEP_LINE.search(line)
    if match is None:
        return None
    return StepLine(
        step=int(match["step"]),
        loss=_finite(match["loss"]),
        grad_norm=_finite(match["grad_norm"]),
        lr=_finite(match["lr"]),
        tokens_per_s=_finite(match["tps"]),
    )


def _finite(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
