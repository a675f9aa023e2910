"""Model families as registered units: a toy family added by docs/models.md's recipe alone works through the
registries, and `arch` dispatch lives only in the families' modules and the registries."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from hlat.core import models as core_models
from hlat.core.config import ConfigError, ModelConfig, validate_config
from hlat.core.init_from import InitFromError, model_fields
from hlat.core.models.base import HfConfigRefused, ModelFamily, ModelShape, require
from hlat.core.models.job import job_model
from hlat.training import models as training_models
from hlat.training.checkpoint.hf_export import from_hf_state_dict, to_hf_state_dict
from hlat.training.model import Transformer
from hlat.training.models.base import DenseParameter, FamilyModules, Layers
from hlat.training.models.llama import RMSNorm
from hlat.training.parallel.tensor_slices import consolidate, dense_parameters, shard
from tests.layout import ROOT, project_modules

# -- the toy family: step 1 of the recipe, its core module --------------------------------------------------------


class Toy(ModelFamily):
    """Pre-norm RMSNorm blocks with a two-matrix squared-ReLU MLP; no biases, no partial rotary."""

    name = "toy"
    hf_architecture = "ToyForCausalLM"
    hf_model_type = "toy"
    hf_config_class = "PretrainedConfig"
    special_ids = (1, 2)

    def check(self, cfg: ModelShape) -> None:
        if cfg.rotary_fraction != 1.0:
            raise ValueError(f"rotary_fraction={cfg.rotary_fraction}: arch=toy rotates the whole head")

    def block_params(self, cfg: ModelShape) -> int:
        d, f, kv_dim = cfg.d_model, cfg.ffn_hidden, cfg.kv_heads * cfg.head_dim
        return 2 * d * d + 2 * d * kv_dim + 2 * d * f + 2 * d

    def final_norm_params(self, cfg: ModelShape) -> int:
        return cfg.d_model

    def fields_from_hf(self, hf: Mapping[str, Any], rope: Mapping[str, Any]) -> dict[str, Any]:
        require(hf, hidden_act="relu2")
        kv = hf.get("num_key_value_heads")
        return {
            "n_kv_heads": None if kv in (None, hf["num_attention_heads"]) else int(kv),
            "norm_eps": float(hf["rms_norm_eps"]),
            "rotary_fraction": 1.0,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }

    def hf_config(self, cfg: ModelShape, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
        return {
            "architectures": [self.hf_architecture],
            "model_type": self.hf_model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_hidden,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads,
            "hidden_act": "relu2",
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
        }


# -- step 2: its training module ---------------------------------------------------------------------------------


class ReluSquaredMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: Layers) -> None:
        super().__init__()
        self.up = parallel.linear("column", cfg.d_model, cfg.ffn_hidden)
        self.down = parallel.linear("row", cfg.ffn_hidden, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(torch.relu(self.up(x)) ** 2)


class ToyModules(FamilyModules):
    core = Toy()
    norm_class = RMSNorm
    hf_names = (
        ("embed.weight", "toy.embed.weight"),
        ("layers.{i}.attn_norm.weight", "toy.layers.{i}.norm1.weight"),
        ("layers.{i}.attn.q_proj.weight", "toy.layers.{i}.q.weight"),
        ("layers.{i}.attn.k_proj.weight", "toy.layers.{i}.k.weight"),
        ("layers.{i}.attn.v_proj.weight", "toy.layers.{i}.v.weight"),
        ("layers.{i}.attn.o_proj.weight", "toy.layers.{i}.o.weight"),
        ("layers.{i}.mlp_norm.weight", "toy.layers.{i}.norm2.weight"),
        ("layers.{i}.mlp.up.weight", "toy.layers.{i}.up.weight"),
        ("layers.{i}.mlp.down.weight", "toy.layers.{i}.down.weight"),
        ("norm.weight", "toy.norm.weight"),
        ("output.weight", "toy.head.weight"),
    )
    hf_prefix = "toy."

    def norm(self, cfg: ModelConfig, parallel: Layers) -> nn.Module:
        norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        parallel.norm(norm.weight)
        return norm

    def mlp(self, cfg: ModelConfig, parallel: Layers) -> nn.Module:
        return ReluSquaredMLP(cfg, parallel)

    def norm_parameters(self, cfg: ModelConfig, name: str) -> list[DenseParameter]:
        return [DenseParameter(f"{name}.weight", (cfg.d_model,), "ones", "replicated")]

    def block_parameters(self, cfg: ModelConfig, prefix: str) -> list[DenseParameter]:
        d, f, p = cfg.d_model, cfg.ffn_hidden, prefix
        kv_dim = cfg.kv_heads * cfg.head_dim
        return [
            *self.norm_parameters(cfg, f"{p}.attn_norm"),
            DenseParameter(f"{p}.attn.q_proj.weight", (d, d), "normal", "q"),
            DenseParameter(f"{p}.attn.k_proj.weight", (kv_dim, d), "normal", "kv"),
            DenseParameter(f"{p}.attn.v_proj.weight", (kv_dim, d), "normal", "kv"),
            DenseParameter(f"{p}.attn.o_proj.weight", (d, d), "output", "o"),
            *self.norm_parameters(cfg, f"{p}.mlp_norm"),
            DenseParameter(f"{p}.mlp.up.weight", (f, d), "normal", "column"),
            DenseParameter(f"{p}.mlp.down.weight", (d, f), "output", "row"),
        ]

    def hf_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        rename = {ours: hf for ours, hf in self.hf_names}
        shapes = {}
        for param in dense_parameters(cfg):
            pattern = re.sub(r"layers\.\d+\.", "layers.{i}.", param.name)
            index = re.findall(r"layers\.(\d+)\.", param.name)
            shapes[rename[pattern].format(i=index[0] if index else "")] = param.shape
        return shapes


# -- step 3: registered (here for the test only) -----------------------------------------------------------------


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> ToyModules:
    modules = ToyModules()
    monkeypatch.setitem(core_models.FAMILIES, "toy", modules.core)
    monkeypatch.setitem(training_models.FAMILIES, "toy", modules)
    return modules


TOY = {"arch": "toy", "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64}
TOY |= {"vocab_size": 300, "max_seq_len": 64}


def test_an_unregistered_family_is_refused_naming_the_families() -> None:
    with pytest.raises(ValueError, match=r"model.arch='toy' is no model family; the families are llama, gpt_neox"):
        ModelConfig(**TOY)


def test_the_toy_family_config_is_validated_by_its_own_check_and_the_shared_ones(toy: ToyModules) -> None:
    assert ModelConfig(**TOY).arch == "toy"
    with pytest.raises(ValueError, match="arch=toy rotates the whole head"):
        ModelConfig(**TOY | {"rotary_fraction": 0.5})
    with pytest.raises(ValueError, match="must divide n_heads"):  # the shared checks still apply
        ModelConfig(**TOY | {"n_kv_heads": 3})
    with pytest.raises(ConfigError, match="toy rotates the whole head"):  # and through the whole config
        validate_config({"model": TOY | {"rotary_fraction": 0.5}})


def test_the_toy_parameter_count_and_flops_are_its_models(toy: ToyModules) -> None:
    cfg = ModelConfig(**TOY)
    model = Transformer(cfg, device="cpu")
    assert cfg.num_params() == model.num_params() == sum(math.prod(p.shape) for p in dense_parameters(cfg))
    assert [p.name for p in dense_parameters(cfg)] == list(model.state_dict())
    assert cfg.flops_per_token(64) == cfg.n_layers * (6 * cfg.block_params() + 12 * 32 * 64) + 6 * (300 * 32 + 32)


def test_the_toy_model_runs_forward_and_backward_and_splits_over_tensor_ranks(toy: ToyModules) -> None:
    cfg = ModelConfig(**TOY)
    model = Transformer(cfg, device="cpu")
    model.init_weights(seed=5)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 16, 300) and torch.isfinite(logits).all()
    loss = model(tokens[:, :-1], targets=tokens[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert isinstance(model.layers[0].mlp, ReluSquaredMLP) and not model.layers[0].parallel_residual
    # TP slicing follows the kinds the family gave: every rank's slices put back are the dense tensors.
    dense = model.state_dict()
    ranks = [{p.name: shard(p, dense[p.name], rank, 2, cfg) for p in dense_parameters(cfg)} for rank in range(2)]
    assert all(torch.equal(t, dense[name]) for name, t in consolidate(ranks, cfg).items())


def test_the_toy_hf_config_and_weights_round_trip_through_the_registries(toy: ToyModules) -> None:
    cfg = ModelConfig(**TOY)
    config = training_models.hf_config(cfg)  # the family's config class, here transformers' PretrainedConfig
    hf = config.to_dict()
    assert hf["architectures"] == ["ToyForCausalLM"] and (hf["bos_token_id"], hf["eos_token_id"]) == (1, 2)
    fields = model_fields(hf, "org/toy")
    assert ModelConfig(**fields) == cfg
    with pytest.raises(InitFromError, match=r"model.init_from='org/toy': config.json hidden_act='gelu'"):
        model_fields(hf | {"hidden_act": "gelu"}, "org/toy")
    with pytest.raises(HfConfigRefused, match="hlat imports LlamaForCausalLM and GPTNeoXForCausalLM and "):
        core_models.hf_family({"architectures": ["Other"]})

    model = Transformer(cfg, device="cpu")
    model.init_weights(seed=6)
    exported = to_hf_state_dict(model)
    assert {n: tuple(t.shape) for n, t in exported.items()} == toy.hf_shapes(cfg)
    back = from_hf_state_dict(exported, cfg)
    assert all(torch.equal(back[name], t) for name, t in model.state_dict().items())


# -- which model a job builds -------------------------------------------------------------------------------------

NEOX_JSON = {"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 500}
NEOX_JSON |= {"num_attention_heads": 4, "intermediate_size": 256, "max_position_embeddings": 128, "rotary_pct": 0.25}


def test_the_job_model_follows_the_checkpoint_then_the_tokenizer_and_checks_the_embedding() -> None:
    cfg = validate_config(
        {"model": {"init_from": "org/x", "vocab_multiple": 64}, "tokenizer": {"pretrained": "org/x"}}
        | {"training": {"seq_len": 128}}
    )
    built, lines = job_model(cfg, NEOX_JSON, 480)
    m = built.model
    assert (m.arch, m.n_layers, m.d_model, m.rotary_fraction, m.vocab_size, m.padded_vocab_size) == (
        "gpt_neox", 3, 64, 0.25, 480, 512,
    )  # fmt: skip
    assert len(lines) == 2 and lines[0].startswith("model: arch llama -> gpt_neox, n_layers 2 -> 3")
    assert lines[1].startswith("model.vocab_size 4096 -> 480") and lines[1].endswith("(tokenizer.pretrained=org/x)")
    # Before the tokenizer is known (the flow ahead of its stage): the checkpoint's part only.
    assert job_model(cfg, NEOX_JSON, None)[1] == lines[:1]
    # Nothing imported yet: the config as written.
    assert job_model(cfg, None, None) == (cfg, [])
    with pytest.raises(InitFromError, match="its embedding has 600 rows, more than the 512"):
        job_model(cfg, NEOX_JSON | {"vocab_size": 600}, 480)


# -- where `arch` is dispatched ----------------------------------------------------------------------------------

ARCH_BRANCH = re.compile(r"arch ==|\.arch\b")
FAMILY_HOMES = {"core/models", "training/models"}


def test_arch_is_dispatched_only_in_the_families_modules_and_the_registries() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text.strip()}"
        for path in project_modules().values()
        if str(path.relative_to(ROOT).parent) not in FAMILY_HOMES
        for line, text in enumerate(path.read_text().splitlines(), 1)
        if ARCH_BRANCH.search(text)
    ]
    assert not found, "\n".join(found)
