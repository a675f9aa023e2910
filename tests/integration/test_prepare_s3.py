"""prepare-data reading from and writing to S3 (a moto server on 127.0.0.1)."""

from __future__ import annotations

import json

import pytest

from infra.prepare import prepare_dataset
from infra.shards import iter_documents, read_manifest
from infra.storage import Storage, StorageNotFound
from tests.integration.conftest import S3Env
from training.presets import load_config


def test_s3_source_to_s3_run_storage(s3_env: S3Env) -> None:
    client = s3_env.client()
    for part in range(2):
        body = "".join(
            json.dumps({"text": f"document {part}-{i} about tokenizers and packing"}) + "\n" for i in range(30)
        )
        client.put_object(Bucket=s3_env.bucket, Key=f"corpus/part-{part}.jsonl", Body=body.encode())
    cfg = load_config("tiny", {"data.source": f"s3://{s3_env.bucket}/corpus", "data.validation_fraction": 0.0}).data
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
