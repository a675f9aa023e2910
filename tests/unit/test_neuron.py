"""Trainium support checked where it can be here without neuronx-distributed: environment, config translation, the
checkpoint shards, clear errors (tests/nxd runs NxD itself)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hlat.core.environment import neuron_available, neuron_environment, xla_job_environment, xla_precision_environment
from hlat.core.parallel import ParallelDims
from hlat.core.presets import load_config
from hlat.training.parallel.distributed import World, _model_parallel
from hlat.training.parallel.neuron import NeuronUnavailable, parallel_settings, require_nxd, shard_name, shard_names

pytestmark = pytest.mark.skipif(neuron_available(), reason="checks the behaviour outside a Neuron container")


HLAT_7B_NEURON = {
    "NEURON_CC_FLAGS": "--model-type transformer --distribution-strategy=llm-training",
    "NEURON_FUSE_SOFTMAX": "1",
    "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": "3",
    "NEURON_RT_EXEC_TIMEOUT": "4000",
    "MALLOC_ARENA_MAX": "64",
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
}
"""What HLAT 7B's launch script sets besides the precision flags."""
PROJECT = Path(__file__).resolve().parents[2]


def test_precision_environment() -> None:
    assert xla_precision_environment("bf16-sr") == {
        "XLA_USE_BF16": "1",
        "XLA_DOWNCAST_BF16": "0",
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1",
    }
    assert xla_precision_environment("bf16-mixed") == {
        "XLA_USE_BF16": "0",
        "XLA_DOWNCAST_BF16": "1",
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0",
    }
    assert set(xla_precision_environment("fp32").values()) == {"0"}


def test_neuron_2_28_sets_no_precision_flags_and_the_trainer_casts_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neuron 2.25+ dropped XLA_USE_BF16 / XLA_DOWNCAST_BF16: a 2.28 job keeps only the runtime's stochastic
    rounding, its optimizer is the one a cast or autocast model needs, and each SDK has its own image and
    environment. A torch-xla of the other release is refused in one line that names the fix."""
    from hlat.core.config import ConfigError
    from hlat.core.environment import NEURON_SDKS, precision_by_flags, xla_cpu_environment
    from hlat.training import xla
    from hlat.training.optim import AdamWStochasticRounding, MasterWeightAdamW, optimizer_recipe

    newer = {"neuron.sdk": "2.28.0"}
    seven = neuron_environment(load_config("hlat-7b", newer))
    assert seven == {
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1",
        **HLAT_7B_NEURON,
        "NEURON_CC_FLAGS": f"{HLAT_7B_NEURON['NEURON_CC_FLAGS']} --enable-mixed-precision-accumulation",
    }
    seventy = neuron_environment(load_config("hlat-70b", newer))
    assert not {"XLA_USE_BF16", "XLA_DOWNCAST_BF16"} & set(seventy)
    assert seventy["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "0"
    rehearsal = load_config("tiny", {**newer, "training.device": "xla", "precision.mode": "bf16-sr"})
    assert xla_cpu_environment(rehearsal) == {
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1", "PJRT_DEVICE": "CPU", "TORCHINDUCTOR_COMPILE_THREADS": "1"
    }  # fmt: skip
    assert not precision_by_flags(rehearsal, on_xla=True)
    older = load_config("tiny", {"neuron.sdk": "2.24.1"})  # selectable: the last release with the flags
    assert precision_by_flags(older, on_xla=True) and not precision_by_flags(older, False)
    assert not precision_by_flags(load_config("tiny"), on_xla=True)  # the default is 2.28.0
    # Neuron 2.24 (flags): an FP32-typed model, the device rounds; 2.28: a BF16 model (bf16-sr) or FP32 parameters
    # under autocast (bf16-mixed), updated by plain AdamW on XLA; CPU keeps its software stochastic rounding.
    cfg = rehearsal.training
    bf16 = [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    fp32 = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_recipe(fp32, cfg, "bf16-sr", "xla")[0] is torch.optim.AdamW
    assert optimizer_recipe(bf16, cfg, "bf16-sr", "xla", flags=False)[0] is torch.optim.AdamW
    assert optimizer_recipe(bf16, cfg, "bf16-sr", "cpu", flags=False)[0] is AdamWStochasticRounding
    assert optimizer_recipe(fp32, cfg, "bf16-mixed", "xla")[0] is MasterWeightAdamW
    assert optimizer_recipe(fp32, cfg, "bf16-mixed", "xla", flags=False)[0] is torch.optim.AdamW
    with pytest.raises(TypeError, match="FP32 parameters"):
        optimizer_recipe(bf16, cfg, "bf16-mixed", "xla", flags=False)
    # One record per release: image, pins, requirements, local environment
    assert NEURON_SDKS["2.28.0"].image_tag == "2.9.0-neuronx-py312-sdk2.28.0-ubuntu24.04"
    assert NEURON_SDKS["2.24.1"].image_tag == "2.7.0-neuronx-py310-sdk2.24.1-ubuntu22.04"
    assert [sdk.install_target for sdk in NEURON_SDKS.values()] == ["xla", "xla-2.28"]  # scripts/install.sh's
    for sdk in NEURON_SDKS.values():
        assert (PROJECT / "deployments" / sdk.image_pins).exists()
        assert (PROJECT / "deployments" / sdk.job_requirements).exists()
        assert f"torch-xla=={sdk.torch_xla}." in (PROJECT / "deployments" / sdk.image_pins).read_text()
    # The release check reads torch-xla's metadata only
    monkeypatch.setattr(xla, "torch_xla_release", lambda: "2.9")
    monkeypatch.setattr(xla, "environment_sdk", lambda: NEURON_SDKS["2.28.0"])
    xla.require_release(NEURON_SDKS["2.28.0"])
    with pytest.raises(ConfigError, match=r"neuron\.sdk=2\.24\.1 expects torch-xla 2\.7 .* set neuron\.sdk=2\.28\.0"):
        xla.require_release(NEURON_SDKS["2.24.1"])
    with pytest.raises(ConfigError, match=r"neuron\.sdk.*'2\.24\.1' or '2\.28\.0'"):
        load_config("tiny", {"neuron.sdk": "2.27.1"})


def test_the_neuron_environment_of_hlat_7b_and_70b() -> None:
    """HLAT's environment, flag-based precision included, on 2.24.1 (the last release with those flags)."""
    flags = {"neuron.sdk": "2.24.1"}
    seven = neuron_environment(load_config("hlat-7b", flags), "s3://b/run/compile-cache/neuron")
    assert seven == {
        **xla_precision_environment("bf16-sr"),
        **HLAT_7B_NEURON,
        "NEURON_COMPILE_CACHE_URL": "s3://b/run/compile-cache/neuron",
    }
    seventy = neuron_environment(load_config("hlat-70b", flags))
    assert seventy == {
        **xla_precision_environment("bf16-mixed"),
        **HLAT_7B_NEURON,
        "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": "31",
        "NEURON_EXPERIMENTAL_COMPRESS_RG": "1",
        "TORCH_DIST_INIT_BARRIER": "0",
        "XLA_DISABLE_FUNCTIONALIZATION": "0",  # ZeRO-1, as NxD's 70B scripts and NxDT set it
    }
    fp32 = neuron_environment(load_config("hlat-7b", {**flags, "precision.mode": "fp32"}))
    assert fp32["NEURON_CC_FLAGS"] == HLAT_7B_NEURON["NEURON_CC_FLAGS"] + " --auto-cast=none"
    told = load_config("hlat-7b", {**flags, "precision.mode": "fp32", "neuron.compiler_flags": "--auto-cast=matmult"})
    assert neuron_environment(told)["NEURON_CC_FLAGS"] == "--auto-cast=matmult"  # a choice made is kept
    for name in ("pythia-6.9b", "neox-20b"):  # HLAT 7B's settings
        assert neuron_environment(load_config(name, flags)) == {
            **xla_precision_environment("bf16-sr"),
            **HLAT_7B_NEURON,
        }


BASE_CC = HLAT_7B_NEURON["NEURON_CC_FLAGS"]
ACCUMULATE = "--enable-mixed-precision-accumulation"


@pytest.mark.parametrize(
    ("precision", "sdk", "cc_flags", "precision_env"),
    [
        # 2.24.1: HLAT's precision flags and HLAT's compiler flags; fp32 turns neuronx-cc's BF16 matmuls off.
        ("fp32", "2.24.1", f"{BASE_CC} --auto-cast=none", {"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0", "SR": "0"}),
        ("bf16-mixed", "2.24.1", BASE_CC, {"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "1", "SR": "0"}),
        ("bf16-sr", "2.24.1", BASE_CC, {"XLA_USE_BF16": "1", "XLA_DOWNCAST_BF16": "0", "SR": "1"}),
        # 2.28.0: no flags; autocast needs the compiler's own cast off (Neuron's migration guide, NxDT `autocast`),
        # a BF16 model accumulates in FP32 (NxDT `bf16SR`).
        ("fp32", "2.28.0", f"{BASE_CC} --auto-cast=none", {"SR": "0"}),
        ("bf16-mixed", "2.28.0", f"{BASE_CC} {ACCUMULATE} --auto-cast=none", {"SR": "0"}),
        ("bf16-sr", "2.28.0", f"{BASE_CC} {ACCUMULATE}", {"SR": "1"}),
    ],
)
def test_the_compiler_and_precision_environment_of_every_precision_and_sdk(
    precision: str, sdk: str, cc_flags: str, precision_env: dict[str, str]
) -> None:
    env = neuron_environment(load_config("hlat-7b", {"precision.mode": precision, "neuron.sdk": sdk}))
    assert env["NEURON_CC_FLAGS"] == cc_flags
    expected = {k.replace("SR", "NEURON_RT_STOCHASTIC_ROUNDING_EN"): v for k, v in precision_env.items()}
    assert {k: env[k] for k in env if k.startswith("XLA_") or k == "NEURON_RT_STOCHASTIC_ROUNDING_EN"} == expected


@pytest.mark.parametrize("sdk", ["2.24.1", "2.28.0"])
@pytest.mark.parametrize(
    ("user_flags", "expected"),
    [
        ("--model-type transformer --auto-cast matmult", "--model-type transformer --auto-cast matmult {accumulate}"),
        (
            "--auto-cast=all --enable-mixed-precision-accumulation",
            "--auto-cast=all --enable-mixed-precision-accumulation",
        ),
        ("--auto-cast-type=fp16", "--auto-cast-type=fp16 {accumulate} {no_cast}"),  # not a choice of --auto-cast
        ("", "{accumulate} {no_cast}"),
    ],
)
def test_a_users_own_compiler_choices_are_kept(sdk: str, user_flags: str, expected: str) -> None:
    """bf16-mixed: what 2.28's autocast adds, unless the user's flags already choose it."""
    overrides = {"precision.mode": "bf16-mixed", "neuron.sdk": sdk, "neuron.compiler_flags": user_flags}
    added = {"accumulate": ACCUMULATE, "no_cast": "--auto-cast=none"} if sdk == "2.28.0" else {}
    want = " ".join(expected.format_map({"accumulate": "", "no_cast": "", **added}).split())
    assert neuron_environment(load_config("hlat-7b", overrides))["NEURON_CC_FLAGS"] == want


def test_neuron_settings_switch_off_and_neuron_env_overrides_last() -> None:
    cfg = load_config(
        "hlat-7b",
        {
            "neuron.fuse_softmax": False,
            "neuron.malloc_arena_max": None,
            "neuron.efa": False,
            "neuron.efa_fork_safe": False,
            "neuron.env": {"NEURON_RT_EXEC_TIMEOUT": "9000", "XLA_USE_BF16": "0", "NEURON_RT_LOG_LEVEL": "INFO"},
        },
    )
    env = neuron_environment(cfg)
    assert not {"NEURON_FUSE_SOFTMAX", "MALLOC_ARENA_MAX", "FI_PROVIDER", "FI_EFA_FORK_SAFE"} & set(env)
    assert (env["NEURON_RT_EXEC_TIMEOUT"], env["XLA_USE_BF16"], env["NEURON_RT_LOG_LEVEL"]) == ("9000", "0", "INFO")


def test_the_xla_cpu_rehearsal_gets_the_precision_flags_and_no_neuron_runtime() -> None:
    overrides = {
        "training.device": "xla",
        "precision.mode": "bf16-sr",
        "neuron.env": {"NEURON_RT_LOG_LEVEL": "INFO"},
        "neuron.sdk": "2.24.1",
    }
    cfg = load_config("tiny", overrides)
    assert xla_job_environment(cfg, compile_cache="/tmp/cache") == {
        **xla_precision_environment("bf16-sr"),
        "PJRT_DEVICE": "CPU",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    }


def test_parallel_settings_of_the_hlat_presets() -> None:
    s7 = parallel_settings(load_config("hlat-7b"))
    assert (s7["tensor_parallel_size"], s7["pipeline_parallel_size"], s7["sequence_parallel"]) == (8, 1, True)
    assert s7["optimizer_config"] == {"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 1.0}
    assert not s7["mixed_precision_config"]["use_master_weights"]
    s70 = parallel_settings(load_config("hlat-70b"))
    assert (s70["tensor_parallel_size"], s70["pipeline_parallel_size"]) == (32, 8)
    assert s70["optimizer_config"]["zero_one_enabled"]
    # HLAT 70B: ZeRO-1 keeps FP32 master weights under bf16-mixed.
    assert s70["mixed_precision_config"]["use_master_weights"] and s70["mixed_precision_config"]["use_fp32_grad_acc"]


def test_the_checkpoint_shards_of_a_split_model() -> None:
    assert shard_name(3, 1) == "tp03-pp01"
    assert shard_names(ParallelDims(2, 2)) == ["tp00-pp00", "tp01-pp00", "tp00-pp01", "tp01-pp01"]


def test_clear_errors_without_neuronx_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NXD_CPU_MODE", raising=False)
    with pytest.raises(NeuronUnavailable, match="exists only in the AWS Neuron training container"):
        require_nxd()
    cfg = load_config("tiny", {"parallelism.tensor": 2, "job.processes_per_node": 2})
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(NeuronUnavailable, match=r"set parallelism\.tensor=1"):
        _model_parallel(world, cfg)
    assert _model_parallel(world, load_config("tiny")) is world  # nothing split: nothing needed
