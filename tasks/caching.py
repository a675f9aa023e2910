"""What every stage's tasks share: the retry policy, cache keys (with the upstream stages' outputs that feed them),
and artifact naming."""

from __future__ import annotations

import re
from typing import Any

from prefect import Task, task
from prefect.client.schemas.objects import State, TaskRun

from hlat.core.config import stable_hash
from hlat.core.run import Run
from hlat.core.stages import stage
from hlat.core.storage import is_transient

# Transient faults are retried with backoff; bad data and bad config never are (they would fail again).
RETRIES = 3
RETRY_DELAYS: list[float] = [2, 5, 15]


def retry_on_transient(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect retry condition: retry only transient faults."""
    try:
        state.result()
    except Exception as exc:
        return is_transient(exc)
    return False


TRANSIENT_RETRIES: dict[str, Any] = {
    "retries": RETRIES,
    "retry_delay_seconds": RETRY_DELAYS,
    "retry_condition_fn": retry_on_transient,
}
"""Task options: retry transient faults only, with backoff."""


@task(name="read-output-checksum", **TRANSIENT_RETRIES)
def output_checksum(run: Run, upstream: str) -> str:
    """The checksum of what stage `upstream` wrote into the run (its row's `checksum`)."""
    return stage(upstream).output_checksum(run)


def stage_cache_key(run: Run, name: str, *inputs: Any) -> str:
    """Cache key of stage `name`: its name, the run it writes into, everything of its own that its output depends
    on (`inputs`), and the outputs of the upstream stages the table names (core/stages.py `Stage.inputs`)."""
    upstream = [output_checksum(run, name_) for name_ in stage(name).inputs]
    return f"hlat-{name}-{stable_hash([name, run.uri, *inputs, *upstream])[:32]}"


def cache_key_param(context: Any, parameters: dict[str, Any]) -> str:
    """cache_key_fn for tasks that take their precomputed key as the `cache_key` parameter."""
    return str(parameters["cache_key"])


CACHED_STAGE: dict[str, Any] = {**TRANSIENT_RETRIES, "cache_key_fn": cache_key_param, "persist_result": True}
"""Task options of a stage's main task: cached under the precomputed `cache_key` parameter, transient retries."""


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:120]


def run_cached(task: Task[..., Any], outputs_present: Any, **params: Any) -> Any:
    """Call a cached stage task; if its cached result's outputs have vanished from run storage, redo it."""
    from prefect.logging import get_run_logger

    result = task(**params)
    if not outputs_present(result):
        get_run_logger().warning("%s: cached result's outputs are missing from run storage; running again", task.name)
        result = task.with_options(refresh_cache=True)(**params)
    return result
