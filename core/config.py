"""The one typed config tree of an hlat run.

The same object is a Prefect flow parameter, the `config.json` saved with every run and checkpoint, and
what a training job reads (`python -m hlat.training.train --config <uri>`). Every field is documented by the
docstring under it; validation happens here, once, and a wrong value raises `ConfigError` naming the dotted
field and what is allowed. Presets live in `core/presets.py`; dotted overrides are applied by
`apply_overrides`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from collections.abc import Iterator
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from hlat.core.models import family, family_of
from hlat.core.parallel import LayoutError, ParallelDims


class ConfigError(ValueError):
    """A user mistake in the config: the message names the field and the fix."""


CREDENTIALS_IN_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s]+@")
"""A URI with a user (and password, or token) before its host: https://user:pw@host, https://token@host."""
CREDENTIALS_REFUSED = (
    "holds credentials in a URI (user:password@host): a config is copied into config.json, checkpoints, tracking "
    "and logs. Give the URI without them and the credentials from a secret: MLflow reads MLFLOW_TRACKING_USERNAME "
    "and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN), resolved from AWS Secrets Manager or a Prefect Secret "
    "block at run time (docs/deployments.md, 'Security')"
)


def _texts(value: Any) -> Iterator[str]:
    """The strings of a field's raw value: itself, or a list's or a mapping's values (nested sections check their
    own fields)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list | tuple):
        yield from (v for v in value if isinstance(v, str))
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, str))


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are field descriptions, and no field holds
    a URI with credentials in it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_credentials(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation if info.field_name else None
        if isinstance(annotation, type) and issubclass(annotation, Section):
            return value  # a nested section checks its own fields, and names them
        if any(CREDENTIALS_IN_URI.search(text) for text in _texts(value)):
            raise ValueError(CREDENTIALS_REFUSED)
        return value


class ModelConfig(Section):
    """Decoder-only transformer: LLaMA (pre-norm RMSNorm, SwiGLU, RoPE, untied embeddings) or GPT-NeoX (`arch`)."""

    n_layers: int = Field(2, ge=1)
    """Number of transformer blocks."""
    d_model: int = Field(128, ge=8)
    """Hidden size (embedding width)."""
    n_heads: int = Field(4, ge=1)
    """Attention heads; must divide d_model."""
    n_kv_heads: int | None = Field(None, ge=1)
    """Key/value heads for grouped-query attention; None means n_heads (multi-head attention)."""
    ffn_hidden: int = Field(344, ge=8)
    """MLP inner width: SwiGLU's (11008 for LLaMA 7B, 28672 for 70B), or GPT-NeoX's GeLU MLP (4 x d_model)."""
    arch: str = "llama"
    """Model family (`core.models.FAMILIES`, docs/models.md): llama (pre-norm RMSNorm, SwiGLU, RoPE, no biases) or
    gpt_neox (GPT-NeoX / Pythia: parallel attention and MLP on the same input, LayerNorm with bias, GeLU MLP, biased
    projections, partial rotary)."""
    vocab_size: int = Field(4096, ge=260)
    """The tokenizer's vocabulary: the tokenizer stage trains exactly this many pieces (>= 260: 256 byte pieces plus
    specials); with tokenizer.pretrained it is that tokenizer's size. The model's embedding is padded_vocab_size."""
    vocab_multiple: int = Field(1, ge=1)
    """Pad the embedding and output rows up to a multiple of this (Megatron/NxDT's make_vocab_size_divisible_by, e.g.
    128); padded rows never take probability in the loss and are dropped on export. The padded size must also
    divide evenly over parallelism.tensor."""
    max_seq_len: int = Field(4096, ge=16)
    """Longest context the model supports (RoPE tables are built this long)."""
    norm_eps: float = Field(1e-5, gt=0)
    """Epsilon of the norms (RMSNorm for llama, LayerNorm for gpt_neox)."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency."""
    rotary_fraction: float = Field(1.0, gt=0, le=1)
    """Fraction of each head's dimensions that is rotated (0.25 for Pythia/NeoX; 1.0 for LLaMA)."""
    init_std: float = Field(0.021, gt=0)
    """Standard deviation of the normal weight initialisation."""
    scale_output_init: bool = False
    """Scale output projections' init std by 1/sqrt(2 * n_layers) (HLAT 70B)."""
    tie_embeddings: bool = False
    """Share input embedding and output projection weights (HLAT: untied)."""
    init_from: str | None = None
    """Start from published weights instead of a random initialisation: a Hugging Face `LlamaForCausalLM` or
    `GPTNeoXForCausalLM` checkpoint (config.json and safetensors, one file or a sharded index) as a hub name
    `org/name[@revision]`, a local folder or an s3:// prefix. Its config.json decides the family and shape (where
    this section says otherwise, the checkpoint wins, with one line saying what changed); the optimizer starts
    fresh with this run's schedule. Needs tokenizer.pretrained (the tokenizer the weights were trained with)."""

    @field_validator("arch")
    @classmethod
    def _known_family(cls, value: str) -> str:
        family(value)  # ValueError naming the families
        return value

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        kv = self.kv_heads
        if self.n_heads % kv:
            raise ValueError(f"n_kv_heads={kv} must divide n_heads={self.n_heads}")
        head_dim = self.d_model // self.n_heads
        rotated = head_dim * self.rotary_fraction
        if rotated != int(rotated) or int(rotated) % 2:
            raise ValueError(
                f"rotary_fraction={self.rotary_fraction} rotates {rotated} of {head_dim} head dims; "
                "it must rotate an even whole number of dims"
            )
        family_of(self).check(self)
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the output projection: vocab_size rounded up to a multiple of vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    # The model's arithmetic, in one place: the model (training/model.py), the config checks, the MFU figure
    # (training/loop.py), the dry run's estimate (infra/stage_jobs.py) and the planner (infra/planner.py) use these.
    def block_params(self) -> int:
        """Parameters of one transformer block (the family's count)."""
        return family_of(self).block_params(self)

    def final_norm_params(self) -> int:
        """The final norm's parameters (the family's count)."""
        return family_of(self).final_norm_params(self)

    def num_params(self) -> int:
        """Parameter count (embeddings of padded_vocab_size rows included; a tied embedding counts once)."""
        embeddings = self.padded_vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
        return self.n_layers * self.block_params() + embeddings + self.final_norm_params()

    def training_state_bytes(self, precision: str) -> int:
        """Bytes of one whole replica's weights, gradients and AdamW moments (activations not counted): 16 per
        parameter with FP32 weights (fp32, and bf16-mixed's master weights), 8 in pure BF16 (bf16-sr). What DDP
        holds on every device, and FSDP2 splits over the ranks."""
        return (8 if precision == "bf16-sr" else 16) * self.num_params()

    def layer_flops_per_token(self, seq_len: int) -> int:
        """Forward + backward FLOPs of one block per token: 6 per matmul parameter (2 forward, 4 backward), and
        12·d·T for the attention scores (QKᵀ) and their weighted sum (AV) over T positions."""
        return 6 * self.block_params() + 12 * self.d_model * seq_len

    def head_flops_per_token(self) -> int:
        """The output projection (its padded_vocab_size rows are all computed) and the final norm, forward +
        backward (6 per parameter)."""
        return 6 * (self.padded_vocab_size * self.d_model + self.final_norm_params())

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token, for MFU: 6·N + 12·L·d·T.

        N is the number of parameters used in matrix multiplies: everything but the input embedding table (a
        lookup), which with tied embeddings is still counted once as the output projection. As in PaLM's MFU, the
        causal mask is not discounted (the count is that of full attention over T)."""
        return self.n_layers * self.layer_flops_per_token(seq_len) + self.head_flops_per_token()


class DataValidationConfig(Section):
    """great-expectations checks applied to every document of the source."""

    policy: Literal["fail", "quarantine"] = "quarantine"
    """What a bad row does: 'fail' stops the stage; 'quarantine' sets it aside with its reason."""
    min_chars: int = Field(16, ge=0)
    """Shortest document kept, in characters."""
    max_chars: int = Field(1_000_000, ge=1)
    """Longest document kept, in characters."""
    max_duplicate_rate: float = Field(0.5, ge=0, le=1)
    """Largest fraction of exact-duplicate documents before the whole data set is refused."""
    min_rows: int = Field(1, ge=1)
    """Fewest documents (after quarantine) the data set must keep."""
    expectations: list[dict[str, Any]] = Field(default_factory=list)
    """Extra great-expectations expectations, each {"type": "expect_...", "kwargs": {...}} (row-level ones
    quarantine the rows they flag)."""

    @model_validator(mode="after")
    def _check_bounds(self) -> DataValidationConfig:
        if self.min_chars > self.max_chars:
            raise ValueError(f"min_chars={self.min_chars} is larger than max_chars={self.max_chars}")
        for i, exp in enumerate(self.expectations):
            if not isinstance(exp.get("type"), str) or not exp["type"].startswith("expect_"):
                raise ValueError(
                    f"expectations[{i}] needs a 'type' naming a great-expectations expectation, "
                    "e.g. 'expect_column_values_to_match_regex'"
                )
            unknown = set(exp) - {"type", "kwargs"}
            if unknown:
                raise ValueError(f"expectations[{i}] has unknown keys {sorted(unknown)}; allowed: type, kwargs")
        return self


SOURCE_READER_FIELDS = ("source", "hf_config", "split", "streaming", "revision", "text_column", "file_format",
                        "max_documents")  # fmt: skip
"""The reader settings a source has: data.sources entries and the one-source shorthand fields of data."""


class SourceReader(Section):
    """The reader settings of one source (SOURCE_READER_FIELDS): a data.sources entry's, and data's one-source
    shorthand."""

    source: str = "builtin:python-stdlib"
    """A Hugging Face dataset name, an s3:// URI, a local file or folder (jsonl, json, parquet, txt), or
    'builtin:python-stdlib' (the offline corpus built from the installed Python standard library)."""
    hf_config: str | None = None
    """Hugging Face dataset configuration name (e.g. 'wikitext-103-raw-v1')."""
    split: str = "train"
    """Split to read from the source."""
    streaming: bool = False
    """Stream the source instead of downloading it whole (Hugging Face and remote files)."""
    revision: str | None = None
    """Hugging Face dataset revision (commit, tag or branch) to pin."""
    text_column: str = "text"
    """Column holding the document text."""
    file_format: Literal["auto", "jsonl", "parquet", "txt"] = "auto"
    """Format of local or s3:// files; 'auto' goes by the file extension."""
    max_documents: int | None = Field(None, ge=1)
    """Read at most this many documents from the source (None: all)."""

    def reader(self) -> dict[str, Any]:
        """The reader settings alone (what decides which documents are read)."""
        return {k: getattr(self, k) for k in SOURCE_READER_FIELDS}


class SourceConfig(SourceReader):
    """One source of the corpus mixture: where its documents come from, its share of the training tokens and how
    often it may be repeated."""

    name: str | None = None
    """Short name (letters, digits, '-', '_'), used in reports, metrics and the mixture schedule; None derives one
    from `source` (its last path part, lower-cased)."""
    source: str
    """A Hugging Face dataset name, an s3:// URI, a local file or folder (jsonl, json, parquet, txt), or
    'builtin:python-stdlib' (the offline corpus built from the installed Python standard library)."""
    weight: float = Field(1.0, gt=0)
    """This source's share of the training tokens, relative to the other sources' weights (normalised to sum 1)."""
    max_epochs: float | None = Field(4.0, gt=0)
    """The most passes over this source's training tokens a run may make (OLMo-core's max repetition); a run that
    would draw more is refused before it starts; None: no limit (the one-source shorthand's). Muennighoff et al.
    2023 (arXiv 2305.16264): up to ~4 epochs of repeated data are about as good as fresh data."""
    tokens: int | None = Field(None, ge=1)
    """The source's training tokens, if known before prepare-data runs (e.g. from its dataset card): what the dry run
    and `hlat plan` count epochs against. Once the source is prepared its measured size is used instead."""

    @property
    def resolved_name(self) -> str:
        return self.name or source_slug(self.source)


def source_slug(source: str) -> str:
    """'HuggingFaceFW/fineweb' -> 'fineweb', 's3://b/corpus/books/' -> 'books', 'builtin:python-stdlib' ->
    'python-stdlib': the default name of a source."""
    tail = re.split(r"[/:]", source.rstrip("/"))[-1] or "source"
    tail = re.sub(r"\.(jsonl|json|parquet|txt|gz|zst)$", "", tail.lower())
    return re.sub(r"[^a-z0-9_-]+", "-", tail).strip("-")[:40] or "source"


class MixtureStep(Section):
    """From `step` on (until the next entry), the sources' weights are these (Levanter's train_weights by step)."""

    step: int = Field(ge=0)
    """Optimizer step from which these weights apply."""
    weights: dict[str, float]
    """Weight by source name; a source left out has weight 0 from this step on."""


class CurationConfig(Section):
    """What prepare-data removes from each source beyond great-expectations' row checks, with Hugging Face's
    datatrove (https://github.com/huggingface/datatrove). Each rule is a switch; every removed document is counted per
    source and per rule in the data report. Presets: the tiny rehearsal runs every rule; the HLAT, Pythia and NeoX
    presets (public, already-filtered corpora) run deduplication and decontamination, not the web-text quality rules,
    which would drop code, tables and lists from curated sources."""

    exact_dedup: bool = True
    """Drop exact duplicates across the whole source: datatrove's hash-partitioned exact dedup (signatures, then
    one finder per hash range, then a filter), so no worker holds more than its own range's hashes."""
    minhash: bool = False
    """Drop near duplicates: datatrove's MinHash LSH dedup (signatures, buckets, clusters, filter)."""
    minhash_ngrams: int = Field(5, ge=1)
    """Word n-grams (shingles) hashed by MinHash (FineWeb: 5)."""
    minhash_buckets: int = Field(14, ge=1)
    """LSH bands (FineWeb: 14 of 8 hashes: documents ~75% similar are found with high probability)."""
    minhash_hashes_per_bucket: int = Field(8, ge=1)
    """Hashes per LSH band."""
    gopher_quality: bool = False
    """Gopher's quality rules (Rae et al. 2021): word counts and lengths, symbol ratios, stop words."""
    gopher_quality_params: dict[str, Any] = Field(default_factory=dict)
    """Arguments of datatrove's GopherQualityFilter that differ from its defaults (Gopher's), e.g.
    {"min_doc_words": 50, "max_non_alpha_words_ratio": 0.8}."""
    gopher_repetition: bool = False
    """Gopher's repetition rules: duplicated lines, paragraphs and n-grams within a document."""
    gopher_repetition_params: dict[str, Any] = Field(default_factory=dict)
    """Arguments of datatrove's GopherRepetitionFilter that differ from its defaults, e.g. {"dup_line_frac": 0.3}."""
    c4_quality: bool = False
    """C4's rules (Raffel et al. 2020): lines ending in punctuation, no javascript/lorem ipsum/curly brackets."""
    c4_quality_params: dict[str, Any] = Field(default_factory=dict)
    """Arguments of datatrove's C4QualityFilter that differ from its defaults, e.g. {"filter_no_terminal_punct":
    false}."""
    fineweb_quality: bool = False
    """FineWeb's rules (Penedo et al. 2024): line punctuation ratio, short lines, duplicated line characters."""
    fineweb_quality_params: dict[str, Any] = Field(default_factory=dict)
    """Arguments of datatrove's FineWebQualityFilter that differ from its defaults, e.g. {"line_punct_thr": 0.12}."""
    decontaminate: bool = False
    """Drop documents that share an n-gram with the texts of the evaluation tasks the run scores
    (evaluation.tasks, the offline ones included)."""
    decontamination_ngrams: int = Field(13, ge=4)
    """Word n-gram length of the decontamination match (GPT-3, Brown et al. 2020: 13)."""
    examples_per_rule: int = Field(5, ge=0)
    """Removed documents kept as examples per rule in the data report."""
    finder_workers: int = Field(4, ge=1)
    """Hash ranges of the exact dedup (and tasks of its find phase); each finder holds only its range."""

    @property
    def any_rule(self) -> bool:
        """Whether any rule is on (else prepare-data writes the validated units as they are)."""
        rules = (self.exact_dedup, self.minhash, self.gopher_quality, self.gopher_repetition, self.c4_quality)
        return any(rules) or self.fineweb_quality or self.decontaminate


class DataConfig(SourceReader):
    """Where the corpus comes from and how prepare-data shards it."""

    validation_fraction: float = Field(0.01, ge=0, lt=1)
    """Fraction of kept documents held out for validation (assigned by content hash, so stable)."""
    shard_format: Literal["parquet", "jsonl"] = "parquet"
    """Format of the prepared shards."""
    shard_rows: int = Field(50_000, ge=1)
    """Documents per output shard."""
    batch_rows: int = Field(20_000, ge=1)
    """Documents read and validated at a time (bounds the stage's memory)."""
    validation: DataValidationConfig = Field(default_factory=DataValidationConfig)
    """Validation rules and the bad-row policy."""
    sources: list[SourceConfig] = Field(default_factory=list)
    """The corpus as a weighted mixture of sources, each prepared (and cached) on its own; empty: one source, given
    by the shorthand fields above (data.source, data.hf_config, ...). When set, those shorthand fields are not read."""
    schedule: list[MixtureStep] = Field(default_factory=list)
    """Weights that change by step: each entry gives every source's weight from its step on (before the first entry,
    the sources' own weights)."""
    curation: CurationConfig = Field(default_factory=CurationConfig)
    """Deduplication, quality filters and decontamination (datatrove), per source."""
    unit_mb: int = Field(64, ge=1)
    """Size of the pieces (units) the source is cut into for the workers: a jsonl file larger than this is read as
    byte ranges, parquet as groups of row groups; each unit is written and committed on its own, so a worker that
    dies redoes only its unfinished unit."""
    workers: int = Field(1, ge=1)
    """Worker processes of the prepare-data job (locally: processes on this machine; on SageMaker:
    data.workers_per_instance per instance of data.instance_type). With data.max_documents set one worker reads."""
    workers_per_instance: int = Field(8, ge=1)
    """SageMaker: worker processes per instance; the job's instance count is data.workers / this (rounded up)."""
    instance_type: str = "ml.c5.4xlarge"
    """SageMaker instance type of the prepare-data job (CPU: it streams, validates and writes shards)."""
    image_uri: str | None = None
    """Container image of the prepare-data job on SageMaker; None: AWS's PyTorch CPU training image."""
    price_per_hour_usd: float | None = Field(None, ge=0)
    """Price of one data.instance_type node-hour; None: the instance catalog's."""
    worker_retries: int = Field(2, ge=0)
    """Times a worker that dies (killed, out of memory) is started again, alone, before the job fails."""
    max_runtime_hours: float = Field(24.0, gt=0)
    """Max runtime of one prepare-data job; a relaunch resumes from the committed units."""

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        names = [s.resolved_name for s in self.mixture]
        for i, name in enumerate(names):
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}", name):
                raise ValueError(f"sources[{i}].name={name!r}: use 1-40 letters, digits, '-' or '_'")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"sources: the names {twice} are used twice; give each source its own name")
        last = -1
        for i, entry in enumerate(self.schedule):
            if entry.step <= last:
                raise ValueError(f"schedule[{i}].step={entry.step}: steps must increase (previous {last})")
            last = entry.step
            unknown = sorted(set(entry.weights) - set(names))
            if unknown:
                raise ValueError(f"schedule[{i}].weights names unknown sources {unknown}; the sources are {names}")
            if any(w < 0 for w in entry.weights.values()) or sum(entry.weights.values()) <= 0:
                raise ValueError(f"schedule[{i}].weights must be >= 0 with a positive sum")
        return self

    @property
    def mixture(self) -> list[SourceConfig]:
        """The corpus's sources: data.sources, or the one source of the shorthand fields (weight 1)."""
        if self.sources:
            return list(self.sources)
        return [SourceConfig(**self.reader(), max_epochs=None)]

    def weights_at(self, step: int) -> dict[str, float]:
        """Each source's weight at optimizer step `step`, normalised to sum 1 (the schedule's last entry at or
        before the step, else the sources' own weights)."""
        raw = {s.resolved_name: s.weight for s in self.mixture}
        for entry in self.schedule:
            if entry.step <= step:
                raw = {name: entry.weights.get(name, 0.0) for name in raw}
        total = sum(raw.values())
        return {name: w / total for name, w in raw.items()}

    def source_data_config(self, source: SourceConfig) -> DataConfig:
        """This data config with `source`'s reader settings in the shorthand fields and no mixture: what prepares
        that one source."""
        return self.model_copy(update={**source.reader(), "sources": [], "schedule": []})


class TokenizerConfig(Section):
    """sentencepiece BPE trained the LLaMA way (the vocabulary size is model.vocab_size), or an existing tokenizer."""

    pretrained: str | None = None
    """An existing tokenizer instead of training one: a Hugging Face hub name (e.g. meta-llama/Llama-2-7b-hf, as
    HLAT used), a local folder or an s3:// prefix holding it in Hugging Face's format (tokenizer.json and/or a
    sentencepiece tokenizer.model). The stage validates it and copies it into the run; model.vocab_size follows it.
    None trains a sentencepiece tokenizer on the run's data."""

    sample_bytes: int = Field(50_000_000, ge=1_000)
    """Bytes of training text streamed from the shards into the tokenizer trainer (a bounded sample)."""
    character_coverage: float = Field(0.99995, gt=0, le=1)
    """Fraction of characters covered by pieces; the rest fall back to bytes."""
    byte_fallback: bool = True
    """Encode characters outside the vocabulary as UTF-8 byte pieces (<0x..>), so no text is lost."""
    split_digits: bool = True
    """Split numbers into single digits."""
    max_sentence_length: int = Field(16384, ge=256)
    """Longest training line in bytes; longer lines are cut into pieces of this size."""
    threads: int | None = Field(None, ge=1)
    """Trainer threads; None means the number of CPU cores."""
    report_sample_bytes: int = Field(2_000_000, ge=1_000)
    """Bytes of validation text encoded for the report's bytes-per-token and byte-fallback figures."""


class TrainingConfig(Section):
    """Optimizer, schedule, batch and checkpointing."""

    lr: float = Field(3e-4, gt=0)
    """Peak learning rate."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Floor of the decay (cosine or WSD) as a fraction of the peak (HLAT: 0.1)."""
    warmup_steps: int = Field(2000, ge=0)
    """Linear warmup steps."""
    max_steps: int = Field(429_000, ge=1)
    """Optimizer steps to train."""
    schedule_steps: int | None = Field(None, ge=1)
    """Schedule horizon in steps (HLAT 7B's cosine: 500k); None means max_steps."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """Learning-rate schedule after the linear warm-up: 'cosine' down to min_lr_ratio at the horizon (HLAT), or
    'wsd' (warmup-stable-decay): the peak held, then a decay over the last decay_steps of the horizon, so that a run
    can be extended (more steps) without a re-warm or a kink before its decay starts."""
    decay_steps: int | None = Field(None, ge=1)
    """With schedule='wsd': the decay's length at the end of the horizon (None: 20% of it), a 1-sqrt decay from
    the peak to min_lr_ratio of it, reached on the horizon's last step (Hägele et al. 2024,
    https://arxiv.org/abs/2405.18392)."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW beta2."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW weight decay, applied to all parameters, norms included (HLAT)."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip; 0 disables clipping."""
    global_batch_size: int = Field(1024, ge=1)
    """Sequences per optimizer step across all data-parallel ranks."""
    micro_batch_size: int = Field(1, ge=1)
    """Sequences per forward/backward on one rank; the rest is gradient accumulation."""
    seq_len: int = Field(4096, ge=8)
    """Tokens per training sequence (packed, no padding)."""
    seed: int = 1234
    """Seed for initialisation, data order and every RNG."""
    checkpoint_every: int = Field(1000, ge=1)
    """Steps between checkpoints."""
    keep_checkpoints: int = Field(5, ge=1)
    """Most recent checkpoints kept."""
    keep_every: int | None = Field(None, ge=1)
    """Also keep every checkpoint whose step is a multiple of this, permanently (None: none)."""
    async_checkpoint: bool = True
    """Write checkpoints in the background: the loop blocks only while the state is copied to host memory (which
    then holds one copy of this rank's state between saves); FSDP2's through torch.distributed.checkpoint's
    async_save. False: the loop waits until each checkpoint is committed."""
    commit_timeout_s: float = Field(600.0, gt=0)
    """How long rank 0 waits for every rank's checkpoint files to appear in storage before it gives up on a
    commit (the job then fails and is relaunched from the previous checkpoint)."""
    nan_policy: Literal["exit", "skip"] = "exit"
    """On a NaN/inf loss: 'exit' non-zero so the job restarts from the last checkpoint (HLAT), or 'skip' the step."""
    spike_skip: bool = False
    """Skip the update of a step whose loss or gradient norm spikes: more than spike_zscore standard deviations
    above the mean of the trailing spike_window steps, decided on the device (no host sync; OLMo-core's skip-step
    optimizer). Skipped steps are counted and logged at the next sync point."""
    spike_window: int = Field(128, ge=8)
    """Trailing steps whose loss and gradient norm define a spike (no step is judged before the window is full)."""
    spike_zscore: float = Field(6.0, gt=0)
    """Standard deviations above the trailing mean that make a spike."""
    spike_max_consecutive: int = Field(8, ge=1)
    """Spiking steps in a row that stop the job (exit code EXIT_LOSS_SPIKES, not relaunched): the run has diverged."""
    log_every: int = Field(1, ge=1)
    """Steps between metric records."""
    eval_every: int = Field(1000, ge=0)
    """Steps between validation-loss evaluations on the held-out split (0: only at the end)."""
    eval_batches: int = Field(8, ge=1)
    """Micro-batches per rank scored at each validation-loss evaluation (the same ones every time)."""
    compile: bool = False
    """Compile the model with torch.compile (CPU and CUDA; on XLA the graph is compiled by XLA itself)."""
    device: Literal["auto", "cpu", "cuda", "xla"] = "auto"
    """Device of the training, precompile and burn-in jobs: 'auto' (XLA inside a Neuron container, else CUDA when
    present, else CPU), or one of them. 'xla' outside a Neuron container runs on XLA:CPU (PJRT_DEVICE=CPU): the local
    rehearsal of the trn1 code path, in the XLA environment of neuron.sdk (`scripts/install.sh xla-2.28` makes
    2.28.0's, the default; `scripts/install.sh xla` 2.24.1's)."""
    document_masking: bool = False
    """Stop attention at document boundaries inside packed sequences."""
    deterministic: bool = True
    """On CUDA, deterministic kernels only (`torch.use_deterministic_algorithms`, cuBLAS's fixed workspace
    `CUBLAS_WORKSPACE_CONFIG=:4096:8`, https://pytorch.org/docs/stable/notes/randomness.html), so that a job killed
    and resumed reaches bitwise the weights of one never interrupted. Off: some backward kernels (embedding, index
    adds) accumulate with atomics in any order, for a little speed. CPU and XLA are deterministic either way."""
    xla_graph_cuts: Literal["micro-batch", "step"] = "micro-batch"
    """On XLA (trn1, XLA:CPU), where the traced graph is cut: 'micro-batch' after each micro-batch's backward (the
    last cut is the one before the optimizer step), as HLAT's and NxD's training scripts cut it: gradient
    accumulation + 1 graphs per step, each one small to compile; 'step': one graph for the whole optimizer step
    (fewest launches, largest compile)."""

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainingConfig:
        if self.decay_steps is not None and self.schedule != "wsd":
            raise ValueError(
                f"training.decay_steps={self.decay_steps} is the decay of training.schedule='wsd'; the "
                f"'{self.schedule}' schedule decays over its whole horizon: set training.schedule=wsd, or leave "
                "training.decay_steps unset"
            )
        return self

    @property
    def schedule_horizon(self) -> int:
        """The schedule's length in steps: schedule_steps, or max_steps when unset."""
        return self.schedule_steps or self.max_steps

    @property
    def decay_start(self) -> int:
        """With schedule='wsd': the first step of the decay, decay_steps (None: 20% of the horizon, at least one
        step) before the horizon's end, never inside the warm-up; the peak is held from the warm-up's end to here."""
        horizon = self.schedule_horizon
        length = self.decay_steps if self.decay_steps is not None else max(1, horizon // 5)
        return max(self.warmup_steps, horizon - length)

    def lr_differs_from(self, other: TrainingConfig) -> int | None:
        """The first optimizer step whose learning rate differs between this schedule and `other`'s (None: none).
        Exact where the two share the peak, floor, warm-up and schedule kind; otherwise step 0 (conservatively)."""
        same = ("schedule", "lr", "min_lr_ratio", "warmup_steps")
        if any(getattr(self, f) != getattr(other, f) for f in same):
            return 0
        if self.schedule == "cosine":  # the cosine's every step after the warm-up depends on its horizon
            return None if self.schedule_horizon == other.schedule_horizon else self.warmup_steps
        if (self.decay_start, self.schedule_horizon) == (other.decay_start, other.schedule_horizon):
            return None
        return min(self.decay_start, other.decay_start)  # both hold the peak until one of them starts its decay

    def extension_problem(self, longer: TrainingConfig, steps_taken: int) -> str | None:
        """Why a run trained `steps_taken` steps under this schedule cannot go on under `longer`'s (one line), or
        None when every step already taken had the same learning rate under both (its checkpoints stay valid):
        a WSD run extended before its decay began."""
        first = self.lr_differs_from(longer)
        if first is None or first >= steps_taken:
            return None
        if self.schedule == longer.schedule == "wsd" and first == self.decay_start:
            why = f"its decay began at step {self.decay_start} and it has taken {steps_taken} steps"
        else:
            why = f"the learning rate of step {first} (of the {steps_taken} taken) would change"
        return (
            f"training.max_steps {self.max_steps} -> {longer.max_steps}: the run cannot be extended in place, {why}; "
            "start a new run from its checkpoint (hlat export, then model.init_from) or re-run with the longer "
            "horizon (training.max_steps / training.schedule_steps) from the start"
        )


class PrecisionConfig(Section):
    """Numeric format of compute, weights and optimizer state."""

    mode: Literal["fp32", "bf16-mixed", "bf16-sr"] = "fp32"
    """'fp32'; 'bf16-mixed' (BF16 compute, FP32 master weights and optimizer states); 'bf16-sr' (pure BF16
    with stochastic rounding of the parameter update, HLAT 7B)."""


NeuronSdkVersion = Literal["2.24.1", "2.28.0"]
DEFAULT_NEURON_SDK: NeuronSdkVersion = "2.28.0"
"""neuron.sdk's default, for every preset: Neuron 2.28, the last release that trains with PyTorch/XLA and NxD on trn1,
the one Neuron advises XLA-training users to stay on. (HLAT itself ran Neuron 2.20.0, which no longer has a PyTorch 2
image: awslabs/HLAT, common/install_2_20_0.sh.)"""
NEURON_RESERVED_ENV = frozenset({"NEURON_COMPILE_CACHE_URL", "RUN_NEURON_PARALLEL_COMPILE", "HLAT_RUN_ID"})
"""Variables the job backends set themselves (the run's compile cache, the precompile wrapper, the run id)."""
NEURON_ENV_PREFIXES = ("NEURON_", "XLA_", "PJRT_", "FI_", "CCOM_", "NCCL_", "TORCH_DIST_", "TORCH_GLOO_")
"""What neuron.env may set: the Neuron compiler and runtime (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/
neuron-runtime/nrt-configurable-parameters.html), torch-xla and PJRT, libfabric/EFA, Neuron's collectives, and
torch.distributed's process-group switches."""
NEURON_ENV_NAMES = frozenset({"MALLOC_ARENA_MAX", "OMP_NUM_THREADS", "RDMAV_FORK_SAFE", "TF_CPP_MIN_LOG_LEVEL"})
"""Single variables neuron.env may set besides `NEURON_ENV_PREFIXES`'."""
NEURON_ENV_REFUSED = ("PATH", "LIBRARY", "PLUGIN", "PRELOAD")
"""Within the prefixes, names holding one of these are refused: a search path, library or plugin to load is code."""


class NeuronConfig(Section):
    """Neuron compiler and runtime settings of the trn1 jobs (train, precompile, burn-in), as HLAT ran them; the
    defaults are HLAT 7B's. They become environment variables of those jobs, next to the precision flags of
    precision.mode (`core.environment.neuron_environment`); jobs off trn1 get none of them. A boolean that is off
    leaves its variable unset: the reader's own default."""

    sdk: NeuronSdkVersion = DEFAULT_NEURON_SDK
    """Neuron SDK release of the trn1 jobs: their training image (when job.image_uri is None), what a job installs
    on it, and how precision.mode is set. '2.28.0' (the default; PyTorch 2.9, NxD 0.17) is the last release that
    trains with PyTorch/XLA and NxD, and Neuron's advice to XLA-training users; it has no XLA_USE_BF16 /
    XLA_DOWNCAST_BF16, so the trainer casts the model (bf16-sr) or autocasts (bf16-mixed) itself. '2.24.1'
    (PyTorch 2.7, NxD 0.13) is the last release that honours those two flags: the closest selectable to HLAT's
    flag-based precision. Neither is HLAT's own release (Neuron 2.20.0, torch-neuronx 1.13.1, NxD 0.9, with HLAT's
    patches: awslabs/HLAT, common/install_2_20_0.sh). See `core.environment.NEURON_SDKS`."""
    compiler_flags: str = "--model-type transformer --distribution-strategy=llm-training"
    """neuronx-cc options (NEURON_CC_FLAGS). Part of the compile cache's key: changing them recompiles."""
    fuse_softmax: bool = True
    """Use the fused softmax kernel (NEURON_FUSE_SOFTMAX=1)."""
    async_inflight_requests: int = Field(3, ge=1)
    """Asynchronous executions the Neuron runtime keeps in flight (NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS;
    HLAT 7B: 3, 70B: 31)."""
    exec_timeout: int = Field(4000, ge=1)
    """Timeout of one execution in the Neuron runtime, in seconds (NEURON_RT_EXEC_TIMEOUT; HLAT: 4000)."""
    malloc_arena_max: int | None = Field(64, ge=1)
    """glibc malloc arenas per process (MALLOC_ARENA_MAX; HLAT: 64, against host out-of-memory); None leaves
    glibc's default."""
    compress_rg: bool = False
    """Compress the replica groups of collectives (NEURON_EXPERIMENTAL_COMPRESS_RG=1; HLAT 70B). Part of the compile
    cache's key."""
    dist_init_barrier: bool = True
    """Leave TORCH_DIST_INIT_BARRIER unset (torch's and torch-xla's defaults); False sets it to 0, skipping the
    store-based barrier at process-group init (HLAT 70B)."""
    efa: bool = True
    """Use EFA for inter-node collectives (FI_PROVIDER=efa, FI_EFA_USE_DEVICE_RDMA=1). SageMaker's Torchrun driver
    sets both on trn1.32xlarge too; turn it off on instance types without EFA (trn1.2xlarge)."""
    efa_fork_safe: bool = True
    """Make libfabric's EFA provider safe across fork() (FI_EFA_FORK_SAFE=1; SageMaker's Torchrun driver sets
    RDMAV_FORK_SAFE=1 itself)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra or overriding variables of the trn1 jobs, applied last (e.g. {"NEURON_RT_LOG_LEVEL": "INFO"}); numbers
    are taken as text. Only Neuron, XLA, EFA and process-group variables (`NEURON_ENV_PREFIXES`, `NEURON_ENV_NAMES`);
    NEURON_COMPILE_CACHE_URL, RUN_NEURON_PARALLEL_COMPILE and HLAT_RUN_ID are the backends'."""

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_text(cls, value: Any) -> Any:
        # An override `neuron.env.SOME_VAR=8` reads the value as a JSON number; an environment variable is text.
        if isinstance(value, dict):
            return {
                k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for k, v in value.items()
            }
        return value

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        bad = [k for k in env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
        if bad:
            raise ValueError(
                f"{bad} are not environment variable names: use letters, digits and '_', not starting with a digit"
            )
        reserved = sorted(NEURON_RESERVED_ENV & set(env))
        if reserved:
            raise ValueError(f"{reserved} are set by the job backends for the run: remove them from neuron.env")
        # An allow-list, not a deny-list: whoever can start a run can set this, and a loader, shell, Python or pip
        # variable (LD_PRELOAD, BASH_ENV, PYTHONSTARTUP, PIP_INDEX_URL) runs code of their choosing in the job.
        foreign = sorted(
            k
            for k in env
            if (k not in NEURON_ENV_NAMES and not k.startswith(NEURON_ENV_PREFIXES))
            or any(part in k for part in NEURON_ENV_REFUSED)
        )
        if foreign:
            allowed = ", ".join([*(f"{p}*" for p in NEURON_ENV_PREFIXES), *sorted(NEURON_ENV_NAMES)])
            raise ValueError(
                f"{foreign} are not Neuron, XLA, EFA or process-group settings: neuron.env takes {allowed} only "
                "(a loader, shell, Python or pip variable would run code in the job); remove them"
            )
        return env


class ParallelismConfig(Section):
    """Parallel degrees; data parallelism takes the devices left over."""

    tensor: int = Field(1, ge=1)
    """Tensor-parallel degree (HLAT 7B: 8; 70B: 32)."""
    pipeline: int = Field(1, ge=1)
    """Pipeline-parallel degree (HLAT 70B: 8)."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in norm/dropout regions (with tensor parallelism)."""
    zero1: bool = False
    """Shard optimizer states across data-parallel ranks (ZeRO-1)."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: 'selective' the core attention (softmax(QK^T)V) and SwiGLU's
    silu(gate) * up, as HLAT does; 'full' each whole block."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer states over the data-parallel ranks with FSDP2 (torch's
    `fully_shard`, one unit per block), checkpointed with torch.distributed.checkpoint: for CPU and CUDA jobs whose
    model, gradients and AdamW states do not fit one device under DDP. On trn1: tensor parallelism and zero1."""

    @model_validator(mode="after")
    def _check_sequence_parallel(self) -> ParallelismConfig:
        try:
            ParallelDims(self.tensor, self.pipeline, sequence_parallel=self.sequence_parallel)
        except LayoutError as exc:
            raise ValueError(f"sequence_parallel: {exc}; set tensor > 1 or sequence_parallel=false") from None
        return self


class JobConfig(Section):
    """Where training jobs run, on what, and within which budget."""

    backend: Literal["local", "sagemaker"] = "local"
    """'local' runs jobs as processes on this machine; 'sagemaker' submits SageMaker training jobs."""
    instance_type: str = "local"
    """Instance type: 'local', or e.g. 'ml.trn1.32xlarge'."""
    instance_count: int = Field(1, ge=1)
    """Nodes per training job."""
    processes_per_node: int = Field(1, ge=1)
    """Worker processes per node (32 NeuronCores on trn1.32xlarge)."""
    region: str = "us-west-2"
    """AWS region of the jobs and buckets."""
    image_uri: str | None = None
    """Training container image; None uses the Neuron PyTorch training image of the region."""
    python: str | None = None
    """Local backend: the Python interpreter that runs the job programs (its stand-in for image_uri); None: the
    flow's own, or with training.device=xla the XLA environment of neuron.sdk (.venv-xla-2.28 for 2.28.0, the default,
    from `scripts/install.sh xla-2.28`; .venv-xla for 2.24.1, from `scripts/install.sh xla`)."""
    role_arn: str | None = None
    """IAM role SageMaker assumes (the sagemaker backend needs it, or role_arn_secret)."""
    role_arn_secret: str | None = None
    """Name of a Prefect Secret block holding the IAM role ARN SageMaker assumes, read by each flow run;
    used when role_arn is not set (create it with `Secret(value="arn:aws:iam::...").save("<name>")`)."""
    aws_credentials_block: str | None = None
    """Name of a prefect-aws AwsCredentials block whose credentials every AWS client of the run uses (S3 storage,
    SageMaker, CloudWatch, local job processes); None: boto3's default chain (environment, profile, instance or
    task role). See infra/aws.py for how the block's settings override the environment's."""
    max_runtime_hours: float = Field(24 * 28, gt=0, le=24 * 28)
    """Longest a single job may run (SageMaker allows 28 days)."""
    volume_size_gb: int = Field(512, ge=1)
    """EBS volume per node."""
    max_restarts: int = Field(100, ge=0)
    """Relaunches from the newest checkpoint before the stage gives up (HLAT: 100)."""
    max_repeats: int = Field(2, ge=1)
    """Stop the stage when the same failure of the job's own (same cause: the failure record's type and step; a NaN
    at any step) ends this many attempts in a row with no newer checkpoint committed between them: it repeats
    deterministically."""
    max_attempts_without_progress: int = Field(3, ge=1)
    """Stop the stage when this many attempts in a row commit no newer checkpoint, whatever ended them (the job's
    own failure, a platform fault, no capacity, a hang): each costs the whole cluster's start-up, and a fault that
    repeats that often is not going away by itself (fatal failures stop at once)."""
    budget_usd: float | None = Field(None, gt=0)
    """Stop relaunching once this many dollars have been billed. None: on SageMaker, 1.25 x the plan's estimate of
    the training's cost (the dry run states it; a run with no estimate must set one); locally, no budget."""
    price_per_hour_usd: float | None = Field(None, ge=0)
    """Price of one node-hour; None uses the instance catalog (infra/catalog.py)."""
    poll_seconds: float = Field(60, gt=0)
    """How often the train stage polls the job's status and logs."""
    hang_timeout_minutes: float | None = Field(60, gt=0)
    """Stop and relaunch a job that logs no new step for this long, counted from its first step once it reached
    SageMaker's Training status (None: never)."""
    startup_timeout_minutes: float | None = Field(120, gt=0)
    """Stop and relaunch a job that logs no first step this long after it reached SageMaker's Training status (the
    start-up in the container: compile-cache copy, process groups, first graphs); None: no bound."""
    backoff_seconds: list[float] = Field(default_factory=lambda: [60.0, 300.0, 900.0, 1800.0])
    """Delays before relaunching after a capacity or throttling failure (the last repeats)."""
    stop_grace_seconds: float = Field(120, ge=0)
    """Local backend: time between SIGTERM and SIGKILL when a job is stopped (SageMaker gives 120 s)."""
    deadline: datetime | None = None
    """When the run's training must stop, as ISO 8601 with a time zone (e.g. 2026-12-01T18:00:00Z); None: no
    deadline. The job itself stops at a checkpoint before it, supervised or not (training/stop_rule.py), and a job
    is never submitted past it; set a later one to go on."""
    unsupervised_stop_minutes: float | None = Field(30, gt=0)
    """A training job stops itself at a checkpoint when no supervisor has written its heartbeat
    (jobs/train-supervisor.json) for this long: a dead CLI or flow leaves no job running unwatched. None: never."""
    watchdog: Literal["auto", "off"] | float = "auto"
    """The training job's own hang watchdog (training/watchdog.py), on every rank: with no step, evaluation batch or
    checkpoint save for longer than its bound it logs every thread's stack, records `HangDetected` and ends the
    process, so the job (and its bill) ends whether or not a supervisor lives. 'auto': the bound follows this job's
    measured step and save times (`watchdog_bound_seconds`); a number: that many seconds once each phase has been
    seen (a phase met for the first time, start-up included, keeps the 60-min allowance); 'off': none."""
    collective_timeout_minutes: float = Field(20, gt=0)
    """How long a host-side (gloo) collective, and the forming of its group, may wait for its peers before it fails
    (gloo's own default is 30 min). With the watchdog on, its bound usually ends a hang first and says where."""
    subnets: list[str] = Field(default_factory=list)
    """SageMaker: VPC subnet ids (empty: no VPC). trn1 clusters need EFA, so subnets in one AZ."""
    security_group_ids: list[str] = Field(default_factory=list)
    """SageMaker: VPC security groups (with subnets). With inter-container encryption they must pass UDP 500 and
    ESP (protocol 50) between their members (deployments/account.yaml's job group passes all traffic among them)."""
    encrypt_inter_container_traffic: bool = True
    """SageMaker: encrypt the traffic between a job's instances (EnableInterContainerTrafficEncryption, IPsec:
    https://docs.aws.amazon.com/sagemaker/latest/dg/train-encrypt.html). No fee of its own, but SageMaker states it
    can lengthen distributed training, by as much as the job's traffic between instances costs to encrypt, and the
    billed hours with it; one instance is unaffected. What it costs a trn1 step (torchrun's store and gloo go over
    TCP; whether EFA's collectives pass through it) only a trn1 run can show: docs/trn1.md."""
    kms_key_id: str | None = None
    """SageMaker: KMS key for the training volumes and output."""
    keep_alive_minutes: int | None = Field(None, ge=1, le=60)
    """SageMaker: keep the instances as a warm pool this long after a job, so a relaunch starts fast."""
    training_plan_arn: str | None = None
    """SageMaker: a training plan (reserved capacity) to run the jobs in."""
    sagemaker_retry_attempts: int = Field(0, ge=0, le=30)
    """SageMaker's own RetryStrategy (retries InternalServerError only, inside one job)."""
    infra_check: bool = False
    """SageMaker: run its InfraCheckConfig health checks on the instances before the job starts."""

    @model_validator(mode="after")
    def _check_backend(self) -> JobConfig:
        if self.role_arn and self.role_arn_secret:
            raise ValueError(
                "job.role_arn and job.role_arn_secret are both set: the role comes from one place; unset "
                "job.role_arn to read it from the Secret block, or job.role_arn_secret to use job.role_arn"
            )
        for field in ("role_arn_secret", "aws_credentials_block"):
            name = getattr(self, field)
            if name is not None and not re.fullmatch(r"[a-z0-9-]+", name):
                raise ValueError(
                    f"job.{field}={name!r} is not a Prefect block name: use lowercase letters, digits and dashes"
                )
        if self.security_group_ids and not self.subnets:
            raise ValueError("security_group_ids need subnets: set job.subnets as well")
        if not isinstance(self.watchdog, str) and self.watchdog <= 0:
            raise ValueError(f"job.watchdog={self.watchdog} is not a bound: use seconds > 0, 'auto' or 'off'")
        if self.deadline is not None and self.deadline.utcoffset() is None:
            raise ValueError(
                f"job.deadline={self.deadline.isoformat()} has no time zone: add one, e.g. "
                f"{self.deadline.isoformat()}Z for UTC or +01:00"
            )
        if self.backend == "sagemaker" and not self.instance_type.startswith("ml."):
            raise ValueError(
                f"instance_type={self.instance_type!r} is not a SageMaker instance type; "
                "use e.g. 'ml.trn1.32xlarge' with backend 'sagemaker'"
            )
        return self


OPERATIONAL_JOB_FIELDS = frozenset(
    {
        "role_arn", "max_runtime_hours", "volume_size_gb", "max_restarts", "budget_usd", "price_per_hour_usd",
        "poll_seconds", "hang_timeout_minutes", "backoff_seconds", "stop_grace_seconds", "subnets",
        "security_group_ids", "kms_key_id", "keep_alive_minutes", "training_plan_arn", "sagemaker_retry_attempts",
        "infra_check", "role_arn_secret", "aws_credentials_block", "python", "deadline", "unsupervised_stop_minutes",
        "watchdog", "collective_timeout_minutes", "max_attempts_without_progress", "startup_timeout_minutes",
    }
)  # fmt: skip
"""Job settings that do not change what a run computes: not part of its fingerprint (nor its run id)."""

OPERATIONAL_TRAINING_FIELDS = frozenset({"commit_timeout_s", "async_checkpoint"})
"""Training settings that do not change what a run computes: not part of its fingerprint (nor its run id)."""

OPERATIONAL_DATA_FIELDS = frozenset(
    {"workers", "workers_per_instance", "instance_type", "image_uri", "price_per_hour_usd", "worker_retries",
     "max_runtime_hours"}
)  # fmt: skip
"""Data settings that decide where and how fast prepare-data runs, not what it writes: outside the fingerprint, the
run id and the stage's cache key."""


class StorageConfig(Section):
    """Where runs keep their outputs."""

    root: str = "./runs"
    """Local folder or s3://bucket/prefix under which each run has its own <run_id>/ prefix."""


class PrecompileConfig(Section):
    """The precompile stage: build the training step's compiled graphs once, before training, into compile-cache/."""

    enabled: bool = True
    """Run the stage (it has nothing to do on CPU/CUDA unless training.compile is on)."""
    steps: int = Field(4, ge=1, le=100)
    """Training steps of the rehearsal that builds every graph a job runs (the steps, a periodic health check, a
    checkpoint one step before the end, the last step's checkpoint and validation pass): HLAT's compile run took
    4, with a checkpoint at step 3."""


class PlannerConfig(Section):
    """The parallelism planner (`hlat plan`, and the plan-parallelism task at the head of the train stage): advice
    only, it never changes what a run computes."""

    enabled: bool = True
    """Run the plan-parallelism task before training (it warns; it never stops the stage)."""
    warn_if_slower_than: float = Field(0.10, ge=0)
    """Warn when the configured parallelism is predicted this fraction slower than the best layout (0.10: 10%)."""
    prices_usd_per_hour: dict[str, float] = Field(default_factory=dict)
    """Node-hour prices by instance type for the planner's cost columns, over the catalog's on-demand figures, e.g.
    {"ml.trn1.32xlarge": 7.59} for a 3-year reserved rate. job.price_per_hour_usd, when set, prices the run's own
    instance type unless it is listed here."""
    micro_batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4])
    """Micro-batch sizes the planner tries."""
    hbm_usable_fraction: float = Field(0.9, gt=0, le=1)
    """Share of a NeuronCore's HBM a layout may fill; the rest is left to the runtime, collective buffers and
    fragmentation (an assumption, not a measured figure)."""
    compute_efficiency: float | None = Field(None, gt=0, le=1)
    """Fraction of peak FLOP/s the NeuronCores reach on the model's FLOPs; None: fitted on two rows of the published
    Pythia 6.9B / GPT-NeoX 20B trn1 throughput (infra/planner.py)."""
    step_overhead_s: float | None = Field(None, ge=0)
    """Fixed seconds per optimizer step beyond compute and communication; None: fitted with compute_efficiency."""

    @model_validator(mode="after")
    def _check_values(self) -> PlannerConfig:
        bad = {k: v for k, v in self.prices_usd_per_hour.items() if v < 0}
        if bad:
            raise ValueError(f"prices_usd_per_hour must be >= 0; got {bad}")
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise ValueError(f"micro_batch_sizes must list sizes >= 1, e.g. [1, 2, 4]; got {self.micro_batch_sizes}")
        return self


class HealthThresholds(Section):
    """What a healthy device, collective and checkpoint store deliver on one instance type."""

    min_matmul_tflops: float = Field(0.0, ge=0)
    """Per device (NeuronCore, GPU, or CPU rank), on burn_in.matmul_size square matrices: a BF16 floor; an FP32 matmul
    is held to the same share of the device's FP32 peak (`training/health.py` `matmul_floor_tflops`)."""
    max_matmul_rel_error: float = Field(1e-2, gt=0)
    """Largest relative error of a device's matmul against a float64 reference."""
    min_allreduce_gbps: float = Field(0.0, ge=0)
    """Bus bandwidth of large all-reduces across all ranks, GB/s (the nccl-tests / nccom-test convention); a check's
    floor for its message size and rank count comes from a latency-bandwidth model (`training/health.py`
    `allreduce_floor_gbps`)."""
    min_allreduce_share_of_first: float = Field(0.25, ge=0, le=1)
    """The trainer's periodic check: unhealthy when the slowest rank's best all-reduce busbw falls below this share of
    the job's first check's (a link down to a quarter of what it delivered at the start; one check's timing noise
    on dedicated hardware stays well inside a factor of 4). 0: no relative check."""
    min_write_mbps: float = Field(0.0, ge=0)
    """Write throughput to the checkpoint location, MB/s."""


def _default_thresholds() -> dict[str, HealthThresholds]:
    # trn1.32xlarge: a NeuronCore peaks at 95 TFLOP/s BF16; a burn-in matmul below a third of that is a bad core (the
    # 30 TFLOP/s floor is BF16's; fp32 is held to 7.5, the same share of the FP32 peak).
    # The all-reduce and write floors are conservative guesses, not measurements (no trn1 here): far below what
    # NeuronLink/EFA and local NVMe deliver, so they catch a broken node, not a slow one; tune them per cluster.
    # CPU ("local"): floors that catch a broken or badly oversubscribed machine, not a slow laptop; no relative check
    # (a CPU shared with other work measures more than 4x apart from one check to the next).
    return {
        "ml.trn1.32xlarge": HealthThresholds(
            min_matmul_tflops=30.0, max_matmul_rel_error=2e-2, min_allreduce_gbps=20.0, min_write_mbps=200.0
        ),
        "local": HealthThresholds(
            min_matmul_tflops=0.0005,
            max_matmul_rel_error=1e-4,
            min_allreduce_gbps=0.001,
            min_write_mbps=5.0,
            min_allreduce_share_of_first=0.0,
        ),
    }


class BurnInConfig(Section):
    """The burn-in stage (before training, on the training's instance type and count) and periodic health
    checks inside training jobs."""

    enabled: bool = True
    """Run the burn-in stage before training."""
    matmul_size: int = Field(2048, ge=16)
    """Side of the square matrices multiplied on every device."""
    matmul_repeats: int = Field(10, ge=1)
    """Timed launches per device (after one untimed launch of the same graph)."""
    matmul_batch: int = Field(32, ge=1)
    """Products per launch (one batched matmul): a 2048² product is about 0.2 ms of a NeuronCore's work at its
    95 TFLOP/s, less than launching it costs; 32 of them make the launch overhead a few percent."""
    allreduce_mb: float = Field(256.0, gt=0)
    """Size of the all-reduced buffer, MB."""
    write_mb: float = Field(1024.0, gt=0)
    """Bytes written to the checkpoint location by each node, MB."""
    thresholds: dict[str, HealthThresholds] = Field(default_factory=_default_thresholds)
    """Per instance type (job.instance_type); an instance type not listed is measured but never failed."""
    continue_on_failure: bool = False
    """Go on to training when burn-in fails (the report still names the failing ranks)."""
    health_check_every: int | None = Field(None, ge=1)
    """Inside training jobs: every this many steps, time an all-reduce and check its result; a degraded or wrong
    collective ends the job (it is relaunched from the last checkpoint). None: never."""
    health_allreduce_mb: float = Field(16.0, gt=0)
    """Size of the periodic health check's all-reduce, MB."""


OFFLINE_TASK_PREFIX = "hlat_"
"""evaluation.tasks starting with this are the project's own offline tasks (`training/evaluation/lm_harness.py`),
not lm-eval's."""


class EvaluationConfig(Section):
    """Post-training evaluation: perplexity on the held-out split and lm-eval-harness tasks on the exported model,
    in a job of its own (one process on one instance)."""

    tasks: list[str] = Field(default_factory=list)
    """lm-eval-harness task names run on the exported model (e.g. 'hellaswag', 'mmlu'). 'hlat_cloze' and
    'hlat_choice' are the project's own offline tasks, generated from the run's held-out text."""
    limit: int | None = Field(None, ge=1)
    """Examples per task (None: all)."""
    num_fewshot: int | None = Field(None, ge=0)
    """Few-shot examples for every task (None: each task's own default)."""
    batch_size: int = Field(8, ge=1)
    """Evaluation batch size (perplexity windows and lm-eval requests)."""
    perplexity_tokens: int = Field(1_000_000, ge=0)
    """Held-out tokens scored for perplexity and bits per byte (0: skip perplexity)."""
    every_steps: int | None = Field(None, ge=1)
    """Also evaluate each checkpoint whose step is a multiple of this while training runs (None: only the
    final one). Results go to eval/step-NNNNNNNNN/; training is not paused."""
    instance_type: str | None = None
    """Instance of the evaluation job (None: job.instance_type). lm-eval runs Hugging Face transformers, so on
    AWS this is a GPU instance, e.g. 'ml.p4d.24xlarge'."""
    image_uri: str | None = None
    """Container image of the evaluation job on SageMaker (None: the PyTorch GPU training image of job.region for
    a GPU instance, job.image_uri otherwise)."""
    max_runtime_hours: float = Field(24.0, gt=0)
    """Wall-clock limit of one evaluation job."""


class TrackingConfig(Section):
    """Experiment tracking in the team's own tool, beside the run's TensorBoard files and metrics.jsonl. Every attempt
    of a run logs into one tracked run (resumed across relaunches, never duplicated)."""

    backend: Literal["none", "mlflow", "wandb"] = "none"
    """'mlflow' (MLflow tracking: a server, SageMaker's managed MLflow, or a local store), 'wandb' (Weights & Biases),
    or 'none' (TensorBoard files and metrics.jsonl only)."""
    mlflow_tracking_uri: str | None = None
    """MLflow's tracking URI (an http(s) server, a sqlite:/// or file: store); None: a SQLite store in the run's
    tracking/ folder for a local run, and with mlflow_tracking_server_arn that server."""
    mlflow_tracking_server_arn: str | None = None
    """A SageMaker managed MLflow tracking server (arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME): the
    training job's request carries it (CreateTrainingJob MlflowConfig) and the stages log to it through the
    sagemaker-mlflow plugin."""
    experiment: str = "hlat"
    """MLflow experiment, or W&B project, the run is logged under."""
    wandb_entity: str | None = None
    """W&B entity (team or user); None: the API key's default."""
    wandb_mode: Literal["online", "offline"] = "online"
    """W&B mode: 'offline' writes the run under the run's tracking/ folder for a later `wandb sync`."""

    @field_validator("mlflow_tracking_server_arn")
    @classmethod
    def _check_arn(cls, arn: str | None) -> str | None:
        # CreateTrainingJob's MlflowConfig.MlflowResourceArn pattern (botocore's SageMaker service model).
        if arn is not None and not re.fullmatch(
            r"arn:aws[a-z\-]*:sagemaker:[a-z0-9\-]*:[0-9]{12}:mlflow-[a-zA-Z-]*/.+", arn
        ):
            raise ValueError(
                f"{arn!r} is not a SageMaker MLflow tracking server ARN "
                "(arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME)"
            )
        return arn


class AlertsConfig(Section):
    """Notifications when a run needs a person: Prefect automations (created by `hlat deploy`) that send through a
    Prefect notification block. Each alert says what happened, the run, and how to look."""

    block: str | None = None
    """The Prefect notification block alerts go through, as 'TYPE/NAME' (e.g. 'slack-webhook/hlat-alerts',
    'custom-webhook/oncall'); None: no alerts. The block holds the webhook and its secrets, never the config.
    `hlat deploy` makes the automations (tasks/alerts.py) from the deployments' configs; they are the Prefect
    server's, one set for every hlat run it sees."""
    stalled_minutes: float = Field(60, ge=1 / 6)
    """Alert when a training job has made no progress (no new step) for this long; at least 10 s, the shortest
    window a Prefect proactive trigger takes."""
    max_relaunches: int = Field(3, ge=1)
    """Alert when a run relaunches its training job more than this many times."""
    budget_fractions: list[float] = Field(default_factory=lambda: [0.5, 0.9])
    """Alert when the spend crosses each of these fractions of job.budget_usd."""
    eval_floors: dict[str, float] = Field(default_factory=dict)
    """Alert when an evaluation metric comes out below its floor (metric name -> minimum, e.g. {"hellaswag": 0.3}):
    an lm-eval task (its main metric), '<task>/<metric>', or a field of the perplexity results."""

    @field_validator("block")
    @classmethod
    def _block_is_type_and_name(cls, value: str | None) -> str | None:
        kind, _, name = (value or "x/x").partition("/")
        if not kind or not name or "/" in name:
            raise ValueError(f"{value!r}: give a Prefect notification block as TYPE/NAME, e.g. custom-webhook/oncall")
        return value


class HlatConfig(Section):
    """An hlat run: everything that determines its outputs."""

    preset: str = "custom"
    """Preset the config started from (informational)."""
    run_id: str | None = None
    """Run identifier; None derives '<preset>-<hash of this config>' so equal configs share a run."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model architecture."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Corpus source, validation and sharding."""
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    """Tokenizer training."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """Optimizer, schedule, batch, checkpoints."""
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    """Numeric formats."""
    neuron: NeuronConfig = Field(default_factory=NeuronConfig)
    """Neuron compiler and runtime settings of the trn1 jobs."""
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    """Parallel degrees."""
    job: JobConfig = Field(default_factory=JobConfig)
    """Job backend, cluster and budget."""
    storage: StorageConfig = Field(default_factory=StorageConfig)
    """Run storage."""
    precompile: PrecompileConfig = Field(default_factory=PrecompileConfig)
    """Graph precompilation before training."""
    burn_in: BurnInConfig = Field(default_factory=BurnInConfig)
    """Pre-flight cluster checks and periodic health checks."""
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    """Parallelism planning advice and the prices it compares."""
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    """Evaluation."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Experiment tracking (MLflow, W&B)."""
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    """Notifications through Prefect automations."""

    @model_validator(mode="after")
    def _check_cross_fields(self) -> HlatConfig:
        t, m, p = self.training, self.model, self.parallelism
        if t.seq_len > m.max_seq_len:
            raise ValueError(
                f"training.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
                "raise model.max_seq_len or lower training.seq_len"
            )
        if t.global_batch_size % t.micro_batch_size:
            raise ValueError(
                f"training.global_batch_size={t.global_batch_size} must be a multiple of "
                f"training.micro_batch_size={t.micro_batch_size}"
            )
        if (problem := ParallelDims(p.tensor, p.pipeline).problem(m.n_heads, m.kv_heads, m.n_layers)) is not None:
            raise ValueError(f"parallelism.tensor={p.tensor}, parallelism.pipeline={p.pipeline}: {problem}")
        if m.padded_vocab_size % p.tensor:
            raise ValueError(
                f"model.vocab_multiple={m.vocab_multiple}: the padded vocabulary ({m.padded_vocab_size} rows for "
                f"model.vocab_size={m.vocab_size}) does not divide over parallelism.tensor={p.tensor}; set "
                f"model.vocab_multiple to a multiple of {p.tensor}"
            )
        try:
            dims = self.parallel_dims
        except LayoutError as exc:
            raise ValueError(
                f"parallelism.tensor x parallelism.pipeline: {exc} (job.instance_count x job.processes_per_node)"
            ) from None
        if (problem := dims.batch_problem(t.global_batch_size, t.micro_batch_size)) is not None:
            raise ValueError(f"training.global_batch_size: {problem} (training.micro_batch_size)")
        if p.fsdp:
            self._check_fsdp()
        if m.init_from is not None and self.tokenizer.pretrained is None:
            raise ValueError(
                f"model.init_from={m.init_from!r} needs tokenizer.pretrained: the weights read token ids of the "
                "tokenizer they were trained with; set tokenizer.pretrained to it (usually the same as model.init_from)"
            )
        if t.schedule == "wsd" and t.decay_steps is not None and t.warmup_steps + t.decay_steps > t.schedule_horizon:
            raise ValueError(
                f"training.decay_steps={t.decay_steps}: warm-up ({t.warmup_steps}) and decay do not fit in the "
                f"schedule's {t.schedule_horizon} steps (training.schedule_steps or max_steps); shorten one of them"
            )
        if self.run_id is not None:
            check_run_id(self.run_id)
        return self

    def _check_fsdp(self) -> None:
        p = self.parallelism
        refused = [
            (self.parallel_dims.splits_model, "tensor and pipeline parallelism (NxD's, on trn1)", "set both to 1"),
            (p.zero1, "parallelism.zero1 (FSDP2 already shards the optimizer states)", "set parallelism.zero1=false"),
            (self.training.device == "xla", "training.device=xla (XLA jobs shard with NxD)", "use cpu or cuda"),
            (
                self.precision.mode == "bf16-sr",
                "precision.mode=bf16-sr (a BF16 model; FSDP2 keeps FP32 master weights)",
                "use precision.mode=bf16-mixed",
            ),
        ]
        for bad, what, fix in refused:
            if bad:
                raise ValueError(f"parallelism.fsdp does not combine with {what}: {fix}")

    @property
    def world_size(self) -> int:
        """Processes (devices) of one training job: nodes x processes per node."""
        return self.job.instance_count * self.job.processes_per_node

    @property
    def parallel_dims(self) -> ParallelDims:
        """The job's layout: parallelism.tensor x parallelism.pipeline, data parallelism over the rest of the
        world. Raises LayoutError when the split does not divide the world (validation reports it by field)."""
        p = self.parallelism
        return ParallelDims.of_world(p.tensor, p.pipeline, self.world_size, p.sequence_parallel)

    @property
    def gradient_accumulation(self) -> int:
        t = self.training
        return self.parallel_dims.accumulation(t.global_batch_size, t.micro_batch_size)

    @property
    def tokens_per_step(self) -> int:
        return self.training.global_batch_size * self.training.seq_len

    def fingerprint(self) -> str:
        """Hash of everything that determines the run's outputs. Excluded: run_id, the storage root, evaluation,
        tracking, alerts, precompile, burn-in, the planner, the Neuron compiler and runtime settings and the job's
        operational settings (budget, restarts, polling, networking...), which may change between relaunches of the
        same run. A relaunch with other Neuron settings continues the same run; the compile cache's key holds the ones
        that change the compiled graphs, so those are rebuilt."""
        operational = {"evaluation", "precompile", "burn_in", "planner", "neuron", "tracking", "alerts"}
        body = self.model_dump(mode="json", exclude={"run_id", "storage", *operational})
        body["job"] = {k: v for k, v in body["job"].items() if k not in OPERATIONAL_JOB_FIELDS}
        body["data"] = {k: v for k, v in body["data"].items() if k not in OPERATIONAL_DATA_FIELDS}
        body["training"] = {k: v for k, v in body["training"].items() if k not in OPERATIONAL_TRAINING_FIELDS}
        return stable_hash(body)

    def trajectory_fingerprint(self) -> str:
        """The fingerprint less the run's length, so that a run may be extended from one config to another with the
        same one (open_run allows it). Cosine: training.max_steps is left out and the horizon made explicit
        (schedule_steps or max_steps): the two compute the same weights at every step both reach. WSD: the horizon
        and decay_steps are left out too, since they only move the decay's start: the two compute the same weights
        until the first of their decays begins, so whether a run can still be extended depends on how far it got
        (`TrainingConfig.extension_problem`, checked when a job resumes)."""
        t = self.training
        if t.schedule == "wsd":
            length: dict[str, Any] = {"max_steps": 1, "schedule_steps": None, "decay_steps": None}
        else:
            length = {"max_steps": 1, "schedule_steps": t.schedule_horizon}
        return self.model_copy(update={"training": t.model_copy(update=length)}).fingerprint()

    def resolved_run_id(self) -> str:
        return self.run_id or f"{self.preset}-{self.fingerprint()[:10]}"

    def section_hash(self, *sections: str) -> str:
        """Hash of some sections only: what a stage's cache key depends on."""
        dump = self.model_dump(mode="json")
        return stable_hash({s: dump[s] for s in sections})


def closest_match(value: str, options: list[str]) -> str | None:
    """The option a typo most likely meant: fewest edits (insertions, deletions, substitutions and swaps of two
    neighbours: a swap is one typo, `ml.trn1.23xlarge` for `ml.trn1.32xlarge`), then the closest length, then
    difflib's similarity; None when nothing is close (more edits than a third of the value's length, at least 2)."""

    def edits(a: str, b: str) -> int:  # optimal string alignment distance
        d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
        for i in range(1, len(a) + 1):
            for j in range(1, len(b) + 1):
                d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
                if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                    d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
        return d[len(a)][len(b)]

    limit = max(2, len(value) // 3)
    scored = [
        (edits(value, o), abs(len(o) - len(value)), -difflib.SequenceMatcher(None, value, o).ratio(), o)
        for o in options
    ]
    best = min(scored, default=None)
    return best[3] if best is not None and best[0] <= limit else None


def stable_hash(obj: Any) -> str:
    """sha256 of the canonical JSON form of obj."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def check_run_id(run_id: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", run_id):
        raise ConfigError(
            f"run_id: {run_id!r} is not allowed; use 1-100 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return run_id


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        got = e.get("input")
        hidden = isinstance(got, dict) or e["type"] == "extra_forbidden" or msg == CREDENTIALS_REFUSED
        shown = "" if hidden else f" (got {got!r})"  # never a credential back on the terminal
        lines.append(f"{field}: {msg}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)


def validate_config(data: dict[str, Any]) -> HlatConfig:
    """Build an HlatConfig from plain data; every problem is reported as 'dotted.field: what is allowed'."""
    try:
        return HlatConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def parse_override(item: str) -> tuple[str, Any]:
    """'training.lr=1e-3' -> ('training.lr', 0.001). Values are read as JSON when they parse, else as text."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like dotted.path=value, e.g. training.lr=1e-3")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = {"none": None, "null": None, "true": True, "false": False}.get(raw.lower(), raw)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"override {item!r}: value must be finite")
    return key.strip(), value


def _plain(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def flatten_config(nested: dict[str, Any], model: type[BaseModel] = HlatConfig, prefix: str = "") -> dict[str, Any]:
    """A nested partial config (a config file's `{"data": {"sources": [...]}}`) as the dotted-path overrides
    apply_overrides takes (`{"data.sources": [...]}`), in the file's order. It descends only into fields whose type
    is a config Section (data, data.curation, training...); any other value, lists and mappings included
    (data.sources, burn_in.thresholds), is one leaf and replaces the preset's value whole. An unknown key stays a
    path, for apply_overrides to name with its closest match."""
    out: dict[str, Any] = {}
    for key, value in nested.items():
        dotted = f"{prefix}{key}"
        field = model.model_fields.get(str(key))
        section = field.annotation if field is not None else None
        if isinstance(section, type) and issubclass(section, Section) and isinstance(value, dict):
            out.update(flatten_config(value, section, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted paths in a plain config dict; an unknown path names the closest known ones."""
    out = json.loads(json.dumps(data))
    for dotted, value in overrides.items():
        node: Any = out
        model: type[BaseModel] | None = HlatConfig
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            fields = model.model_fields if model is not None else {}
            if model is not None and part not in fields:
                where = ".".join(parts[:i]) or "the config"
                close = closest_match(part, list(fields))
                hint = f"; did you mean {'.'.join([*parts[:i], close])}?" if close else ""
                # The suggestion first: it is the fix; the list of every field is for when there is none.
                raise ConfigError(f"{dotted}: unknown field {part!r} in {where}{hint} (known: {', '.join(fields)})")
            field = fields[part] if model is not None else None
            annotation = field.annotation if field is not None else None
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
            if i == len(parts) - 1:
                node[part] = value
            else:
                if not isinstance(node.get(part), dict):
                    default = field.get_default(call_default_factory=True) if field is not None else None
                    if model is None and isinstance(default, dict):
                        # A mapping field (e.g. burn_in.thresholds) the preset leaves at its default: start from it.
                        node[part] = json.loads(json.dumps({k: _plain(v) for k, v in default.items()}))
                    elif model is None:
                        raise ConfigError(f"{dotted}: {'.'.join(parts[: i + 1])} is not a section")
                    else:
                        node[part] = {}
                node = node[part]
    return out
