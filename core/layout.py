"""The run layout: every file and folder of a run named once, and how to find its committed checkpoints.

docs/stages.md ("What a run writes") draws the tree. Every path built from a run is built here: names, and
small functions for the paths that take a stage, step or job. tests/unit/test_layers.py finds none elsewhere.
Finding checkpoints needs no torch: `CheckpointIndex` lists and validates them (marker, meta.json, sizes).
`training.checkpoint.CheckpointManager` adds saving, loading and pruning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hlat.core.storage import Storage, storage_errors

log = logging.getLogger("hlat.training.checkpoint")

CONFIG_FILE = "config.json"
DATA_DIR = "data"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_MODEL = "tokenizer.model"
"""A sentencepiece model: what the tokenizer stage trains, and what LLaMA's Hugging Face folders hold too."""
TOKENIZER_SPECIALS = ("tokenizer_config.json", "special_tokens_map.json")
"""The Hugging Face files that name a tokenizer.json's special tokens (its EOS and BOS among them)."""
TOKENIZER_FILES = (TOKENIZER_MODEL, "tokenizer.json", *TOKENIZER_SPECIALS, "added_tokens.json", "chat_template.jinja")
"""The files of a Hugging Face tokenizer folder that `AutoTokenizer.from_pretrained` reads: what is copied of one.
tokenizer.json is a Hugging Face `tokenizers` tokenizer (GPT-NeoX's folders hold only that one)."""
COMPILE_CACHE_DIR = "compile-cache"
COMPILE_LATEST_FILE = "latest.json"
COMPILE_LATEST = f"{COMPILE_CACHE_DIR}/{COMPILE_LATEST_FILE}"
"""The precompile stage's record of the cache it built (its key and status): written last."""
TORCH_CACHE_DIR = "torch"
XLA_CACHE_DIR = "xla"
"""torch-xla's persistent compilation cache, per key (XLA jobs off trn1: the XLA:CPU rehearsal)."""
NEURON_CACHE_DIR = "neuron"
NEURON_CACHE = f"{COMPILE_CACHE_DIR}/{NEURON_CACHE_DIR}"
"""The Neuron compiler's cache (NEURON_COMPILE_CACHE_URL of trn1 jobs)."""
BURN_IN_DIR = "burn-in"
BURN_IN_REPORT = f"{BURN_IN_DIR}/report.json"
CHECKPOINTS_DIR = "checkpoints"
TRACKING_DIR = "tracking"
"""tracking.backend's local files: tracking.json (the tracked run's id), a local MLflow store, W&B's offline runs."""
AVERAGED_DIR = "averaged"
"""`hlat average`'s checkpoints: the mean of the last K checkpoints' weights, as step-N (N: the newest averaged)."""
METRICS_FILE = "metrics.jsonl"
EVAL_DIR = "eval"
EVAL_RESULTS_FILE = "results.json"
JOBS_DIR = "jobs"
COMPARE_DIR = "compare"
"""`hlat compare`'s output beside run A: compare/<label B>/."""
JOB_LOG_FILE = "output.log"
"""In a local job's folder: the supervisor's messages and the processes' output."""
SOURCES_DIR = "sources"
"""Beside the runs, under the storage root: `sources/<name>-<key>/`, each prepared source (its manifest, shards and
report), keyed by its reader, validation, curation and shard settings and its content: shared by every run that
prepares the same source the same way, so adding a source or changing weights prepares nothing twice."""
MANIFEST_FILE = "manifest.json"
"""A data folder's manifest (the run's data/ mixture, a prepared source's shards), written last."""
REPORT_FILE = "report.json"
"""A stage folder's report (data/, tokenizer/, a prepared source's)."""
DATA_MANIFEST = f"{DATA_DIR}/{MANIFEST_FILE}"
DATA_REPORT = f"{DATA_DIR}/{REPORT_FILE}"
EVAL_RESULTS = f"{EVAL_DIR}/{EVAL_RESULTS_FILE}"
"""The evaluation the report describes (written last)."""
EVAL_REPORT_FILE = "report.md"
EVAL_REPORT = f"{EVAL_DIR}/{EVAL_REPORT_FILE}"
ALERTS_DIR = "alerts"
ALERTS_SENT = f"{ALERTS_DIR}/sent.json"
"""What a run's alerts already announced: {"budget_fractions": [...], "spikes_skipped": n, "relaunch": attempt}."""
TRACKING_RECORD = f"{TRACKING_DIR}/tracking.json"
"""Which tracked run the hlat run logs into: {"backend", "run_id" (MLflow) or "id" (W&B), ...}."""
IMPORT_DIR = "init"
IMPORT_RECORD = f"{IMPORT_DIR}/import.json"
"""The run's record of the weights it started from (model.init_from)."""
IMPORTS_DIR = "imports"
"""Beside the runs, under the storage root: `imports/<sha256>/`, local init_from weights uploaded for S3 runs."""
STAGE_DIRS = (DATA_DIR, TOKENIZER_DIR, COMPILE_CACHE_DIR, BURN_IN_DIR, CHECKPOINTS_DIR, EVAL_DIR)
"""The folders each stage writes, in the DAG's order."""


def tokenizer_defining_files(names: Iterable[str]) -> list[str]:
    """Of a tokenizer folder's file `names`, those that decide its token ids: tokenizer.model alone where there is
    one (sentencepiece is preferred: it also holds its EOS and BOS), otherwise tokenizer.json and the files beside
    it that name its special tokens. Empty: no tokenizer."""
    present = set(names)
    if TOKENIZER_MODEL in present:
        return [TOKENIZER_MODEL]
    if "tokenizer.json" in present:
        return ["tokenizer.json", *(name for name in TOKENIZER_SPECIALS if name in present)]
    return []


def tokenizer_sha256(contents: Mapping[str, bytes]) -> str:
    """The identity of a tokenizer from its defining files' bytes (`tokenizer_defining_files`): one file's sha256
    (so a trained tokenizer's is its tokenizer.model's, as the loader states of earlier runs recorded), several
    files' the sha256 of their `sha256sum` lines in name order."""
    if len(contents) == 1:
        return hashlib.sha256(next(iter(contents.values()))).hexdigest()
    lines = "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in sorted(contents.items()))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def source_folder(root: Storage, name: str, key: str) -> Storage:
    """Where the source `name` prepared under cache key `key` lives: `<storage root>/sources/<name>-<key>/`
    (`root`: the storage root, `Run.root`)."""
    return root.child(SOURCES_DIR, f"{name}-{key.rpartition('-')[2][:16]}")


def import_folder(root: Storage, sha256: str) -> Storage:
    """Where local init_from weights are uploaded for a run on S3: `<storage root>/imports/<sha256>/`."""
    return root.child(IMPORTS_DIR, sha256[:32])


# -- jobs/: each stage's ledger, supervisor heartbeat, lease, stop request and stop record -------------------------
def ledger_path(stage: str) -> str:
    """The stage's attempts ledger, relative to the run."""
    return f"{JOBS_DIR}/{stage}-attempts.json"


def heartbeat_path(stage: str = "train") -> str:
    """The heartbeat the stage's supervisor writes each poll and its job reads, relative to the run:
    {"beat_at": epoch seconds, "pid", "host", "flow_run_id", "command"}."""
    return f"{JOBS_DIR}/{stage}-supervisor.json"


def lease_path(stage: str) -> str:
    """The lease that makes one supervisor the stage's only one, relative to the run."""
    return f"{JOBS_DIR}/{stage}-lease.json"


def stop_request_path(stage: str) -> str:
    """`hlat stop`'s request that the stage relaunch nothing, relative to the run."""
    return f"{JOBS_DIR}/{stage}-stop-request.json"


def stop_record_path(stage: str = "train") -> str:
    """Where a job that stopped itself leaves its `StopRecord` (the newest one), relative to the run."""
    return f"{JOBS_DIR}/{stage}-stop.json"


def clock_probe_path(stage: str | None = None, side: str = "supervisor") -> str:
    """The object written to read run storage's clock: `hlat status`'s (no stage), or a stage's supervisor's or
    job's."""
    return f"{JOBS_DIR}/status-clock" if stage is None else f"{JOBS_DIR}/{stage}-clock-{side}"


def job_log_path(job_name: str) -> str:
    """The local backend's log of one job (its folder's JOB_LOG_FILE), relative to the run."""
    return f"{JOBS_DIR}/{job_name}/{JOB_LOG_FILE}"


CHECKPOINT_MARKER = "COMMITTED"
"""A checkpoint folder counts only once this file exists: {"step", "meta_sha256"}, written last."""
CHECKPOINT_META = "meta.json"
STEP_DIR = re.compile(r"step-(\d+)")
PINS_DIR = "pins"
"""Under checkpoints/: one file per pinned step, named like its folder (`pins/step-000001000`). Retention never
deletes a pinned checkpoint. Not a step folder's name, so `all_steps` never takes it for one."""


def step_dir(step: int) -> str:
    """`step-000001000` for step 1000: 9 digits, so names sort by step."""
    return f"step-{step:09d}"


def shard_file(shard: str) -> str:
    """A sharded checkpoint's file of one model-parallel shard (e.g. "tp01-pp00")."""
    return f"model-{shard}.pt"


def eval_path(*parts: str) -> str:
    """A file or folder under the run's eval/ (`eval_path("step-000000600", "results.json")`)."""
    return "/".join((EVAL_DIR, *parts))


def compare_path(label: str) -> str:
    """`hlat compare`'s output folder for run B's `label`, under run A."""
    return f"{COMPARE_DIR}/{label}"


def eval_results_path(step: int, averaged: bool = False) -> str:
    """Where the evaluation of checkpoint `step` is written, relative to the run (an averaged checkpoint's beside
    the trained step's, under averaged-step-N)."""
    return f"{EVAL_DIR}/{'averaged-' if averaged else ''}{step_dir(step)}/{EVAL_RESULTS_FILE}"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names it and why."""


class CheckpointIndex:
    """The checkpoints under one folder (a run's checkpoints/): which exist, which are complete, their meta.json."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def all_steps(self) -> list[int]:
        """Steps of every checkpoint folder, complete or not, ascending."""
        steps = []
        for name in self.storage.list():
            match = STEP_DIR.fullmatch(name)
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps)

    def committed_steps(self) -> list[int]:
        """Steps whose folder has the commit marker (not otherwise validated), ascending."""
        return [s for s in self.all_steps() if self.storage.exists(f"{step_dir(s)}/{CHECKPOINT_MARKER}")]

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (None: none); newer broken ones are skipped with a warning."""
        for step in reversed(self.all_steps()):
            problem = self._problem(step)
            if problem is None:
                return step
            log.warning("skipping checkpoint %s: %s", self.storage.uri(step_dir(step)), problem)
        return None

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest complete checkpoint's (step, meta.json), each validated once (None: none); newer broken ones
        are skipped with a warning. What one rank reads at resume and shares with the others."""
        for step in reversed(self.all_steps()):
            problem, meta = self._check(step)
            if problem is None and meta is not None:
                return step, meta
            log.warning("skipping checkpoint %s: %s", self.storage.uri(step_dir(step)), problem)
        return None

    def read_meta(self, step: int) -> dict[str, Any]:
        """meta.json of a committed checkpoint."""
        problem, meta = self._check(step)
        if problem is not None or meta is None:
            raise CheckpointError(f"checkpoint {self.storage.uri(step_dir(step))} is not usable: {problem}")
        return meta

    # -- pins: checkpoints retention must keep (queued for evaluation) ---------------------------------------
    def pin(self, step: int, why: str = "") -> None:
        """Keep checkpoint `step` from retention until `unpin(step)` (a small file under pins/)."""
        self.storage.write_json(f"{PINS_DIR}/{step_dir(step)}", {"step": step, "why": why})

    def unpin(self, step: int) -> None:
        self.storage.remove(f"{PINS_DIR}/{step_dir(step)}")
        if self.storage.is_local:  # S3 has no folders; a local one left empty would linger beside the steps
            with contextlib.suppress(OSError):
                os.rmdir(self.storage.path(PINS_DIR))

    def pinned_steps(self) -> list[int]:
        """Steps pinned against retention, ascending (one LIST of pins/)."""
        return sorted(int(m.group(1)) for m in map(STEP_DIR.fullmatch, self.storage.list(PINS_DIR)) if m)

    def _problem(self, step: int) -> str | None:
        """Why checkpoint `step` is not complete, or None when it is."""
        return self._check(step)[0]

    def _check(self, step: int) -> tuple[str | None, dict[str, Any] | None]:
        """(why checkpoint `step` is not complete, None) or (None, its meta.json): one listing of its folder and
        one GET each of the marker and meta.json."""
        folder = step_dir(step)
        meta = None
        try:
            sizes = self._file_sizes(folder)
            if CHECKPOINT_MARKER not in sizes:
                return f"no {CHECKPOINT_MARKER} marker (an interrupted save)", None
            if CHECKPOINT_META not in sizes:
                return f"{CHECKPOINT_META} is missing", None
            meta_bytes = self.storage.read_bytes(f"{folder}/{CHECKPOINT_META}", one_request=True)
            marker = json.loads(self.storage.read_bytes(f"{folder}/{CHECKPOINT_MARKER}", one_request=True))
            if marker.get("meta_sha256") != hashlib.sha256(meta_bytes).hexdigest():
                return f"{CHECKPOINT_META} does not match the sha256 recorded in {CHECKPOINT_MARKER}", None
            meta = json.loads(meta_bytes)
            if meta.get("step") != step:
                return f"{CHECKPOINT_META} is for step {meta.get('step')}", None
            for shard in meta.get("shards") or ():
                if shard_file(shard) not in meta["files"]:
                    return f"{CHECKPOINT_META} lists shard {shard!r} but not its file {shard_file(shard)}", None
            for name, info in meta["files"].items():
                if name not in sizes:
                    return f"{name} is missing", None
                if sizes[name] != info["size"]:
                    return f"{name} is {sizes[name]} bytes, {info['size']} were written (truncated or replaced)", None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"unreadable ({type(exc).__name__}: {exc})", None
        return None, meta

    def _file_sizes(self, folder: str) -> dict[str, int]:
        # One listing (paginated on S3) instead of a HEAD request per file: thousands of ranks mean thousands
        # of rank files.
        path = self.storage.path(folder)
        with storage_errors(self.storage.uri(folder)):
            if not self.storage.fs.exists(path):
                return {}
            entries = self.storage.fs.ls(path, detail=True)
        sizes = {}
        for entry in entries:
            if entry.get("type") == "file":
                sizes[str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]] = int(entry["size"])
        return sizes


# -- from a run's checkpoint ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointRef:
    """One committed checkpoint of a run, found from a checkpoint folder, a checkpoints folder or a run folder."""

    checkpoints: Storage
    """The run's checkpoints/ folder."""
    step: int
    run_folder: Storage | None
    """The folder above checkpoints/ (a run's) when it has one: where tokenizer/ is."""

    @property
    def uri(self) -> str:
        return self.checkpoints.uri(step_dir(self.step))


def locate_checkpoint(source: str, step: int | None = None) -> CheckpointRef:
    """Resolve `source`: `<run>/checkpoints/step-000000600` (that step), `<run>/checkpoints` or `<run>` (the
    newest complete checkpoint, or `step`). Raises CheckpointError saying what is missing."""
    source = source.rstrip("/")
    parent, _, name = source.rpartition("/")
    match = STEP_DIR.fullmatch(name)
    if match:
        if step is not None and step != int(match.group(1)):
            raise CheckpointError(f"{source} is step {int(match.group(1))}, not the step {step} asked for")
        checkpoints, step = Storage(parent or "."), int(match.group(1))
    else:
        folder = Storage(source)
        checkpoints = folder.child(CHECKPOINTS_DIR) if folder.exists(CHECKPOINTS_DIR) else folder
    if not checkpoints.exists():
        raise CheckpointError(f"no checkpoint at {source}: {checkpoints.uri()} does not exist")
    manager = CheckpointIndex(checkpoints)
    if step is None:
        step = manager.latest_step()
        if step is None:
            raise CheckpointError(
                f"no complete checkpoint under {checkpoints.uri()} (none has its {CHECKPOINT_MARKER} marker); "
                "train first, or pass a checkpoint folder step-NNNNNNNNN"
            )
    if step not in manager.all_steps():
        # A step that was never saved (or was pruned): say which exist, not why a folder is incomplete.
        committed = manager.committed_steps()
        have = ", ".join(str(s) for s in committed) if committed else "none"
        raise CheckpointError(
            f"no checkpoint of step {step} under {checkpoints.uri()}: the committed steps are {have}; "
            "ask for one of them (--step N), or for no step to get the newest"
        )
    manager.read_meta(step)  # raises CheckpointError naming the problem of an incomplete checkpoint
    base, _, last = checkpoints.uri().rstrip("/").rpartition("/")
    above = Storage(base) if last in (CHECKPOINTS_DIR, AVERAGED_DIR) and base else None
    return CheckpointRef(checkpoints=checkpoints, step=step, run_folder=above)
