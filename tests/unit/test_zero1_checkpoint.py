"""ZeRO-1's master weights go into checkpoints wherever they hold more than the parameters (NxD's
use_master_weights_in_ckpt, `training.parallel.neuron.zero1_masters_outrank_parameters`): HLAT 70B's bf16-mixed under
Neuron 2.24's XLA_DOWNCAST_BF16 (BF16 parameters on the device, FP64 masters: FP32 there) and bf16-sr's BF16 model
on 2.28; not where the masters are the parameters' exact copy. The NxD tier checks the masters come back bitwise
either way (tests/nxd/test_zero1.py)."""

from __future__ import annotations

import pytest

from hlat.core.environment import NEURON_SDKS
from hlat.core.presets import load_config
from hlat.training.parallel.neuron import parallel_settings

SAVED = {
    # (precision, Neuron SDK): whether the masters are saved
    ("bf16-mixed", "2.24.1"): True,  # HLAT 70B: XLA_DOWNCAST_BF16, NxD's FP64 masters over BF16 parameters
    ("bf16-mixed", "2.28.0"): False,  # autocast over FP32 parameters: the masters are their copy
    ("bf16-sr", "2.24.1"): False,  # XLA_USE_BF16: masters and parameters alike BF16 on the device
    ("bf16-sr", "2.28.0"): True,  # a BF16 model, FP32 masters
    ("fp32", "2.24.1"): False,
    ("fp32", "2.28.0"): False,
}


def test_every_sdk_and_precision_is_decided() -> None:
    assert {sdk for _, sdk in SAVED} == set(NEURON_SDKS)


@pytest.mark.parametrize(("precision", "sdk"), list(SAVED))
def test_zero1_saves_its_master_weights_where_they_outrank_the_parameters(precision: str, sdk: str) -> None:
    cfg = load_config("hlat-70b", {"precision.mode": precision, "neuron.sdk": sdk})
    assert cfg.parallelism.zero1
    mixed = parallel_settings(cfg)["mixed_precision_config"]
    assert mixed["use_master_weights_in_ckpt"] is SAVED[(precision, sdk)]
    # NxD refuses use_master_weights_in_ckpt without ZeRO-1 (trainer.py, initialize_optimizer_from_class).
    off = load_config("hlat-70b", {"precision.mode": precision, "neuron.sdk": sdk, "parallelism.zero1": False})
    assert parallel_settings(off)["mixed_precision_config"]["use_master_weights_in_ckpt"] is False
