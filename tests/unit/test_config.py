"""The config tree: presets carry the published figures, errors name the field, overrides by dotted path."""

from __future__ import annotations

import pytest

from hlat.core.config import ConfigError, HlatConfig, apply_overrides, parse_override, validate_config
from hlat.core.presets import PRESETS, load_config


def test_every_preset_validates_and_every_field_is_documented() -> None:
    for name in PRESETS:
        assert load_config(name).preset == name

    def walk(model: type) -> None:
        for field_name, field in model.model_fields.items():  # type: ignore[attr-defined]
            assert field.description, f"{model.__name__}.{field_name} has no docstring"
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann)

    walk(HlatConfig)


def test_hlat_7b_figures() -> None:
    c = load_config("hlat-7b")
    m, t = c.model, c.training
    assert (m.n_layers, m.d_model, m.ffn_hidden, m.n_heads, m.kv_heads) == (32, 4096, 11008, 32, 32)
    assert (m.vocab_size, t.seq_len, m.norm_eps, m.rope_theta, m.init_std) == (
        32000,
        4096,
        1e-5,
        10000.0,
        0.021,
    )
    assert not m.tie_embeddings and not m.scale_output_init
    assert (t.lr, t.lr * t.min_lr_ratio, t.warmup_steps, t.schedule_steps) == (
        3e-4,
        pytest.approx(3e-5),
        2000,
        500_000,
    )
    assert (t.beta1, t.beta2, t.eps, t.weight_decay, t.grad_clip) == (0.9, 0.95, 1e-8, 0.1, 1.0)
    assert (t.global_batch_size, t.micro_batch_size, c.tokens_per_step) == (1024, 1, 4_194_304)
    assert (t.checkpoint_every, t.keep_checkpoints) == (1000, 5)
    p = c.parallelism
    assert (p.tensor, p.pipeline, p.sequence_parallel, p.zero1, p.activation_checkpointing) == (
        8,
        1,
        True,
        False,
        "selective",
    )
    assert c.precision.mode == "bf16-sr"
    assert (c.job.instance_type, c.job.instance_count) == ("ml.trn1.32xlarge", 64)
    assert c.parallel_dims.data == 4 * c.job.instance_count  # HLAT 7B: TP 8 on 32 NeuronCores a node, so DP = 4 x nodes
    assert 6.5e9 < m.num_params() < 7e9


def test_hlat_70b_figures() -> None:
    c = load_config("hlat-70b")
    m, t, p = c.model, c.training, c.parallelism
    assert (m.n_layers, m.d_model, m.ffn_hidden, m.n_heads, m.kv_heads) == (80, 8192, 28672, 64, 8)
    assert m.scale_output_init
    assert (t.lr, t.lr * t.min_lr_ratio) == (1.5e-4, pytest.approx(1.5e-5))
    assert (p.tensor, p.pipeline, p.zero1, p.sequence_parallel) == (32, 8, True, True)
    assert c.precision.mode == "bf16-mixed"
    assert (t.checkpoint_every, t.keep_checkpoints, t.async_checkpoint) == (300, 3, True)
    assert 68e9 < m.num_params() < 71e9


@pytest.mark.parametrize(
    ("name", "tp", "pp", "batch", "params"),
    [("pythia-6.9b", 8, 1, 1024, 6.9e9), ("neox-20b", 8, 4, 1536, 20.5e9)],
)
def test_partial_rotary_presets(name: str, tp: int, pp: int, batch: int, params: float) -> None:
    c = load_config(name)
    assert c.model.rotary_fraction == 0.25 and c.training.seq_len == 2048
    assert (c.parallelism.tensor, c.parallelism.pipeline, c.training.global_batch_size) == (tp, pp, batch)
    assert abs(c.model.num_params() - params) / params < 0.02


@pytest.mark.parametrize("name", ["hlat-7b", "hlat-70b", "pythia-6.9b", "neox-20b"])
def test_each_presets_token_budget_follows_its_named_source(name: str) -> None:
    from hlat.core.presets import TOKEN_BUDGETS
    from hlat.infra.cost import planner
    from hlat.infra.cost.estimates import estimate

    tokens, source = TOKEN_BUDGETS[name]
    c = load_config(name)
    t = c.training
    # Steps and batch from the same run: NeoX's 150k steps with the trn1 benchmark's 16,384 sequences was 5.0T.
    assert t.max_steps * t.global_batch_size * t.seq_len == pytest.approx(tokens, rel=2e-3), source
    assert t.global_batch_size * t.seq_len == pytest.approx(tokens / t.max_steps, rel=2e-3)
    # The dry run's estimate and the planner's default budget read the same figure.
    assert estimate(c)["tokens"] == planner.default_tokens(c) == t.max_steps * c.tokens_per_step
    assert c.parallel_dims.data * t.micro_batch_size * c.gradient_accumulation == t.global_batch_size
    assert "arXiv" in source
    from hlat.commands.planning import presets_table

    [row] = [line for line in presets_table().splitlines() if line.startswith(f"{name} ")]
    assert f" {t.global_batch_size} " in row  # `hlat presets` shows the batch the budget is made of


def test_tiny_is_cpu_sized_and_offline() -> None:
    c = load_config("tiny")
    assert c.model.num_params() < 5_000_000
    assert c.data.source == "builtin:python-stdlib"
    assert (c.job.backend, c.storage.root) == ("local", "./runs")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["training.lr=-1"], "training.lr: Input should be greater than 0 (got -1)"),
        (["precision.mode=bf16"], "precision.mode: Input should be 'fp32', 'bf16-mixed' or 'bf16-sr'"),
        (["training.lrr=1"], "training.lrr: unknown field 'lrr' in training; did you mean training.lr? (known: lr,"),
        (["training.lrr=1"], "did you mean training.lr?"),
        (["modle.n_layers=1"], "did you mean model"),
        (["training.seq_len=512"], "training.seq_len=512 exceeds model.max_seq_len=256"),
        (["model.n_heads=3"], "n_heads=3 must divide d_model=128"),
        (["training.global_batch_size=7"], "must be a multiple of training.micro_batch_size=4"),
        (["data.validation.policy=drop"], "data.validation.policy: Input should be 'fail' or 'quarantine'"),
        (["run_id=../etc"], "run_id: '../etc' is not allowed"),
        (["training.lr"], "must look like dotted.path=value"),
        (["neuron.exec_timeout=0"], "neuron.exec_timeout: Input should be greater than or equal to 1 (got 0)"),
        (["neuron.env.NEURON_COMPILE_CACHE_URL=/x"], "neuron.env: ['NEURON_COMPILE_CACHE_URL'] are set by the job"),
        (["neuron.env.1X=1"], "neuron.env: ['1X'] are not environment variable names"),
        (["neuron.env.BASH_ENV=/tmp/x"], "neuron.env: ['BASH_ENV'] are not Neuron, XLA, EFA or process-group settings"),
        (["neuron.env.LD_PRELOAD=/tmp/x.so"], "neuron.env: ['LD_PRELOAD'] are not Neuron, XLA"),
        (["neuron.env.PIP_INDEX_URL=https://evil"], "neuron.env: ['PIP_INDEX_URL'] are not Neuron, XLA"),
        (["neuron.env.PYTHONSTARTUP=/tmp/x.py"], "would run code in the job); remove them"),
        (["neuron.env.NEURON_LIBRARY_PATH=/tmp"], "neuron.env: ['NEURON_LIBRARY_PATH'] are not Neuron"),
    ],
)
def test_wrong_values_name_the_field_and_the_fix(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides)
    assert expected in str(err.value)


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="choose one of tiny, hlat-7b"):
        load_config("llama-7b")


def test_overrides_parse_json_and_text() -> None:
    assert parse_override("training.lr=1e-3") == ("training.lr", 1e-3)
    assert parse_override("data.source=s3://b/p") == ("data.source", "s3://b/p")
    assert parse_override("training.keep_every=none") == ("training.keep_every", None)
    assert parse_override('evaluation.tasks=["piqa"]') == ("evaluation.tasks", ["piqa"])
    c = load_config("tiny", {"training.lr": 2e-3, "data.validation.max_chars": 500}, run_id="r1", storage="s3://b/x")
    assert (c.training.lr, c.data.validation.max_chars, c.run_id, c.storage.root) == (
        2e-3,
        500,
        "r1",
        "s3://b/x",
    )


def test_overrides_do_not_mutate_presets() -> None:
    before = load_config("tiny").model_dump()
    load_config("tiny", ["model.n_layers=3"])
    assert load_config("tiny").model_dump() == before
    data = {"model": {"n_layers": 1}}
    apply_overrides(data, {"model.d_model": 64})
    assert data == {"model": {"n_layers": 1}}


def test_run_id_is_derived_from_the_config() -> None:
    a, b = load_config("tiny"), load_config("tiny", ["training.lr=3e-3"])
    assert a.resolved_run_id() == load_config("tiny").resolved_run_id()
    assert a.resolved_run_id() != b.resolved_run_id()
    assert a.resolved_run_id().startswith("tiny-")
    # storage root and run id do not change what a run computes
    assert load_config("tiny", storage="/elsewhere").fingerprint() == a.fingerprint()


def test_config_round_trips_through_json() -> None:
    c = load_config("hlat-70b")
    assert validate_config(c.model_dump(mode="json")) == c


def test_extra_expectations_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"expectations\[0\] needs a 'type'"):
        load_config("tiny", {"data.validation.expectations": [{"kwargs": {}}]})


def test_a_field_of_a_default_mapping_can_be_overridden() -> None:
    from hlat.core.presets import load_config

    config = load_config("tiny", {"burn_in.thresholds.local.min_matmul_tflops": 2.5})
    assert config.burn_in.thresholds["local"].min_matmul_tflops == 2.5
    assert config.burn_in.thresholds["local"].min_write_mbps == 5.0  # the rest of the default entry is kept
    assert "ml.trn1.32xlarge" in config.burn_in.thresholds  # and the other entries


def test_neuron_settings_of_the_presets() -> None:
    seven = load_config("hlat-7b").neuron
    assert seven.model_dump() == {
        "sdk": "2.28.0",  # the last Neuron release that trains with PyTorch/XLA and NxD: every preset's default
        "compiler_flags": "--model-type transformer --distribution-strategy=llm-training",
        "fuse_softmax": True,
        "async_inflight_requests": 3,
        "exec_timeout": 4000,
        "malloc_arena_max": 64,
        "compress_rg": False,
        "dist_init_barrier": True,
        "efa": True,
        "efa_fork_safe": True,
        "env": {},
    }
    seventy = load_config("hlat-70b").neuron
    assert seventy.model_dump() == {
        **seven.model_dump(),
        "async_inflight_requests": 31,
        "compress_rg": True,
        "dist_init_barrier": False,
    }
    for name in ("pythia-6.9b", "neox-20b", "tiny"):
        assert load_config(name).neuron == seven
    # 2.24.1 stays selectable: the last release with XLA_USE_BF16 / XLA_DOWNCAST_BF16
    assert load_config("hlat-7b", {"neuron.sdk": "2.24.1"}).neuron.sdk == "2.24.1"


def test_neuron_settings_are_not_part_of_the_run() -> None:
    base = load_config("hlat-7b")
    changed = load_config(
        "hlat-7b", {"neuron.exec_timeout": 9000, "neuron.compiler_flags": "-O1", "neuron.env.NEURON_RT_LOG_LEVEL": 3}
    )
    assert changed.neuron.env == {"NEURON_RT_LOG_LEVEL": "3"}  # a number on the command line is the variable's text
    assert changed.fingerprint() == base.fingerprint() and changed.resolved_run_id() == base.resolved_run_id()


@pytest.mark.parametrize(
    "override, field",
    [
        ("tracking.mlflow_tracking_uri=https://bob:hunter2@mlflow.example.com", "tracking.mlflow_tracking_uri"),
        ("data.source=https://hunter2@huggingface.co/datasets/x", "data.source"),
        ('data.sources=[{"source": "s3://b/x", "weight": 1}, {"source": "https://a:hunter2@h/y"}]', "data.sources.1"),
        ("neuron.env.NEURON_RT_LOG_URL=http://a:hunter2@h", "neuron.env"),
    ],
)
def test_a_uri_with_credentials_is_refused_naming_the_field_and_never_shown(override: str, field: str) -> None:
    """Issue 51: a config is copied into config.json, checkpoints, tracking and logs, so it holds no secret."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [override])
    message = str(err.value)
    assert f"{field}" in message and "holds credentials in a URI" in message and "MLFLOW_TRACKING_PASSWORD" in message
    assert "hunter2" not in message
    assert load_config("tiny", ["tracking.mlflow_tracking_uri=https://mlflow.example.com:5000/x?a=b@c"])
