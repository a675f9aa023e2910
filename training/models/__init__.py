"""The model families' torch code, by `model.arch`: the one place training asks which family a model is."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hlat.core.config import ModelConfig
from hlat.core.models import DEFAULT, family
from hlat.training.models.base import FamilyModules, build_hf_config
from hlat.training.models.gpt_neox import GPT_NEOX
from hlat.training.models.llama import LLAMA

FAMILIES: dict[str, FamilyModules] = {modules.name: modules for modules in (LLAMA, GPT_NEOX)}
"""Every family's torch code by `model.arch`; a new family adds its entry here."""

__all__ = ["FAMILIES", "FamilyModules", "hf_config", "hf_state_family", "modules_of", "norm_classes"]


def modules_of(cfg: ModelConfig) -> FamilyModules:
    """The torch code of `cfg`'s family."""
    family(cfg.arch)  # ValueError naming the families
    return FAMILIES[cfg.arch]


def hf_state_family(names: Iterable[str]) -> FamilyModules:
    """The family whose HF tensor names these are (by `hf_prefix`); the default when none matches."""
    names = list(names)
    for modules in FAMILIES.values():
        if modules.name != DEFAULT and any(name.startswith(modules.hf_prefix) for name in names):
            return modules
    return FAMILIES[DEFAULT]


def norm_classes() -> list[type]:
    """Every family's norm class (NxD's pipeline keeps them whole)."""
    return [modules.norm_class for modules in FAMILIES.values()]


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers config of the same network as `cfg`, with the family's BOS and EOS ids."""
    modules = modules_of(cfg)
    return build_hf_config(modules, cfg, *modules.core.special_ids)
