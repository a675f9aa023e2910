"""prepare-data tasks: fingerprint the source, run the prepare-data job (cached), publish the report."""

from __future__ import annotations

import json
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from hlat.core.config import OPERATIONAL_DATA_FIELDS, DataConfig, stable_hash
from hlat.core.layout import DATA_DIR, DATA_REPORT, MANIFEST_FILE
from hlat.core.run import Run
from hlat.core.shards import read_mixture
from hlat.core.stages import stage
from hlat.core.storage import StorageError
from hlat.infra.stage_jobs import run_stage_job
from hlat.tasks.caching import CACHED_STAGE, TRANSIENT_RETRIES, artifact_key, stage_cache_key
from hlat.tasks.job_failures import job_ended_badly
from hlat.training.data.sources import source_fingerprint
from hlat.training.data.units import DataReport


@task(name="fingerprint-sources", **TRANSIENT_RETRIES)
def fingerprint_sources(data_cfg: DataConfig) -> dict[str, str]:
    """Identify each source's content cheaply (sizes and times, ETags, or hub name and revision), by name."""
    return {s.resolved_name: source_fingerprint(data_cfg.source_data_config(s)) for s in data_cfg.mixture}


def source_keys(run: Run, fingerprints: dict[str, str]) -> dict[str, str]:
    """Each source's cache key: the data settings that decide what preparing it writes (its reader, validation,
    curation and shard settings; not its weight, not how many workers write it) and its content. Not the run: a
    source prepared for one run is prepared for every run under the same storage root."""
    keys = {}
    for source in run.config.data.mixture:
        cfg = run.config.data.source_data_config(source)
        settings = cfg.model_dump(mode="json", exclude={*OPERATIONAL_DATA_FIELDS, "sources", "schedule"})
        keys[source.resolved_name] = f"hlat-source-{stable_hash([settings, fingerprints[source.resolved_name]])[:32]}"
    return keys


def data_cache_key(run: Run, fingerprints: dict[str, str]) -> str:
    """The stage's cache key: the sources' keys, their weights, maximum repetitions and schedule, and the run."""
    mixture = [[s.resolved_name, s.weight, s.max_epochs] for s in run.config.data.mixture]
    schedule = [e.model_dump(mode="json") for e in run.config.data.schedule]
    return stage_cache_key(run, "prepare-data", source_keys(run, fingerprints), mixture, schedule)


@task(name="build-shards", **CACHED_STAGE)
def build_shards(run: Run, cache_key: str, sources: dict[str, str]) -> DataReport:
    """Run the prepare-data job (data.workers workers on the run's job backend): the sources not prepared yet into
    their folders beside the runs, then the run's mixture manifest and report in <run>/data/; cached on the sources'
    keys, the mixture and the run."""
    record, _ = run_stage_job(run, "prepare-data", args={"key": cache_key, "sources": json.dumps(sources)})
    report = DATA_REPORT
    if run.storage.exists(report):
        found = DataReport.model_validate(run.storage.read_json(report))
        if found.fingerprint == cache_key:  # not the report of an earlier key
            return found
    raise job_ended_badly(run, "prepare-data", record, report)


def shards_present(run: Run, report: DataReport) -> bool:
    """A cached report counts only while the manifest it wrote is still the run's manifest, and every source it
    names is still where it was prepared."""
    data = run.stage(DATA_DIR)
    if not stage("prepare-data").done(run, run.config):
        return False
    if data.read_json(MANIFEST_FILE).get("fingerprint") != report.fingerprint:
        return False
    try:
        read_mixture(data)
    except (StorageError, ValueError):
        return False
    return True


@task(name="publish-data-report")
def publish_data_report(report: DataReport, run_id: str) -> None:
    """The report as a Prefect table (counts, per source) and markdown (reasons and rules, per source) artifact."""
    rows: list[dict[str, Any]] = [
        {"metric": "rows read", "value": report.rows_read},
        {"metric": "rows kept", "value": report.rows_kept},
        {"metric": "rows removed", "value": report.rows_quarantined},
        *({"metric": f"removed: {k}", "value": v} for k, v in report.quarantined_by_reason.items()),
        {"metric": "duplicate rate", "value": f"{report.duplicate_rate:.2%}"},
        {"metric": "units / workers", "value": f"{report.units} / {len(report.workers)}"},
        *(
            {
                "metric": f"source {r.name}",
                "value": f"{r.rows_read} read, {r.rows_kept} kept ({r.train_rows} train, {r.validation_rows} "
                f"validation), {r.train_bytes / 1e6:,.1f} MB train",
            }
            for r in report.sources
        ),
        *(
            {"metric": f"worker {w.worker}", "value": f"{w.units} units, {w.bytes / 1e6:,.1f} MB, {w.mb_per_s} MB/s"}
            for w in report.workers
        ),
        {"metric": "train rows / bytes", "value": f"{report.train_rows} / {report.train_bytes}"},
        {
            "metric": "validation rows / bytes",
            "value": f"{report.validation_rows} / {report.validation_bytes}",
        },
        {"metric": "shards", "value": report.shards},
    ]
    create_table_artifact(rows, key=artifact_key("data-report", run_id), description=f"prepare-data of {run_id}")
    create_markdown_artifact(data_summary(report, run_id), key=artifact_key("data-summary", run_id))


def data_summary(report: DataReport, run_id: str) -> str:
    """The markdown artifact: per source, rows removed by reason or rule, and a few removed rows by rule."""
    parts = [
        f"# prepare-data: {run_id}\n\nPolicy `{report.policy}`: {report.rows_read} rows read = {report.rows_kept} "
        f"kept + {report.rows_quarantined} removed.\n"
    ]
    for source in report.sources or [report]:
        reasons = "\n".join(f"| {k} | {v} |" for k, v in source.quarantined_by_reason.items()) or "| (none) | 0 |"
        parts.append(
            f"## {source.name or source.source}\n\n`{source.source}`: {source.rows_read} read, {source.rows_kept} "
            f"kept.\n\n| reason or rule | rows |\n| --- | --- |\n{reasons}\n"
        )
        examples = "\n".join(
            f"| {e.reason} | `{e.file}` | {e.line} | {e.excerpt[:80].replace('|', '/').replace(chr(10), ' ')} |"
            for e in source.examples[:20]
        )
        if examples:
            parts.append(f"Removed rows:\n\n| reason | file | line | text |\n| --- | --- | --- | --- |\n{examples}\n")
    return "\n".join(parts)
