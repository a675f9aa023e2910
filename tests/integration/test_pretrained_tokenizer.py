"""tokenizer.pretrained end to end: the tokenizer stage's flow brings in a GPT-NeoX-like tokenizer built here, the
training job trains on it with the model's vocabulary following it; and the same stage from an s3:// prefix (moto)."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from hlat.core.config import TokenizerConfig
from hlat.core.layout import REPORT_FILE
from hlat.core.presets import load_config
from hlat.core.run import open_run
from hlat.core.shards import iter_documents, read_manifest
from hlat.core.storage import Storage
from hlat.infra.checks.sources import tokenizer_finding
from hlat.infra.inputs.tokenizer import build_pretrained_tokenizer
from hlat.training.checkpoint import CheckpointManager
from hlat.training.data.tokenizer import Tokenizer
from tests.conftest import SMALL_RUN
from tests.jobs import metrics, train
from tests.pretrained_tokenizers import neox_like


def source_documents(prepared: Path, count: int = 200) -> list[str]:
    """The first `count` training documents of the prepared data (the tiny preset's source)."""
    from tests.jobs import source_data

    data = source_data(Storage(str(prepared / "data")))
    return list(itertools.islice(iter_documents(data, read_manifest(data), "train"), count))


@pytest.mark.slow
def test_a_run_with_a_pretrained_tokenizer_trains_none_records_its_hash_and_pads_its_vocabulary(
    prefect_server: None, prepared: Path, tmp_path: Path
) -> None:
    from hlat.flows.train_tokenizer import train_tokenizer

    folder = neox_like(tmp_path / "neox", source_documents(prepared), vocab_size=600)
    tokenizer = Tokenizer.load(str(folder))
    assert tokenizer.vocab_size == 600
    overrides: dict[str, Any] = {
        **SMALL_RUN,  # model.vocab_size 512: the run's own tokenizer would have 512 pieces
        "tokenizer.pretrained": str(folder),
        "model.vocab_multiple": 64,
        "training.max_steps": 4,
        "training.checkpoint_every": 4,
        "training.eval_every": 4,
    }
    run = tmp_path / "pretrained"
    open_run(load_config("tiny", overrides, run_id="pretrained", storage=str(tmp_path)))
    shutil.copytree(prepared / "data", run / "data")

    report = train_tokenizer(preset="tiny", overrides=overrides, run_id="pretrained", storage=str(tmp_path))
    assert report["pretrained"]["source"] == str(folder) and "trainer_options" not in report
    assert report["tokenizer_sha256"] == tokenizer.sha256 and report["vocab_size"] == 600
    assert sorted(p.name for p in (run / "tokenizer").iterdir()) == sorted(report["files"])
    assert not (run / "tokenizer" / "tokenizer.model").exists()

    code, out = train(run)
    assert code == 0, out[-3000:]
    assert "model.vocab_size 512 -> 600 (the tokenizer's), padded to 640 rows by model.vocab_multiple=64" in out
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2, 3, 4]
    shared, mine = CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1).load(4)
    model = shared["config"]["model"]
    assert (model["vocab_size"], model["vocab_multiple"]) == (600, 64)
    assert shared["model"]["embed.weight"].shape[0] == 640  # padded_vocab_size rows (the model's part)
    assert tokenizer.sha256 in json.dumps(mine, default=str)  # the loader state records the tokenizer's hash
    # The stored config keeps what the user wrote; the jobs derive the vocabulary from the tokenizer each time.
    assert json.loads((run / "config.json").read_text())["model"]["vocab_size"] == 512


def test_the_stage_reads_a_pretrained_tokenizer_from_an_s3_prefix(s3_env: Any, prepared: Path, tmp_path: Path) -> None:
    folder = neox_like(tmp_path / "neox", source_documents(prepared, 100))
    prefix = Storage(f"{s3_env.url}/tokenizers/neox")
    for path in folder.iterdir():
        prefix.put_file(str(path), path.name)
    data = Storage(str(prepared / "data"))
    out = Storage(str(tmp_path / "tokenizer"))
    report = build_pretrained_tokenizer(data, out, prefix.url, 128, TokenizerConfig(), Tokenizer.load)
    assert report["pretrained"] == {"source": prefix.url, "from": "s3", "revision": None}
    assert report["tokenizer_sha256"] == Tokenizer.load(str(folder)).sha256 == Tokenizer.load(out.url).sha256
    assert report["bytes_per_token"] > 1 and out.exists(REPORT_FILE)
    assert tokenizer_finding(prefix.url).ok

    empty = f"{s3_env.url}/tokenizers/none"
    with pytest.raises(ValueError, match=r"tokenizer.pretrained='s3://.*/none' holds no tokenizer") as caught:
        build_pretrained_tokenizer(data, out, empty, 128, TokenizerConfig(), Tokenizer.load)
    assert "\n" not in str(caught.value)
    finding = tokenizer_finding(empty)
    assert not finding.ok and "holds no tokenizer" in finding.message
