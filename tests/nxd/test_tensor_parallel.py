"""Tensor and sequence parallelism of our model on neuronx-distributed's real layers (CPU mode, gloo ranks): the
model is built with its parallelism (`training.parallel.neuron.NxdLayers`), starts from the dense model's weights
sliced, and its forward and backward equal the dense model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.nxd.conftest import run_ranks

CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "tp2": (2, {"config": {"parallelism.tensor": 2}}),
    "tp2-sequence-parallel": (2, {"config": {"parallelism.tensor": 2, "parallelism.sequence_parallel": True}}),
    # More TP ranks than KV heads: NxD's GQAQKVColumnParallelLinear, each KV head replicated on 2 ranks.
    "tp2-one-kv-head-document-masking": (
        2, {"config": {"parallelism.tensor": 2, "model.n_kv_heads": 1}, "document_masking": True}
    ),
    "tp4-two-kv-heads-sequence-parallel": (
        4,
        {
            "config": {
                "parallelism.tensor": 4, "model.n_heads": 8, "model.n_kv_heads": 2,
                "parallelism.sequence_parallel": True,
            },
            "document_masking": True,
        },
    ),
    # GPT-NeoX blocks (biased column/row layers: the row bias added once, after the reduction; LayerNorm biases under
    # SP) with a padded vocabulary (320 -> 384 rows: the padded logits of the last rank's slice are -inf).
    "tp2-gpt-neox-padded-vocabulary-document-masking": (
        2,
        {
            "config": {
                "parallelism.tensor": 2, "model.arch": "gpt_neox", "model.rotary_fraction": 0.25,
                "model.vocab_multiple": 96,
            },
            "document_masking": True,
        },
    ),
    "tp4-gpt-neox-sequence-parallel": (
        4,
        {
            "config": {
                "parallelism.tensor": 4, "model.n_heads": 8, "model.arch": "gpt_neox", "model.rotary_fraction": 0.25,
                "model.vocab_multiple": 96, "parallelism.sequence_parallel": True,
            },
        },
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_equal_the_dense_model(case: str, tmp_path: Path) -> None:
    processes, args = CASES[case]
    ranks = run_ranks(processes, "tp_equals_dense", tmp_path, **args)
    for rank, result in enumerate(ranks):
        assert result["tp"] == (rank, processes)
        assert result["weight_error"] == 0.0  # every rank holds exactly its slice of the dense weights
        # The logits stay split over the vocabulary (no rank gathers B x T x V): NxD's parallel cross-entropy.
        assert result["logits_shape"][-1] * processes == result["padded_vocab_size"], result["logits_shape"]
        assert abs(result["loss"] - result["dense_loss"]) <= 1e-5 * abs(result["dense_loss"])
        worst = max(result["grad_error"], key=result["grad_error"].get)
        # Gradients gathered from the shards: within 1e-5 of the largest dense gradient.
        assert result["grad_error"][worst] <= 1e-5 * result["grad_scale"], (worst, result["grad_error"][worst])
    heads, kv_heads = ranks[0]["local_heads"]
    n_heads = args["config"].get("model.n_heads", 4)
    n_kv_heads = args["config"].get("model.n_kv_heads") or n_heads
    assert heads == n_heads // processes and kv_heads == max(1, n_kv_heads // processes)
