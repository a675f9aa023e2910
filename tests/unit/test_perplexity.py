"""Perplexity and bits per byte: exact values for a model whose predictions are known, every token scored once,
and agreement with a direct computation on our model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hlat.core.config import ModelConfig
from hlat.training.evaluation.perplexity import held_out_perplexity, score_stream, token_stream
from hlat.training.model import Transformer

TEXTS = [f"document number {i}: the quick brown fox jumps over the lazy dog {i * 7}." for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("spm")
    prefix = str(folder / "tok")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 5),
        model_prefix=prefix,
        vocab_size=64,
        model_type="bpe",
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        byte_fallback=False,
        minloglevel=2,
    )
    return prefix + ".model"


class Uniform(nn.Module):
    """Predicts every token of a vocabulary of `vocab` with probability 1/vocab; records the windows it sees."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, tokens: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        self.shapes.append(tuple(tokens.shape))
        return torch.zeros(*tokens.shape, self.vocab)


def test_a_uniform_model_scores_log_vocab_per_token_and_the_bits_per_byte_follow(tokenizer: str) -> None:
    model = Uniform(64)
    result = held_out_perplexity(model, TEXTS, tokenizer, seq_len=16, max_tokens=10**9, batch_size=4, device="cpu")
    stream, _, documents, size = token_stream(TEXTS, tokenizer, 10**9)
    assert documents == len(TEXTS) and size == sum(len(t.encode()) for t in TEXTS)
    assert result["tokens"] == len(stream) - 1  # every token after the leading EOS, once
    assert result["nll_per_token"] == pytest.approx(math.log(64), rel=1e-6)
    assert result["perplexity"] == pytest.approx(64, rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(result["tokens"] * 6 / size, rel=1e-6)
    # Windows of 16 in batches of 4; the last window is shorter.
    assert sum(math.prod(s) for s in model.shapes) == result["tokens"]
    assert sum(s[1] != 16 for s in model.shapes) == 1 and all(s[0] <= 4 for s in model.shapes)


def test_whole_documents_are_taken_until_the_token_budget(tokenizer: str) -> None:
    stream, eos, documents, _ = token_stream(TEXTS, tokenizer, max_tokens=50)
    assert stream[0] == eos and stream[-1] == eos
    assert len(stream) - 1 >= 50 and documents < len(TEXTS)
    assert stream.count(eos) == documents + 1


def test_scores_match_a_direct_cross_entropy_on_our_model(tokenizer: str) -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(n_layers=1, d_model=32, n_heads=2, ffn_hidden=64, vocab_size=260, max_seq_len=128))
    model.init_weights()
    stream, eos, _, _ = token_stream(TEXTS[:3], tokenizer, 10**9)
    assert len(stream) <= 128
    ids = torch.tensor(stream)
    with torch.no_grad():
        expected = F.cross_entropy(model(ids[None, :-1])[0], ids[1:], reduction="sum").item()
    nll, tokens = score_stream(model.eval(), stream, seq_len=128, batch_size=2, device=torch.device("cpu"))
    assert tokens == len(stream) - 1 and nll == pytest.approx(expected, rel=1e-5)
    # With document masking the first document's tokens see the same context, later ones less: not more likely.
    masked, _ = score_stream(model, stream, seq_len=128, batch_size=2, device=torch.device("cpu"), eos_id=eos)
    assert masked != pytest.approx(nll, rel=1e-9)


def test_no_held_out_text_is_a_clear_error(tokenizer: str) -> None:
    with pytest.raises(ValueError, match="held-out split has no text"):
        held_out_perplexity(Uniform(64), ["", ""], tokenizer, 16, 100, 2, torch.device("cpu"))


def test_the_tokenizer_needs_an_eos(tmp_path: Path) -> None:
    prefix = str(tmp_path / "noeos")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 5), model_prefix=prefix, vocab_size=60, eos_id=-1, minloglevel=2
    )
    with pytest.raises(ValueError, match="no EOS"):
        token_stream(TEXTS, prefix + ".model", 10)
