"""The transformer: shapes, init, causality, document masking, GQA, partial rotary, and HF Llama parity."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.config import ModelConfig
from hlat.core.models.llama import UNROTATED
from hlat.training.checkpoint.hf_export import export_hf, from_hf_state_dict, to_hf_state_dict
from hlat.training.model import Transformer, apply_rotary, rope_tables, rotate_half
from hlat.training.models.llama import hf_llama_config

os.environ["HF_HUB_OFFLINE"] = "1"

# Small enough to run in milliseconds; GQA on (4 query heads, 2 key/value heads).
SMALL: dict[str, Any] = {
    "n_layers": 2,
    "d_model": 64,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_hidden": 176,
    "vocab_size": 300,
    "max_seq_len": 64,
}


def make_model(seed: int = 0, **overrides: Any) -> Transformer:
    cfg = ModelConfig(**{**SMALL, **overrides})
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.init_weights()
    return model.eval()


def tokens(b: int, t: int, vocab: int = 300, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_dtype() -> None:
    model = make_model()
    logits = model(tokens(3, 17))
    assert logits.shape == (3, 17, 300) and logits.dtype == torch.float32
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(1, 65))


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": None}, {"tie_embeddings": True}, {"n_kv_heads": 1}])
def test_num_params_matches_config(overrides: dict[str, Any]) -> None:
    model = make_model(**overrides)
    assert model.num_params() == model.cfg.num_params()


def test_rope_tables_are_buffers_not_state() -> None:
    model = make_model()
    assert "rope_cos" not in model.state_dict() and "rope_sin" not in model.state_dict()
    assert model.rope_cos.shape == (64, 16)


def test_init_statistics() -> None:
    cfg = {"d_model": 128, "n_heads": 4, "n_kv_heads": None, "ffn_hidden": 512, "n_layers": 4, "vocab_size": 1024}
    model = make_model(**cfg, init_std=0.02)
    std = model.cfg.init_std
    for w in (
        model.embed.weight,
        model.output.weight,
        model.layers[0].mlp.w1.weight,
        model.layers[0].attn.o_proj.weight,
    ):
        assert w.mean().abs() < 1e-3
        assert w.std().item() == pytest.approx(std, rel=0.03)
    assert torch.equal(model.layers[1].attn_norm.weight, torch.ones(128))
    assert torch.equal(model.norm.weight, torch.ones(128))

    scaled = make_model(**cfg, init_std=0.02, scale_output_init=True)
    out_std = std / math.sqrt(2 * 4)
    for layer in scaled.layers:
        assert layer.attn.o_proj.weight.std().item() == pytest.approx(out_std, rel=0.03)
        assert layer.mlp.w2.weight.std().item() == pytest.approx(out_std, rel=0.03)
        assert layer.attn.q_proj.weight.std().item() == pytest.approx(std, rel=0.03)


def test_init_is_deterministic_under_seed() -> None:
    a, b, c = make_model(seed=7), make_model(seed=7), make_model(seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attn.q_proj.weight"], sc["layers.0.attn.q_proj.weight"])


def test_meta_device_construction_then_init() -> None:
    cfg = ModelConfig(**SMALL)
    meta = Transformer(cfg, device="meta")
    assert meta.embed.weight.is_meta
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    meta.init_weights()
    ref = make_model(seed=0)
    x = tokens(2, 9)
    assert torch.equal(meta.eval()(x), ref(x))

    tied = Transformer(ModelConfig(**SMALL, tie_embeddings=True), device="meta").to_empty(device="cpu")
    assert tied.output.weight is tied.embed.weight


def test_causality() -> None:
    model = make_model()
    x = tokens(2, 24)
    y = x.clone()
    y[:, 15] = (y[:, 15] + 1) % 300
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :15], b[:, :15], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def test_document_masking_equals_running_each_document_alone() -> None:
    model = make_model()
    doc1, doc2 = tokens(1, 7, seed=2), tokens(1, 11, seed=3)
    packed = torch.cat([doc1, doc2], dim=1)  # (1, 18)
    doc_ids = torch.tensor([[0] * 7 + [1] * 11])
    out = model(packed, doc_ids=doc_ids)
    torch.testing.assert_close(out[:, :7], model(doc1), rtol=0, atol=1e-5)
    # doc 2 sits at positions 7..17 here and 0..10 alone: RoPE depends only on relative positions.
    torch.testing.assert_close(out[:, 7:], model(doc2), rtol=0, atol=1e-5)
    assert not torch.allclose(model(packed)[:, 7:], model(doc2), atol=1e-3)
    # A single document through the mask path agrees with the is_causal fast path.
    torch.testing.assert_close(model(packed, doc_ids=torch.zeros_like(packed)), model(packed), rtol=0, atol=1e-5)


def test_flex_attention_document_mask_equals_the_dense_mask() -> None:
    """The FlexAttention path (`flex_document_mask`) computes what SDPA's dense mask does. On CPU, FlexAttention's
    unfused reference, forward only (it has no CPU backward); the CUDA test below checks the fused kernel, backward
    included."""
    dense, flex = make_model(seed=4), make_model(seed=4)
    flex.flex_document_mask = True
    x = tokens(2, 48, seed=5)
    doc_ids = torch.tensor([[0] * 5 + [1] * 30 + [2] * 13, [0] * 40 + [1] * 8])
    with torch.no_grad():
        torch.testing.assert_close(flex(x, doc_ids), dense(x, doc_ids), rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flex_attention_matches_the_dense_mask_on_cuda() -> None:
    """Compiled blocks with FlexAttention's fused kernel against eager SDPA with the dense mask, in float32: the
    loss and every gradient (on an H100 the gradients agreed to a relative 6.6e-7)."""
    from hlat.training.parallel.parallelize import compile_blocks

    cfg = ModelConfig(**{**SMALL, "d_model": 256, "n_heads": 8, "ffn_hidden": 688, "max_seq_len": 1024})
    torch.manual_seed(0)
    dense = Transformer(cfg, device="cuda")
    dense.init_weights(3)
    fused = Transformer(cfg, device="cuda")
    fused.load_state_dict(dense.state_dict())
    compile_blocks(fused)
    assert fused.flex_document_mask
    x = tokens(2, 1000).cuda()
    doc_ids = torch.zeros(2, 1000, dtype=torch.long)
    doc_ids[0, [90, 400, 777]] = 1
    doc_ids[1, [3, 500]] = 1
    doc_ids = doc_ids.cumsum(1).cuda()
    results = []
    for model in (dense, fused):
        loss = model(x, doc_ids, targets=x)
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (loss_d, grad_d), (loss_f, grad_f) = results
    assert abs(loss_f.item() - loss_d.item()) < 1e-4
    assert ((grad_f - grad_d).norm() / grad_d.norm()).item() < 1e-4


@pytest.mark.slow
def test_compile_blocks_keeps_names_and_traces_one_graph_for_every_block() -> None:
    from torch._dynamo.utils import counters

    from hlat.training.parallel.parallelize import compile_blocks

    eager, compiled = make_model(seed=6, n_layers=3), make_model(seed=6, n_layers=3)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(compiled)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert not compiled.flex_document_mask  # CPU: SDPA's dense mask (FlexAttention is fused on CUDA only)
    x = tokens(2, 32, seed=7)
    torch.testing.assert_close(compiled(x, targets=x), eager(x, targets=x), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_checkpointing_recomputes_what_hlat_recomputes(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """'selective' re-runs only the core attention and SwiGLU's gated activation in backward (HLAT's scripts): no
    projection (under TP and SP: no collective) runs twice; 'full' re-runs every block. Gradients are unchanged."""
    from hlat.core.presets import load_config
    from hlat.training import model as model_module
    from hlat.training.models import llama as llama_module
    from hlat.training.parallel.distributed import World
    from hlat.training.parallel.parallelize import parallelize

    calls: dict[str, int] = {}

    def counting(name: str, forward: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return forward(*args, **kwargs)

        return counted

    # Counted in the classes (recomputation calls a module's forward itself, which no forward hook sees).
    for cls, name in ((model_module.CoreAttention, "core"), (llama_module.GatedSiLU, "act")):
        monkeypatch.setattr(cls, "forward", counting(name, cls.forward))
    overrides = {f"model.{k}": v for k, v in SMALL.items()} | {"training.seq_len": 32}
    cfg = load_config("tiny", overrides | {"parallelism.activation_checkpointing": mode})
    reference, model = make_model(seed=3).train(), make_model(seed=3).train()
    parallelize(model, cfg, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    for name in ("q_proj", "w1", "attn_norm"):
        module = model.layers[0].get_submodule({"q_proj": "attn.q_proj", "w1": "mlp.w1"}.get(name, name))
        module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    x = tokens(2, 32, seed=4)
    model(x, targets=x).backward()
    calls_of_model = dict(calls)
    reference(x, targets=x).backward()
    again, once = {"none": (1, 1), "selective": (2, 1), "full": (2, 2)}[mode]  # core and act; projections and norms
    layers = SMALL["n_layers"]
    assert calls_of_model == {"core": again * layers, "act": again * layers, "q_proj": once, "w1": once,
                              "attn_norm": once}  # fmt: skip
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    gqa = make_model(n_kv_heads=2)
    mha = make_model(n_kv_heads=None)
    state = gqa.state_dict()
    head_dim, rep = gqa.cfg.head_dim, gqa.cfg.n_heads // gqa.cfg.kv_heads
    for i in range(gqa.cfg.n_layers):
        for name in ("k_proj", "v_proj"):
            key = f"layers.{i}.attn.{name}.weight"
            w = state[key].view(gqa.cfg.kv_heads, head_dim, -1)  # (n_kv, head_dim, d_model)
            # Query head h reads key/value head h // rep: consecutive query heads share one.
            state[key] = w.repeat_interleave(rep, dim=0).reshape(-1, w.shape[-1])  # (n_heads*head_dim, d_model)
    mha.load_state_dict(state)
    x = tokens(2, 20)
    torch.testing.assert_close(gqa(x), mha(x), rtol=0, atol=1e-5)


def test_partial_rotary_leaves_the_rest_unrotated() -> None:
    cfg = ModelConfig(**{**SMALL, "rotary_fraction": 0.25})  # head_dim 16: 4 rotated dims, 12 not
    cos, sin = rope_tables(cfg)  # (64, 16)
    rotated = (sin != 0).any(dim=0)  # (16,)
    assert rotated.tolist() == [i in (0, 1, 8, 9) for i in range(16)]
    assert torch.equal(cos[:, ~rotated], torch.ones(64, 12)) and torch.equal(sin[:, ~rotated], torch.zeros(64, 12))

    # Against an explicit GPT-NeoX partial rotary on the permuted head: dims (0, 1, 8, 9) are its rotated
    # (0, 1, 2, 3), paired (0, 2), (1, 3), frequencies theta^(-2i/r) for r = 4.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, 16, generator=gen)  # (heads, T, head_dim)
    ours = apply_rotary(x, cos, sin)
    perm = [0, 1, 8, 9, *[i for i in range(16) if i not in (0, 1, 8, 9)]]
    xp = x[..., perm]
    r = 4
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = torch.outer(torch.arange(64, dtype=torch.float64), inv_freq)
    ang = torch.cat([ang, ang], dim=-1).float()  # (T, r)
    neox = torch.cat([xp[..., :r] * ang.cos() + rotate_half(xp[..., :r]) * ang.sin(), xp[..., r:]], dim=-1)
    torch.testing.assert_close(ours[..., perm], neox, rtol=0, atol=1e-5)

    # q·k over the unrotated dims does not depend on position; over all dims only on the distance.
    q, k = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    qr, kr = apply_rotary(q.expand(64, 16), cos, sin), apply_rotary(k.expand(64, 16), cos, sin)  # (T, 16)
    assert torch.allclose(qr[:, ~rotated], q[~rotated].expand(64, 12))
    dots = qr @ kr.T  # (T, T): score of query at position m with key at position n
    torch.testing.assert_close(dots.diagonal(offset=-3)[:-1], dots.diagonal(offset=-3)[1:], rtol=0, atol=1e-5)

    model = make_model(rotary_fraction=0.25)
    assert model(tokens(2, 12)).shape == (2, 12, 300)


def test_full_rotary_tables_match_hf_llama() -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = ModelConfig(**SMALL)
    rotary = LlamaRotaryEmbedding(hf_llama_config(cfg))
    x = torch.zeros(1, 64, 16)
    hf_cos, hf_sin = rotary(x, torch.arange(64)[None])  # (1, T, head_dim)
    cos, sin = rope_tables(cfg)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-5)


def test_flops_per_token() -> None:
    cfg = ModelConfig(**SMALL)
    n = cfg.num_params() - 300 * 64
    assert cfg.flops_per_token(32) == 6 * n + 12 * 2 * 64 * 32
    tied = ModelConfig(**SMALL, tie_embeddings=True)
    assert tied.flops_per_token(32) == 6 * tied.num_params() + 12 * 2 * 64 * 32


def _hf_logits(hf: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=x).logits.float()  # type: ignore[no-any-return]


@pytest.mark.parametrize("overrides", [{}, {"rope_theta": 500000.0, "norm_eps": 1e-6, "n_kv_heads": 1}])
def test_parity_with_hf_llama(overrides: dict[str, Any]) -> None:
    from transformers import LlamaForCausalLM

    model = make_model(seed=3, **overrides)
    # Perturb the norms off 1 so their mapping is exercised too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    hf = LlamaForCausalLM(hf_llama_config(model.cfg)).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    x = tokens(2, 40, seed=4)
    with torch.no_grad():
        ours = model(x)
    torch.testing.assert_close(ours, _hf_logits(hf, x), rtol=0, atol=1e-5)


def test_round_trip_is_bitwise() -> None:
    model = make_model(seed=5)
    back = from_hf_state_dict(to_hf_state_dict(model))
    state = model.state_dict()
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    fresh = Transformer(model.cfg)
    fresh.load_state_dict(back, strict=True)
    x = tokens(1, 10)
    assert torch.equal(fresh.eval()(x), model(x))
    with pytest.raises(ValueError, match="unexpected tensor"):
        from_hf_state_dict({"model.layers.0.self_attn.q_proj.bias": torch.zeros(1)})


@pytest.mark.parametrize("tie", [False, True])
def test_export_hf_loads_with_from_pretrained(tmp_path: Path, tie: bool) -> None:
    from transformers import LlamaForCausalLM

    model = make_model(seed=6, tie_embeddings=tie)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.model").write_bytes(b"spm")
    (tok_dir / "tokenizer_config.json").write_text("{}")
    (tok_dir / "report.json").write_text("{}")
    out = export_hf(model, model.cfg, tmp_path / "hf", tokenizer_dir=str(tok_dir))
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"} <= names
    assert "report.json" not in names
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2 and config["tie_word_embeddings"] is tie

    hf, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True, local_files_only=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    x = tokens(2, 33, seed=7)
    with torch.no_grad():
        ours = model(x)
    torch.testing.assert_close(ours, _hf_logits(hf.eval(), x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_partial_rotary_exports_as_a_longrope_llama_with_the_same_logits(tmp_path: Path, fraction: float) -> None:
    """Pythia's and NeoX's partial rotary (25%): transformers' Llama computes the same network from the exported
    folder, its rope a longrope whose per-pair divisors leave the unrotated pairs at frequency 0; checked over the
    whole context, where a wrong frequency shows most."""
    from transformers import LlamaForCausalLM

    model = make_model(seed=8, rotary_fraction=fraction, max_seq_len=256)
    rope = hf_llama_config(model.cfg).rope_parameters
    assert rope["rope_type"] == "longrope" and rope["short_factor"] == rope["long_factor"]
    rotated = round(model.cfg.head_dim * fraction) // 2
    assert rope["short_factor"][0] == 1.0 and all(f == UNROTATED for f in rope["short_factor"][rotated:])
    out = export_hf(model, model.cfg, tmp_path / "hf")
    # Standard JSON: no Infinity or NaN, which Python's json writes and other readers refuse.
    json.loads((out / "config.json").read_text(), parse_constant=lambda name: pytest.fail(f"config.json has {name}"))
    hf = LlamaForCausalLM.from_pretrained(out, local_files_only=True).eval()
    x = tokens(2, 256, seed=9)
    with torch.no_grad():
        ours = model(x)
    exported = _hf_logits(hf, x)
    torch.testing.assert_close(ours, exported, rtol=0, atol=1e-4)
    # ... while the default RoPE with Llama's partial_rotary_factor, what one would try first, rotates every dim:
    # a model at initialisation, whose attention is nearly uniform, already shows it.
    wrong = hf_llama_config(model.cfg)
    wrong.rope_parameters = {
        "rope_type": "default",
        "rope_theta": model.cfg.rope_theta,
        "partial_rotary_factor": fraction,
    }
    naive = LlamaForCausalLM(wrong).eval()
    naive.load_state_dict(hf.state_dict())
    assert (ours - _hf_logits(naive, x)).abs().max() > 100 * (ours - exported).abs().max()


def test_export_refuses_a_mismatched_config(tmp_path: Path) -> None:
    model = make_model()
    other = ModelConfig(**{**SMALL, "ffn_hidden": 192})
    with pytest.raises(ValueError, match="different ModelConfig"):
        export_hf(model, other, tmp_path / "a")
    with pytest.raises(ValueError, match="wrong shape"):
        export_hf(model.state_dict(), other, tmp_path / "b")
