"""Evaluation throughput: held-out perplexity scoring with our model against Hugging Face `LlamaForCausalLM`
loaded from our export (`training.checkpoint.hf_export.export_hf`), on the same token stream in the same windows, in
one run.

Ours is `training.evaluation.perplexity.score_stream` (what the evaluation stage runs); the peer is the plain HF loop:
the same windows of `--seq-len` tokens, `--batch` at a time (the stream's short last window alone), summing
`F.cross_entropy(hf(inputs).logits, targets, reduction="sum")`, with `use_cache=False` (no KV cache to build
when scoring). Both run in float32 with the same weights (a random init), so their NLL per token must agree to
1e-5 relative: the benchmark asserts it. A third row scores with document masking (attention within documents,
as the evaluation stage does for runs trained with it): a different NLL, shown for its cost. The text is the
last modules of the builtin Python-stdlib corpus, the tokenizer a sentencepiece BPE trained on its first ones.

With `--harness-limit N` (0: off) it also times lm-eval-harness (`training.evaluation.lm_harness.run_harness`, the hf
model on the exported folder) on the offline tasks made from the same held-out text, N examples per task;
model load and task setup included in each call (best of N after a warm-up), in loglikelihood requests
per second. On a CPU shared with other work, `--threads 1` keeps the figures steady: with more intra-op
threads than free cores, every parallel op waits on a descheduled thread and a pass can take 40x longer. Run:

    .venv/bin/python -m benchmarks.bench_evaluate [--kb K] [--vocab V] [--seq-len L] [--batch B] [--repeats R]
                                                  [--threads N] [--harness-limit N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.measure import best_of, table
from hlat.core.config import ModelConfig, TokenizerConfig
from hlat.infra.inputs.tokenizer import export_hf_tokenizer, train_sentencepiece, training_lines
from hlat.training.checkpoint.hf_export import export_hf
from hlat.training.data.sources import build_stdlib_corpus
from hlat.training.evaluation.perplexity import score_stream, token_stream
from hlat.training.model import Transformer

RELATIVE_TOLERANCE = 1e-5
"""Most relative difference allowed between the two NLLs per token (float32, the same weights)."""


def corpus_split(sample_mb: float, held_out_kb: float) -> tuple[list[str], list[str]]:
    """(tokenizer training text: the first documents, about `sample_mb`; held-out text: the last documents,
    about `held_out_kb`, last module first) of the builtin corpus."""
    with open(build_stdlib_corpus(), encoding="utf-8") as fh:
        docs = [json.loads(line)["text"] for line in fh]

    def take(texts: list[str], budget: int) -> list[str]:
        out = []
        for text in texts:
            if budget <= 0:
                break
            out.append(text)
            budget -= len(text.encode())
        return out

    held_out = take(docs[::-1], int(held_out_kb * 1e3))
    return take(docs[: len(docs) - len(held_out)], int(sample_mb * 1e6)), held_out


@torch.no_grad()
def score_hf(model: nn.Module, stream: list[int], seq_len: int, batch_size: int, device: torch.device) -> float:
    """Summed NLL (nats) of `stream` under the HF model: full windows `batch_size` at a time, then the short
    last window alone; the same windows and batches as `score_stream`."""
    ids = torch.tensor(stream, dtype=torch.long)
    predicted = len(stream) - 1
    full = predicted // seq_len
    inputs = ids[: full * seq_len].view(full, seq_len)  # (windows, T)
    targets = ids[1 : full * seq_len + 1].view(full, seq_len)  # (windows, T)
    batches = [(inputs[i : i + batch_size], targets[i : i + batch_size]) for i in range(0, full, batch_size)]
    if predicted % seq_len:
        batches.append((ids[full * seq_len : predicted][None], ids[full * seq_len + 1 :][None]))
    total = 0.0
    for x, y in batches:
        logits = model(x.to(device), use_cache=False).logits  # (B, T, vocab)
        total += float(F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), reduction="sum"))
    return total


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kb", type=float, default=300.0, help="KB of held-out text scored")
    parser.add_argument("--sample-mb", type=float, default=1.0, help="MB of text the tokenizer is trained on")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0: torch's default")
    parser.add_argument("--harness-limit", type=int, default=50, help="lm-eval examples per offline task; 0: off")
    args = parser.parse_args(argv)
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig(
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.d_model // 32,
        ffn_hidden=args.d_model * 8 // 3 // 16 * 16,
        vocab_size=args.vocab,
        max_seq_len=args.seq_len,
    )
    sample, held_out = corpus_split(args.sample_mb, args.kb)
    with tempfile.TemporaryDirectory(prefix="hlat-bench-evaluate-") as tmp:
        tok_cfg = TokenizerConfig()
        tokenizer_dir = os.path.join(tmp, "tokenizer")
        tokenizer = train_sentencepiece(
            training_lines(sample, 10**9, tok_cfg.max_sentence_length), args.vocab, tok_cfg, tokenizer_dir
        )
        export_hf_tokenizer(tokenizer, tokenizer_dir, args.seq_len)
        stream, eos, documents, size = token_stream(held_out, tokenizer, 10**12)  # every held-out document

        torch.manual_seed(0)
        ours = Transformer(cfg)
        ours.init_weights()
        hf_dir = export_hf(ours, cfg, os.path.join(tmp, "hf"), tokenizer_dir=tokenizer_dir)
        ours.to(device).eval()
        hf: nn.Module = LlamaForCausalLM.from_pretrained(hf_dir, local_files_only=True)
        hf.to(device).eval()

        scorers: list[tuple[str, Callable[[], float]]] = [
            ("hlat score_stream", lambda: score_stream(ours, stream, args.seq_len, args.batch, device)[0]),
            ("HF LlamaForCausalLM loop", lambda: score_hf(hf, stream, args.seq_len, args.batch, device)),
            (
                "hlat score_stream, document masking",
                lambda: score_stream(ours, stream, args.seq_len, args.batch, device, eos)[0],
            ),
        ]
        tokens = len(stream) - 1
        results = []
        for name, fn in scorers:
            nll = fn()  # warm-up, and the value compared (float() of each batch's loss waits for the device)
            results.append((name, nll / tokens, best_of(fn, args.repeats)))
        ours_nll, hf_nll = results[0][1], results[1][1]
        assert abs(ours_nll - hf_nll) <= RELATIVE_TOLERANCE * abs(hf_nll), (
            f"NLL per token differs: hlat {ours_nll!r}, HF {hf_nll!r}"
        )
        harness = time_harness(hf_dir, held_out, args, device) if args.harness_limit > 0 else None

    t_hf = results[1][2]
    rows = [
        [name, f"{t:.2f}", f"{tokens:,}", f"{tokens / t:,.0f}", f"{t_hf / t:.2f}x", f"{nll:.6f}"]
        for name, nll, t in results
    ]
    out = table(["scorer", "seconds", "tokens", "tokens/s", "speed vs HF", "NLL/token"], rows)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    head = (
        f"{cfg.n_layers} layers, d_model {cfg.d_model} ({cfg.num_params() / 1e6:.1f}M params), vocab {cfg.vocab_size}, "
        f"fp32, {name}; {documents} held-out documents, {size / 1e3:.0f} KB, {tokens:,} tokens; "
        f"windows of {args.seq_len}, batch {args.batch}; best of {args.repeats}; "
        f"NLL/token relative difference {abs(ours_nll - hf_nll) / abs(hf_nll):.1e}"
    )
    if harness is not None:
        seconds, requests = harness
        out += "\n" + table(
            ["lm-eval (hf model, offline tasks)", "seconds", "requests", "requests/s"],
            [
                [
                    f"hlat_cloze + hlat_choice, limit {args.harness_limit}",
                    f"{seconds:.2f}",
                    requests,
                    f"{requests / seconds:,.0f}",
                ]
            ],
        )
    print(f"{head}\n{out}")
    return out


def time_harness(hf_dir: Path, texts: list[str], args: argparse.Namespace, device: torch.device) -> tuple[float, int]:
    """(best seconds of `run_harness` calls on the offline tasks, after one warm-up call; loglikelihood requests
    per call): lm-eval's model load and task setup are part of each call, its import is not."""
    import datasets
    import lm_eval  # noqa: F401  (seconds to import, once per process)

    from hlat.training.evaluation.lm_harness import CHOICE_TASK, CHOICES, CLOZE_TASK, run_harness, write_offline_tasks

    datasets.disable_progress_bars()
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # one warning per context cut to the model's length
    with tempfile.TemporaryDirectory(prefix="hlat-bench-lm-eval-") as tasks_dir:
        tasks = write_offline_tasks(texts, tasks_dir, max_examples=args.harness_limit)

        def call() -> dict[str, Any]:
            return run_harness(str(hf_dir), tasks, tasks_dir, args.harness_limit, args.batch, str(device))

        samples = {name: task["n_samples"] for name, task in call()["tasks"].items()}
        seconds = best_of(call, args.repeats)
    return seconds, samples[CLOZE_TASK] + CHOICES * samples[CHOICE_TASK]


if __name__ == "__main__":
    main()
