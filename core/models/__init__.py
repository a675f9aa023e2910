"""The model families hlat builds, by `model.arch`: the one place core asks which family a config is.

Each family has a torch-free module here and a torch one in training/models/; docs/models.md says how to add one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hlat.core.models.base import HfConfigRefused, ModelFamily, ModelShape
from hlat.core.models.gpt_neox import GPT_NEOX
from hlat.core.models.llama import LLAMA

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (LLAMA, GPT_NEOX)}
"""Every family by its `model.arch` name; a new family adds its entry here."""

DEFAULT = LLAMA.name
"""The family of a config or HF tensors that name none."""

__all__ = ["DEFAULT", "FAMILIES", "HfConfigRefused", "ModelFamily", "ModelShape", "family", "family_of", "hf_family"]


def family(name: str) -> ModelFamily:
    """The family `model.arch` names; ValueError listing the known ones."""
    found = FAMILIES.get(name)
    if found is None:
        raise ValueError(f"model.arch={name!r} is no model family; the families are {', '.join(FAMILIES)}")
    return found


def family_of(cfg: ModelShape) -> ModelFamily:
    """The family of a model config."""
    return family(cfg.arch)


def hf_family(hf: Mapping[str, Any]) -> ModelFamily:
    """The family of a transformers config.json (`architectures`, else `model_type`); else HfConfigRefused."""
    for name in hf.get("architectures") or []:
        for candidate in FAMILIES.values():
            if candidate.hf_architecture == name:
                return candidate
    for candidate in FAMILIES.values():
        if hf.get("model_type") == candidate.hf_model_type:
            return candidate
    found = hf.get("architectures") or hf.get("model_type")
    known = " and ".join(f.hf_architecture for f in FAMILIES.values())
    raise HfConfigRefused(f"config.json describes {found!r}; hlat imports {known} checkpoints")
