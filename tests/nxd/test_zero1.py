"""ZeRO-1's master weights survive a checkpoint: NxD's ZeRO-1 optimizer (torch-xla's ZeroRedundancyOptimizer) on
XLA:CPU in one process (its collectives over a group of one rank), checkpointed through the trainer's ZeRO-1 format
and loaded into a fresh model and optimizer. Where the masters hold more than the parameters (bf16-mixed under
Neuron 2.24's XLA_DOWNCAST_BF16: HLAT 70B; bf16-sr's BF16 model on 2.28) they are saved, each rank its shard in its
rank file; elsewhere they are the parameters' exact copy and are rebuilt from them. Either way they come back
bitwise: a resumed job continues from the same masters, not from masters rebuilt from BF16 parameters.

ZeRO-1 over several ranks needs collectives across XLA devices, which XLA:CPU processes lack: trn1 only."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlat.core.environment import xla_precision_environment
from hlat.core.presets import load_config
from hlat.training.parallel.neuron import zero1_masters_outrank_parameters
from tests.nxd.conftest import SDK, SMALL_MODEL, run_ranks


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-sr", "fp32"])
def test_zero1_master_weights_come_back_bitwise_from_a_checkpoint(precision: str, tmp_path: Path) -> None:
    config = {
        "parallelism.zero1": True,
        "precision.mode": precision,
        # NxD's CPU mode all-reduces the norm over replica-group lists, which torch.distributed cannot: no clipping.
        "training.grad_clip": 0.0,
    }
    (result,) = run_ranks(
        1,
        "zero1_masters_round_trip",
        tmp_path / "ranks",
        env=xla_precision_environment(precision, SDK.precision_flags),  # set before torch_xla is imported
        config=config,
        checkpoints=str(tmp_path / "checkpoints"),
        group_of_one=True,
    )
    cfg = load_config("tiny", {**SMALL_MODEL, **config, "neuron.sdk": SDK.version})
    outrank = zero1_masters_outrank_parameters(cfg)
    assert result["masters_are_the_parameters"] is not outrank, result  # what decides whether they are saved
    assert result["saved"] is outrank, result
    assert result["bitwise"], result
    if (precision, SDK.precision_flags) == ("bf16-mixed", True):
        assert result["dtypes"] == ["torch.float64"]  # HLAT 70B: NxD's FP64 masters, FP32 on the device
