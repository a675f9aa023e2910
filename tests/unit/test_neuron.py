"""Trainium support checked where it can be here: environment, config translation, the tensor-parallel plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training.config import ModelConfig
from training.devices import neuron_available, neuron_environment, xla_job_environment, xla_precision_environment
from training.distributed import World
from training.model import Transformer
from training.neuron import NeuronUnavailable, parallel_settings, require_neuron, tensor_parallel_plan
from training.parallelize import parallelize
from training.presets import load_config

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


def test_the_neuron_environment_of_hlat_7b_and_70b() -> None:
    seven = neuron_environment(load_config("hlat-7b"), "s3://b/run/compile-cache/neuron")
    assert seven == {
        **xla_precision_environment("bf16-sr"),
        **HLAT_7B_NEURON,
        "NEURON_COMPILE_CACHE_URL": "s3://b/run/compile-cache/neuron",
    }
    seventy = neuron_environment(load_config("hlat-70b"))
    assert seventy == {
        **xla_precision_environment("bf16-mixed"),
        **HLAT_7B_NEURON,
        "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": "31",
        "NEURON_EXPERIMENTAL_COMPRESS_RG": "1",
        "TORCH_DIST_INIT_BARRIER": "0",
    }
    for name in ("pythia-6.9b", "neox-20b"):  # HLAT 7B's settings
        assert neuron_environment(load_config(name)) == {**xla_precision_environment("bf16-sr"), **HLAT_7B_NEURON}


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
    cfg = load_config("tiny", {"training.device": "xla", "precision.mode": "bf16-sr", "neuron.env": {"A": "1"}})
    assert xla_job_environment(cfg, compile_cache="/tmp/cache") == {
        **xla_precision_environment("bf16-sr"),
        "PJRT_DEVICE": "CPU",
    }


def test_parallel_settings_of_the_hlat_presets() -> None:
    s7 = parallel_settings(load_config("hlat-7b"))
    assert s7["initialize_model_parallel"] == {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 1}
    assert (s7["sequence_parallel_enabled"], s7["zero1"], s7["data_parallel_size"], s7["kv_replication"]) == (
        True,
        False,
        256,
        1,
    )
    s70 = parallel_settings(load_config("hlat-70b"))
    assert s70["initialize_model_parallel"] == {"tensor_model_parallel_size": 32, "pipeline_model_parallel_size": 8}
    assert (s70["zero1"], s70["data_parallel_size"], s70["kv_replication"]) == (True, 32, 4)


def test_tensor_parallel_plan_covers_every_linear_layer() -> None:
    model = Transformer(ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=176, vocab_size=300))
    plan = tensor_parallel_plan(model)
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(plan) - {"embed"} == linears
    assert (
        plan["embed"] == "embedding" and plan["layers.1.attn.o_proj"] == "row" and plan["layers.0.mlp.w1"] == "column"
    )


def test_clear_errors_outside_a_neuron_container() -> None:
    with pytest.raises(NeuronUnavailable, match="exist only in the AWS Neuron training container"):
        require_neuron()
    cfg = load_config("tiny", {"parallelism.tensor": 2, "job.processes_per_node": 2})
    model = Transformer(cfg.model)
    world = World(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(NeuronUnavailable, match=r"set parallelism\.tensor=1"):
        parallelize(model, cfg, world)
