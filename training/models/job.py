"""The model a job builds: reads what the run holds and asks `core.models.job.job_model`.

Training, precompile and checkpoints all use `job_config`, so they agree on shape and compile-cache key."""

from __future__ import annotations

import logging
import os
import tempfile

from hlat.core.config import HlatConfig
from hlat.core.contract import fetch_tokenizer
from hlat.core.init_from import import_record
from hlat.core.models.job import job_model
from hlat.core.run import Run
from hlat.training.data.tokenizer import Tokenizer

log = logging.getLogger("hlat.models")


def job_config(run: Run, cfg: HlatConfig) -> HlatConfig:
    """The config a job builds its model from: the run's import record and the tokenizer's size."""
    if cfg.tokenizer.pretrained is None:
        return cfg
    record = import_record(run) if cfg.model.init_from is not None else None
    with tempfile.TemporaryDirectory(prefix="hlat-tokenizer-") as tmp:
        vocab = Tokenizer.load(fetch_tokenizer(run, tmp)).vocab_size
    followed, changes = job_model(cfg, record["config"] if record is not None else None, vocab)
    if os.environ.get("RANK", "0") == "0":
        for change in changes:
            log.info("%s", change)
    return followed
