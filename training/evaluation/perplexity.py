"""Perplexity and bits per byte of a model on the run's held-out split.

Documents are packed as training packs them: tokens then EOS, one stream starting with an EOS.
The stream is cut into windows of `seq_len`; each token after the first is predicted once, within its window.
Whole documents are taken until `max_tokens`, so the byte count is exact.

    nll_per_token = sum of -log p(token) / tokens          (nats)
    perplexity    = exp(nll_per_token)
    bits_per_byte = sum of -log p(token) / ln 2 / UTF-8 bytes of the documents

Bits per byte does not depend on the tokenizer, so runs with different vocabularies compare on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hlat.training.data.tokenizer import Tokenizer


def token_stream(texts: Iterable[str], tokenizer_model: str, max_tokens: int) -> tuple[list[int], int, int, int]:
    """(stream, eos id, documents, UTF-8 bytes): whole documents with EOS until over `max_tokens` predicted tokens.

    `tokenizer_model`: the run's tokenizer folder, or its tokenizer.model or tokenizer.json.
    """
    tokenizer = Tokenizer.load(tokenizer_model)
    eos = tokenizer.eos_id
    stream, documents, size = [eos], 0, 0
    for text in texts:
        if not text:
            continue
        stream.extend(tokenizer.encode(text))
        stream.append(eos)
        documents += 1
        size += len(text.encode("utf-8"))
        if len(stream) - 1 >= max_tokens:
            break
    return stream, eos, documents, size


@torch.no_grad()
def score_stream(
    model: nn.Module,
    stream: list[int],
    seq_len: int,
    batch_size: int,
    device: torch.device,
    eos_id: int | None = None,
) -> tuple[float, int]:
    """(summed negative log-likelihood in nats, tokens predicted) of `stream` in windows of `seq_len`;
    `eos_id` given: attention within documents (document masking)."""
    ids = torch.tensor(stream, dtype=torch.long)
    predicted = len(stream) - 1
    starts = list(range(0, predicted, seq_len))
    total = 0.0
    for first in range(0, len(starts), batch_size):
        group = starts[first : first + batch_size]
        # Windows of one batch share a length; only the stream's last window can be shorter.
        for length in sorted({min(seq_len, predicted - s) for s in group}):
            rows = [s for s in group if min(seq_len, predicted - s) == length]
            inputs = torch.stack([ids[s : s + length] for s in rows]).to(device)  # (B, T)
            targets = torch.stack([ids[s + 1 : s + 1 + length] for s in rows]).to(device)  # (B, T)
            doc_ids = None
            if eos_id is not None:
                eos = (inputs == eos_id).long()
                doc_ids = eos.cumsum(1) - eos  # a document starts after each EOS, as the loader marks them
            logits = model(inputs, doc_ids)  # (B, T, vocab)
            total += float(F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum"))
    return total, predicted


def held_out_perplexity(
    model: nn.Module,
    texts: Iterable[str],
    tokenizer_model: str,
    seq_len: int,
    max_tokens: int,
    batch_size: int,
    device: torch.device,
    document_masking: bool = False,
) -> dict[str, Any]:
    """Perplexity, NLL per token and bits per byte over at least `max_tokens` held-out tokens; ValueError if none."""
    stream, eos, documents, size = token_stream(texts, tokenizer_model, max_tokens)
    if documents == 0 or size == 0:
        raise ValueError("the held-out split has no text: nothing to score (check data.validation_fraction)")
    was_training = model.training
    model.eval()
    try:
        nll, tokens = score_stream(model, stream, seq_len, batch_size, device, eos if document_masking else None)
    finally:
        model.train(was_training)
    per_token = nll / tokens
    return {
        "split": "validation",
        "tokens": tokens,
        "documents": documents,
        "bytes": size,
        "seq_len": seq_len,
        "nll_per_token": per_token,
        "perplexity": math.exp(per_token) if per_token < 700 else None,  # None: overflow (JSON has no inf)
        "bits_per_byte": nll / math.log(2) / size,
    }
