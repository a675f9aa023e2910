"""Stage 1, prepare-data: source -> great-expectations validation -> shards + manifest + report in <run>/data/."""

from __future__ import annotations

from hlat.core.run import Run
from hlat.flows.stage import not_a_command, stage_flow
from hlat.tasks.caching import run_cached
from hlat.tasks.prepare_data import (
    build_shards,
    data_cache_key,
    fingerprint_sources,
    publish_data_report,
    shards_present,
    source_keys,
)
from hlat.tasks.tracking import start_tracking, track_data_report
from hlat.training.data.units import DataReport


@stage_flow("prepare-data")
def prepare_data(run: Run) -> DataReport:
    """Download (or build), validate and shard the corpus of a run: a job of data.workers workers."""
    start_tracking(run)  # the run's tracked run (tracking.backend), before any job: a setting it cannot use fails here
    fingerprints = fingerprint_sources(run.config.data)
    key = data_cache_key(run, fingerprints)
    sources = source_keys(run, fingerprints)
    report: DataReport = run_cached(
        build_shards, lambda r: shards_present(run, r), run=run, cache_key=key, sources=sources
    )
    publish_data_report(report, run.run_id)
    track_data_report(run, report.model_dump(mode="json"))
    print(
        f"prepare-data: {report.rows_read} rows read, {report.rows_kept} kept, {report.rows_quarantined} "
        f"quarantined {report.quarantined_by_reason} -> {run.uri}/data"
    )
    return report


if __name__ == "__main__":
    raise SystemExit(not_a_command(prepare_data.name))
