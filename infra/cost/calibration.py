"""The planner's calibration: two free figures fitted to published trn1 throughput.

Compute efficiency and step overhead are solved from two published runs, then checked on the rest. A config's
planner section may override either figure. The published table and its sources are in docs/sources.md."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hlat.core.config import HlatConfig
from hlat.core.presets import load_config
from hlat.infra.cost.perf_model import Calibration, PlanError, configured_layout, neuron_topology, step_time

# Published trn1 throughput: Neuron NeMo runs on trn1.32xlarge, sequence 2048, $7.59 3-year reserved node-hour
# (https://aws.amazon.com/blogs/machine-learning/frugality-meets-accuracy-cost-efficient-training-of-gpt-neox-and-pythia-models-with-aws-trainium/).
# Assumed: AWS's public scripts (aws-neuron/neuronx-nemo-megatron pythia_6.9B_slurm.sh, neox_20b.sh): BF16 with
# stochastic rounding, SP, full checkpointing, no ZeRO, micro-batch 2 (Pythia) and 1 (NeoX). `published_config`
# lays the presets out that way.
PUBLISHED_PRICE_PER_NODE_HOUR = 7.59


@dataclass(frozen=True)
class PublishedRun:
    preset: str
    tensor: int
    pipeline: int
    nodes: int
    global_batch: int
    seq_per_s: float
    tokens_per_usd: float
    micro_batch: int

    @property
    def label(self) -> str:
        return f"{self.preset} TP{self.tensor} PP{self.pipeline} x{self.nodes}"


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("pythia-6.9b", 8, 1, 1, 256, 10.4, 10_102_387, 2),
    PublishedRun("pythia-6.9b", 8, 1, 4, 256, 35.8, 8_693_881, 2),
    PublishedRun("neox-20b", 8, 4, 4, 16384, 13.6, 3_302_704, 1),
    PublishedRun("neox-20b", 8, 4, 8, 16384, 26.8, 3_254_134, 1),
    PublishedRun("neox-20b", 8, 4, 16, 16384, 54.3, 3_296_632, 1),
    PublishedRun("neox-20b", 8, 4, 32, 16384, 107.5, 3_263_241, 1),
    PublishedRun("neox-20b", 8, 4, 64, 16384, 212.0, 3_217_708, 1),
)
CALIBRATION_RUNS = (1, 6)
"""The rows fitted: Pythia 6.9B on 4 nodes (pins the overhead) and NeoX 20B on 64 (pins the efficiency)."""


def published_config(run: PublishedRun) -> HlatConfig:
    """The preset laid out as the published run was."""
    return load_config(
        run.preset,
        {
            "job.instance_count": run.nodes,
            "parallelism.tensor": run.tensor,
            "parallelism.pipeline": run.pipeline,
            "parallelism.sequence_parallel": True,
            "parallelism.zero1": False,
            "parallelism.activation_checkpointing": "full",
            "precision.mode": "bf16-sr",
            "training.global_batch_size": run.global_batch,
            "training.micro_batch_size": run.micro_batch,
        },
    )


def _published_step(run: PublishedRun, calibration: Calibration) -> float:
    config = published_config(run)
    topology = neuron_topology(config.job.instance_type)
    layout = configured_layout(config, run.nodes, topology)
    return step_time(config, layout, topology, calibration).total


def fit_calibration(rows: tuple[int, int] = CALIBRATION_RUNS) -> Calibration:
    """Solve compute efficiency and step overhead so the two calibration rows are reproduced exactly.

    Step time is A/efficiency + X + overhead, so two measured rows give two linear equations."""
    coeffs = []
    for i in rows:
        run = PUBLISHED_RUNS[i]
        at_one = _published_step(run, Calibration(1.0, 0.0))
        at_half = _published_step(run, Calibration(0.5, 0.0))
        compute, comm = at_half - at_one, 2 * at_one - at_half
        measured = run.global_batch / run.seq_per_s
        coeffs.append((compute, measured - comm))
    (a1, y1), (a2, y2) = coeffs
    inverse_efficiency = (y1 - y2) / (a1 - a2)
    overhead = y1 - a1 * inverse_efficiency
    efficiency = 1 / inverse_efficiency
    if not (0 < efficiency <= 1 and overhead >= 0):
        raise PlanError(
            f"calibration on rows {rows} is unphysical: efficiency {efficiency:.3f}, overhead {overhead:.3f}s"
        )
    labels = ", ".join(PUBLISHED_RUNS[i].label for i in rows)
    return Calibration(efficiency, overhead, source=f"fitted on {labels}")


@functools.cache
def default_calibration() -> Calibration:
    return fit_calibration()


def calibration_for(config: HlatConfig) -> Calibration:
    """The fitted calibration, with the config's planner.compute_efficiency / step_overhead_s where set."""
    fitted = default_calibration()
    pc = config.planner
    if pc.compute_efficiency is None and pc.step_overhead_s is None:
        return fitted
    return Calibration(
        pc.compute_efficiency if pc.compute_efficiency is not None else fitted.compute_efficiency,
        pc.step_overhead_s if pc.step_overhead_s is not None else fitted.step_overhead_s,
        source="planner config",
    )


@dataclass(frozen=True)
class PublishedCheck:
    run: PublishedRun
    fitted: bool
    predicted_seq_per_s: float
    predicted_tokens_per_usd: float

    @property
    def error(self) -> float:
        """Relative error of the predicted throughput."""
        return self.predicted_seq_per_s / self.run.seq_per_s - 1


def check_published(calibration: Calibration | None = None) -> list[PublishedCheck]:
    """Predict every published row (fitted ones included) with the calibration."""
    cal = calibration or default_calibration()
    out = []
    for i, run in enumerate(PUBLISHED_RUNS):
        config = published_config(run)
        step = _published_step(run, cal)
        seq_per_s = run.global_batch / step
        tokens_per_usd = seq_per_s * config.training.seq_len * 3600 / (PUBLISHED_PRICE_PER_NODE_HOUR * run.nodes)
        out.append(PublishedCheck(run, i in CALIBRATION_RUNS, seq_per_s, tokens_per_usd))
    return out
