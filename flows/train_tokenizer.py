"""Stage 2, train-tokenizer: sentencepiece BPE (LLaMA options) on a bounded sample of the shards -> <run>/tokenizer/."""

from __future__ import annotations

from typing import Any

from prefect import flow

from hlat.flows.params import OVERRIDES, PRESET, RUN_ID, STORAGE, OptionalText, Overrides, PresetName
from hlat.flows.stage import resolve, run_name
from hlat.tasks.caching import run_cached
from hlat.tasks.train_tokenizer import fit_tokenizer, publish_tokenizer_report, tokenizer_cache_key, tokenizer_present


@flow(name="train-tokenizer", flow_run_name=run_name, log_prints=True)
def train_tokenizer(
    preset: PresetName = PRESET,
    run_id: OptionalText = RUN_ID,
    storage: OptionalText = STORAGE,
    overrides: Overrides = OVERRIDES,
) -> dict[str, Any]:
    """Train the run's tokenizer from its prepared shards."""
    config, run = resolve(preset, overrides, run_id, storage)
    vocab, seq = config.model.vocab_size, config.model.max_seq_len
    key = tokenizer_cache_key(config, run.uri)
    report: dict[str, Any] = run_cached(
        fit_tokenizer,
        lambda r: tokenizer_present(run, r),
        tok_cfg=config.tokenizer,
        vocab_size=vocab,
        max_seq_len=seq,
        run_uri=run.uri,
        cache_key=key,
    )
    publish_tokenizer_report(report, run.run_id)
    print(
        f"train-tokenizer: vocab {report.get('vocab_size')}, {report.get('bytes_per_token')} bytes/token, "
        f"byte fallback {report.get('byte_fallback_rate')} -> {run.uri}/tokenizer"
    )
    return report


if __name__ == "__main__":
    import sys

    from hlat.cli import main

    sys.exit(main(["run", "train-tokenizer", *sys.argv[1:]]))
