"""What a model family decides with torch: its blocks' parts, TP slicing rules and HF weight names.

A family subclasses `FamilyModules` and is registered in `training/models/__init__.py`. `Layers` and `DenseParameter`
are shared by all families; docs/models.md lists every piece."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hlat.core.config import ModelConfig
from hlat.core.models import ModelFamily

Kind = Literal["column", "row", "vocab", "replicated", "q", "o", "kv"]
Init = Literal["normal", "output", "ones", "zeros"]
LinearKind = Literal["column", "row", "output"]


@dataclass(frozen=True)
class DenseParameter:
    """One parameter of the single-device model (training/parallel/tensor_slices.py says how kinds split)."""

    name: str
    shape: tuple[int, ...]
    init: Init
    """'normal': N(0, init_std); 'output': scaled by 1/sqrt(2 * n_layers) with scale_output_init; 'ones'; 'zeros'."""
    kind: Kind


class Layers(Protocol):
    """Where linear and embedding layers come from and how they split (`DenseLayers`, or NxD's `NxdLayers`)."""

    tensor: int
    """The tensor-parallel degree: how many ranks share each layer."""

    def linear(self, kind: LinearKind, in_features: int, out_features: int, bias: bool = False) -> nn.Module: ...

    def embedding(self, num_embeddings: int, dim: int) -> nn.Module: ...

    def grouped_qkv(self, cfg: ModelConfig) -> nn.Module | None: ...

    def norm(self, weight: nn.Parameter) -> None: ...

    def local_name(self, name: str) -> str: ...

    def shard(self, param: DenseParameter, full: Tensor) -> Tensor: ...

    def cross_entropy(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean FP32 cross-entropy of logits (B, T, V or this rank's vocabulary slice) against targets (B, T)."""
        ...


class DenseLayers:
    """The whole model on one device: nn.Linear (biased only where asked) and nn.Embedding, parameters unsplit."""

    tensor = 1

    def linear(self, kind: LinearKind, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=bias)

    def embedding(self, num_embeddings: int, dim: int) -> nn.Module:
        return nn.Embedding(num_embeddings, dim)

    def grouped_qkv(self, cfg: ModelConfig) -> nn.Module | None:
        """A fused query/key/value layer, or None for separate q_proj, k_proj, v_proj."""
        return None

    def norm(self, weight: nn.Parameter) -> None:
        """Mark a norm's scale (sequence parallelism reduces their gradients over the TP group)."""

    def local_name(self, name: str) -> str:
        """The name of this model's parameter that holds (a slice of) dense parameter `name`."""
        return name

    def shard(self, param: DenseParameter, full: Tensor) -> Tensor:
        """This rank's slice of `param`'s dense tensor."""
        return full

    def cross_entropy(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class FamilyModules:
    """One family's torch code; subclasses set names and override what they need."""

    core: ModelFamily
    """The family's torch-free rules (core/models/<family>.py)."""
    norm_class: type[nn.Module]
    """The family's norm; NxD's pipeline keeps it whole (a leaf module)."""
    attention_bias: bool = False
    """Q, K, V and O projections with biases."""
    parallel_residual: bool = False
    """Attention and MLP on the same input (GPT-NeoX), else one after the other (LLaMA)."""
    hf_names: tuple[tuple[str, str], ...] = ()
    """(our name, HF name) of every tensor; `{i}` is the layer index."""
    hf_aliases: tuple[tuple[str, str], ...] = ()
    """(our name, HF name) pairs read but never written."""
    hf_prefix: str = ""
    """The prefix of the family's HF tensor names, which tells its state dicts apart."""
    hf_non_parameters: tuple[str, ...] = ()
    """Regular expressions of checkpoint tensors that are transformers' buffers, not weights (skipped on import)."""

    @property
    def name(self) -> str:
        return self.core.name

    def norm(self, cfg: ModelConfig, parallel: Layers) -> nn.Module:
        """A new norm of width d_model, its parameters marked for `parallel`."""
        raise NotImplementedError

    def mlp(self, cfg: ModelConfig, parallel: Layers) -> nn.Module:
        """A new MLP of the block."""
        raise NotImplementedError

    def rotary_block(self, cfg: ModelConfig) -> int | None:
        """The width of the runs of head dims the rotation turns (None: the whole head, rotate_half pairing)."""
        return None

    def rope_angles(self, cfg: ModelConfig, positions: Tensor, exponents: Tensor) -> Tensor:
        """Angles (T, head_dim) float64; `exponents` is 2i/r per rotated pair. Default: LLaMA's pairing (i, i + d/2)."""
        inv_freq = torch.zeros(cfg.head_dim // 2, dtype=torch.float64, device="cpu")  # (head_dim/2,)
        inv_freq[: exponents.shape[0]] = torch.pow(cfg.rope_theta, -exponents)
        angles = torch.outer(positions, inv_freq)  # (T, head_dim/2)
        return torch.cat([angles, angles], dim=-1)  # (T, head_dim)

    def norm_parameters(self, cfg: ModelConfig, name: str) -> list[DenseParameter]:
        """A norm's dense parameters (replicated over TP ranks)."""
        raise NotImplementedError

    def block_parameters(self, cfg: ModelConfig, prefix: str) -> list[DenseParameter]:
        """One block's dense parameters, with how TP splits each."""
        raise NotImplementedError

    def to_hf(self, state: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        """Our state dict rearranged where HF lays tensors out otherwise (before renaming). Default: unchanged."""
        return dict(state)

    def from_hf(self, state: Mapping[str, Tensor], cfg: ModelConfig | None) -> dict[str, Tensor]:
        """The inverse of `to_hf`, on tensors already under our names."""
        return dict(state)

    def hf_sources(self, name: str) -> tuple[str, ...]:
        """Our tensor names (after `to_hf`) that dense parameter `name` is read from."""
        return (name,)

    def hf_shape(self, param: DenseParameter) -> tuple[int, ...]:
        """The shape of the HF tensor `param` is read from (the vocabulary's rows aside)."""
        return param.shape

    def split_hf(self, param: DenseParameter, ours: str, tensor: Tensor, cfg: ModelConfig) -> dict[str, Tensor]:
        """The dense parameters one HF tensor (under our name `ours`) holds."""
        return {param.name: tensor}

    def hf_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor an export holds, with its shape."""
        raise NotImplementedError


def build_hf_config(family: FamilyModules, cfg: ModelConfig, bos_id: int | None, eos_id: int | None) -> Any:
    """The transformers config object of `cfg` (`core.hf_config_class`), with the family's extra attributes."""
    # Imported here: transformers takes seconds to import and training jobs do not need it.
    import transformers

    config = getattr(transformers, family.core.hf_config_class)(**family.core.hf_config(cfg, bos_id, eos_id))
    for key, value in family.core.hf_config_attributes(cfg).items():
        setattr(config, key, value)
    return config
