"""Stage 1, prepare-data: source -> great-expectations validation -> shards + manifest + report in <run>/data/."""

from __future__ import annotations

from prefect import flow

from hlat.flows.params import OVERRIDES, PRESET, RUN_ID, STORAGE, OptionalText, Overrides, PresetName
from hlat.flows.stage import resolve, run_name, stop_jobs_on_cancel
from hlat.tasks.caching import run_cached
from hlat.tasks.prepare_data import (
    build_shards,
    data_cache_key,
    fingerprint_source,
    publish_data_report,
    shards_present,
)
from hlat.training.data.units import DataReport


@flow(name="prepare-data", flow_run_name=run_name, log_prints=True, on_cancellation=[stop_jobs_on_cancel])
def prepare_data(
    preset: PresetName = PRESET,
    run_id: OptionalText = RUN_ID,
    storage: OptionalText = STORAGE,
    overrides: Overrides = OVERRIDES,
) -> DataReport:
    """Download (or build), validate and shard the corpus of a run: a job of data.workers workers."""
    config, run = resolve(preset, overrides, run_id, storage)
    key = data_cache_key(config, run.uri, fingerprint_source(config.data))
    report: DataReport = run_cached(
        build_shards, lambda r: shards_present(run, r), config=config, run_uri=run.uri, run_id=run.run_id, cache_key=key
    )
    publish_data_report(report, run.run_id)
    print(
        f"prepare-data: {report.rows_read} rows read, {report.rows_kept} kept, {report.rows_quarantined} "
        f"quarantined {report.quarantined_by_reason} -> {run.uri}/data"
    )
    return report


if __name__ == "__main__":
    import sys

    from hlat.cli import main

    sys.exit(main(["run", "prepare-data", *sys.argv[1:]]))
