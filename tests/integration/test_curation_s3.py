"""Curation (training/data/curation.py) with an s3 prefix as the medium between its phases, on a real moto S3
server over HTTP (fixtures in conftest.py): the same counts and documents as on a local folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlat.core.storage import Storage
from hlat.training.data.curation import curate
from tests.integration.conftest import S3Env
from tests.unit.test_curation import ALL_ON, Corpus, _texts


@pytest.mark.slow  # every phase twice, once through moto's S3 (15-20 s)
def test_curation_on_s3_matches_a_local_folder(s3_env: S3Env, tmp_path: Path) -> None:
    corpus = Corpus(seed=13)
    results = {}
    for name, storage in (("local", Storage(str(tmp_path))), ("s3", Storage(s3_env.url))):
        inputs = corpus.write(storage)
        result = curate(
            ALL_ON,
            storage,
            "work-1",
            inputs,
            "parquet",
            shard_rows=16,
            tasks=2,
            workers=2,
            contamination={"eval_task": [corpus.eval_passage]},
        )
        results[name] = (result.removed, result.shards, _texts(storage, result.shards))
    assert results["s3"] == results["local"]
    assert results["s3"][0] == corpus.expected
