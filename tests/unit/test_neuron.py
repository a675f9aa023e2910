"""Trainium support checked where it can be here: environment, config translation, the tensor-parallel plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training.config import ModelConfig
from training.devices import neuron_available, neuron_environment
from training.distributed import World
from training.model import Transformer
from training.neuron import NeuronUnavailable, parallel_settings, require_neuron, tensor_parallel_plan
from training.parallelize import parallelize
from training.presets import load_config

pytestmark = pytest.mark.skipif(neuron_available(), reason="checks the behaviour outside a Neuron container")


def test_precision_environment() -> None:
    assert neuron_environment("bf16-sr") == {"XLA_USE_BF16": "1", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"}
    assert neuron_environment("bf16-mixed", "s3://b/run/compile-cache") == {
        "NEURON_COMPILE_CACHE_URL": "s3://b/run/compile-cache"
    }
    assert neuron_environment("fp32")["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "0"


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
