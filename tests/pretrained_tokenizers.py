"""Existing tokenizers the tests build and save in Hugging Face's format, as published ones are laid out.

- `neox_like`: a byte-level BPE made with `tokenizers` and saved by transformers' `PreTrainedTokenizerFast`, with
  "<|endoftext|>" as its BOS and EOS: GPT-NeoX's folder (tokenizer.json and its config files, no sentencepiece model).
- `llama_like`: the project's own sentencepiece tokenizer with its Hugging Face files, as LLaMA-2's folders hold both
  (tokenizer.model beside tokenizer.json, <s> and </s>).
- `hub_cache`: a folder laid out as huggingface_hub's cache holding one of them under a hub name, for the offline
  (HF_HUB_OFFLINE=1) hub path: nothing is ever downloaded.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

NEOX_EOS = "<|endoftext|>"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def neox_like(folder: Path, texts: Iterable[str], vocab_size: int = 400) -> Path:
    """A GPT-NeoX-like tokenizer trained on `texts`, saved into `folder` by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[NEOX_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=NEOX_EOS, eos_token=NEOX_EOS, unk_token=NEOX_EOS
    )
    tokenizer.save_pretrained(str(folder))
    return folder


def llama_like(folder: Path, texts: Iterable[str], vocab_size: int = 400, max_length: int = 128) -> Path:
    """The project's sentencepiece BPE trained on `texts`, with its Hugging Face files, in `folder`."""
    from hlat.core.config import TokenizerConfig
    from hlat.infra.inputs.tokenizer import export_hf_tokenizer, train_sentencepiece, training_lines

    model = train_sentencepiece(training_lines(texts, 10**7, 4096), vocab_size, TokenizerConfig(), str(folder))
    export_hf_tokenizer(model, str(folder), max_length)
    return folder


def hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = HUB_COMMIT) -> Path:
    """`cache` laid out as huggingface_hub's cache (models--org--name/refs/main and snapshots/<commit>/) holding the
    tokenizer files of `folder` as the hub repo `repo_id`; returns the cache folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in folder.iterdir():
        shutil.copyfile(path, snapshot / path.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return cache
