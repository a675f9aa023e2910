"""The one typed config tree of an hlat run.

It is the flow parameter, the run's `config.json` and what a training job reads.
Each field's docstring is its description. Validation happens here, once.
A wrong value raises `ConfigError` naming the dotted field.
Presets live in `core/presets.py`; `apply_overrides` applies dotted overrides."""

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
    """The strings of a raw value: itself, or a list's or mapping's values."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list | tuple):
        yield from (v for v in value if isinstance(v, str))
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, str))


class Section(BaseModel):
    """Base of every section: unknown keys are errors and no field holds a URI with credentials."""

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
    """Model family (`core.models.FAMILIES`, docs/models.md): 'llama' or 'gpt_neox' (GPT-NeoX / Pythia)."""
    vocab_size: int = Field(4096, ge=260)
    """Tokenizer vocabulary size (>= 260: 256 bytes plus specials); with tokenizer.pretrained, that tokenizer's."""
    vocab_multiple: int = Field(1, ge=1)
    """Pad embedding and output rows up to a multiple of this (Megatron's make_vocab_size_divisible_by).
    The padded size must divide over parallelism.tensor; padded rows take no probability."""
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
    """Published weights to start from: a Hugging Face Llama or GPT-NeoX checkpoint (hub `org/name[@rev]`, folder or
    s3://). Its config.json wins over this section; the optimizer starts fresh. Needs tokenizer.pretrained."""

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
    # (training/loop.py), the dry run's estimate (infra/cost/estimates.py) and the planner (infra/cost/perf_model.py)
    # use these.
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
        """Bytes of one replica's weights, gradients and AdamW moments: 16 per parameter, 8 in pure BF16."""
        return (8 if precision == "bf16-sr" else 16) * self.num_params()

    def layer_flops_per_token(self, seq_len: int) -> int:
        """Forward + backward FLOPs of one block per token: 6 per matmul parameter plus 12·d·T for attention."""
        return 6 * self.block_params() + 12 * self.d_model * seq_len

    def head_flops_per_token(self) -> int:
        """FLOPs of the output projection and final norm per token, forward + backward."""
        return 6 * (self.padded_vocab_size * self.d_model + self.final_norm_params())

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, for MFU: 6·N + 12·L·d·T.

        N excludes the input embedding lookup. As in PaLM's MFU, the causal mask is not discounted."""
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
    """A Hugging Face dataset, an s3:// URI, a local file or folder, or 'builtin:python-stdlib' (offline corpus)."""
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
    """One source of the corpus mixture: where it comes from, its token share and its repeat limit."""

    name: str | None = None
    """Short name used in reports, metrics and the schedule; None: derived from `source`."""
    source: str
    """A Hugging Face dataset, an s3:// URI, a local file or folder, or 'builtin:python-stdlib' (offline corpus)."""
    weight: float = Field(1.0, gt=0)
    """This source's share of the training tokens, relative to the other sources' weights (normalised to sum 1)."""
    max_epochs: float | None = Field(4.0, gt=0)
    """Most passes over this source a run may make; more is refused before start (None: no limit).
    Muennighoff et al. 2023 (arXiv 2305.16264): up to ~4 epochs are about as good as fresh data."""
    tokens: int | None = Field(None, ge=1)
    """The source's training tokens if known before prepare-data; the measured size replaces it."""

    @property
    def resolved_name(self) -> str:
        return self.name or source_slug(self.source)


def source_slug(source: str) -> str:
    """The default name of a source: 'HuggingFaceFW/fineweb' -> 'fineweb', 's3://b/books/' -> 'books'."""
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
    """What prepare-data removes beyond the row checks, with datatrove (https://github.com/huggingface/datatrove).
    Each rule is a switch; removals are counted per source and rule in the data report."""

    exact_dedup: bool = True
    """Drop exact duplicates across the source (datatrove's hash-partitioned exact dedup)."""
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
    """Drop documents sharing an n-gram with the texts of evaluation.tasks."""
    decontamination_ngrams: int = Field(13, ge=4)
    """Word n-gram length of the decontamination match (GPT-3, Brown et al. 2020: 13)."""
    examples_per_rule: int = Field(5, ge=0)
    """Removed documents kept as examples per rule in the data report."""
    finder_workers: int = Field(4, ge=1)
    """Hash ranges of the exact dedup; each finder holds only its range."""

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
    """The corpus as a weighted mixture of sources; empty: one source from the shorthand fields above."""
    schedule: list[MixtureStep] = Field(default_factory=list)
    """Weights by step: each entry sets every source's weight from its step on."""
    curation: CurationConfig = Field(default_factory=CurationConfig)
    """Deduplication, quality filters and decontamination (datatrove), per source."""
    unit_mb: int = Field(64, ge=1)
    """Size of the units the source is cut into; each unit is committed alone, so a dead worker redoes only its own."""
    workers: int = Field(1, ge=1)
    """Worker processes of prepare-data (SageMaker: workers_per_instance per instance); max_documents means one."""
    workers_per_instance: int = Field(8, ge=1)
    """SageMaker: worker processes per instance; instances = workers / this, rounded up."""
    instance_type: str = "ml.c5.4xlarge"
    """SageMaker instance type of the prepare-data job (CPU work)."""
    image_uri: str | None = None
    """Container image of the prepare-data job on SageMaker; None: AWS's PyTorch CPU training image."""
    price_per_hour_usd: float | None = Field(None, ge=0)
    """Price of one data.instance_type node-hour; None: the instance catalog's."""
    worker_retries: int = Field(2, ge=0)
    """Times a dead worker is restarted, alone, before the job fails."""
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
        """Each source's weight at `step`, normalised to sum 1."""
        raw = {s.resolved_name: s.weight for s in self.mixture}
        for entry in self.schedule:
            if entry.step <= step:
                raw = {name: entry.weights.get(name, 0.0) for name in raw}
        total = sum(raw.values())
        return {name: w / total for name, w in raw.items()}

    def source_data_config(self, source: SourceConfig) -> DataConfig:
        """This config narrowed to one source: what prepares that source."""
        return self.model_copy(update={**source.reader(), "sources": [], "schedule": []})


class TokenizerConfig(Section):
    """sentencepiece BPE trained the LLaMA way (model.vocab_size pieces), or an existing tokenizer."""

    pretrained: str | None = None
    """An existing tokenizer instead of training one: hub name (HLAT: meta-llama/Llama-2-7b-hf), folder or s3://.
    model.vocab_size follows it. None trains a sentencepiece tokenizer on the run's data."""

    sample_bytes: int = Field(50_000_000, ge=1_000)
    """Bytes of training text sampled into the tokenizer trainer."""
    character_coverage: float = Field(0.99995, gt=0, le=1)
    """Fraction of characters covered by pieces; the rest fall back to bytes."""
    byte_fallback: bool = True
    """Encode characters outside the vocabulary as UTF-8 byte pieces, so no text is lost."""
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
    """Schedule after warm-up: 'cosine' to min_lr_ratio at the horizon (HLAT), or 'wsd'.
    WSD holds the peak, then decays over decay_steps, so a run can be extended."""
    decay_steps: int | None = Field(None, ge=1)
    """WSD only: the 1-sqrt decay's length at the horizon's end (None: 20%).
    Hägele et al. 2024, https://arxiv.org/abs/2405.18392."""
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
    """Also keep, permanently, every checkpoint whose step is a multiple of this."""
    async_checkpoint: bool = True
    """Write checkpoints in the background; the loop blocks only for the copy to host memory.
    False: the loop waits until each checkpoint is committed."""
    commit_timeout_s: float = Field(600.0, gt=0)
    """Seconds rank 0 waits for every rank's checkpoint files before the commit fails."""
    nan_policy: Literal["exit", "skip"] = "exit"
    """On a NaN/inf loss: 'exit' to restart from the last checkpoint (HLAT), or 'skip' the step."""
    spike_skip: bool = False
    """Skip a step whose loss or gradient norm is spike_zscore deviations above the trailing mean.
    Decided on the device with no host sync (OLMo-core's skip-step optimizer)."""
    spike_window: int = Field(128, ge=8)
    """Trailing steps that define a spike; no step is judged before the window fills."""
    spike_zscore: float = Field(6.0, gt=0)
    """Standard deviations above the trailing mean that make a spike."""
    spike_max_consecutive: int = Field(8, ge=1)
    """Spiking steps in a row that stop the job for good (EXIT_LOSS_SPIKES): it diverged."""
    log_every: int = Field(1, ge=1)
    """Steps between metric records."""
    eval_every: int = Field(1000, ge=0)
    """Steps between validation-loss evaluations on the held-out split (0: only at the end)."""
    eval_batches: int = Field(8, ge=1)
    """Micro-batches per rank scored at each validation-loss evaluation (the same ones every time)."""
    compile: bool = False
    """Compile the model with torch.compile (CPU and CUDA; XLA compiles its own graph)."""
    device: Literal["auto", "cpu", "cuda", "xla"] = "auto"
    """Device of the training, precompile and burn-in jobs; 'auto': XLA in a Neuron container, else CUDA, else CPU.
    'xla' elsewhere runs XLA:CPU in neuron.sdk's XLA environment (`scripts/install.sh xla-2.28`)."""
    document_masking: bool = False
    """Stop attention at document boundaries inside packed sequences."""
    deterministic: bool = True
    """CUDA: deterministic kernels only, so a resumed job matches an uninterrupted one bitwise.
    See https://pytorch.org/docs/stable/notes/randomness.html. CPU and XLA are deterministic either way."""
    xla_graph_cuts: Literal["micro-batch", "step"] = "micro-batch"
    """XLA: where the traced graph is cut. 'micro-batch' after each backward, as HLAT and NxD do (small compiles).
    'step': one graph per optimizer step (fewest launches, largest compile)."""

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
        """WSD: the decay's first step (decay_steps before the horizon's end, never inside the warm-up)."""
        horizon = self.schedule_horizon
        length = self.decay_steps if self.decay_steps is not None else max(1, horizon // 5)
        return max(self.warmup_steps, horizon - length)

    def lr_differs_from(self, other: TrainingConfig) -> int | None:
        """The first step whose learning rate differs from `other`'s (None: none); 0 when unsure."""
        same = ("schedule", "lr", "min_lr_ratio", "warmup_steps")
        if any(getattr(self, f) != getattr(other, f) for f in same):
            return 0
        if self.schedule == "cosine":  # the cosine's every step after the warm-up depends on its horizon
            return None if self.schedule_horizon == other.schedule_horizon else self.warmup_steps
        if (self.decay_start, self.schedule_horizon) == (other.decay_start, other.schedule_horizon):
            return None
        return min(self.decay_start, other.decay_start)  # both hold the peak until one of them starts its decay

    def extension_problem(self, longer: TrainingConfig, steps_taken: int) -> str | None:
        """Why this run cannot go on under `longer`'s schedule after `steps_taken` steps, or None."""
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
    """'fp32'; 'bf16-mixed' (FP32 master weights and states); 'bf16-sr' (pure BF16, stochastic rounding, HLAT 7B)."""


NeuronSdkVersion = Literal["2.24.1", "2.28.0"]
DEFAULT_NEURON_SDK: NeuronSdkVersion = "2.28.0"
"""neuron.sdk's default: 2.28, the last Neuron that trains with PyTorch/XLA and NxD on trn1.
HLAT ran 2.20.0, which has no PyTorch 2 image (awslabs/HLAT, common/install_2_20_0.sh)."""
NEURON_RESERVED_ENV = frozenset({"NEURON_COMPILE_CACHE_URL", "RUN_NEURON_PARALLEL_COMPILE", "HLAT_RUN_ID"})
"""Variables the job backends set themselves (the run's compile cache, the precompile wrapper, the run id)."""
NEURON_ENV_PREFIXES = ("NEURON_", "XLA_", "PJRT_", "FI_", "CCOM_", "NCCL_", "TORCH_DIST_", "TORCH_GLOO_")
"""What neuron.env may set: Neuron compiler and runtime, torch-xla, PJRT, EFA, collectives, process groups.
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/nrt-configurable-parameters.html"""
NEURON_ENV_NAMES = frozenset({"MALLOC_ARENA_MAX", "OMP_NUM_THREADS", "RDMAV_FORK_SAFE", "TF_CPP_MIN_LOG_LEVEL"})
"""Single variables neuron.env may set besides `NEURON_ENV_PREFIXES`'."""
NEURON_ENV_REFUSED = ("PATH", "LIBRARY", "PLUGIN", "PRELOAD")
"""Names within the prefixes that hold these are refused: a path, library or plugin to load is code."""


class NeuronConfig(Section):
    """Neuron compiler and runtime settings of the trn1 jobs; defaults are HLAT 7B's.
    They become environment variables (`core.environment.neuron_environment`); an off boolean leaves its variable unset.
    """

    sdk: NeuronSdkVersion = DEFAULT_NEURON_SDK
    """Neuron SDK release of the trn1 jobs: their image, installs and precision flags (`core.environment.NEURON_SDKS`).
    '2.28.0' is the last that trains with PyTorch/XLA; '2.24.1' is the last with XLA_USE_BF16 (closest to HLAT's 2.20).
    """
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
    """False sets TORCH_DIST_INIT_BARRIER=0, skipping the init barrier (HLAT 70B)."""
    efa: bool = True
    """Use EFA for inter-node collectives (FI_PROVIDER=efa); turn off on instances without EFA."""
    efa_fork_safe: bool = True
    """Make libfabric's EFA provider safe across fork() (FI_EFA_FORK_SAFE=1; SageMaker's Torchrun driver sets
    RDMAV_FORK_SAFE=1 itself)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra or overriding variables of the trn1 jobs, applied last, e.g. {"NEURON_RT_LOG_LEVEL": "INFO"}.
    Only `NEURON_ENV_PREFIXES` and `NEURON_ENV_NAMES`; the backends' own variables are refused."""

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
    """Recompute in backward: 'selective' the attention core and SwiGLU product (HLAT); 'full' each block."""
    fsdp: bool = False
    """Shard parameters, gradients and states over data-parallel ranks with FSDP2 (CPU and CUDA).
    For models that do not fit one device under DDP; trn1 uses tensor parallelism and zero1."""

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
    """Local backend: the job's Python interpreter; None: the flow's own, or neuron.sdk's XLA venv for device=xla."""
    role_arn: str | None = None
    """IAM role SageMaker assumes (the sagemaker backend needs it, or role_arn_secret)."""
    role_arn_secret: str | None = None
    """Prefect Secret block holding the role ARN; used when role_arn is not set."""
    aws_credentials_block: str | None = None
    """prefect-aws AwsCredentials block every AWS client of the run uses; None: boto3's default chain."""
    max_runtime_hours: float = Field(24 * 28, gt=0, le=24 * 28)
    """Longest a single job may run (SageMaker allows 28 days)."""
    volume_size_gb: int = Field(512, ge=1)
    """EBS volume per node."""
    max_restarts: int = Field(100, ge=0)
    """Relaunches from the newest checkpoint before the stage gives up (HLAT: 100)."""
    max_repeats: int = Field(2, ge=1)
    """Stop when the same job failure ends this many attempts in a row with no new checkpoint: it repeats."""
    max_attempts_without_progress: int = Field(3, ge=1)
    """Stop when this many attempts in a row commit no new checkpoint, whatever ended them."""
    budget_usd: float | None = Field(None, gt=0)
    """Stop relaunching past this spend; None: 1.25 x the plan's estimate on SageMaker, no limit locally."""
    price_per_hour_usd: float | None = Field(None, ge=0)
    """Price of one node-hour; None uses the instance catalog (infra/cost/catalog.py)."""
    poll_seconds: float = Field(60, gt=0)
    """How often the train stage polls the job's status and logs."""
    hang_timeout_minutes: float | None = Field(60, gt=0)
    """Relaunch a job that logs no new step for this long, counted from its first step (None: never)."""
    startup_timeout_minutes: float | None = Field(120, gt=0)
    """Relaunch a job that logs no first step this long after it started training (None: no bound)."""
    backoff_seconds: list[float] = Field(default_factory=lambda: [60.0, 300.0, 900.0, 1800.0])
    """Delays before relaunching after a capacity or throttling failure (the last repeats)."""
    stop_grace_seconds: float = Field(120, ge=0)
    """Local backend: seconds between SIGTERM and SIGKILL when a job is stopped (SageMaker: 120)."""
    deadline: datetime | None = None
    """When training must stop (ISO 8601 with zone); None: no deadline.
    The job stops at a checkpoint before it (training/stop_rule.py) and none is submitted past it."""
    unsupervised_stop_minutes: float | None = Field(30, gt=0)
    """A job stops at a checkpoint when no supervisor heartbeat was written for this long (None: never)."""
    watchdog: Literal["auto", "off"] | float = "auto"
    """The job's own hang watchdog (training/watchdog.py): past its bound it logs stacks and ends the process.
    'auto': the bound follows measured step and save times; a number: that many seconds; 'off': none."""
    collective_timeout_minutes: float = Field(20, gt=0)
    """How long a gloo collective, or forming its group, waits for peers before failing."""
    subnets: list[str] = Field(default_factory=list)
    """SageMaker: VPC subnet ids (empty: no VPC). trn1 clusters need EFA, so subnets in one AZ."""
    security_group_ids: list[str] = Field(default_factory=list)
    """SageMaker: VPC security groups; with encryption they must pass UDP 500 and ESP between members."""
    encrypt_inter_container_traffic: bool = True
    """SageMaker: encrypt traffic between a job's instances (IPsec).
    It may lengthen multi-instance jobs (https://docs.aws.amazon.com/sagemaker/latest/dg/train-encrypt.html)."""
    kms_key_id: str | None = None
    """SageMaker: KMS key for the training volumes and output."""
    keep_alive_minutes: int | None = Field(None, ge=1, le=60)
    """SageMaker: keep instances as a warm pool this long after a job, for fast relaunches."""
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
    """Steps of the rehearsal that builds every graph a job runs, checkpoints included (HLAT's compile run: 4)."""


class PlannerConfig(Section):
    """The parallelism planner (`hlat plan`, and the train stage's first task): advice only."""

    enabled: bool = True
    """Run the plan-parallelism task before training (it warns; it never stops the stage)."""
    warn_if_slower_than: float = Field(0.10, ge=0)
    """Warn when the configured layout is predicted this fraction slower than the best one."""
    prices_usd_per_hour: dict[str, float] = Field(default_factory=dict)
    """Node-hour prices by instance type over the catalog's, e.g. {"ml.trn1.32xlarge": 7.59}."""
    micro_batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4])
    """Micro-batch sizes the planner tries."""
    hbm_usable_fraction: float = Field(0.9, gt=0, le=1)
    """Share of a NeuronCore's HBM a layout may fill (an assumption, not a measurement)."""
    compute_efficiency: float | None = Field(None, gt=0, le=1)
    """Fraction of peak FLOP/s reached; None: fitted on published Pythia / NeoX trn1 throughput."""
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
    """Per-device BF16 matmul floor, TFLOP/s; FP32 is held to the same share of its peak."""
    max_matmul_rel_error: float = Field(1e-2, gt=0)
    """Largest relative error of a device's matmul against a float64 reference."""
    min_allreduce_gbps: float = Field(0.0, ge=0)
    """Bus bandwidth floor of large all-reduces, GB/s (nccl-tests convention), scaled by a latency model."""
    min_allreduce_share_of_first: float = Field(0.25, ge=0, le=1)
    """Periodic check: unhealthy below this share of the first check's all-reduce busbw (0: off)."""
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
    """The burn-in stage before training, and periodic health checks inside training jobs."""

    enabled: bool = True
    """Run the burn-in stage before training."""
    matmul_size: int = Field(2048, ge=16)
    """Side of the square matrices multiplied on every device."""
    matmul_repeats: int = Field(10, ge=1)
    """Timed launches per device (after one untimed launch of the same graph)."""
    matmul_batch: int = Field(32, ge=1)
    """Products per launch, so launch overhead stays a few percent of the timing."""
    allreduce_mb: float = Field(256.0, gt=0)
    """Size of the all-reduced buffer, MB."""
    write_mb: float = Field(1024.0, gt=0)
    """Bytes written to the checkpoint location by each node, MB."""
    thresholds: dict[str, HealthThresholds] = Field(default_factory=_default_thresholds)
    """Per instance type (job.instance_type); an instance type not listed is measured but never failed."""
    continue_on_failure: bool = False
    """Go on to training when burn-in fails (the report still names the failing ranks)."""
    health_check_every: int | None = Field(None, ge=1)
    """Every this many steps, time and check an all-reduce; a bad one ends the job (None: never)."""
    health_allreduce_mb: float = Field(16.0, gt=0)
    """Size of the periodic health check's all-reduce, MB."""


OFFLINE_TASK_PREFIX = "hlat_"
"""evaluation.tasks starting with this are the project's own offline tasks (`training/evaluation/lm_harness.py`),
not lm-eval's."""


class EvaluationConfig(Section):
    """Post-training evaluation: held-out perplexity and lm-eval tasks, in a job of its own."""

    tasks: list[str] = Field(default_factory=list)
    """lm-eval task names, e.g. 'hellaswag'; 'hlat_cloze' and 'hlat_choice' are the offline tasks."""
    limit: int | None = Field(None, ge=1)
    """Examples per task (None: all)."""
    num_fewshot: int | None = Field(None, ge=0)
    """Few-shot examples for every task (None: each task's own default)."""
    batch_size: int = Field(8, ge=1)
    """Evaluation batch size (perplexity windows and lm-eval requests)."""
    perplexity_tokens: int = Field(1_000_000, ge=0)
    """Held-out tokens scored for perplexity and bits per byte (0: skip perplexity)."""
    every_steps: int | None = Field(None, ge=1)
    """Also evaluate each checkpoint whose step is a multiple of this, during training (None: final only)."""
    instance_type: str | None = None
    """Evaluation instance (None: job.instance_type); on AWS a GPU one, e.g. 'ml.p4d.24xlarge'."""
    image_uri: str | None = None
    """Evaluation image on SageMaker; None: the PyTorch GPU image, or job.image_uri off GPU."""
    max_runtime_hours: float = Field(24.0, gt=0)
    """Wall-clock limit of one evaluation job."""


class TrackingConfig(Section):
    """Experiment tracking beside TensorBoard and metrics.jsonl; one tracked run across relaunches."""

    backend: Literal["none", "mlflow", "wandb"] = "none"
    """'mlflow', 'wandb', or 'none' (TensorBoard files and metrics.jsonl only)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; None: a SQLite store in the run's tracking/ folder, or the ARN's server."""
    mlflow_tracking_server_arn: str | None = None
    """A SageMaker managed MLflow server ARN; jobs and stages log to it."""
    experiment: str = "hlat"
    """MLflow experiment, or W&B project, the run is logged under."""
    wandb_entity: str | None = None
    """W&B entity (team or user); None: the API key's default."""
    wandb_mode: Literal["online", "offline"] = "online"
    """'offline' writes the run under tracking/ for a later `wandb sync`."""

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
    """Alerts when a run needs a person: Prefect automations made by `hlat deploy`."""

    block: str | None = None
    """Prefect notification block as 'TYPE/NAME', e.g. 'slack-webhook/hlat-alerts'; None: no alerts."""
    stalled_minutes: float = Field(60, ge=1 / 6)
    """Alert when a job makes no progress for this long (at least 10 s, Prefect's shortest window)."""
    max_relaunches: int = Field(3, ge=1)
    """Alert when a run relaunches its training job more than this many times."""
    budget_fractions: list[float] = Field(default_factory=lambda: [0.5, 0.9])
    """Alert when the spend crosses each of these fractions of job.budget_usd."""
    eval_floors: dict[str, float] = Field(default_factory=dict)
    """Alert when an evaluation metric falls below its floor, e.g. {"hellaswag": 0.3}."""

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
        """The job's layout: tensor x pipeline, data parallel over the rest (LayoutError if it does not divide)."""
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
        """Hash of everything that determines the run's outputs.
        Operational sections and settings (storage, evaluation, Neuron, budgets...) are left out."""
        operational = {"evaluation", "precompile", "burn_in", "planner", "neuron", "tracking", "alerts"}
        body = self.model_dump(mode="json", exclude={"run_id", "storage", *operational})
        body["job"] = {k: v for k, v in body["job"].items() if k not in OPERATIONAL_JOB_FIELDS}
        body["data"] = {k: v for k, v in body["data"].items() if k not in OPERATIONAL_DATA_FIELDS}
        body["training"] = {k: v for k, v in body["training"].items() if k not in OPERATIONAL_TRAINING_FIELDS}
        return stable_hash(body)

    def trajectory_fingerprint(self) -> str:
        """The fingerprint less the run's length, so a run may be extended to a longer config.
        For WSD, whether it still can depends on how far it got (`TrainingConfig.extension_problem`)."""
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
    """The option a typo most likely meant: fewest edits (a swap counts as one), then length, then difflib.
    None when nothing is close."""

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
    """A nested partial config as the dotted overrides apply_overrides takes, in file order.
    It descends into Section fields only; lists and mappings are leaves."""
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
