"""Named presets as data: each is a partial config laid over the defaults of `HlatConfig`.

Figures come from the HLAT paper (7B/70B) and the AWS Neuron NeMo runs of Pythia 6.9B and GPT-NeoX 20B
(partial rotary 25%, sequence 2048). Pythia and NeoX keep their depth, width, heads and vocabulary; their
4x GeLU MLP becomes a SwiGLU of 2/3 the width, so parameter counts stay 6.9B and 20B.
`tiny` is CPU-sized: it trains in minutes on 2 cores, offline.

The Neuron compiler and runtime settings of the trn1 jobs (`neuron`) default to HLAT 7B's launch script; hlat-7b,
pythia-6.9b and neox-20b keep them (like HLAT 7B they train in pure BF16 with stochastic rounding at TP 8);
hlat-70b sets what HLAT 70B changed.
"""

from __future__ import annotations

from typing import Any

from training.config import ConfigError, HlatConfig, apply_overrides, parse_override, validate_config

_TRN1 = {
    "backend": "sagemaker",
    "instance_type": "ml.trn1.32xlarge",
    "processes_per_node": 32,
}

# A public web corpus streamed from the hub; point data.source at your own copy (s3://...) for real runs.
_WEB_CORPUS = {"source": "HuggingFaceFW/fineweb", "hf_config": "sample-350BT", "streaming": True}

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

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": {
            "n_layers": 2,
            "d_model": 128,
            "n_heads": 4,
            "ffn_hidden": 344,
            "vocab_size": 2048,
            "max_seq_len": 256,
        },
        "data": {
            "source": "builtin:python-stdlib",
            "max_documents": 1500,
            "validation_fraction": 0.05,
            "shard_rows": 500,
            "batch_rows": 1000,
            "validation": {"min_chars": 32, "max_chars": 200_000, "max_duplicate_rate": 0.2},
        },
        "tokenizer": {"sample_bytes": 3_000_000, "report_sample_bytes": 500_000},
        "training": {
            "lr": 2e-3,
            "warmup_steps": 30,
            "max_steps": 600,
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "seq_len": 128,
            "checkpoint_every": 100,
            "keep_checkpoints": 2,
            "eval_every": 100,
            "eval_batches": 8,
        },
        "precision": {"mode": "fp32"},
        # A local job: poll often, and give up on a silent job or a failing launch within minutes, not hours.
        "job": {"poll_seconds": 1, "hang_timeout_minutes": 5, "stop_grace_seconds": 20, "backoff_seconds": [2, 5]},
        "burn_in": {"matmul_size": 256, "matmul_repeats": 3, "allreduce_mb": 4, "write_mb": 8},
        # The project's offline lm-eval tasks, generated from the run's held-out text: the harness runs for real.
        "evaluation": {
            "tasks": ["hlat_cloze", "hlat_choice"],
            "limit": 50,
            "batch_size": 8,
            "perplexity_tokens": 20_000,
        },
    },
    "hlat-7b": {
        "model": {
            "n_layers": 32,
            "d_model": 4096,
            "n_heads": 32,
            "ffn_hidden": 11008,
            "vocab_size": 32000,
            "max_seq_len": 4096,
            "init_std": 0.021,
        },
        "data": _WEB_CORPUS,
        "tokenizer": {"sample_bytes": 2_000_000_000},
        "training": {
            "lr": 3e-4,
            "min_lr_ratio": 0.1,
            "warmup_steps": 2000,
            "max_steps": 429_000,
            "schedule_steps": 500_000,
            "global_batch_size": 1024,
            "micro_batch_size": 1,
            "log_every": 10,  # a sync point: one device round trip on trn1 (training/trainer.py)
            "seq_len": 4096,
            "checkpoint_every": 1000,
            "keep_checkpoints": 5,
        },
        "precision": {"mode": "bf16-sr"},
        "parallelism": {
            "tensor": 8,
            "pipeline": 1,
            "sequence_parallel": True,
            "activation_checkpointing": "selective",
        },
        "job": {**_TRN1, "instance_count": 64},
        "evaluation": {"tasks": HLAT_EVAL_TASKS, "instance_type": "ml.p4d.24xlarge"},
    },
    "hlat-70b": {
        "model": {
            "n_layers": 80,
            "d_model": 8192,
            "n_heads": 64,
            "n_kv_heads": 8,
            "ffn_hidden": 28672,
            "vocab_size": 32000,
            "max_seq_len": 4096,
            "init_std": 0.021,
            "scale_output_init": True,
        },
        "data": _WEB_CORPUS,
        "tokenizer": {"sample_bytes": 2_000_000_000},
        "training": {
            "lr": 1.5e-4,
            "min_lr_ratio": 0.1,
            "warmup_steps": 2000,
            "max_steps": 429_000,
            "schedule_steps": 500_000,
            "global_batch_size": 1024,
            "micro_batch_size": 1,
            "log_every": 10,  # a sync point: one device round trip on trn1 (training/trainer.py)
            "seq_len": 4096,
            "checkpoint_every": 300,
            "keep_checkpoints": 3,
            "async_checkpoint": True,
        },
        "precision": {"mode": "bf16-mixed"},
        # HLAT 70B's launch script: HLAT 7B's compiler and runtime settings (the NeuronConfig defaults) plus these.
        "neuron": {"async_inflight_requests": 31, "compress_rg": True, "dist_init_barrier": False},
        "parallelism": {
            "tensor": 32,
            "pipeline": 8,
            "sequence_parallel": True,
            "zero1": True,
            "activation_checkpointing": "selective",
        },
        "job": {**_TRN1, "instance_count": 256},
        "evaluation": {"tasks": HLAT_EVAL_TASKS, "instance_type": "ml.p4d.24xlarge"},
    },
    "pythia-6.9b": {
        "model": {
            "n_layers": 32,
            "d_model": 4096,
            "n_heads": 32,
            "ffn_hidden": 10944,
            "vocab_size": 50432,
            "max_seq_len": 2048,
            "rotary_fraction": 0.25,
            "init_std": 0.02,
        },
        "data": _WEB_CORPUS,
        "tokenizer": {"sample_bytes": 2_000_000_000},
        "training": {
            "lr": 1.2e-4,
            "min_lr_ratio": 0.1,
            "warmup_steps": 1430,
            "max_steps": 143_000,
            "global_batch_size": 256,
            "micro_batch_size": 1,
            "log_every": 10,  # a sync point: one device round trip on trn1 (training/trainer.py)
            "seq_len": 2048,
            "weight_decay": 0.01,
        },
        "precision": {"mode": "bf16-sr"},
        "parallelism": {"tensor": 8, "pipeline": 1, "sequence_parallel": True},
        "job": {**_TRN1, "instance_count": 4},
        # Perplexity only (no task list); partial rotary models cannot be exported to Hugging Face Llama.
        "evaluation": {"instance_type": "ml.p4d.24xlarge"},
    },
    "neox-20b": {
        "model": {
            "n_layers": 44,
            "d_model": 6144,
            "n_heads": 64,
            "ffn_hidden": 16384,
            "vocab_size": 50432,
            "max_seq_len": 2048,
            "rotary_fraction": 0.25,
            "init_std": 0.01,
        },
        "data": _WEB_CORPUS,
        "tokenizer": {"sample_bytes": 2_000_000_000},
        "training": {
            "lr": 0.97e-4,
            "min_lr_ratio": 0.1,
            "warmup_steps": 1500,
            "max_steps": 150_000,
            "global_batch_size": 16384,
            "micro_batch_size": 1,
            "log_every": 10,  # a sync point: one device round trip on trn1 (training/trainer.py)
            "seq_len": 2048,
            "weight_decay": 0.01,
        },
        "precision": {"mode": "bf16-sr"},
        "parallelism": {"tensor": 8, "pipeline": 4, "sequence_parallel": True},
        "job": {**_TRN1, "instance_count": 32},
        "evaluation": {"instance_type": "ml.p4d.24xlarge"},
    },
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
    data = {"preset": preset, **PRESETS[preset]}
    extra: dict[str, Any] = dict(overrides or {})
    if run_id is not None:
        extra["run_id"] = run_id
    if storage is not None:
        extra["storage.root"] = storage
    return validate_config(apply_overrides(data, extra))
