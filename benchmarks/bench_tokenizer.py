"""Tokenizer speed: training time, and encoding throughput of the Hugging Face export against sentencepiece.

Both tokenizers give identical ids (checked here too); the benchmark says which one the online
tokenize-and-pack loader should use. Run:

    .venv/bin/python -m benchmarks.bench_tokenizer [--vocab V] [--sample-mb M] [--repeats R]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import sentencepiece as spm

from benchmarks.measure import best_of, table
from hlat.core.presets import load_config
from hlat.infra.inputs.tokenizer import export_hf_tokenizer, train_sentencepiece, training_lines
from hlat.training.data.sources import stdlib_documents


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--sample-mb", type=float, default=8.0)
    parser.add_argument("--encode-mb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    cfg = load_config("tiny").tokenizer
    docs = [d["text"] for d in stdlib_documents()]
    held_out, budget = [], int(args.encode_mb * 1e6)
    for text in reversed(docs):  # the last modules, not the first ones trained on
        if budget <= 0:
            break
        held_out.append(text)
        budget -= len(text.encode())
    encode_mb = sum(len(t.encode()) for t in held_out) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        model = train_sentencepiece(training_lines(docs, int(args.sample_mb * 1e6), 16384), args.vocab, cfg, tmp)
        train_s = time.perf_counter() - start
        export_hf_tokenizer(model, tmp, 4096)
        sp = spm.SentencePieceProcessor(model_file=model)
        hf = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        hf.model_max_length = 10**9  # whole modules are encoded here, not model inputs
        sp_ids = sp.encode(held_out)
        hf_ids = hf(held_out, add_special_tokens=False)["input_ids"]
        assert sp_ids == hf_ids, "the Hugging Face export must give sentencepiece's ids"
        tokens = sum(map(len, sp_ids))
        t_sp = best_of(lambda: sp.encode(held_out), args.repeats)
        t_hf = best_of(lambda: hf(held_out, add_special_tokens=False), args.repeats)
    rows = [
        ["sentencepiece encode (batch)", f"{t_sp:.2f}", f"{encode_mb / t_sp:.1f}", f"{tokens / t_sp:,.0f}", "1.0x"],
        [
            "HF fast tokenizer (batch)",
            f"{t_hf:.2f}",
            f"{encode_mb / t_hf:.1f}",
            f"{tokens / t_hf:,.0f}",
            f"{t_sp / t_hf:.2f}x",
        ],
    ]
    out = table(["encoder", "seconds", "MB/s", "tokens/s", "speed vs sentencepiece"], rows)
    print(
        f"sentencepiece BPE, vocab {args.vocab}, trained on {args.sample_mb:.0f} MB in {train_s:.1f} s; "
        f"encoding {encode_mb:.1f} MB ({tokens:,} tokens, identical ids), best of {args.repeats}\n{out}"
    )
    return out


if __name__ == "__main__":
    main()
