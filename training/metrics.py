"""Per-step metrics: one JSON line per record in `<run>/metrics.jsonl`, and TensorBoard scalars.

Only rank 0 writes. On local storage lines are appended as they come; on S3 (no appends) they are buffered
and the object is rewritten at each flush (before every checkpoint is saved, and at exit). A resumed job first drops the
lines past the step it resumes from, so the file always describes one consistent history.

Besides the step's figures, the training loop records `tokens/<source>` for each source of the data mixture: the
training tokens drawn from it so far by data rank 0's loader (host integers from its state, so no device read and
no collective), with `data_degree`. Every data rank mixes its own documents by the same rule, so rank 0's shares are
the run's and the run's tokens of a source are about data_degree times rank 0's.

With a tracker attached (`attach`: tracking.backend, `training/tracking.py`), the records are also logged to the
run's tracked run at the same flushes, from the values already here: no extra host read, and a failing store never
stops training. At a resume, the kept history's steps the store lacks are logged first.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from hlat.core.layout import METRICS_FILE
from hlat.core.run import Run
from hlat.training.tracking import Tracker

log = logging.getLogger("hlat.train")


class MetricsLog:
    def __init__(self, run: Run, enabled: bool, tensorboard_dir: str | None = None) -> None:
        self.run, self.enabled = run, enabled
        self._lines: list[str] = []
        self._writer: Any = None
        self.tracker: Tracker | None = None
        self._pending: list[tuple[int, dict[str, Any]]] = []  # recorded since the last flush, for the tracker
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=tensorboard_dir)

    def attach(self, tracker: Tracker | None) -> None:
        """Log every record to `tracker` too, at each flush (rank 0's; it skips the steps its store already holds)."""
        self.tracker = tracker if self.enabled else None

    def resume_at(self, step: int) -> None:
        """Keep the history up to `step` (the checkpoint resumed from); later lines are redone."""
        if not self.enabled:
            return
        kept: list[str] = []
        if self.run.storage.exists(METRICS_FILE):
            kept = [
                line
                for line in self.run.storage.read_text(METRICS_FILE).splitlines()
                if json.loads(line)["step"] <= step
            ]
        self.run.storage.write_text(METRICS_FILE, "".join(f"{line}\n" for line in kept))
        self._lines = kept
        self._pending = []
        if self.tracker is not None:
            # What the store lacks of the kept history (an earlier attempt killed before its tracker wrote it out, a
            # store that was down), from the lines themselves: the steps after `step` are trained and logged again.
            records = [json.loads(line) for line in kept]
            self.tracker.log_records((r.pop("step"), r) for r in records)

    def record(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}
        line = json.dumps({"step": step, **clean}, sort_keys=True)
        self._lines.append(line)
        if self.tracker is not None:
            self._pending.append((step, clean))
        if self.run.storage.is_local:
            with self.run.storage.open(METRICS_FILE, "a") as fh:
                fh.write(line + "\n")
        if self._writer is not None:
            for key, value in values.items():
                if isinstance(value, int | float) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)

    def flush(self) -> None:
        if not self.enabled:
            return
        if not self.run.storage.is_local:
            self.run.storage.write_text(METRICS_FILE, "".join(f"{line}\n" for line in self._lines))
        if self._writer is not None:
            self._writer.flush()
        if self.tracker is not None and self._pending:
            pending, self._pending = self._pending, []
            self.tracker.log_records(pending)

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()
