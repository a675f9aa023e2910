"""The GPT-NeoX architecture (model.arch=gpt_neox) and the padded vocabulary (model.vocab_multiple): logits equal to
transformers' GPTNeoXForCausalLM on the same weights, partial rotary exactly HF's, document masking, activation
checkpointing, compile, training, export (tensors, config, tokenizer ids) and what is refused."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.config import ConfigError, ModelConfig
from hlat.core.presets import load_config
from hlat.training.checkpoint.hf_export import (
    export_hf,
    from_hf_state_dict,
    special_token_ids,
    to_hf_state_dict,
)
from hlat.training.model import Transformer, apply_rotary, rope_tables

os.environ["HF_HUB_OFFLINE"] = "1"

# A tiny GPT-NeoX: head_dim 16, a quarter of it (4 dims) rotated, as Pythia's rotary_pct.
NEOX: dict[str, Any] = {
    "arch": "gpt_neox",
    "n_layers": 2,
    "d_model": 64,
    "n_heads": 4,
    "ffn_hidden": 256,
    "vocab_size": 1000,
    "rotary_fraction": 0.25,
    "max_seq_len": 64,
}


def hf_neox(seed: int = 0) -> Any:
    """A random `transformers.GPTNeoXForCausalLM` of NEOX's shape (biases and LayerNorms random too, so that
    every parameter's mapping matters)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        rotary_pct=0.25,
        hidden_act="gelu",
        use_parallel_residual=True,
        attention_bias=True,
        max_position_embeddings=64,
        layer_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def ours_from(hf: Any, **overrides: Any) -> Transformer:
    cfg = ModelConfig(**{**NEOX, **overrides})
    model = Transformer(cfg)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg), strict=True)
    return model.eval()


def make_model(seed: int = 0, **overrides: Any) -> Transformer:
    model = Transformer(ModelConfig(**{**NEOX, **overrides}))
    model.init_weights(seed)
    return model.eval()


def tokens(b: int, t: int, vocab: int = 1000, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_transformers_gpt_neox_and_the_mapping_goes_both_ways() -> None:
    hf = hf_neox()
    ours = ours_from(hf)
    x = tokens(2, 64)
    with torch.no_grad():
        diff = (ours(x) - hf(x).logits).abs().max().item()
    assert diff < 1e-5  # measured 4.8e-7 on logits of magnitude ~2
    back = to_hf_state_dict(ours)
    back["lm_head.weight"] = back.pop("embed_out.weight")  # transformers 5's name; files keep GPT-NeoX's embed_out
    theirs = hf.state_dict()
    assert set(back) == set(theirs) and all(torch.equal(back[k], theirs[k]) for k in theirs)


def test_partial_rotary_is_exactly_hf_gpt_neox() -> None:
    """Full-width tables with zero frequencies, turned over runs of the rotated width, give HF's rotation of the
    first r dims (pairs (i, i + r/2)) and leave the rest bit for bit as they were."""
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    hf = hf_neox()
    cfg = ModelConfig(**NEOX)
    cos, sin = rope_tables(cfg)  # (64, 16)
    assert torch.equal(cos[:, 4:], torch.ones(64, 12)) and torch.equal(sin[:, 4:], torch.zeros(64, 12))
    hf_cos, hf_sin = GPTNeoXRotaryEmbedding(hf.config)(torch.zeros(1), torch.arange(64)[None])  # (1, T, 4)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 64, 16, generator=gen), torch.randn(2, 4, 64, 16, generator=gen)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    ours_q, ours_k = apply_rotary(q, cos, sin, block=4), apply_rotary(k, cos, sin, block=4)
    torch.testing.assert_close(ours_q, hf_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_k, hf_k, rtol=0, atol=1e-6)
    assert torch.equal(ours_q[..., 4:], q[..., 4:])


def test_document_masking_equals_running_each_document_alone() -> None:
    model = make_model()
    doc1, doc2 = tokens(1, 9, seed=2), tokens(1, 14, seed=3)
    packed = torch.cat([doc1, doc2], dim=1)
    out = model(packed, doc_ids=torch.tensor([[0] * 9 + [1] * 14]))
    torch.testing.assert_close(out[:, :9], model(doc1), rtol=0, atol=1e-5)
    torch.testing.assert_close(out[:, 9:], model(doc2), rtol=0, atol=1e-5)
    assert not torch.allclose(model(packed)[:, 9:], model(doc2), atol=1e-3)


@pytest.mark.parametrize("overrides", [{}, {"vocab_multiple": 64}, {"n_layers": 3, "ffn_hidden": 96}])
def test_num_params_and_state_match_the_config(overrides: dict[str, Any]) -> None:
    model = make_model(**overrides)
    assert model.num_params() == model.cfg.num_params()
    assert model.layers[0].attn.q_proj.bias is not None and model.layers[0].mlp_norm.bias is not None
    assert torch.equal(model.layers[0].attn.o_proj.bias, torch.zeros(64))  # biases start at zero
    assert torch.equal(model.norm.weight, torch.ones(64)) and torch.equal(model.norm.bias, torch.zeros(64))
    d, f = model.cfg.d_model, model.cfg.ffn_hidden
    # Per block: Q, K, V, O with biases; the 2-matrix MLP with biases; two LayerNorms with biases.
    assert model.cfg.block_params() == 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
    head = 6 * (model.cfg.padded_vocab_size * d + 2 * d)
    assert model.cfg.flops_per_token(32) == model.cfg.n_layers * (6 * model.cfg.block_params() + 12 * d * 32) + head


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"n_kv_heads": 2}, "n_kv_heads=2"), ({"tie_embeddings": True}, "tie_embeddings"),
     ({"rotary_fraction": 0.375}, "rotary_fraction=0.375")],
)  # fmt: skip
def test_the_config_refuses_what_gpt_neox_does_not_have(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**NEOX, **overrides})
    with pytest.raises(ConfigError, match=field):
        load_config("tiny", {"model.arch": "gpt_neox", **{f"model.{k}": v for k, v in overrides.items()}})


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_gives_the_eager_loss_and_gradients(mode: str) -> None:
    from hlat.training.parallel.distributed import World
    from hlat.training.parallel.parallelize import parallelize

    overrides = {f"model.{k}": v for k, v in NEOX.items()} | {"training.seq_len": 32}
    cfg = load_config("tiny", overrides | {"parallelism.activation_checkpointing": mode})
    reference, model = make_model(seed=3).train(), make_model(seed=3).train()
    parallelize(model, cfg, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    x = tokens(2, 32, seed=4)
    loss, expected = model(x, targets=x), reference(x, targets=x)
    loss.backward()
    expected.backward()
    assert loss.item() == expected.item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.slow
def test_compiled_blocks_give_the_eager_loss() -> None:
    from hlat.training.parallel.parallelize import compile_blocks

    eager, compiled = make_model(seed=6), make_model(seed=6)
    torch._dynamo.reset()
    compile_blocks(compiled)
    x = tokens(2, 32, seed=7)
    doc_ids = torch.tensor([[0] * 20 + [1] * 12, [0] * 32])
    torch.testing.assert_close(compiled(x, targets=x), eager(x, targets=x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled(x, doc_ids, targets=x), eager(x, doc_ids, targets=x), rtol=1e-5, atol=1e-5)


def test_a_short_cpu_training_lowers_the_loss() -> None:
    model = make_model(seed=1).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = tokens(4, 32, vocab=50, seed=5)  # a few tokens, so the model can learn them in a few steps
    losses = []
    for _ in range(20):
        loss = model(x, targets=x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


# -- the padded vocabulary -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_a_padded_vocabulary_takes_no_probability_and_exports_the_tokenizers_rows(arch: str, tmp_path: Path) -> None:
    base = {**NEOX, "arch": arch} if arch == "gpt_neox" else {**NEOX, "arch": arch, "rotary_fraction": 1.0}
    padded = Transformer(ModelConfig(**base, vocab_multiple=64))
    padded.init_weights(5)
    assert padded.embed.weight.shape[0] == padded.output.weight.shape[0] == 1024
    plain = Transformer(ModelConfig(**base))
    plain.load_state_dict({k: v[:1000] if k in ("embed.weight", "output.weight") else v
                           for k, v in padded.state_dict().items()})  # fmt: skip
    x = tokens(2, 40)
    logits = padded(x)
    assert logits.shape[-1] == 1024 and torch.isneginf(logits[..., 1000:]).all()
    torch.testing.assert_close(logits[..., :1000], plain(x), rtol=0, atol=1e-6)
    loss, expected = padded(x, targets=x), plain(x, targets=x)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    loss.backward()
    assert torch.equal(padded.output.weight.grad[1000:], torch.zeros(24, 64))  # the padded rows learn nothing
    hf = to_hf_state_dict(padded)
    rows = {k: v.shape[0] for k, v in hf.items() if "embed" in k or "lm_head" in k}
    assert set(rows.values()) == {1000} and len(rows) == 2
    back = from_hf_state_dict(hf, padded.cfg)  # and back: zero rows pad the tokenizer's vocabulary again
    assert back["embed.weight"].shape == (1024, 64) and not back["embed.weight"][1000:].any()


def test_without_a_multiple_the_vocabulary_is_the_tokenizers() -> None:
    model = make_model(arch="llama", rotary_fraction=1.0, vocab_size=1000)
    assert model.embed.weight.shape[0] == 1000 and model(tokens(1, 5)).shape[-1] == 1000


# -- export ----------------------------------------------------------------------------------------------------
def pretrained_tokenizer(folder: Path) -> Path:
    """A tokenizer in Hugging Face's format only (tokenizer.json, tokenizer_config.json, no sentencepiece model), as
    GPT-NeoX's is: its <|endoftext|> (BOS and EOS) is id 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<pad>": 1, **{chr(97 + i): 2 + i for i in range(26)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_export_loads_as_gpt_neox_for_causal_lm_with_our_logits(tmp_path: Path) -> None:
    from transformers import GPTNeoXForCausalLM

    model = make_model(seed=2, vocab_multiple=128)
    with torch.no_grad():  # non-trivial biases and norms, as after training
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0, 0.1).add_(1.0 if name.endswith("weight") else 0.0)
    tokenizer = pretrained_tokenizer(tmp_path / "tok")
    out = export_hf(model, model.cfg, tmp_path / "hf", tokenizer_dir=str(tokenizer))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPTNeoXForCausalLM"] and config["vocab_size"] == 1000
    assert config["rotary_pct"] == 0.25 and config["use_parallel_residual"] and not config["tie_word_embeddings"]
    assert config["layer_norm_eps"] == 1e-5 and (config["bos_token_id"], config["eos_token_id"]) == (0, 0)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    hf = GPTNeoXForCausalLM.from_pretrained(out).eval()
    x = tokens(2, 64)
    with torch.no_grad():
        diff = (model(x)[..., :1000] - hf(x).logits).abs().max().item()
    assert diff < 1e-5


def test_special_token_ids_come_from_the_tokenizers_files(tmp_path: Path) -> None:
    assert special_token_ids(pretrained_tokenizer(tmp_path / "neox")) == (0, 0)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    assert special_token_ids(tmp_path / "bare") == (None, None)  # named nowhere: not guessed
    (tmp_path / "bare" / "tokenizer.model").write_bytes(b"")  # a sentencepiece model of the tokenizer stage
    assert special_token_ids(tmp_path / "bare") == (1, 2)


# -- end to end ------------------------------------------------------------------------------------------------
NEOX_RUN = {
    "model.arch": "gpt_neox",
    "model.rotary_fraction": 0.25,  # 8 of the tiny model's 32 head dims, as Pythia's quarter
    "model.vocab_multiple": 96,  # the tests' 512-piece tokenizer padded to 576 rows
    "max_steps": 6,
    "checkpoint_every": 3,
    "eval_every": 3,
    "eval_batches": 1,
}


@pytest.mark.slow
def test_a_tiny_gpt_neox_run_trains_exports_and_transformers_gives_its_logits(prepared: Path, tmp_path: Path) -> None:
    """The tiny pipeline's training job with model.arch=gpt_neox, as the job backend launches it; then `hlat
    export`'s function, and transformers' GPTNeoXForCausalLM on the exported folder against the checkpoint's model."""
    from transformers import GPTNeoXForCausalLM

    from hlat.core.layout import locate_checkpoint
    from hlat.infra.inputs.tokenizer import export_hf_tokenizer
    from hlat.training.checkpoint.hf_export import export_checkpoint, load_checkpoint_model
    from tests.jobs import make_run, metrics, train

    run = make_run(prepared, tmp_path, "neox", **NEOX_RUN)
    code, log = train(run)
    assert code == 0, log
    losses = [m["loss"] for m in metrics(run) if "loss" in m]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    out, ref = export_checkpoint(str(run), tmp_path / "hf", build_tokenizer_json=export_hf_tokenizer)
    assert ref.step == 6
    ours, config = load_checkpoint_model(locate_checkpoint(str(run)))
    assert config.model.arch == "gpt_neox" and ours.embed.weight.shape[0] == 576
    hf = GPTNeoXForCausalLM.from_pretrained(out).eval()
    assert hf.config.vocab_size == 512
    x = tokens(2, 128, vocab=512, seed=9)
    with torch.no_grad():
        diff = (ours(x)[..., :512] - hf(x).logits).abs().max().item()
    assert diff < 1e-5, diff


@pytest.mark.slow
def test_an_fsdp2_gpt_neox_step_on_two_gloo_ranks_equals_one_process(prepared: Path, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from tests.integration.conftest import free_port
    from tests.integration.test_distributed import run_layout

    results = {}
    extra = {"parallelism.fsdp": True, "model.arch": "gpt_neox", "model.rotary_fraction": 0.25}
    for world_size in (1, 2):
        out = tmp_path / f"ws{world_size}.pt"
        args = (world_size, free_port(), str(prepared), str(out), extra)
        mp.start_processes(run_layout, args=args, nprocs=world_size, start_method="spawn")
        results[world_size] = torch.load(out, weights_only=True)
    one, two = results[1], results[2]
    assert two["sharded"] and "layers.0.mlp.fc_in.bias" in one["model"]
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-5)
    for name, tensor in one["model"].items():
        torch.testing.assert_close(two["model"][name], tensor, rtol=1e-5, atol=3e-6, msg=name)
