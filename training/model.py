"""The decoder-only transformer every family shares: architecture only, no distributed or device code.

`Transformer(cfg)` builds the modules and `init_weights()` initialises them, so a meta-device model can be materialised
with `to_empty()` first. Family differences come from `training.models` (docs/models.md). Positions are absolute within
a packed sequence; RoPE makes each document attend as it would alone. Every linear and embedding comes from a `Layers`
factory, so parallelism is known at construction. Padded vocabulary rows get -inf logits, so every TP rank keeps an
equal slice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from hlat.core.config import ModelConfig
from hlat.training.models import modules_of
from hlat.training.models.base import DenseLayers, Layers
from hlat.training.parallel.tensor_slices import DenseParameter, dense_init, dense_parameters


def rope_tables(
    cfg: ModelConfig, seq_len: int | None = None, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """cos and sin tables, each (seq_len, head_dim) float32, for positions 0..seq_len-1.

    Computed in float64 for accuracy at long positions; pairs past the rotary fraction do not turn."""
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    rotary_dims = rotary_block(cfg)
    # On the CPU whatever the default device (also inside `with torch.device("meta")`), then moved.
    exponents = torch.arange(0, rotary_dims, 2, dtype=torch.float64, device="cpu") / rotary_dims
    positions = torch.arange(seq_len, dtype=torch.float64, device="cpu")
    angles = modules_of(cfg).rope_angles(cfg, positions, exponents)  # (T, head_dim)
    return angles.cos().to(device=device, dtype=torch.float32), angles.sin().to(device=device, dtype=torch.float32)


def rotary_block(cfg: ModelConfig) -> int:
    """The rotated dims of a head, `head_dim * rotary_fraction`."""
    return round(cfg.head_dim * cfg.rotary_fraction)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim's halves: the 90° turn of each (i, i + d/2) pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, block: int | None = None) -> Tensor:
    """Rotate x (..., T, head_dim) by cos, sin (T, head_dim), cast to x's dtype as HF does.

    `block` (gpt_neox): rotate within each run of `block` dims instead of the whole head; see docs/models.md."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if block is None or block == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned = rotate_half(x.unflatten(-1, (x.shape[-1] // block, block))).flatten(-2)
    return x * cos + turned * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE and optional document masking; this rank's heads under TP."""

    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, cfg: ModelConfig, parallel: Layers) -> None:
        super().__init__()
        tp = parallel.tensor
        # Local heads: each rank a run of query heads, and its KV heads (one replicated KV head when TP exceeds
        # them: training/parallel/tensor_slices.py).
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads // tp, max(1, cfg.kv_heads // tp), cfg.head_dim
        d, q_dim, kv_dim = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        family = modules_of(cfg)
        bias = family.attention_bias
        # None: rotate_half over the whole head (llama); gpt_neox turns each run of its rotated width.
        self.rotary_block = family.rotary_block(cfg)
        self.qkv = parallel.grouped_qkv(cfg)
        if self.qkv is None:
            self.q_proj = parallel.linear("column", d, q_dim, bias=bias)
            self.k_proj = parallel.linear("column", d, kv_dim, bias=bias)
            self.v_proj = parallel.linear("column", d, kv_dim, bias=bias)
        self.o_proj = parallel.linear("row", q_dim, d, bias=bias)
        self.core = CoreAttention()
        # The RoPE tables: the model's own, shared by every layer (Transformer._share_rope_tables); each layer holds
        # them so that a pipeline stage of layers is self-contained.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def forward(self, x: Tensor, mask: Tensor | BlockMask | None) -> Tensor:
        if self.qkv is not None:
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # The whole sequence: under sequence parallelism x holds this rank's part, the projections gather it.
        B, T = q.shape[:2]
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, n_heads, T, head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, head_dim)
        cos, sin = rope_window(self.rope_cos, T), rope_window(self.rope_sin, T)  # (T, head_dim)
        q, k = apply_rotary(q, cos, sin, self.rotary_block), apply_rotary(k, cos, sin, self.rotary_block)
        out = self.core(q, k, v, mask)  # (B, n_heads, T, head_dim); positional: torch-xla's checkpoint takes no kwargs
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, d_model)


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V, causal or within documents: attention without parameters or communication. 'selective'
    checkpointing recomputes it: large activations, small FLOPs (Korthikanti et al. 2022)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | BlockMask | None) -> Tensor:
        gqa = k.shape[1] != q.shape[1]
        if isinstance(mask, BlockMask):
            # Document masking with a fused kernel: FlexAttention skips the blocks the mask empties (compiled, since
            # the block runs under torch.compile; see `Transformer.flex_document_mask`).
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        # enable_gqa shares each key/value head with n_heads/n_kv_heads consecutive query heads without
        # materialising the repeated tensors; is_causal (no mask tensor) lets SDPA pick a flash kernel.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


class Block(nn.Module):
    """Pre-norm block: llama adds attention then SwiGLU; gpt_neox adds both from the same input (parallel residual)."""

    def __init__(self, cfg: ModelConfig, parallel: Layers) -> None:
        super().__init__()
        family = modules_of(cfg)
        self.parallel_residual = family.parallel_residual
        self.attn_norm = family.norm(cfg, parallel)
        self.attn = Attention(cfg, parallel)
        self.mlp_norm = family.norm(cfg, parallel)
        self.mlp = family.mlp(cfg, parallel)

    def forward(self, x: Tensor, mask: Tensor | BlockMask | None) -> Tensor:
        if self.parallel_residual:
            # HF GPTNeoXLayer's order of the sums (mlp + attn + x).
            return self.mlp(self.mlp_norm(x)) + self.attn(self.attn_norm(x), mask) + x  # (B, T, d_model)
        x = x + self.attn(self.attn_norm(x), mask)  # (B, T, d_model)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, d_model)


def _fx_tracing() -> bool:
    """Whether torch.fx is tracing this forward (NxD's pipeline does)."""
    trace = torch.fx._symbolic_trace
    check = getattr(trace, "is_fx_symbolic_tracing", trace.is_fx_tracing)
    return bool(check())


def rope_window(table: Tensor, length: int) -> Tensor:
    """The first `length` rows of a RoPE table (max_seq_len, head_dim)."""
    return table[:length]


def document_mask(doc_ids: Tensor) -> Tensor:
    """Boolean mask (B, 1, T, T), True where query t may attend key s: s <= t, same document."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()  # (T, T)
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return (same_doc & causal).unsqueeze(1)  # (B, 1, T, T)


def document_block_mask(doc_ids: Tensor) -> BlockMask:
    """`document_mask` as FlexAttention's block-sparse mask; blocks outside a document are skipped."""
    B, T = doc_ids.shape

    def same_document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (kv <= q) & (doc_ids[b, q] == doc_ids[b, kv])

    return create_block_mask(same_document_causal, B, None, T, T, device=doc_ids.device)


class Transformer(nn.Module):
    """A decoder of `cfg`'s family (training/models/); weights are uninitialised until `init_weights()` or loading.

    With `device="meta"` nothing is allocated: call `to_empty(device=...)`, then `init_weights()`, or
    `init_rope_tables()` and `load_state_dict(...)` (RoPE tables are not in the state dict)."""

    rope_cos: Tensor
    rope_sin: Tensor
    flex_document_mask: bool = False
    """Use FlexAttention block masks instead of dense SDPA masks (set on CUDA under torch.compile)."""

    def __init__(
        self, cfg: ModelConfig, device: torch.device | str | None = None, layers: Layers | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.parallel: Layers = layers if layers is not None else DenseLayers()
        # Built on the meta device and then given uninitialised storage: construction draws no random
        # numbers and spends no time on default inits, so init_weights() alone decides the weights (the same
        # ones whatever the device, the way the model was built, or how it is split), and a model too big for
        # one process is never materialised whole.
        with torch.device("meta"):
            self.embed = self.parallel.embedding(cfg.padded_vocab_size, cfg.d_model)
            self.layers = nn.ModuleList(Block(cfg, self.parallel) for _ in range(cfg.n_layers))
            self.norm = modules_of(cfg).norm(cfg, self.parallel)
            self.output = self.parallel.linear("output", cfg.d_model, cfg.padded_vocab_size)
            cos, sin = rope_tables(cfg, seq_len=cfg.max_seq_len, device="meta")
        self._real_columns = self._real_vocab_columns()
        # Non-persistent: derived from the config, so they stay out of checkpoints and HF exports.
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, head_dim)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, head_dim)
        self._tie()
        target = torch.device(device) if device is not None else torch.get_default_device()
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_rope_tables()

    def _real_vocab_columns(self) -> int:
        """How many of this rank's logit columns are real tokens (the rest are padding)."""
        embed = next(p for p in dense_parameters(self.cfg) if p.name == "embed.weight")
        ids = self.parallel.shard(embed, torch.arange(self.cfg.padded_vocab_size, device="cpu"))
        return int((ids < self.cfg.vocab_size).sum())

    def _mask_padding(self, logits: Tensor) -> Tensor:
        """logits (B, T, V_local) with padded rows set to -inf, keeping every rank's width equal. Python ints and slices
        only: NxD's pipeline traces this with torch.fx."""
        if self.cfg.padded_vocab_size == self.cfg.vocab_size:
            return logits
        real = self._real_columns
        return torch.cat([logits[..., :real], torch.full_like(logits[..., real:], float("-inf"))], dim=-1)

    def _tie(self) -> None:
        if self.cfg.tie_embeddings:
            self.output.weight = self.embed.weight

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Transformer:
        """As nn.Module.to_empty, keeping the tied embedding tied and the parallel attributes on the parameters."""
        marks = {name: dict(vars(p)) for name, p in self.named_parameters() if vars(p)}
        super().to_empty(device=device, recurse=recurse)
        self._tie()
        for name, attributes in marks.items():
            vars(self.get_parameter(name)).update(attributes)
        return self

    @torch.no_grad()
    def init_rope_tables(self) -> None:
        """Recompute the RoPE tables in place (after `to_empty`), keeping their current device and dtype."""
        cos, sin = rope_tables(self.cfg, device=self.rope_cos.device)
        self.rope_cos = cos.to(self.rope_cos.dtype)
        self.rope_sin = sin.to(self.rope_sin.dtype)
        self._share_rope_tables()

    def _share_rope_tables(self) -> None:
        """Point every layer's RoPE buffers at the model's (one copy, whatever device moves made of them)."""
        for layer in self.layers:
            layer.attn.rope_cos, layer.attn.rope_sin = self.rope_cos, self.rope_sin  # type: ignore[union-attr]

    def _apply(self, fn: Any, recurse: bool = True) -> Transformer:
        super()._apply(fn, recurse)
        self._share_rope_tables()
        return self

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """N(0, init_std) for every linear and embedding weight, ones for the norms; this rank's slice of each.

        With `scale_output_init`, o_proj and w2 use init_std / sqrt(2 * n_layers), so residual variance stays flat. Each
        dense tensor is seeded by `seed` and its name, so the weights do not depend on device or TP degree."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        for param in dense_parameters(self.cfg):
            local = self.get_parameter(self.parallel.local_name(param.name))
            local.copy_(self.parallel.shard(param, dense_init(param, self.cfg, seed)))
        self.init_rope_tables()

    def initialiser(self, seed: int) -> Callable[[nn.Module, torch.device], None]:
        """`init_weights(seed)` one module at a time, for a meta model materialised in parts (NxD's `param_init_fn`).
        The weights equal `init_weights(seed)`'s."""
        owners: dict[tuple[int, str], DenseParameter] = {}
        for param in dense_parameters(self.cfg):
            path, _, key = self.parallel.local_name(param.name).rpartition(".")
            owners[(id(self.get_submodule(path)), key)] = param

        @torch.no_grad()
        def init(module: nn.Module, device: torch.device) -> None:
            for key, local in module.named_parameters(recurse=False):
                param = owners.get((id(module), key))
                if param is not None:
                    local.copy_(self.parallel.shard(param, dense_init(param, self.cfg, seed)))
            if isinstance(module, Attention):
                cos, sin = rope_tables(self.cfg, device=device)
                module.rope_cos = cos.to(module.rope_cos.dtype)
                module.rope_sin = sin.to(module.rope_sin.dtype)

        return init

    def num_params(self) -> int:
        """Distinct parameters held here (a tied embedding counts once); this rank's share under TP."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: Tensor, doc_ids: Tensor | None = None, targets: Tensor | None = None) -> Tensor:
        """Logits (B, T, padded_vocab_size) in float32, -inf in padded columns; with `targets`, the mean cross-entropy.

        doc_ids (B, T), optional: each token's document in a packed sequence; attention stays within it. The output
        projection runs in the parameters' dtype and is cast to float32 for the loss."""
        seq_len = tokens.shape[1]
        if not _fx_tracing():  # the pipeline traces this forward: no branching on shapes
            if seq_len > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={self.cfg.max_seq_len}")
            if doc_ids is not None and doc_ids.shape != tokens.shape:
                raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} differs from tokens {tuple(tokens.shape)}")
        mask: Tensor | BlockMask | None = None
        if doc_ids is not None:
            mask = document_block_mask(doc_ids) if self.flex_document_mask else document_mask(doc_ids)  # (B, 1, T, T)
        h = self.embed(tokens)  # (B, T, d_model)
        for layer in self.layers:
            h = layer(h, mask)  # (B, T, d_model)
        logits = self._mask_padding(self.output(self.norm(h)).float())  # (B, T, V; under TP this rank's slice)
        if targets is None:
            return logits
        return self.loss(logits, targets)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of this model's logits, whole or vocabulary-parallel (`Layers.cross_entropy`)."""
        return self.parallel.cross_entropy(logits, targets)
