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
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass

from hlat.core.config import HlatConfig, validate_config
from hlat.core.layout import CHECKPOINTS_DIR, TOKENIZER_DIR, TOKENIZER_MODEL
from hlat.core.storage import Storage

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

SAGEMAKER_CHECKPOINT_DIR = "/opt/ml/checkpoints"
SAGEMAKER_TENSORBOARD_DIR = "/opt/ml/output/tensorboard"
SAGEMAKER_FAILURE_FILE = "/opt/ml/output/failure"
MAX_FAILURE_REASON = 1024  # SageMaker's FailureReason limit

log = logging.getLogger("hlat.train")


def in_sagemaker() -> bool:
    return "SM_TRAINING_ENV" in os.environ or "SM_CURRENT_HOST" in os.environ


def checkpoint_location(run: Storage) -> Storage:
    """Where the job's checkpoints go: the run's checkpoints/, whichever host a rank is on (HLAT_CHECKPOINT_DIR
    overrides it, e.g. a shared FSx path)."""
    if "HLAT_CHECKPOINT_DIR" in os.environ:
        return Storage(os.environ["HLAT_CHECKPOINT_DIR"])
    return run.child(CHECKPOINTS_DIR)


def channel_location(run: Storage, channel: str) -> Storage:
    """The run's `channel`/ folder, or the job's local copy of it when the job has that input channel."""
    local = os.environ.get(f"SM_CHANNEL_{channel.upper()}")
    return Storage(local) if local else run.child(channel)


def tensorboard_location(run: Storage) -> str | None:
    if in_sagemaker():
        return os.environ.get("SM_TENSORBOARD_DIR", SAGEMAKER_TENSORBOARD_DIR)
    return run.path("tensorboard") if run.is_local else None


def failure_file() -> str | None:
    if "HLAT_FAILURE_FILE" in os.environ:
        return os.environ["HLAT_FAILURE_FILE"]
    return SAGEMAKER_FAILURE_FILE if in_sagemaker() else None


# -- the failure record: why a job failed, in a form the control plane reads without guessing from prose -----------
RECORD_TAG = "hlat-failure"
"""Marks a failure record inside any text: SageMaker's FailureReason (the failure file, after its own prefix) or a
line of the job's log, whichever reaches the control plane (`infra.jobs.classify`)."""
_RECORD = re.compile(r"\[" + RECORD_TAG + r" (\{[^{}]*\})\]")
_current_step: int | None = None


@dataclass(frozen=True)
class FailureRecord:
    """Why a job program failed: the exception's type (and module, for library errors), the step the job had
    reached, the rank and host that failed first, and the message. Written as one line,
    `<type>: <message> [hlat-failure {"type": ..., "step": ..., "rank": ..., "host": ...}]`: readable as it
    stands, and the record's fields at its end survive SageMaker's 1,024-character FailureReason (the message is cut
    to make room)."""

    type: str
    message: str
    module: str | None = None
    step: int | None = None
    rank: int | None = None
    host: str | None = None

    def line(self, limit: int = MAX_FAILURE_REASON) -> str:
        fields = {"type": self.type, "module": self.module, "step": self.step, "rank": self.rank, "host": self.host}
        # No braces inside the record (the pattern above matches a flat object): a host or module name has none.
        tail = f" [{RECORD_TAG} {json.dumps({k: v for k, v in fields.items() if v is not None}, sort_keys=True)}]"
        head = f"{self.type}: {' '.join(self.message.split())}"
        room = limit - len(tail)
        if len(head) > room:
            head = head[: max(0, room - 3)] + "..."
        return head + tail

    @property
    def cause(self) -> str:
        """What makes two failures the same: the type and the step it happened at."""
        return f"{self.type} at step {self.step}" if self.step is not None else self.type


def parse_failure_record(text: str | None) -> FailureRecord | None:
    """The last failure record in `text` (None: there is none, or it does not parse)."""
    if not text:
        return None
    found = _RECORD.findall(text)
    for raw in reversed(found):
        try:
            fields = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(fields, dict) or not isinstance(fields.get("type"), str):
            continue
        start = text.rfind(f"[{RECORD_TAG} {raw}]")
        line_start = text.rfind("\n", 0, start) + 1
        head = text[line_start:start].strip()
        # The message is what follows '<type>: ' on the record's own line (any prefix, e.g. SageMaker's, before it).
        _, sep, message = head.partition(f"{fields['type']}: ")
        step, rank = fields.get("step"), fields.get("rank")
        return FailureRecord(
            type=fields["type"],
            message=message if sep else head,
            module=fields.get("module"),
            step=step if isinstance(step, int) else None,
            rank=rank if isinstance(rank, int) else None,
            host=fields.get("host") if isinstance(fields.get("host"), str) else None,
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


def read_job_config(config_uri: str) -> tuple[Storage, HlatConfig]:
    """The run (the config's folder: data/, tokenizer/, checkpoints/ are its children) and its validated config."""
    folder, _, name = config_uri.rstrip("/").rpartition("/")
    run = Storage(folder or ".")
    return run, validate_config(run.read_json(name))


def fetch_tokenizer(run: Storage, folder: str) -> str:
    """Copy the sentencepiece model (from the job's tokenizer channel, or the run) into `folder`; its path."""
    path = os.path.join(folder, TOKENIZER_MODEL)
    channel_location(run, TOKENIZER_DIR).get_file(TOKENIZER_MODEL, path)
    return path


def reporting_failure(program: Callable[[], int]) -> int:
    """Run a job program; an exception becomes the job's failure record (its type, module, step, rank, host and
    message), then propagates."""
    try:
        return program()
    except Exception as exc:
        module = type(exc).__module__
        write_failure(f"{type(exc).__name__}: {exc}", module=None if module == "builtins" else module)
        raise
