"""Stage 2, train-tokenizer: sentencepiece BPE (LLaMA options) on a bounded sample of the shards -> <run>/tokenizer/;
or, with tokenizer.pretrained, that tokenizer validated on the shards and copied there (nothing trained)."""

from __future__ import annotations

from typing import Any

from hlat.core.run import Run
from hlat.flows.stage import not_a_command, stage_flow
from hlat.tasks.caching import run_cached
from hlat.tasks.tracking import track_tokenizer_report
from hlat.tasks.train_tokenizer import fit_tokenizer, publish_tokenizer_report, tokenizer_cache_key, tokenizer_present


@stage_flow("train-tokenizer", stops_jobs=False)
def train_tokenizer(run: Run) -> dict[str, Any]:
    """Train the run's tokenizer from its prepared shards, or bring in tokenizer.pretrained."""
    key = tokenizer_cache_key(run)
    report: dict[str, Any] = run_cached(fit_tokenizer, lambda r: tokenizer_present(run, r), run=run, cache_key=key)
    publish_tokenizer_report(report, run.run_id)
    track_tokenizer_report(run, report)
    pretrained = report.get("pretrained")
    origin = f"pretrained {pretrained['source']} (trained nothing), " if pretrained else ""
    print(
        f"train-tokenizer: {origin}vocab {report.get('vocab_size')}, {report.get('bytes_per_token')} bytes/token, "
        f"byte fallback {report.get('byte_fallback_rate')} -> {run.uri}/tokenizer"
    )
    return report


if __name__ == "__main__":
    raise SystemExit(not_a_command(train_tokenizer.name))
