"""Named presets, typed: each is an `HlatConfig` built from its sections, so a wrong field fails at import.

Figures come from the HLAT paper (7B/70B) and the AWS Neuron runs of Pythia 6.9B and GPT-NeoX 20B. Pythia and NeoX use
the `gpt_neox` family with their published shapes. `tiny` trains in minutes on 2 CPU cores. Each trn1 preset's token
budget follows one named source (TOKEN_BUDGETS): steps and batch from the same run. The published trn1 throughput runs
set only the layout (docs/planning.md, "Presets"). `neuron` defaults to HLAT 7B's launch script; hlat-70b sets what HLAT
70B changed."""

from __future__ import annotations

from typing import Any

from hlat.core.config import (
    BurnInConfig,
    ConfigError,
    CurationConfig,
    DataConfig,
    DataValidationConfig,
    EvaluationConfig,
    HlatConfig,
    JobConfig,
    ModelConfig,
    NeuronConfig,
    ParallelismConfig,
    PrecisionConfig,
    TokenizerConfig,
    TrainingConfig,
    apply_overrides,
    parse_override,
    validate_config,
)

# The published tokenizers these runs used. HLAT used LLaMA-2's (https://github.com/awslabs/HLAT, "Get Started"
# step 2): gated, so a run needs HF_TOKEN, an s3:// copy, or --set tokenizer.pretrained=null to train its own.
# Pythia and GPT-NeoX-20B share GPT-NeoX's 50,277-token BPE (https://huggingface.co/EleutherAI/gpt-neox-20b).
_LLAMA2_TOKENIZER = TokenizerConfig(pretrained="meta-llama/Llama-2-7b-hf", sample_bytes=2_000_000_000)
_GPT_NEOX_TOKENIZER = TokenizerConfig(pretrained="EleutherAI/gpt-neox-20b", sample_bytes=2_000_000_000)


def _trn1_job(instance_count: int) -> JobConfig:
    """SageMaker jobs on `instance_count` trn1.32xlarge nodes, one process per NeuronCore."""
    return JobConfig(
        backend="sagemaker", instance_type="ml.trn1.32xlarge", processes_per_node=32, instance_count=instance_count
    )


# A public web corpus streamed from the hub; point data.source at your own copy (s3://...) for real runs.
# Prepared by a job of 64 workers (8 x ml.c5.4xlarge): the hub data set's files are split between them.
# Curated public corpora (HLAT's mixture, the Pile for Pythia and NeoX): deduplicated (exact, then MinHash near
# duplicates) and decontaminated against the evaluation tasks; the web-text quality rules stay off, since on code,
# books and papers they drop good documents (docs/data.md).
_PUBLIC_CORPUS_CURATION = CurationConfig(exact_dedup=True, minhash=True, decontaminate=True)
# The tiny rehearsal runs every rule, so the whole curation path runs before money is spent. Its offline corpus is
# Python source, which the web-text rules at their defaults mostly remove: thresholds are loosened (docs/data.md).
_EVERY_RULE = CurationConfig(
    exact_dedup=True,
    minhash=True,
    gopher_quality=True,
    gopher_quality_params={
        "max_non_alpha_words_ratio": 0.3,
        "min_doc_words": 20,
        "max_symbol_word_ratio": 0.5,
        "min_stop_words": 0,
        "max_avg_word_length": 20,
    },
    gopher_repetition=True,
    gopher_repetition_params={
        "top_n_grams": [[2, 0.4], [3, 0.3], [4, 0.25]],
        "dup_n_grams": [[5, 0.3], [6, 0.28], [7, 0.26], [8, 0.24], [9, 0.22], [10, 0.2]],
    },
    c4_quality=True,
    c4_quality_params={
        "min_num_sentences": -1,
        "min_words_per_line": 1,
        "filter_javascript": False,
        "filter_curly_bracket": False,
    },
    fineweb_quality=True,
    fineweb_quality_params={"char_duplicates_ratio": 0.3, "line_punct_thr": 0.0, "short_line_thr": 0.9},
    decontaminate=True,
)

_WEB_CORPUS = DataConfig(
    source="HuggingFaceFW/fineweb",
    hf_config="sample-350BT",
    streaming=True,
    workers=64,
    workers_per_instance=8,
    curation=_PUBLIC_CORPUS_CURATION,
)

# HLAT's evaluation suite (lm-eval-harness task names).
HLAT_EVAL_TASKS = [
    "mmlu",
    "hellaswag",
    "piqa",
    "winogrande",
    "arc_easy",
    "arc_challenge",
    "openbookqa",
    "boolq",
    "triviaqa",
    "nq_open",
    "gsm8k",
]

_GPT_NEOX_VOCABULARY: dict[str, Any] = {"vocab_size": 50277, "vocab_multiple": 256}
"""GPT-NeoX's tokenizer has 50,277 tokens; Pythia-6.9B and NeoX-20B pad to 50,432 rows, a multiple of 256
(make_vocab_size_divisible_by 128 x model-parallel size 2). Sources: https://huggingface.co/EleutherAI/gpt-neox-20b/blob/main/tokenizer.json,
https://huggingface.co/EleutherAI/pythia-6.9b/blob/main/config.json,
https://huggingface.co/EleutherAI/gpt-neox-20b/blob/main/config.json."""

TOKEN_BUDGETS: dict[str, tuple[float, str]] = {
    "hlat-7b": (1.8e12, "HLAT paper (arXiv 2404.10630): 1.8T tokens = ~429k steps of 1024 x 4096 tokens"),
    "hlat-70b": (1.8e12, "HLAT paper (arXiv 2404.10630): 1.8T tokens = ~429k steps of 1024 x 4096 tokens"),
    "pythia-6.9b": (
        299_892_736_000,
        "Pythia paper (Biderman et al. 2023, arXiv 2304.01373): 143k steps of 1024 x 2048 tokens = 300B tokens",
    ),
    "neox-20b": (
        150_000 * 1536 * 2048,
        "GPT-NeoX-20B paper (Black et al. 2022, arXiv 2204.06745): 150k steps of ~3.15M tokens (1538 x 2048; "
        "1536 here) = ~472B tokens",
    ),
}
"""Per trn1 preset: the tokens it trains on and the source of that figure."""

PRESETS: dict[str, HlatConfig] = {
    "tiny": HlatConfig(
        preset="tiny",
        model=ModelConfig(
            n_layers=2,
            d_model=128,
            n_heads=4,
            ffn_hidden=344,
            vocab_size=2048,
            max_seq_len=256,
        ),
        data=DataConfig(
            source="builtin:python-stdlib",
            max_documents=1500,
            validation_fraction=0.05,
            shard_rows=500,
            batch_rows=1000,
            validation=DataValidationConfig(min_chars=32, max_chars=200_000, max_duplicate_rate=0.2),
            curation=_EVERY_RULE,
        ),
        tokenizer=TokenizerConfig(sample_bytes=3_000_000, report_sample_bytes=500_000),
        training=TrainingConfig(
            lr=2e-3,
            warmup_steps=30,
            max_steps=600,
            global_batch_size=8,
            micro_batch_size=4,
            seq_len=128,
            checkpoint_every=100,
            keep_checkpoints=2,
            eval_every=100,
            eval_batches=8,
        ),
        precision=PrecisionConfig(mode="fp32"),
        # A local job: poll often, and give up on a silent job or a failing launch within minutes, not hours.
        job=JobConfig(poll_seconds=1, hang_timeout_minutes=5, stop_grace_seconds=20, backoff_seconds=[2, 5]),
        burn_in=BurnInConfig(matmul_size=256, matmul_repeats=3, matmul_batch=1, allreduce_mb=4, write_mb=8),
        # The project's offline lm-eval tasks, generated from the run's held-out text: the harness runs for real.
        evaluation=EvaluationConfig(
            tasks=["hlat_cloze", "hlat_choice"],
            limit=50,
            batch_size=8,
            perplexity_tokens=20_000,
        ),
    ),
    "hlat-7b": HlatConfig(
        preset="hlat-7b",
        model=ModelConfig(
            n_layers=32,
            d_model=4096,
            n_heads=32,
            ffn_hidden=11008,
            vocab_size=32000,
            max_seq_len=4096,
            init_std=0.021,
        ),
        data=_WEB_CORPUS,
        tokenizer=_LLAMA2_TOKENIZER,
        training=TrainingConfig(
            lr=3e-4,
            min_lr_ratio=0.1,
            warmup_steps=2000,
            max_steps=429_000,  # HLAT's 1.8T tokens (TOKEN_BUDGETS); schedule horizon 500k as in HLAT
            schedule_steps=500_000,
            global_batch_size=1024,
            micro_batch_size=1,
            log_every=10,  # a sync point: one device round trip on trn1 (training/loop.py)
            seq_len=4096,
            checkpoint_every=1000,
            keep_checkpoints=5,
        ),
        precision=PrecisionConfig(mode="bf16-sr"),
        parallelism=ParallelismConfig(
            tensor=8,
            pipeline=1,
            sequence_parallel=True,
            activation_checkpointing="selective",
        ),
        job=_trn1_job(64),
        evaluation=EvaluationConfig(tasks=HLAT_EVAL_TASKS, instance_type="ml.p4d.24xlarge"),
    ),
    "hlat-70b": HlatConfig(
        preset="hlat-70b",
        model=ModelConfig(
            n_layers=80,
            d_model=8192,
            n_heads=64,
            n_kv_heads=8,
            ffn_hidden=28672,
            vocab_size=32000,
            max_seq_len=4096,
            init_std=0.021,
            scale_output_init=True,
        ),
        data=_WEB_CORPUS,
        tokenizer=_LLAMA2_TOKENIZER,
        training=TrainingConfig(
            lr=1.5e-4,
            min_lr_ratio=0.1,
            warmup_steps=2000,
            max_steps=429_000,  # HLAT's 1.8T tokens (TOKEN_BUDGETS); schedule horizon 500k as in HLAT
            schedule_steps=500_000,
            global_batch_size=1024,
            micro_batch_size=1,
            log_every=10,  # a sync point: one device round trip on trn1 (training/loop.py)
            seq_len=4096,
            checkpoint_every=300,
            keep_checkpoints=3,
        ),
        precision=PrecisionConfig(mode="bf16-mixed"),
        # HLAT 70B's launch script: HLAT 7B's compiler and runtime settings (the NeuronConfig defaults) plus these.
        neuron=NeuronConfig(async_inflight_requests=31, compress_rg=True, dist_init_barrier=False),
        parallelism=ParallelismConfig(
            tensor=32,
            pipeline=8,
            sequence_parallel=True,
            zero1=True,
            activation_checkpointing="selective",
        ),
        job=_trn1_job(256),
        evaluation=EvaluationConfig(tasks=HLAT_EVAL_TASKS, instance_type="ml.p4d.24xlarge"),
    ),
    "pythia-6.9b": HlatConfig(
        preset="pythia-6.9b",
        model=ModelConfig(
            n_layers=32,
            d_model=4096,
            n_heads=32,
            ffn_hidden=16384,
            arch="gpt_neox",
            **_GPT_NEOX_VOCABULARY,
            max_seq_len=2048,
            norm_eps=1e-5,
            rotary_fraction=0.25,
            init_std=0.02,
        ),
        data=_WEB_CORPUS,
        tokenizer=_GPT_NEOX_TOKENIZER,
        # Pythia's own schedule (TOKEN_BUDGETS): 143k steps of 1024 sequences, LR 1.2e-4 after 1% warmup. The
        # published trn1 runs of Pythia 6.9B used a global batch of 256: a throughput benchmark, not a budget.
        training=TrainingConfig(
            lr=1.2e-4,
            min_lr_ratio=0.1,
            warmup_steps=1430,
            max_steps=143_000,
            global_batch_size=1024,
            micro_batch_size=1,
            log_every=10,  # a sync point: one device round trip on trn1 (training/loop.py)
            seq_len=2048,
            weight_decay=0.01,
        ),
        precision=PrecisionConfig(mode="bf16-sr"),
        parallelism=ParallelismConfig(tensor=8, pipeline=1, sequence_parallel=True),
        job=_trn1_job(4),
        # Perplexity only (no task list).
        evaluation=EvaluationConfig(instance_type="ml.p4d.24xlarge"),
    ),
    "neox-20b": HlatConfig(
        preset="neox-20b",
        model=ModelConfig(
            n_layers=44,
            d_model=6144,
            n_heads=64,
            ffn_hidden=24576,
            arch="gpt_neox",
            **_GPT_NEOX_VOCABULARY,
            max_seq_len=2048,
            norm_eps=1e-5,
            rotary_fraction=0.25,
            init_std=0.01,
        ),
        data=_WEB_CORPUS,
        tokenizer=_GPT_NEOX_TOKENIZER,
        # GPT-NeoX-20B's own schedule (TOKEN_BUDGETS): 150k steps of ~3.15M tokens, LR 0.97e-4 after 1% warmup.
        # The paper's 1538 sequences become 1536 so that 32 data-parallel replicas (32 nodes at TP 8 x PP 4) split
        # it evenly (48 pipeline micro-batches each). The published trn1 runs' batch of 16,384 sequences is a
        # throughput benchmark: with NeoX's 150k steps it would be 5.0T tokens, ten times what NeoX trained on.
        training=TrainingConfig(
            lr=0.97e-4,
            min_lr_ratio=0.1,
            warmup_steps=1500,
            max_steps=150_000,
            global_batch_size=1536,
            micro_batch_size=1,
            log_every=10,  # a sync point: one device round trip on trn1 (training/loop.py)
            seq_len=2048,
            weight_decay=0.01,
        ),
        precision=PrecisionConfig(mode="bf16-sr"),
        parallelism=ParallelismConfig(tensor=8, pipeline=4, sequence_parallel=True),
        job=_trn1_job(32),
        evaluation=EvaluationConfig(instance_type="ml.p4d.24xlarge"),
    ),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def load_config(
    preset: str = "tiny",
    overrides: dict[str, Any] | list[str] | None = None,
    run_id: str | None = None,
    storage: str | None = None,
) -> HlatConfig:
    """Resolve a preset, then dotted overrides (dict or 'k=v' strings), then run id and storage root."""
    if preset not in PRESETS:
        raise ConfigError(f"preset: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if isinstance(overrides, list):
        overrides = dict(parse_override(item) for item in overrides)
    data = PRESETS[preset].model_dump(mode="json")
    extra: dict[str, Any] = dict(overrides or {})
    if run_id is not None:
        extra["run_id"] = run_id
    if storage is not None:
        extra["storage.root"] = storage
    return validate_config(apply_overrides(data, extra))
