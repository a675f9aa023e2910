"""prepare-data reading from and writing to S3 (a moto server on 127.0.0.1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlat.core.layout import REPORT_FILE
from hlat.core.presets import load_config
from hlat.core.shards import iter_documents, read_manifest
from hlat.core.storage import Storage, StorageNotFound
from hlat.training.data.units import prepare_dataset
from tests.integration.conftest import S3Env


def test_s3_source_to_s3_run_storage(s3_env: S3Env) -> None:
    client = s3_env.client()
    for part in range(2):
        body = "".join(
            json.dumps({"text": f"document {part}-{i} about tokenizers and packing"}) + "\n" for i in range(30)
        )
        client.put_object(Bucket=s3_env.bucket, Key=f"corpus/part-{part}.jsonl", Body=body.encode())
    overrides = {"data.source": f"s3://{s3_env.bucket}/corpus", "data.validation_fraction": 0.0}
    cfg = load_config("tiny", {**overrides, "data.curation": {"exact_dedup": True}}).data
    out = Storage(f"{s3_env.url}/run/data")
    report = prepare_dataset(cfg, out, fingerprint="a" * 64)
    assert (report.rows_read, report.rows_kept) == (60, 60)
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_env.bucket, Prefix="prefix/run/data/")["Contents"]}
    assert {"prefix/run/data/manifest.json", "prefix/run/data/report.json"} <= keys
    assert len(list(iter_documents(out, read_manifest(out), "train"))) == 60


def test_missing_bucket_is_a_one_line_error(s3_env: S3Env) -> None:
    cfg = load_config("tiny", {"data.source": "s3://no-such-bucket-hlat/corpus"}).data
    with pytest.raises(StorageNotFound) as err:
        prepare_dataset(cfg, Storage(f"{s3_env.url}/run/data"), fingerprint="b" * 64)
    assert "bucket 'no-such-bucket-hlat' does not exist" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_a_two_worker_job_reads_s3_objects_sharded_by_key_into_s3_run_storage(
    s3_env: S3Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prepare-data job on the local backend, its 2 workers reading their own objects of an s3:// source and
    writing an s3:// run; a duplicate planted in every object is found across workers."""
    from hlat.core.run import open_run
    from hlat.training.data.units import DataReport
    from tests.jobs import prepare_job, source_data

    monkeypatch.setenv("HLAT_JOBS_DIR", str(tmp_path / "jobs"))  # the local backend's job folders of an S3 run
    client = s3_env.client()
    for part in range(4):
        docs = [f"document {part}-{i} about tokenizers, shards and packing" for i in range(25)]
        docs.append("the same planted document in every object of the corpus")
        body = "".join(json.dumps({"text": d}) + "\n" for d in docs)
        client.put_object(Bucket=s3_env.bucket, Key=f"corpus/part-{part}.jsonl", Body=body.encode())
    overrides = {"data.source": f"s3://{s3_env.bucket}/corpus", "data.workers": 2, "data.max_documents": None,
                 "data.curation": {"exact_dedup": True}}  # fmt: skip
    config = load_config("tiny", overrides, run_id="s3job", storage=s3_env.url)
    run = open_run(config)
    record, state = prepare_job(run)
    assert state is not None and state.status.value == "Completed", record
    report = DataReport.model_validate(run.stage("data").read_json(REPORT_FILE))
    assert (report.rows_read, report.rows_kept, report.cross_unit_duplicates) == (104, 101, 3)
    assert report.units == 4 and [w.worker for w in report.workers] == [0, 1]
    data = source_data(run.stage("data"))
    assert data.uri().startswith(f"{s3_env.url}/sources/")
    assert len(list(iter_documents(data, read_manifest(data), "train"))) == report.train_rows
