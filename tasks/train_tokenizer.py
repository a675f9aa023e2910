"""train-tokenizer tasks: read the data manifest, train sentencepiece + HF export, or validate and copy in an existing
tokenizer (tokenizer.pretrained) (cached), publish the report."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from hlat.core.layout import DATA_DIR, REPORT_FILE, TOKENIZER_DIR
from hlat.core.run import Run
from hlat.core.stages import stage
from hlat.infra.inputs.tokenizer import build_pretrained_tokenizer, build_tokenizer, pretrained_fingerprint
from hlat.tasks.caching import CACHED_STAGE, artifact_key, stage_cache_key
from hlat.training.data.tokenizer import Tokenizer


@task(name="fit-tokenizer", **CACHED_STAGE)
def fit_tokenizer(run: Run, cache_key: str) -> dict[str, Any]:
    """Train sentencepiece BPE on a bounded sample of the shards and export HF files into <run>/tokenizer/; with
    tokenizer.pretrained, validate that tokenizer on the shards and copy it there instead (nothing is trained)."""
    m, t = run.config.model, run.config.tokenizer
    data, out = run.stage(DATA_DIR), run.stage(TOKENIZER_DIR)
    if t.pretrained is not None:
        return build_pretrained_tokenizer(data, out, t.pretrained, m.max_seq_len, t, Tokenizer.load)
    return build_tokenizer(data, out, m.vocab_size, m.max_seq_len, t)


def tokenizer_cache_key(run: Run) -> str:
    """What the tokenizer depends on: its settings, the vocabulary size and context length, and the shards; with
    tokenizer.pretrained, that tokenizer's source and its files' hash (fetched now: changed files re-run the stage),
    the report's sample size and the context length (model.vocab_size then follows the tokenizer, not the reverse)."""
    m, t = run.config.model, run.config.tokenizer
    if t.pretrained is not None:
        return stage_cache_key(
            run, "train-tokenizer", pretrained_fingerprint(t.pretrained), t.report_sample_bytes, m.max_seq_len
        )
    settings = t.model_dump(mode="json")
    return stage_cache_key(run, "train-tokenizer", settings, m.vocab_size, m.max_seq_len)


def tokenizer_present(run: Run, report: dict[str, Any]) -> bool:
    """A cached report counts only while the tokenizer it describes is still in run storage."""
    out = run.stage(TOKENIZER_DIR)
    return (
        stage("train-tokenizer").done(run, run.config)
        and out.exists(REPORT_FILE)
        and out.read_json(REPORT_FILE).get("data_checksum") == report.get("data_checksum")
    )


@task(name="publish-tokenizer-report")
def publish_tokenizer_report(report: dict[str, Any], run_id: str) -> None:
    """Vocab size, bytes per token and byte-fallback rate as a table; sample encodings as markdown."""
    rows = [
        {"metric": k, "value": report[k]}
        for k in ("vocab_size", "bytes_per_token", "byte_fallback_rate")
        if k in report
    ]
    create_table_artifact(
        rows, key=artifact_key("tokenizer-report", run_id), description=f"train-tokenizer of {run_id}"
    )
    samples = report.get("samples", [])
    lines = [
        f"- `{s.get('text', '')[:60]!r}` → {len(s.get('ids', []))} tokens: `{s.get('pieces', [])[:16]}`"
        for s in samples
    ]
    create_markdown_artifact(
        f"# train-tokenizer: {run_id}\n\n" + "\n".join(lines), key=artifact_key("tokenizer-samples", run_id)
    )
