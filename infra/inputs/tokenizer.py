"""The run's tokenizer: a sentencepiece BPE trained the LLaMA way plus its Hugging Face export, or a pretrained one.

report.json is uploaded last, marking a complete tokenizer. Both tokenizers give the same ids and round-trip text
without U+2581 (docs/stages.md). No training imports: the pretrained loader is passed in.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import sentencepiece as spm

from hlat.core.layout import REPORT_FILE, TOKENIZER_FILES, tokenizer_defining_files, tokenizer_sha256
from hlat.core.layout import TOKENIZER_MODEL as MODEL_FILE
from hlat.core.shards import Split, data_checksum_of, mixture_documents, mixture_rows, read_mixture
from hlat.core.storage import Storage

if TYPE_CHECKING:
    from hlat.core.config import HlatConfig, TokenizerConfig

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

# sentencepiece draws from a process-wide generator (sampling and shuffling of input sentences) that is seeded
# from the clock unless set; a fixed seed makes the same sample give the same model.
TRAINER_SEED = 0
# The byte budget already bounds the sample; this caps the sentence count too, so a corpus of very short lines
# cannot make the trainer hold tens of millions of tiny strings (beyond it the trainer samples, seeded).
MAX_TRAINING_SENTENCES = 10_000_000
SNIPPET_CHARS = 120


def _char_start(data: bytes, pos: int) -> int:
    """The largest position <= pos that does not fall inside a UTF-8 multi-byte character."""
    while 0 < pos < len(data) and data[pos] & 0xC0 == 0x80:
        pos -= 1
    return pos


def _runs_of_lines(document: str, max_bytes: int) -> Iterator[str]:
    """The document as runs of whole lines of at most `max_bytes` UTF-8 bytes; longer lines are cut on characters."""
    run: list[str] = []
    size = 0
    # Only "\n" splits: str.splitlines() would also cut at \r, \x0b, \x1c-\x1e, \x85, \u2028, \u2029, and
    # those characters would then never be seen by the trainer.
    for line in document.split("\n"):
        width = len(line.encode("utf-8"))
        if run and size + 1 + width > max_bytes:
            yield "\n".join(run)
            run, size = [], 0
        if width <= max_bytes:
            size += width + (1 if run else 0)
            run.append(line)
            continue
        data = line.encode("utf-8")
        start = 0
        while start < len(data):
            end = _char_start(data, start + max_bytes)
            yield data[start:end].decode("utf-8")
            start = end
    if run:
        yield "\n".join(run)


def training_lines(documents: Iterable[str], sample_bytes: int, max_sentence_length: int) -> Iterator[str]:
    r"""Trainer input from `documents`: sentences of at most `max_sentence_length` bytes, `sample_bytes` in all.

    sentencepiece strips each sentence's trailing newline and skips long ones. Packing a document's consecutive
    lines into one sentence lets "\n" pieces into the vocabulary. Newline-only runs are skipped. Documents are read
    lazily, one at a time."""
    if sample_bytes < 1:
        raise ValueError(f"sample_bytes must be positive, got {sample_bytes}")
    if max_sentence_length < 4:
        # A sentence must be able to hold the longest UTF-8 character (4 bytes).
        raise ValueError(f"max_sentence_length must be at least 4 bytes, got {max_sentence_length}")
    budget = sample_bytes
    for document in documents:
        for sentence in _runs_of_lines(document, max_sentence_length):
            if not sentence.strip("\n"):
                continue
            data = sentence.encode("utf-8")
            if len(data) >= budget:
                end = _char_start(data, budget)
                if end:
                    yield data[:end].decode("utf-8")
                return
            budget -= len(data)
            yield sentence


def trainer_options(vocab_size: int, cfg: TokenizerConfig) -> dict[str, Any]:
    """The sentencepiece trainer options of the LLaMA recipe, recorded in the report."""
    return {
        "model_type": "bpe",
        "vocab_size": vocab_size,
        # The vocabulary is the model's embedding table: exactly vocab_size pieces or a clear error.
        "hard_vocab_limit": True,
        "byte_fallback": cfg.byte_fallback,
        "split_digits": cfg.split_digits,
        "character_coverage": cfg.character_coverage,
        # No NFKC and no whitespace folding: text must come back byte for byte.
        "normalization_rule_name": "identity",
        "remove_extra_whitespaces": False,
        # No dummy "▁" prefix (LLaMA adds one): transformers 5's LlamaTokenizer cannot match it for text starting
        # with a space (docs/stages.md). A document's first word is then split as at a line start.
        "add_dummy_prefix": False,
        "allow_whitespace_only_pieces": True,
        "unk_id": UNK_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "pad_id": -1,
        "unk_piece": UNK,
        "bos_piece": BOS,
        "eos_piece": EOS,
        "max_sentence_length": cfg.max_sentence_length,
        "input_sentence_size": MAX_TRAINING_SENTENCES,
        "shuffle_input_sentence": True,
        "num_threads": cfg.threads or os.cpu_count() or 1,
        # Warnings and errors only: the INFO log is thousands of lines per training.
        "minloglevel": 1,
    }


def _trainer_error(exc: RuntimeError, vocab_size: int, cfg: TokenizerConfig) -> Exception:
    """A ValueError naming the config field to change, for trainer failures users cause."""
    text = str(exc)
    too_high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", text)
    if too_high:
        most = too_high.group(2)
        return ValueError(
            f"the tokenizer training sample is too small for model.vocab_size={vocab_size}: sentencepiece "
            f"can make only {most} pieces from it; raise tokenizer.sample_bytes (now {cfg.sample_bytes}; "
            f"or prepare more data) or lower model.vocab_size to at most {most}"
        )
    chars = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", text)
    if chars:
        return ValueError(
            f"model.vocab_size={vocab_size} is too small for the training sample: the characters needed for "
            f"tokenizer.character_coverage={cfg.character_coverage}, plus the byte and special pieces, take "
            f"{chars.group(2)}; raise model.vocab_size or lower tokenizer.character_coverage"
        )
    return exc


def train_sentencepiece(lines: Iterator[str], vocab_size: int, cfg: TokenizerConfig, out_dir: str) -> str:
    """Train a sentencepiece BPE model of exactly `vocab_size` pieces; return the path of `tokenizer.model`.

    Deterministic, except that `cfg.threads` None records the machine's thread count."""
    first = next(lines, None)
    if first is None:
        raise ValueError("no training text: the train split has no non-empty lines to train the tokenizer on")

    def sentences() -> Iterator[str]:
        yield first
        yield from lines

    spm.set_random_generator_seed(TRAINER_SEED)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_writer=model, **trainer_options(vocab_size, cfg)
        )
    except RuntimeError as exc:
        raise _trainer_error(exc, vocab_size, cfg) from exc
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    if processor.get_piece_size() != vocab_size:
        raise RuntimeError(f"sentencepiece made {processor.get_piece_size()} pieces instead of {vocab_size}")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, MODEL_FILE)
    with open(path, "wb") as fh:
        fh.write(model.getvalue())
    return path


def _bpe_vocab_and_merges(sp: spm.SentencePieceProcessor) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The sentencepiece vocabulary and the merge list under which Hugging Face BPE encodes identically.

    Ranking every split of each normal piece by that piece's score reproduces sentencepiece's merge order.
    Control, unknown and byte pieces are left out, so "<s>" in a document stays plain text."""
    size = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(size)}
    normal = {
        sp.id_to_piece(i)
        for i in range(size)
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))
    }
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece in normal:
        piece_id = vocab[piece]
        score = sp.get_score(piece_id)
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-score, piece_id, cut, left, right))
    ranked.sort()
    return vocab, [(left, right) for *_, left, right in ranked]


def export_hf_tokenizer(model_path: str, out_dir: str, max_length: int) -> list[str]:
    """Write Hugging Face tokenizer files for the sentencepiece model into `out_dir`; return their names.

    They load offline as a fast `LlamaTokenizer` that adds `<s>` and gives sentencepiece's ids. Without byte
    fallback the export is a generic fast tokenizer: ids match, but unknown text becomes <unk>."""
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    processor = spm.SentencePieceProcessor(model_file=model_path)
    vocab, merges = _bpe_vocab_and_merges(processor)
    # - add_prefix_space=False: no dummy "▁" (the model has none) and no decoder Strip of a leading space;
    #   legacy=False only matters when a prefix is added, and is set for the non-legacy behaviour anyway.
    # - split_special_tokens=True: "<s>" or "</s>" inside a document is text, as in sentencepiece, not a
    #   control token injected by the data.
    # - clean_up_tokenization_spaces=False: decoding must not touch spaces around punctuation.
    common: dict[str, Any] = {
        "unk_token": UNK,
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    tokenizer: PreTrainedTokenizerFast
    if any(processor.is_byte(i) for i in range(processor.get_piece_size())):
        # transformers 5's LlamaTokenizer rebuilds its pre-tokenizer and decoder from these arguments on every
        # load, keeping only tokenizer.json's vocabulary and merges: the arguments make it match sentencepiece.
        tokenizer = LlamaTokenizer(vocab=vocab, merges=merges, add_prefix_space=False, legacy=False, **common)
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        # LlamaTokenizer's BPE has no unk token and would silently drop characters outside the vocabulary,
        # where sentencepiece gives one <unk> per run of them; the generic class loads this BPE as written.
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK, fuse_unk=True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **common)
    os.makedirs(out_dir, exist_ok=True)
    saved = tokenizer.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as fh:
        config = json.load(fh)
    # save_pretrained leaves these out (the post-processor in tokenizer.json carries them); written explicitly
    # so the files say what they do and a reload cannot fall back to other defaults.
    config.update({"add_bos_token": True, "add_eos_token": False})
    with open(config_path, "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2, sort_keys=True, ensure_ascii=False)
        fh.write("\n")
    target = os.path.join(out_dir, MODEL_FILE)
    if os.path.abspath(model_path) != os.path.abspath(target):
        shutil.copyfile(model_path, target)
    names = {os.path.basename(str(p)) for p in saved}
    return [MODEL_FILE, *sorted(names - {MODEL_FILE})]


def _within_budget(text: str, budget: int) -> tuple[str, int]:
    """`text` cut to at most `budget` UTF-8 bytes on a character boundary, and its byte size."""
    data = text.encode("utf-8")
    if len(data) <= budget:
        return text, len(data)
    end = _char_start(data, budget)
    return data[:end].decode("utf-8"), end


def tokenizer_report(
    model_path: str,
    validation_texts: Iterable[str],
    report_sample_bytes: int,
    n_samples: int = 3,
    hf_dir: str | None = None,
) -> dict[str, Any]:
    """Quality figures of a tokenizer on held-out text, as JSON data.

    bytes_per_token, byte_fallback_rate (share of <0x..> pieces), round_trip_failures, and with `hf_dir`
    hf_id_mismatches."""
    processor = spm.SentencePieceProcessor(model_file=model_path)
    byte_ids = {i for i in range(processor.get_piece_size()) if processor.is_byte(i)}
    unk_id = processor.unk_id()
    hf = None
    if hf_dir is not None:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    texts = total_bytes = tokens = byte_tokens = unk = round_trip_failures = hf_mismatches = 0
    samples: list[dict[str, Any]] = []
    for text, size in _report_texts(validation_texts, report_sample_bytes):
        ids = processor.encode(text)
        texts += 1
        total_bytes += size
        tokens += len(ids)
        byte_tokens += sum(1 for i in ids if i in byte_ids)
        unk += sum(1 for i in ids if i == unk_id)
        round_trip_failures += processor.decode(ids) != text
        if hf is not None:
            hf_mismatches += hf.encode(text, add_special_tokens=False, verbose=False) != ids
        if len(samples) < n_samples and text.strip():
            snippet = text[:SNIPPET_CHARS]
            samples.append(
                {
                    "text": snippet,
                    "pieces": processor.encode(snippet, out_type=str),
                    "ids": processor.encode(snippet),
                }
            )
    report: dict[str, Any] = {
        "vocab_size": processor.get_piece_size(),
        "texts": texts,
        "bytes": total_bytes,
        "tokens": tokens,
        "bytes_per_token": round(total_bytes / tokens, 4) if tokens else None,
        "byte_fallback_tokens": byte_tokens,
        "byte_fallback_rate": round(byte_tokens / tokens, 6) if tokens else 0.0,
        "unk_count": unk,
        "round_trip_failures": round_trip_failures,
        "samples": samples,
    }
    if hf is not None:
        report["hf_id_mismatches"] = hf_mismatches
    return report


def _remove_other_tokenizer_files(out: Storage, keep: Iterable[str]) -> None:
    """Delete tokenizer files in `out` that the uploaded tokenizer lacks, lest an earlier one's pass for its own."""
    kept = set(keep)
    for name in out.list():
        if name in TOKENIZER_FILES and name not in kept:
            out.remove(name)


class _CountingSentences:
    def __init__(self, lines: Iterator[str]) -> None:
        self.lines, self.count, self.bytes = lines, 0, 0

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        line = next(self.lines)
        self.count += 1
        self.bytes += len(line.encode("utf-8"))
        return line


def build_tokenizer(
    data: Storage, out: Storage, vocab_size: int, max_seq_len: int, cfg: TokenizerConfig
) -> dict[str, Any]:
    """The train-tokenizer stage: prepared shards in `data` -> tokenizer files and report.json in `out`.

    Trains on the train split and reports on validation (else train). Returns the report."""
    mixture, sources = read_mixture(data)
    if mixture_rows(sources, "train") == 0:
        raise ValueError(f"{data.uri()} has no training documents: re-run prepare-data on a non-empty source")
    # The sample mixes the sources by their weights at step 0: the text the model will first train on.
    weights = mixture.weights_at(0)
    with tempfile.TemporaryDirectory(prefix="hlat-tokenizer-") as tmp:
        sample = _CountingSentences(
            training_lines(mixture_documents(sources, weights, "train"), cfg.sample_bytes, cfg.max_sentence_length)
        )
        started = time.monotonic()
        model_path = train_sentencepiece(sample, vocab_size, cfg, tmp)
        train_seconds = time.monotonic() - started
        files = export_hf_tokenizer(model_path, tmp, max_seq_len)

        report_split: Split = "validation" if mixture_rows(sources, "validation") else "train"
        report = tokenizer_report(
            model_path, mixture_documents(sources, weights, report_split), cfg.report_sample_bytes, hf_dir=tmp
        )
        if report["hf_id_mismatches"]:
            raise RuntimeError(
                f"the Hugging Face export disagrees with sentencepiece on {report['hf_id_mismatches']} of "
                f"{report['texts']} {report_split} texts; the tokenizer was not published"
            )
        report.update(
            {
                "data_checksum": data_checksum_of(data),
                "report_split": report_split,
                "training_sentences": sample.count,
                "training_bytes": sample.bytes,
                "train_seconds": round(train_seconds, 3),
                "max_seq_len": max_seq_len,
                "trainer_options": trainer_options(vocab_size, cfg),
                "files": [*files, REPORT_FILE],
            }
        )
        if report_split == "train":
            report["report_note"] = (
                "the data has no validation split, so these figures are measured on training text "
                "(optimistic); set data.validation_fraction > 0 for held-out figures"
            )
        # An old report.json would vouch for a half-replaced tokenizer while the new files upload.
        out.remove(REPORT_FILE)
        _remove_other_tokenizer_files(out, files)
        for name in files:
            out.put_file(os.path.join(tmp, name), name)
        out.write_json(REPORT_FILE, report)
    return report


# -- an existing tokenizer (tokenizer.pretrained) ----------------------------------------------------------------------
PRETRAINED_FIX = (
    "point tokenizer.pretrained at a local folder, an s3:// prefix or a Hugging Face hub name (org/name[@revision]) "
    "holding tokenizer.json or tokenizer.model, or remove it to train a tokenizer on the run's data"
)
_LOCAL = ("/", "./", "../", "~", "file://")


class LoadedTokenizer(Protocol):
    """What the stage needs of a loaded tokenizer (the training layer's `Tokenizer`)."""

    @property
    def kind(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def byte_ids(self) -> frozenset[int]: ...
    @property
    def sha256(self) -> str: ...
    @property
    def files(self) -> tuple[str, ...]: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def pieces(self, ids: Sequence[int]) -> list[str]: ...


def _copy_tokenizer_files(folder: Storage, dest: str) -> list[str]:
    """Copy the HF tokenizer files `folder` holds into `dest`; return their names."""
    names = [name for name in folder.list() if name in TOKENIZER_FILES]
    os.makedirs(dest, exist_ok=True)
    for name in names:
        folder.get_file(name, os.path.join(dest, name))
    return names


def _hub_cache_dir() -> str | None:
    """The hub cache the environment names now (HF_HUB_CACHE, else HF_HOME/hub).

    huggingface_hub reads both only at import, so a later value is passed explicitly."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


class HubUnreachable(ValueError):
    """The hub did not answer and its cache has no copy; not a wrong name, since a job elsewhere may reach it."""


def hub_snapshot(source: str, allow_patterns: list[str], field: str, fix: str) -> str:
    """The local folder of `org/name[@revision]` through huggingface_hub's cache (cache only under HF_HUB_OFFLINE).

    Its name is the commit got. HubUnreachable or ValueError otherwise, one line naming `field` and `fix`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = source.partition("@")
    try:
        snapshot: str = snapshot_download(
            repo_id,
            revision=revision or None,
            allow_patterns=allow_patterns,
            cache_dir=_hub_cache_dir(),
            local_files_only=_hub_offline(),
        )
    except (OSError, ValueError) as exc:  # not found, gated, offline without a cached copy, malformed name
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        offline = " (HF_HUB_OFFLINE is set: only the local hub cache is read)" if _hub_offline() else ""
        unreachable = isinstance(exc, LocalEntryNotFoundError) and not _hub_offline()
        raise (HubUnreachable if unreachable else ValueError)(
            f"{field}={source!r}: the Hugging Face hub could not give it{offline}: {type(exc).__name__}: {reason}; "
            f"for a gated model (LLaMA-2) accept its license and set HF_TOKEN, or {fix}"
        ) from None
    return snapshot


def _fetch_from_hub(source: str, dest: str) -> dict[str, Any]:
    snapshot = hub_snapshot(source, list(TOKENIZER_FILES), "tokenizer.pretrained", PRETRAINED_FIX)
    names = _copy_tokenizer_files(Storage(snapshot), dest)
    # The cache keeps each snapshot under its commit: the revision the run actually got.
    return {"source": source, "from": "hub", "revision": os.path.basename(os.path.normpath(snapshot)), "names": names}


def fetch_pretrained(source: str, dest: str) -> dict[str, Any]:
    """Copy the tokenizer files of `source` (s3://, local path, or hub name) into `dest`; say where they came from.

    Returns {"source", "from", "revision", "names"}. No tokenizer.json or tokenizer.model: one-line ValueError."""
    if source.startswith("s3://"):
        names = _copy_tokenizer_files(Storage(source), dest)
        info: dict[str, Any] = {"source": source, "from": "s3", "revision": None, "names": names}
    elif os.path.isdir(os.path.expanduser(source)) or source.startswith(_LOCAL):
        folder = os.path.expanduser(source.removeprefix("file://"))
        if not os.path.isdir(folder):
            raise ValueError(f"tokenizer.pretrained={source!r}: no such folder; {PRETRAINED_FIX}")
        names = _copy_tokenizer_files(Storage(folder), dest)
        info = {"source": source, "from": "local", "revision": None, "names": names}
    else:
        info = _fetch_from_hub(source, dest)
    if not tokenizer_defining_files(info["names"]):
        raise ValueError(
            f"tokenizer.pretrained={source!r} holds no tokenizer (neither tokenizer.json nor {MODEL_FILE}); "
            f"{PRETRAINED_FIX}"
        )
    return info


def pretrained_fingerprint(source: str) -> dict[str, Any]:
    """A pretrained tokenizer's fingerprint: its source and its files' sha256, fetched now."""
    with tempfile.TemporaryDirectory(prefix="hlat-pretrained-") as tmp:
        info = fetch_pretrained(source, tmp)
        contents = {}
        for name in tokenizer_defining_files(info["names"]):
            with open(os.path.join(tmp, name), "rb") as fh:
                contents[name] = fh.read()
    return {"source": source, "sha256": tokenizer_sha256(contents)}


def vocabulary_note(config: HlatConfig) -> str | None:
    """The dry run's line on vocabulary size under tokenizer.pretrained; None for a trained tokenizer.

    The jobs take model.vocab_size from that tokenizer; the line says which size the figures assume."""
    pretrained, m = config.tokenizer.pretrained, config.model
    if pretrained is None:
        return None
    return (
        f"vocabulary: model.vocab_size comes from tokenizer.pretrained={pretrained} once the tokenizer stage has "
        f"run (padded to model.vocab_multiple={m.vocab_multiple}); these figures assume model.vocab_size="
        f"{m.vocab_size} ({m.padded_vocab_size} rows): set it to the tokenizer's size for exact ones"
    )


def _report_texts(validation_texts: Iterable[str], budget: int) -> Iterator[tuple[str, int]]:
    """Validation texts with their UTF-8 sizes, up to `budget` bytes."""
    for full_text in validation_texts:
        if budget <= 0:
            return
        text, size = _within_budget(full_text, budget)
        if full_text and not text:
            return
        budget -= size
        yield text, size


def pretrained_report(
    tokenizer: LoadedTokenizer, validation_texts: Iterable[str], report_sample_bytes: int, n_samples: int = 3
) -> dict[str, Any]:
    """`tokenizer_report`'s figures for any loaded tokenizer.

    A byte-level BPE (e.g. GPT-NeoX's) has no byte pieces, so its fallback rate is 0."""
    texts = total_bytes = tokens = byte_tokens = round_trip_failures = 0
    samples: list[dict[str, Any]] = []
    for text, size in _report_texts(validation_texts, report_sample_bytes):
        ids = tokenizer.encode(text)
        texts += 1
        total_bytes += size
        tokens += len(ids)
        byte_tokens += sum(1 for i in ids if i in tokenizer.byte_ids)
        round_trip_failures += tokenizer.decode(ids) != text
        if len(samples) < n_samples and text.strip():
            snippet_ids = tokenizer.encode(text[:SNIPPET_CHARS])
            samples.append({"text": text[:SNIPPET_CHARS], "pieces": tokenizer.pieces(snippet_ids), "ids": snippet_ids})
    return {
        "vocab_size": tokenizer.vocab_size,
        "texts": texts,
        "bytes": total_bytes,
        "tokens": tokens,
        "bytes_per_token": round(total_bytes / tokens, 4) if tokens else None,
        "byte_fallback_tokens": byte_tokens,
        "byte_fallback_rate": round(byte_tokens / tokens, 6) if tokens else 0.0,
        "round_trip_failures": round_trip_failures,
        "samples": samples,
    }


def build_pretrained_tokenizer(
    data: Storage,
    out: Storage,
    source: str,
    max_seq_len: int,
    cfg: TokenizerConfig,
    load: Callable[[str], LoadedTokenizer],
) -> dict[str, Any]:
    """The train-tokenizer stage for tokenizer.pretrained=`source`: fetch, load, check, upload; returns the report.

    The check: it round-trips the held-out split and has an EOS."""
    mixture, sources = read_mixture(data)
    weights = mixture.weights_at(0)
    with tempfile.TemporaryDirectory(prefix="hlat-pretrained-") as tmp:
        info = fetch_pretrained(source, tmp)
        try:
            tokenizer = load(tmp)
        except ValueError as exc:  # no EOS, a malformed file
            raise ValueError(f"tokenizer.pretrained={source!r}: {exc}; {PRETRAINED_FIX}") from None
        report_split: Split = "validation" if mixture_rows(sources, "validation") else "train"
        texts = mixture_documents(sources, weights, report_split)
        report = pretrained_report(tokenizer, texts, cfg.report_sample_bytes)
        if not report["tokens"]:
            raise ValueError(
                f"tokenizer.pretrained={source!r} gave no tokens for the {report_split} split of {data.uri()}: "
                "nothing to validate it on; re-run prepare-data on a non-empty source"
            )
        hashes = {}
        for name in info["names"]:
            with open(os.path.join(tmp, name), "rb") as fh:
                hashes[name] = hashlib.sha256(fh.read()).hexdigest()
        report.update(
            {
                "pretrained": {k: info[k] for k in ("source", "from", "revision")},
                "kind": tokenizer.kind,
                "tokenizer_sha256": tokenizer.sha256,
                "defining_files": list(tokenizer.files),
                "file_sha256": hashes,
                "eos_id": tokenizer.eos_id,
                "bos_id": tokenizer.bos_id,
                "data_checksum": data_checksum_of(data),
                "report_split": report_split,
                "max_seq_len": max_seq_len,
                "files": [*info["names"], REPORT_FILE],
            }
        )
        if report_split == "train":
            report["report_note"] = (
                "the data has no validation split, so these figures are measured on training text; set "
                "data.validation_fraction > 0 for held-out figures"
            )
        out.remove(REPORT_FILE)
        _remove_other_tokenizer_files(out, info["names"])
        for name in info["names"]:
            out.put_file(os.path.join(tmp, name), name)
        out.write_json(REPORT_FILE, report)
    return report
