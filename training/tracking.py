"""Experiment tracking in the team's own tool (`tracking.backend`: mlflow or wandb), beside metrics.jsonl and the
TensorBoard files: one tracked run per hlat run, which every attempt resumes.

- **One run.** Its id is recorded in `<run>/tracking/tracking.json` by whoever opens it first (the first stage's
  flow, or the first training job); later attempts, relaunches and re-attached flows read it. Without the record an
  MLflow run is found by its `hlat.run_id` tag (or a run named as the hlat run: SageMaker's MlflowConfig names one),
  and a W&B run has a stable id derived from the hlat run id (`wandb.init(id=..., resume="allow")`).
- **Every step once.** A resumed job re-trains the steps after its checkpoint with bitwise the same values, so the
  tracker logs only steps past the last one the store already holds: MLflow's run carries `hlat.logged_step`, set in
  the same `log_batch` request as the metrics it covers; W&B's offline files are read back
  (`wandb_offline_history`), and an online resumed run reports its next step. What the store lacks of the history
  a job keeps at its resume (a W&B offline attempt killed before `finish` leaves an empty file; a store that was
  down) is logged from metrics.jsonl first (`MetricsLog.resume_at`).
- **Never in the way.** The training job logs at MetricsLog's flushes (before each checkpoint and at exit) the
  records it already holds: no extra host read. A store that fails is warned about once and left alone for the rest
  of the job; metrics.jsonl stays the record.

Only rank 0 tracks. Nothing here imports torch: the flows' tasks use it too (tasks/tracking.py). MLflow's Python
API: https://mlflow.org/docs/latest/api_reference/python_api/mlflow.client.html; W&B's `wandb.init`:
https://docs.wandb.ai/ref/python/sdk/functions/init/ and resuming: https://docs.wandb.ai/guides/runs/resuming/.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from hlat.core.config import ConfigError, HlatConfig
from hlat.core.layout import TRACKING_DIR, TRACKING_RECORD
from hlat.core.run import Run

log = logging.getLogger("hlat.tracking")

RUN_TAG = "hlat.run_id"
"""MLflow tag naming the hlat run a tracked run belongs to (how a run without its record is found)."""
LOGGED_TAG = "hlat.logged_step"
"""MLflow tag: the last step whose metrics the run holds, every metric of it."""
STORAGE_TAG = "hlat.storage"
"""The run's storage URI (MLflow tag; W&B config key)."""
MLFLOW_DB = "mlflow.db"
BATCH_METRICS = 1000
"""MLflow's log_batch limits: 1000 metrics, 100 params, 100 tags per request
(https://mlflow.org/docs/latest/api_reference/rest-api.html#log-batch)."""
BATCH_PARAMS = 100
PARAM_CHARS = 6000
"""The longest param value MLflow stores (longer config values are cut, marked with '...')."""

Record = tuple[int, Mapping[str, Any]]
"""(step, values) as MetricsLog records them."""


# -- what is tracked ------------------------------------------------------------------------------------------
def numeric(values: Mapping[str, Any]) -> dict[str, float]:
    """The values of a metrics record a tracker plots: finite numbers (a bool as 0/1); strings and None are left
    out (metrics.jsonl keeps them)."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, bool) or (isinstance(value, int | float) and math.isfinite(value)):
            out[key] = float(value)
    return out


def flat_config(cfg: HlatConfig) -> dict[str, str]:
    """The config as flat 'section.field' -> text params (lists and dicts as JSON)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            out[prefix] = text if len(text) <= PARAM_CHARS else text[: PARAM_CHARS - 3] + "..."

    walk("", cfg.model_dump(mode="json"))
    return out


def wandb_run_id(hlat_run_id: str) -> str:
    """A W&B run id stable per hlat run: the hlat run id with anything but letters, digits, '-' and '_' replaced
    (W&B run ids may not hold '/', ':' ...)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", hlat_run_id)[:128]


def mlflow_tracking_uri(cfg: HlatConfig, run: Run) -> str:
    """The MLflow store of `run`: tracking.mlflow_tracking_uri, else the SageMaker tracking server's ARN (the
    sagemaker-mlflow plugin takes it as the URI), else a SQLite store in a local run's tracking/ folder."""
    t = cfg.tracking
    if t.mlflow_tracking_uri:
        return t.mlflow_tracking_uri
    if t.mlflow_tracking_server_arn:
        return t.mlflow_tracking_server_arn
    if not run.storage.is_local:
        raise ConfigError(
            f"tracking.backend=mlflow for a run in {run.uri}: the default store (SQLite in the run's tracking/ folder) "
            "needs a local run; set tracking.mlflow_tracking_uri (an MLflow server) or "
            "tracking.mlflow_tracking_server_arn (SageMaker's managed MLflow)"
        )
    return f"sqlite:///{Path(run.storage.path(TRACKING_DIR)).resolve() / MLFLOW_DB}"


def check_tracking(cfg: HlatConfig, run: Run) -> None:
    """Refuse, naming the field and the fix, a tracking setting this run cannot use (before any stage runs)."""
    t = cfg.tracking
    if t.backend == "mlflow":
        mlflow_tracking_uri(cfg, run)
    if t.backend == "wandb" and t.wandb_mode == "offline" and not run.storage.is_local:
        raise ConfigError(
            f"tracking.wandb_mode=offline for a run in {run.uri}: W&B's offline files go to the run's tracking/ "
            "folder, which needs a local run; use tracking.wandb_mode=online (W&B's own servers keep the run)"
        )


# -- the trackers ---------------------------------------------------------------------------------------------
class Tracker:
    """One tracked run. `logged_step`: the last step the store holds (records up to it are not logged again). Every
    call is guarded: the first failure is warned about once and the tracker then does nothing (`broken`)."""

    backend = ""

    def __init__(self, hlat_run_id: str, run: Run) -> None:
        self.hlat_run_id, self.run = hlat_run_id, run
        self.logged_step = -1
        self.broken = False

    # What each backend implements.
    def _log_records(self, records: list[tuple[int, dict[str, float]]]) -> None:
        raise NotImplementedError

    def _log_params(self, params: Mapping[str, str]) -> None:
        raise NotImplementedError

    def _log_file(self, local: Path, folder: str) -> None:
        raise NotImplementedError

    def _log_summary(self, values: Mapping[str, float]) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        pass

    # What callers use.
    def _safely(self, what: str, fn: Any, *args: Any) -> None:
        if self.broken:
            return
        try:
            fn(*args)
        except Exception as exc:  # a store that fails must never stop training or a stage
            self.broken = True
            log.warning(
                "tracking (%s): %s failed, not tracking the rest of this process (metrics.jsonl and the run's "
                "files stay the record): %s: %s", self.backend, what, type(exc).__name__, exc,
            )  # fmt: skip

    def log_records(self, records: Iterable[Record]) -> None:
        """Log the records past `logged_step`, in step order, as the store's metrics at their steps."""
        fresh = [(step, numeric(values)) for step, values in records if step > self.logged_step]
        fresh = [(step, values) for step, values in fresh if values]
        if fresh:
            self._safely("logging metrics", self._log_records, fresh)

    def log_config(self, cfg: HlatConfig) -> None:
        """The config as flat params, and the run's storage URI."""
        self._safely("logging the config", self._log_params, {**flat_config(cfg), STORAGE_TAG: self.run.storage.url})

    def log_json(self, name: str, value: Any, folder: str = "reports") -> None:
        """`value` as the artifact `<folder>/<name>` (JSON)."""
        with tempfile.TemporaryDirectory(prefix="hlat-tracking-") as tmp:
            path = Path(tmp) / name
            path.write_text(json.dumps(value, indent=2, sort_keys=True, default=str))
            self._safely(f"logging {folder}/{name}", self._log_file, path, folder)

    def log_text(self, name: str, text: str, folder: str = "reports") -> None:
        """`text` as the artifact `<folder>/<name>`."""
        with tempfile.TemporaryDirectory(prefix="hlat-tracking-") as tmp:
            path = Path(tmp) / name
            path.write_text(text)
            self._safely(f"logging {folder}/{name}", self._log_file, path, folder)

    def log_summary(self, values: Mapping[str, Any]) -> None:
        """A stage's figures (cost, final loss, evaluation scores): W&B's summary, MLflow metrics at the last step."""
        figures = numeric(values)
        if figures:
            self._safely("logging a summary", self._log_summary, figures)

    def close(self) -> None:
        self._safely("closing", self._close)
        self.broken = True  # closed: nothing more


class MlflowTracker(Tracker):
    backend = "mlflow"

    def __init__(self, cfg: HlatConfig, run: Run, hlat_run_id: str) -> None:
        super().__init__(hlat_run_id, run)
        # A store that does not answer must fail fast, not hold training through MLflow's default retries (minutes).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        from mlflow.tracking import MlflowClient

        self.uri = mlflow_tracking_uri(cfg, run)
        if self.uri.startswith("sqlite:///"):
            Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.experiment = cfg.tracking.experiment
        self.run_id = self._find_or_create()
        tags = self.client.get_run(self.run_id).data.tags
        self.logged_step = int(tags.get(LOGGED_TAG, -1))

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return str(found.experiment_id)
        # A local store keeps its artifacts beside it (MLflow's default is ./mlruns of whatever folder runs it).
        location = None
        if self.uri.startswith("sqlite:///"):
            location = (Path(self.uri.removeprefix("sqlite:///")).parent / "artifacts").as_uri()
        return str(self.client.create_experiment(self.experiment, artifact_location=location))

    def _find_or_create(self) -> str:
        """The recorded run, else the one tagged (or, from SageMaker's MlflowConfig, named) as this hlat run, else
        a new one; recorded in tracking.json."""
        record = read_record(self.run)
        if record.get("backend") == "mlflow" and record.get("tracking_uri") == self.uri:
            try:
                return str(self.client.get_run(record["run_id"]).info.run_id)
            except Exception as exc:  # deleted from the store: find or create it again
                log.warning("tracking: the recorded MLflow run %s is not in %s (%s)", record["run_id"], self.uri, exc)
        experiment_id = self._experiment_id()
        run_id = None
        for query in (f"tags.`{RUN_TAG}` = '{self.hlat_run_id}'", f"attributes.run_name = '{self.hlat_run_id}'"):
            runs = self.client.search_runs([experiment_id], filter_string=query, order_by=["start_time ASC"])
            if runs:
                run_id = str(runs[0].info.run_id)
                break
        if run_id is None:
            created = self.client.create_run(experiment_id, run_name=self.hlat_run_id, tags={RUN_TAG: self.hlat_run_id})
            run_id = str(created.info.run_id)
            log.info("tracking: MLflow run %s created in %s (experiment %s)", run_id, self.uri, self.experiment)
        else:
            self.client.set_tag(run_id, RUN_TAG, self.hlat_run_id)
            log.info("tracking: resuming MLflow run %s in %s", run_id, self.uri)
        write_record(self.run, {"backend": "mlflow", "tracking_uri": self.uri, "run_id": run_id,
                                "experiment": self.experiment, "hlat_run_id": self.hlat_run_id})  # fmt: skip
        return run_id

    def _log_records(self, records: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        for chunk in _whole_steps(records, BATCH_METRICS):
            metrics = [Metric(key, value, now, step) for step, values in chunk for key, value in values.items()]
            last = chunk[-1][0]
            # The metrics and the step they reach in one request: a job killed mid-flush logs neither.
            self.client.log_batch(self.run_id, metrics=metrics, tags=[RunTag(LOGGED_TAG, str(last))])
            self.logged_step = last

    def _log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        storage = params.get(STORAGE_TAG)
        present = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in params.items() if k in present and present[k] != v and k != STORAGE_TAG)
        if changed:  # MLflow's params are immutable: a changed value (a run extended) is a tag
            log.info("tracking: config changed since the run's params were logged: %s (tagged config.<key>)", changed)
        fresh = [Param(k, v) for k, v in params.items() if k not in present and k != STORAGE_TAG]
        for i in range(0, len(fresh), BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=fresh[i : i + BATCH_PARAMS])
        tags = [RunTag(f"config.{k}", params[k]) for k in changed]
        if storage is not None:
            tags.append(RunTag(STORAGE_TAG, storage))
        for i in range(0, len(tags), BATCH_PARAMS):
            self.client.log_batch(self.run_id, tags=tags[i : i + BATCH_PARAMS])

    def _log_file(self, local: Path, folder: str) -> None:
        self.client.log_artifact(self.run_id, str(local), artifact_path=folder)

    def _log_summary(self, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        step, now = max(self.logged_step, 0), int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])


class WandbTracker(Tracker):
    backend = "wandb"

    def __init__(self, cfg: HlatConfig, run: Run, hlat_run_id: str) -> None:
        super().__init__(hlat_run_id, run)
        import wandb

        t = cfg.tracking
        self.id = wandb_run_id(hlat_run_id)
        self.offline = t.wandb_mode == "offline"
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if run.storage.is_local:
            folder = Path(run.storage.path(TRACKING_DIR))
            folder.mkdir(parents=True, exist_ok=True)
        else:  # online only (check_tracking): W&B's local copy is scratch
            self._tmp = tempfile.TemporaryDirectory(prefix="hlat-wandb-")
            folder = Path(self._tmp.name)
        self.folder = folder
        if self.offline:  # what earlier attempts logged: offline there is no server to ask
            self.logged_step = max((s for s, _ in wandb_offline_history(folder, self.id)), default=-1)
            _next_offline_second(folder, self.id)
        self.wb = wandb.init(
            project=t.experiment,
            entity=t.wandb_entity,
            id=self.id,
            name=hlat_run_id,
            resume="allow",
            mode=t.wandb_mode,
            dir=str(folder),
            settings=wandb.Settings(
                save_code=False, disable_git=True, console="off", x_disable_stats=True, silent=True
            ),
        )
        if not self.offline and self.wb.resumed:  # online: the server knows the run's next step
            self.logged_step = max(self.logged_step, int(self.wb.step) - 1)
        write_record(run, {"backend": "wandb", "id": self.id, "project": t.experiment, "entity": t.wandb_entity,
                           "mode": t.wandb_mode, "hlat_run_id": hlat_run_id})  # fmt: skip

    def _log_records(self, records: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in records:
            self.wb.log(values, step=step)
            self.logged_step = step

    def _log_params(self, params: Mapping[str, str]) -> None:
        self.wb.config.update(dict(params), allow_val_change=True)

    def _log_file(self, local: Path, folder: str) -> None:
        # Into the run's files/<folder>/ (offline: the run folder, uploaded by `wandb sync`).
        staged = Path(tempfile.mkdtemp(prefix="hlat-wandb-file-"))
        (staged / folder).mkdir(parents=True)
        target = staged / folder / local.name
        target.write_bytes(local.read_bytes())
        self.wb.save(str(target), base_path=str(staged), policy="now")

    def _log_summary(self, values: Mapping[str, float]) -> None:
        self.wb.summary.update(dict(values))

    def _close(self) -> None:
        try:
            self.wb.finish()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()


def _next_offline_second(folder: Path, run_id: str) -> None:
    """W&B names an offline session's folder `offline-run-<YYYYMMDD_HHMMSS>-<id>`: a second session of the same run
    started within the same second (two stages ending together) would write into the first's folder. Wait for the
    next second when this one's folder already exists."""
    while (folder / "wandb" / f"offline-run-{time.strftime('%Y%m%d_%H%M%S')}-{run_id}").exists():
        time.sleep(1.0 - time.time() % 1.0 + 0.01)


def open_tracker(cfg: HlatConfig, run: Run) -> Tracker | None:
    """The run's tracker (None with tracking.backend=none, or when the store cannot be opened: warned once)."""
    backend = cfg.tracking.backend
    if backend == "none":
        return None
    hlat_run_id = cfg.run_id or cfg.resolved_run_id()
    try:
        if backend == "mlflow":
            return MlflowTracker(cfg, run, hlat_run_id)
        return WandbTracker(cfg, run, hlat_run_id)
    except Exception as exc:  # a store that does not answer must not stop training or a stage
        log.warning(
            "tracking (%s): could not open the run's tracked run, not tracking in this process (metrics.jsonl and "
            "the run's files stay the record): %s: %s", backend, type(exc).__name__, exc,
        )  # fmt: skip
        return None


# -- the record in the run's storage --------------------------------------------------------------------------
def read_record(run: Run) -> dict[str, Any]:
    try:
        if run.storage.exists(TRACKING_RECORD):
            record: dict[str, Any] = run.storage.read_json(TRACKING_RECORD)
            return record
    except Exception as exc:
        log.warning("tracking: %s unreadable (%s): finding the run again", run.storage.uri(TRACKING_RECORD), exc)
    return {}


def write_record(run: Run, record: Mapping[str, Any]) -> None:
    if read_record(run) != dict(record):
        run.storage.write_text(TRACKING_RECORD, json.dumps(dict(record), indent=2, sort_keys=True) + "\n")


def _whole_steps(records: list[tuple[int, dict[str, float]]], limit: int) -> Iterator[list[tuple[int, dict]]]:
    """The records in chunks of at most about `limit` values that never split a step (a step's values are logged
    together, so `hlat.logged_step` always means every value of that step)."""
    chunk: list[tuple[int, dict[str, float]]] = []
    size = 0
    for i, (step, values) in enumerate(records):
        chunk.append((step, values))
        size += len(values)
        step_ends = i + 1 == len(records) or records[i + 1][0] != step
        if step_ends and size >= limit:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# -- W&B's offline files, read back ----------------------------------------------------------------------------
_WANDB_HEADER = struct.Struct("<4sHB")  # ":W&B", 0xBEE1, version 0
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[Any]:
    """The records (wandb's `Record` protobuf) of one `.wandb` file: W&B's transaction log, LevelDB's log format
    (32 KiB blocks of records with a 7-byte header: CRC, length, type) after a 7-byte W&B header
    (https://github.com/google/leveldb/blob/main/doc/log_format.md; wandb/proto/wandb_internal.proto). A torn tail
    (a killed writer) ends the reading."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if len(data) < _WANDB_HEADER.size or data[:4] != b":W&B":
        return
    pos, pending = _WANDB_HEADER.size, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's trailer: padding
            pos += left
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        body = data[pos + 7 : pos + 7 + length]
        if len(body) < length or kind not in (_FULL, _FIRST, _MIDDLE, _LAST):
            return
        pos += 7 + length
        if kind in (_FULL, _FIRST):
            pending = body
        else:
            pending += body
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # (generated protobuf code)
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_run_files(folder: Path, run_id: str) -> list[Path]:
    """The `.wandb` files of every attempt of W&B run `run_id` under `folder` (wandb.init's dir), oldest first."""
    # offline-run-<time>-<id>[-<n>]/ (a suffix when two start in the same second); not the latest-run link.
    found = (folder / "wandb").glob(f"*-{run_id}*/run-{run_id}.wandb")
    return sorted(p for p in found if not p.parent.is_symlink())


def wandb_key(item: Any) -> str:
    """The key of a history, summary or config item of a W&B record (a plain key, or a nested one joined by '/')."""
    return str(item.key) if item.key else "/".join(item.nested_key)


def wandb_offline_history(folder: Path, run_id: str) -> list[tuple[int, dict[str, Any]]]:
    """(step, values) of every history row W&B wrote for `run_id` under `folder`, in the order written."""
    rows: list[tuple[int, dict[str, Any]]] = []
    for path in wandb_run_files(folder, run_id):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            items = {wandb_key(item): json.loads(item.value_json) for item in record.history.item}
            step = items.pop("_step", None)
            if step is None and record.history.HasField("step"):
                step = record.history.step.num
            if step is not None:
                rows.append((int(step), {k: v for k, v in items.items() if not k.startswith("_")}))
    return rows
