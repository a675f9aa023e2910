"""prepare-data tasks: fingerprint the source, build validated shards (cached), publish the report."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from infra.corpus import source_fingerprint
from infra.prepare import DataReport, prepare_dataset
from infra.runs import Run
from infra.shards import MANIFEST_FILE
from infra.storage import Storage
from tasks.common import CACHED_STAGE, TRANSIENT_RETRIES, artifact_key
from training.config import DataConfig


@task(name="fingerprint-source", **TRANSIENT_RETRIES)
def fingerprint_source(data_cfg: DataConfig) -> str:
    """Identify the source's content cheaply (sizes and times, ETags, or hub name and revision)."""
    return source_fingerprint(data_cfg)


@task(name="build-shards", **CACHED_STAGE)
def build_shards(data_cfg: DataConfig, run_uri: str, cache_key: str) -> DataReport:
    """Read, validate and shard the source into <run>/data/; cached on the config, source and run."""
    return prepare_dataset(data_cfg, Storage(run_uri).child("data"), fingerprint=cache_key)


def shards_present(run: Run, report: DataReport) -> bool:
    """A cached report counts only while the manifest it wrote is still the run's manifest."""
    data = run.stage("data")
    return data.exists(MANIFEST_FILE) and data.read_json(MANIFEST_FILE).get("fingerprint") == report.fingerprint


@task(name="publish-data-report")
def publish_data_report(report: DataReport, run_id: str) -> None:
    """The report as a Prefect table (counts) and markdown (reasons) artifact."""
    rows: list[dict[str, Any]] = [
        {"metric": "rows read", "value": report.rows_read},
        {"metric": "rows kept", "value": report.rows_kept},
        {"metric": "rows quarantined", "value": report.rows_quarantined},
        *({"metric": f"quarantined: {k}", "value": v} for k, v in report.quarantined_by_reason.items()),
        {"metric": "duplicate rate", "value": f"{report.duplicate_rate:.2%}"},
        {"metric": "train rows / bytes", "value": f"{report.train_rows} / {report.train_bytes}"},
        {
            "metric": "validation rows / bytes",
            "value": f"{report.validation_rows} / {report.validation_bytes}",
        },
        {"metric": "shards", "value": report.shards},
    ]
    create_table_artifact(rows, key=artifact_key("data-report", run_id), description=f"prepare-data of {run_id}")
    reasons = "\n".join(f"| {k} | {v} |" for k, v in report.quarantined_by_reason.items()) or "| (none) | 0 |"
    create_markdown_artifact(
        f"# prepare-data: {run_id}\n\nSource `{report.source}`, policy `{report.policy}`: "
        f"{report.rows_read} rows read = {report.rows_kept} kept + {report.rows_quarantined} quarantined.\n\n"
        f"| reason | rows |\n| --- | --- |\n{reasons}\n",
        key=artifact_key("data-summary", run_id),
    )
