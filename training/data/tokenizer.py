"""A run's tokenizer, whichever kind its folder holds: what the loader, perplexity, precompile and the loop encode with.

Two kinds load (`Tokenizer.load`):
- sentencepiece, a `tokenizer.model`: what the tokenizer stage trains, and what LLaMA's Hugging Face folders hold
  beside their tokenizer.json. Preferred wherever it exists: its ids are the original tokenizer's (the HF fast
  LLaMA tokenizer is a conversion of it), its EOS and BOS are in the model itself, and it encodes the loader's
  batches faster.
- Hugging Face `tokenizers`, a `tokenizer.json` (GPT-NeoX's folders have no sentencepiece model): loaded with the
  `tokenizers` library itself, not transformers, so the data loader stays light. Its EOS and BOS are the tokens
  tokenizer_config.json or special_tokens_map.json beside it name (https://huggingface.co/docs/transformers/main_classes/tokenizer).

Either way text is encoded as data: no BOS or EOS is added by the tokenizer, and a special token's spelling inside
a document ("</s>", "<|endoftext|>") is encoded as text, never as the special token (sentencepiece does so by
itself; `tokenizers` is told to with `encode_special_tokens`). The loader appends EOS after each document.

`sha256` identifies the tokenizer by its defining files (`hlat.core.layout.tokenizer_sha256`): for a trained
tokenizer it is its tokenizer.model's sha256, as loader states have always recorded it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import sentencepiece as spm

from hlat.core.config import HlatConfig
from hlat.core.contract import fetch_tokenizer, model_follows_tokenizer
from hlat.core.init_from import check_embedding_rows, import_record, model_follows_checkpoint
from hlat.core.layout import TOKENIZER_MODEL, TOKENIZER_SPECIALS, tokenizer_defining_files, tokenizer_sha256
from hlat.core.run import Run

log = logging.getLogger("hlat.tokenizer")

Kind = Literal["sentencepiece", "tokenizers"]
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer: encodes and decodes text, and says what the model and the loader need of it."""

    kind: Kind
    path: str
    """The file it was loaded from (tokenizer.model or tokenizer.json)."""
    vocab_size: int
    """Ids run from 0 to vocab_size - 1: the rows the model's embedding needs (before padding)."""
    eos_id: int
    bos_id: int | None
    byte_ids: frozenset[int]
    """The byte-fallback pieces (<0x00>..<0xFF>): text the vocabulary lacks, spelled byte by byte."""
    sha256: str
    files: tuple[str, ...]
    """The defining files' names (tokenizer_defining_files), in the folder of `path`."""
    _backend: Any = field(repr=False, compare=False)

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        """The tokenizer at `path`: a tokenizer folder (its tokenizer.model where it has one, else its
        tokenizer.json), or one of those files; a file named *.model is read as sentencepiece, any other as a
        tokenizer.json. ValueError when there is none, or it has no EOS (documents are packed with EOS between)."""
        if os.path.isdir(path):
            names = tokenizer_defining_files(os.listdir(path))
            if not names:
                raise ValueError(f"{path} holds no tokenizer: neither {TOKENIZER_MODEL} nor tokenizer.json")
            folder, main = path, names[0]
        else:
            folder, main = os.path.split(path)
            folder = folder or "."
            if main.endswith(".model"):
                names = [main]
            else:
                names = [main, *(n for n in TOKENIZER_SPECIALS if os.path.isfile(os.path.join(folder, n)))]
        contents = {}
        for name in names:
            with open(os.path.join(folder, name), "rb") as fh:
                contents[name] = fh.read()
        file = os.path.join(folder, main)
        if main.endswith(".model"):
            return _sentencepiece(file, contents[main], tokenizer_sha256(contents), tuple(names))
        return _tokenizers(file, contents, tokenizer_sha256(contents), tuple(names))

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, nothing added."""
        if self.kind == "sentencepiece":
            ids: list[int] = self._backend.encode(text)
            return ids
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str], add_eos: bool = False, threads: int = 1) -> list[np.ndarray]:
        """Each text's ids as an int32 array, EOS appended with `add_eos`. `threads`: sentencepiece's threads for the
        batch; for `tokenizers` more than one encodes the batch on its thread pool (RAYON_NUM_THREADS sizes it)."""
        if self.kind == "sentencepiece":
            arrays: list[np.ndarray] = self._backend.encode(
                list(texts), add_bos=False, add_eos=add_eos, return_type="numpy", num_threads=threads
            )
            return arrays
        if threads > 1:
            encoded = [e.ids for e in self._backend.encode_batch_fast(list(texts), add_special_tokens=False)]
        else:
            encoded = [self._backend.encode(t, add_special_tokens=False).ids for t in texts]
        tail = [self.eos_id] if add_eos else []
        return [np.asarray([*ids, *tail], dtype=np.int32) for ids in encoded]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids` (special tokens skipped by `tokenizers`, control pieces by sentencepiece)."""
        if self.kind == "sentencepiece":
            text: str = self._backend.decode(list(ids))
            return text
        decoded: str = self._backend.decode(list(ids), skip_special_tokens=True)
        return decoded

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of `ids` (for showing how a text was cut)."""
        if self.kind == "sentencepiece":
            return [self._backend.id_to_piece(i) for i in ids]
        return [self._backend.id_to_token(i) or "" for i in ids]


def _sentencepiece(path: str, proto: bytes, sha256: str, files: tuple[str, ...]) -> Tokenizer:
    processor = spm.SentencePieceProcessor(model_proto=proto)
    eos = processor.eos_id()
    if eos < 0:
        raise ValueError(f"{path} has no EOS piece; packed documents need one between them")
    size = processor.get_piece_size()
    bos = processor.bos_id()
    return Tokenizer(
        kind="sentencepiece",
        path=path,
        vocab_size=size,
        eos_id=eos,
        bos_id=bos if bos >= 0 else None,
        byte_ids=frozenset(i for i in range(size) if processor.is_byte(i)),
        sha256=sha256,
        files=files,
        _backend=processor,
    )


def _special_token(contents: dict[str, bytes], key: str) -> str | None:
    """The token the Hugging Face config files name as `key` (eos_token, bos_token): tokenizer_config.json's, else
    special_tokens_map.json's; a string or an AddedToken's {"content": ...}."""
    for name in TOKENIZER_SPECIALS:
        if name not in contents:
            continue
        value = json.loads(contents[name]).get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


def _tokenizers(path: str, contents: dict[str, bytes], sha256: str, files: tuple[str, ...]) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    definition = contents[os.path.basename(path)]
    backend = Backend.from_str(definition.decode("utf-8"))
    # A special token's spelling inside a document is text, as sentencepiece treats it (data must not inject EOS).
    backend.encode_special_tokens = True
    vocab = backend.get_vocab(with_added_tokens=True)
    ids = {}
    for key in ("eos_token", "bos_token"):
        token = _special_token(contents, key)
        ids[key] = None if token is None else backend.token_to_id(token)
        if token is not None and ids[key] is None:
            raise ValueError(f"{path}: the {key} {token!r} its config files name is not in its vocabulary")
    eos = ids["eos_token"]
    if eos is None:
        raise ValueError(
            f"{path} has no EOS: none of {', '.join(TOKENIZER_SPECIALS)} beside it names an eos_token; packed "
            "documents need one between them"
        )
    model = json.loads(definition).get("model", {})
    byte_fallback = bool(model.get("byte_fallback"))
    return Tokenizer(
        kind="tokenizers",
        path=path,
        vocab_size=max(vocab.values()) + 1,
        eos_id=eos,
        bos_id=ids["bos_token"],
        byte_ids=frozenset(i for t, i in vocab.items() if byte_fallback and _BYTE_PIECE.fullmatch(t)),
        sha256=sha256,
        files=files,
        _backend=backend,
    )


def job_config(run: Run, cfg: HlatConfig) -> HlatConfig:
    """The config a job builds its model from, each change logged once by rank 0: with model.init_from, the family
    and shape of the imported checkpoint (its config.json in the run's import record, `model_follows_checkpoint`);
    with tokenizer.pretrained, model.vocab_size is the run's tokenizer's (read from the job's tokenizer channel, or
    the run; `model_follows_tokenizer`), and an imported embedding must fit it (`check_embedding_rows`). Training,
    precompile and their checkpoints all use it, so they agree on the model's shape and on the compile cache's key.
    A trained tokenizer's run (no tokenizer.pretrained) reads nothing and keeps its config."""
    if cfg.tokenizer.pretrained is None:
        return cfg
    main = os.environ.get("RANK", "0") == "0"
    record = import_record(run) if cfg.model.init_from is not None else None
    if record is not None:
        cfg, change = model_follows_checkpoint(cfg, record["config"])
        if change and main:
            log.info("%s", change)
    with tempfile.TemporaryDirectory(prefix="hlat-tokenizer-") as tmp:
        tokenizer = Tokenizer.load(fetch_tokenizer(run, tmp))
    followed, change = model_follows_tokenizer(cfg, tokenizer.vocab_size)
    if change and main:
        log.info("%s (tokenizer.pretrained=%s)", change, cfg.tokenizer.pretrained)
    if record is not None:
        check_embedding_rows(followed, int(record["config"]["vocab_size"]))
    return followed
