"""A tiny pretraining run on three local sources weighted 0.6 / 0.3 / 0.1, given in a `--config` file: every stage
runs, and over any window of 1,000 packed sequences each source's share of the tokens is within 2 points of its
weight, as the training report says."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # the whole DAG on three sources (about a minute)

WEIGHTS = {"web": 0.6, "code": 0.3, "books": 0.1}
STEPS = 140  # x 8 sequences: more than one window of 1,000 sequences
WINDOW = 1000 // 8  # steps of 8 sequences in a window of 1,000


def source(path: Path, name: str, docs: int, seed: int) -> str:
    """Short English-like documents (a few hundred tokens at most: a window of 1,000 rows of 128 tokens holds
    hundreds of them, so no one document moves a share by a point)."""
    rng = random.Random(seed)
    # A vocabulary of 2,000 made-up words plus common ones: documents drawn from it are not near duplicates.
    made_up = ["".join(rng.choice("abcdefghijklmnoprstuvw") for _ in range(rng.randint(3, 8))) for _ in range(2000)]
    words = ["the", "of", "and", "to", "in", "is", "that", "it", "was", "for", *made_up]
    lines = []
    for i in range(docs):
        sentences = [
            " ".join(rng.choice(words) for _ in range(rng.randint(6, 12))).capitalize() + "."
            for _ in range(rng.randint(2, 10))
        ]
        lines.append(json.dumps({"text": f"{name.title()} record {i}. " + " ".join(sentences)}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_three_weighted_sources_from_a_config_file_train_at_their_shares(prefect_server: None, tmp_path: Path) -> None:
    from hlat.cli import _dispatch, build_parser

    sources = [
        {
            "name": name,
            "source": source(tmp_path / f"{name}.jsonl", name, 400, seed),
            "weight": weight,
            "max_epochs": 50,
        }
        for seed, (name, weight) in enumerate(WEIGHTS.items())
    ]
    config: dict[str, Any] = {
        "data": {"sources": sources, "max_documents": None},
        "model": {"vocab_size": 384},
        "tokenizer": {"sample_bytes": 300_000, "report_sample_bytes": 50_000},
        "training": {"max_steps": STEPS, "seq_len": 64, "checkpoint_every": 70, "eval_every": 0, "eval_batches": 2},
        "evaluation": {"limit": 10, "perplexity_tokens": 2000},
    }
    path = tmp_path / "mix.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config))
    storage = tmp_path / "runs"
    args = ["pretrain", "--config", str(path), "--run-id", "mix", "--storage", str(storage)]
    assert _dispatch(build_parser().parse_args(args)) == 0

    run = storage / "mix"
    manifest = json.loads((run / "data/manifest.json").read_text())
    assert [(s["name"], s["weight"]) for s in manifest["sources"]] == list(WEIGHTS.items())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    counts = [(r["step"], {n: r[f"tokens/{n}"] for n in WEIGHTS}) for r in records if "tokens/web" in r]
    assert counts[-1][0] == STEPS
    # Every window of 1,000 sequences (125 steps of 8): each source's share within 2 points of its weight.
    by_step = dict(counts)
    for start in range(0, STEPS - WINDOW + 1):
        before = by_step.get(start, dict.fromkeys(WEIGHTS, 0))
        after = by_step[start + WINDOW]
        drawn = {n: after[n] - before[n] for n in WEIGHTS}
        total = sum(drawn.values())
        assert total == WINDOW * 8 * 64
        for name, weight in WEIGHTS.items():
            assert abs(drawn[name] / total - weight) < 0.02, (start, name, drawn)
    # The training report (the train stage's artifact) shows each source's tokens with its share.
    final = counts[-1][1]
    total = sum(final.values())
    rows = {row["metric"]: row["value"] for row in json.loads(training_report("mix").data)}
    for name, weight in WEIGHTS.items():
        value = rows[f"tokens from source {name} (data rank 0)"]
        assert value == f"{final[name]:,} ({final[name] / total:.1%})"
        assert abs(final[name] / total - weight) < 0.02


def training_report(run_id: str) -> Any:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        (found,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"training-report-{run_id}"])), limit=1
        )
    return found
