"""The import of published weights (`model.init_from`) before the first job of a run: a task of the precompile and
train stages (whichever runs first resolves it; the other finds the run's record), retried on transient faults."""

from __future__ import annotations

import logging
from typing import Any

from prefect import task

from hlat.core.layout import IMPORT_RECORD
from hlat.core.run import Run
from hlat.infra.inputs.init_from import import_checkpoint
from hlat.tasks.caching import TRANSIENT_RETRIES

log = logging.getLogger("hlat.init_from")


@task(name="import-weights", **TRANSIENT_RETRIES)
def import_weights(run: Run) -> dict[str, Any]:
    """Resolve model.init_from into the run's record (infra/inputs/init_from.py): its files, their hash, the folder the
    jobs read; one line saying what the run starts from."""
    record = import_checkpoint(run.config, run)
    revision = f" at {record['revision'][:12]}" if record.get("revision") else ""
    copied = "" if record["location"] == record["source"] else f"; the jobs read it from {record['location']}"
    log.info(
        "init_from: %s%s, %d file(s), %.2f GB, sha256 %s%s",
        record["source"], revision, len(record["files"]), record["bytes"] / 1e9, record["sha256"][:12], copied,
    )  # fmt: skip
    return {k: record[k] for k in ("source", "from", "revision", "location", "bytes", "sha256")}


def imported_identity(run: Run) -> list[str]:
    """What a stage's cache key takes from the import: the record's sha256 (the weights' and config's files), or
    nothing without model.init_from or before the import ran."""
    if run.config.model.init_from is None or not run.storage.exists(IMPORT_RECORD):
        return []
    return [str(run.storage.read_json(IMPORT_RECORD)["sha256"])]
