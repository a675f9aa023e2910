"""Which model a run's jobs build: decided here once, for the train flow and every job.

The stored config keeps what the user wrote. A job's model follows the imported checkpoint, then the pretrained
tokenizer's vocabulary; the checkpoint's embedding must fit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hlat.core.config import HlatConfig
from hlat.core.contract import model_follows_tokenizer
from hlat.core.init_from import check_embedding_rows, model_follows_checkpoint


def job_model(
    cfg: HlatConfig, checkpoint: Mapping[str, Any] | None, tokenizer_vocab: int | None
) -> tuple[HlatConfig, list[str]]:
    """The config a job builds its model from, and one line per change.

    `checkpoint` is the imported config.json and `tokenizer_vocab` the tokenizer's size (None: not known yet).
    ValueError (ConfigError, InitFromError) when the result cannot be built."""
    lines: list[str] = []
    imported = checkpoint if cfg.model.init_from is not None else None
    if imported is not None:
        cfg, change = model_follows_checkpoint(cfg, imported)
        lines += [change] if change else []
    if cfg.tokenizer.pretrained is None or tokenizer_vocab is None:
        return cfg, lines
    cfg, change = model_follows_tokenizer(cfg, tokenizer_vocab)
    if change:
        lines.append(f"{change} (tokenizer.pretrained={cfg.tokenizer.pretrained})")
    if imported is not None:
        check_embedding_rows(cfg, int(imported["vocab_size"]))
    return cfg, lines
