"""What a model family decides without torch: config checks, arithmetic and the HF config.json mapping.

A family subclasses `ModelFamily` and is registered in `core/models/__init__.py`. Methods take any `ModelConfig`-shaped
object (`ModelShape`), so no config import is needed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class ModelShape(Protocol):
    """The `ModelConfig` fields and properties a family reads."""

    @property
    def arch(self) -> str: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int | None: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def ffn_hidden(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rotary_fraction(self) -> float: ...
    @property
    def init_std(self) -> float: ...
    @property
    def tie_embeddings(self) -> bool: ...


class HfConfigRefused(ValueError):
    """A config.json this family cannot hold; the message names the key."""


def require(hf: Mapping[str, Any], **expected: Any) -> None:
    """Keys whose value, where present, must be `expected` (transformers' default when absent)."""
    for key, want in expected.items():
        if key in hf and hf[key] != want:
            raise HfConfigRefused(
                f"config.json {key}={hf[key]!r}: hlat's model has {key}={want!r}; it cannot hold these weights"
            )


class ModelFamily:
    """One family's torch-free rules; subclasses set names and override what they need."""

    name: str = ""
    """The value of `model.arch` that selects this family."""
    hf_architecture: str = ""
    """Its transformers class in config.json `architectures` (e.g. LlamaForCausalLM)."""
    hf_model_type: str = ""
    """Its config.json `model_type` (read when `architectures` is absent)."""
    hf_config_class: str = ""
    """The transformers config class an export builds (e.g. LlamaConfig)."""
    special_ids: tuple[int | None, int | None] = (None, None)
    """BOS and EOS ids of an export without tokenizer files."""

    def check(self, cfg: ModelShape) -> None:
        """Refuse, with ValueError, a shape this family's blocks cannot build."""

    def block_params(self, cfg: ModelShape) -> int:
        """Parameters of one transformer block."""
        raise NotImplementedError

    def final_norm_params(self, cfg: ModelShape) -> int:
        """Parameters of the final norm."""
        raise NotImplementedError

    def fields_from_hf(self, hf: Mapping[str, Any], rope: Mapping[str, Any]) -> dict[str, Any]:
        """The family's own `ModelConfig` fields from a config.json; `rope` holds its RoPE settings. HfConfigRefused for
        what the family cannot hold."""
        raise NotImplementedError

    def hf_config(self, cfg: ModelShape, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
        """The `hf_config_class` keyword arguments describing the same network as `cfg`."""
        raise NotImplementedError

    def hf_config_attributes(self, cfg: ModelShape) -> dict[str, Any]:
        """Attributes set on the built config afterwards (names older transformers read)."""
        return {}
