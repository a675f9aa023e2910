"""Entrypoint of an evaluation job: `python -m hlat.training.evaluate --config <config.json uri> [--step N]`.

It evaluates one committed checkpoint (the newest, or `--step`) in one process:
1. perplexity, NLL per token and bits per byte on the held-out split (`evaluation/perplexity.py`);
2. lm-eval-harness tasks on the checkpoint exported as a Hugging Face folder (`evaluation/lm_harness.py`).
It writes `<run>/eval/step-NNNNNNNNN/results.json`. Task names are checked before anything heavy runs.
A model that cannot be exported keeps its perplexity; its lm-eval part records why.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

import torch

from hlat.core.config import OFFLINE_TASK_PREFIX, EvaluationConfig, HlatConfig, ModelConfig
from hlat.core.contract import channel_location, fetch_tokenizer, job_arguments, read_job_config, reporting_failure
from hlat.core.layout import AVERAGED_DIR, CHECKPOINTS_DIR
from hlat.core.layout import eval_results_path as results_path
from hlat.core.run import Run
from hlat.core.shards import mixture_documents, read_mixture
from hlat.core.storage import Storage
from hlat.training.checkpoint.hf_export import (
    export_hf,
    fetch_tokenizer_files,
    load_checkpoint_model,
    locate_checkpoint,
)
from hlat.training.evaluation.perplexity import held_out_perplexity
from hlat.training.models import hf_config

log = logging.getLogger("hlat.evaluate")


def perplexity_line(p: dict[str, Any]) -> str:
    """`perplexity 266.55 (5.5855 nats/token, 1.2345 bits/byte) over 12,288 tokens of 40 documents`."""
    ppl = p.get("perplexity")
    head = f"perplexity {ppl:,.2f}" if isinstance(ppl, int | float) else "perplexity overflowed"
    parts = []
    if isinstance(p.get("nll_per_token"), int | float):
        parts.append(f"{p['nll_per_token']:.4f} nats/token")
    if isinstance(p.get("bits_per_byte"), int | float):
        parts.append(f"{p['bits_per_byte']:.4f} bits/byte")
    detail = f" ({', '.join(parts)})" if parts else ""
    return f"{head}{detail} over {p.get('tokens', 0):,} tokens of {p.get('documents', 0):,} documents"


"""Task names the project generates from the run's held-out text (see training/evaluation/lm_harness.py)."""
OFFLINE_TASK_DOCUMENTS = 2000
"""Held-out documents read to make the offline tasks' examples."""


def _device(choice: str | None) -> torch.device:
    """The evaluation job's device (CPU or CUDA), whatever device the training used."""
    if choice in (None, "auto", "xla"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def _held_out(data: Storage) -> Any:
    mixture, sources = read_mixture(data)
    return mixture_documents(sources, mixture.weights_at(0), "validation")


def evaluate_checkpoint(
    run: Run, cfg: HlatConfig, step: int | None, device: torch.device, averaged: bool = False
) -> dict[str, Any]:
    """Evaluate one checkpoint of `run` (or of `hlat average`'s with `averaged`); write and return its results.json."""
    from hlat.training.evaluation import lm_harness

    started = time.perf_counter()
    e = cfg.evaluation
    data = channel_location(run, "data")
    standard = [t for t in e.tasks if not t.startswith(OFFLINE_TASK_PREFIX)]
    if standard:
        lm_harness.check_tasks(standard, None)  # a typo fails in seconds, not after the model is loaded
    ref = locate_checkpoint(run.storage.uri(AVERAGED_DIR if averaged else CHECKPOINTS_DIR), step)
    log.info("evaluating %s on %s", ref.uri, device)
    model, saved = load_checkpoint_model(ref, device)
    results: dict[str, Any] = {
        "run_id": cfg.resolved_run_id(),
        "step": ref.step,
        "averaged": averaged,
        "checkpoint": ref.uri,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {"preset": saved.preset, "params": model.num_params()},
        "device": str(device),
        "perplexity": None,
        "lm_eval": None,
    }
    with tempfile.TemporaryDirectory(prefix="hlat-eval-") as tmp:
        tokenizer = fetch_tokenizer(run, tmp)
        if e.perplexity_tokens:
            results["perplexity"] = held_out_perplexity(
                model,
                _held_out(data),
                tokenizer,
                seq_len=saved.training.seq_len,
                max_tokens=e.perplexity_tokens,
                batch_size=e.batch_size,
                device=device,
                document_masking=saved.training.document_masking,
            )
            log.info("%s", perplexity_line(results["perplexity"]))
        if e.tasks:
            work = os.path.join(tmp, "work")
            results["lm_eval"] = _run_tasks(run, e, saved.model, cfg.training.seed, model, data, work, device)
    results["duration_s"] = round(time.perf_counter() - started, 1)
    run.storage.write_json(results_path(ref.step, averaged), results)
    log.info("wrote %s", run.storage.uri(results_path(ref.step, averaged)))
    return results


def _run_tasks(
    run: Run,
    e: EvaluationConfig,
    model_cfg: ModelConfig,
    seed: int,
    model: torch.nn.Module,
    data: Storage,
    work: str,
    device: torch.device,
) -> dict[str, Any]:
    """Export the model, make the offline tasks, run the harness; the lm-eval part of results.json."""
    from hlat.training.evaluation import lm_harness

    try:
        hf_config(model_cfg)
    except ValueError as exc:
        log.warning("lm-eval skipped: %s", exc)
        return {"skipped": str(exc), "tasks": {}}
    os.makedirs(work, exist_ok=True)
    hf_dir = os.path.join(work, "hf")
    tokenizer_dir = os.path.join(work, "tokenizer")
    fetch_tokenizer_files(channel_location(run, "tokenizer"), tokenizer_dir)
    export_hf(model.state_dict(), model_cfg, hf_dir, tokenizer_dir=tokenizer_dir)
    include_path = None
    offline = [t for t in e.tasks if t.startswith(OFFLINE_TASK_PREFIX)]
    if offline:
        include_path = os.path.join(work, "tasks")
        texts = list(itertools.islice(_held_out(data), OFFLINE_TASK_DOCUMENTS))
        made = lm_harness.write_offline_tasks(texts, include_path, seed=seed)
        unknown = sorted(set(offline) - set(made))
        if unknown:
            raise ValueError(
                f"evaluation.tasks: unknown offline task(s) {', '.join(unknown)}; the project defines {', '.join(made)}"
            )
    truncated = _TruncationCounter()
    hf_logger = logging.getLogger("lm_eval.models.huggingface")
    hf_logger.addFilter(truncated)
    try:
        results: dict[str, Any] = lm_harness.run_harness(
            hf_dir,
            list(e.tasks),
            include_path,
            limit=e.limit,
            batch_size=e.batch_size,
            device=str(device),
            num_fewshot=e.num_fewshot,
            seed=seed,
        )
    finally:
        hf_logger.removeFilter(truncated)
    if truncated.count:
        log.warning(
            "%d lm-eval requests were longer than the model's %d tokens and lost their oldest context tokens",
            truncated.count,
            model_cfg.max_seq_len,
        )
    results["truncated_requests"] = truncated.count
    return results


class _TruncationCounter(logging.Filter):
    """Counts lm-eval's per-request truncation warnings instead of logging each; one summary line follows."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "tokens from the left" in record.getMessage():
            self.count += 1
            return False
        return True


def quiet_progress_bars() -> None:
    """No tqdm bars when the output is not a terminal: in a log file each bar is one huge line. Set before imports."""
    if sys.stderr.isatty():
        return
    for name in ("TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(name, "1")


def main(argv: list[str] | None = None) -> int:
    def more(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
        parser.add_argument(
            "--from", dest="folder", choices=(CHECKPOINTS_DIR, AVERAGED_DIR), default=CHECKPOINTS_DIR,
            help="the run's folder the checkpoint is in: its training's, or `hlat average`'s (default: checkpoints)",
        )  # fmt: skip

    args = job_arguments("python -m hlat.training.evaluate", __doc__, argv, more)
    quiet_progress_bars()

    def program() -> int:
        run = read_job_config(args.config)
        cfg = run.config
        evaluate_checkpoint(run, cfg, args.step, _device(args.device), averaged=args.folder == AVERAGED_DIR)
        return 0

    return reporting_failure(program)


if __name__ == "__main__":
    sys.exit(main())
