"""Parallelism planner: how to lay a model out on N trn1 nodes, decided before launch.

It enumerates TP, PP, DP, SP, ZeRO-1, checkpointing and micro-batch, and drops layouts that do not fit. It predicts each
layout's step time and ranks them by tokens/s. `compare_instances` prices the best layout beside GPU instances. Memory
and step-time formulas and the calibration are in docs/planning.md. Constants come from the HLAT paper (arXiv
2404.10630), the published trn1 runs or `infra.cost.catalog`, or say they are assumptions."""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from hlat.core.config import HlatConfig
from hlat.core.parallel import LayoutError, ParallelDims, heads_problem, layers_problem
from hlat.infra.cost.catalog import CATALOG, GIB, Instance, InstanceCost, Topology, price_per_hour, tokens_per_s_at

Checkpointing = Literal["none", "selective", "full"]
CHECKPOINTING: tuple[Checkpointing, ...] = ("none", "selective", "full")


class PlanError(ValueError):
    """The planner cannot plan this config (e.g. an instance type it has no topology for)."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of the model states, by precision mode."""

    weights: int
    grads: int
    optimizer: int
    """Adam moments, plus the FP32 master copy where there is one: what ZeRO-1 shards."""


# Rajbhandari et al. 2020 (ZeRO, arXiv 1910.02054) count mixed-precision Adam as 2 + 2 + 12 bytes per parameter (BF16
# weights and gradients; FP32 master weights, momentum and variance). HLAT's pure BF16 with stochastic rounding keeps
# no master copy and BF16 moments (HLAT, arXiv 2404.10630: "optimizer states BF16"): 2 + 2 + 4. FP32 keeps everything
# in FP32.
STATE_BYTES: dict[str, StateBytes] = {
    "bf16-sr": StateBytes(weights=2, grads=2, optimizer=4),
    "bf16-mixed": StateBytes(weights=2, grads=2, optimizer=12),
    "fp32": StateBytes(weights=4, grads=4, optimizer=8),
}

# Korthikanti et al. 2022 (arXiv 2205.05198), section 4: 16-bit activation bytes per layer are s·b·h·(34 + 5·a·s/h).
# TP shards 24 of the 34, SP the other 10; selective recomputation drops the 5·a·s/h scores term.
# The formula is GPT's (GeLU MLP, dropout); for LLaMA blocks it is an unrederived approximation.
KORTHIKANTI_SHARDED = 24
KORTHIKANTI_REPLICATED = 10
KORTHIKANTI_SCORES = 5
FULL_CHECKPOINT_BYTES = 2
"""Full recomputation keeps each layer's 16-bit input only: 2·s·b·h bytes per layer (the same paper)."""
LOGIT_BYTES = 4
"""The cross-entropy's logits are kept in FP32 (an assumption: what Megatron-style vocab-parallel losses do)."""

# Megatron tensor parallelism (Shoeybi et al. 2019; with SP, Korthikanti et al. 2022): 2 all-reduces forward and 2
# backward per layer, i.e. 4 all-gathers + 4 reduce-scatters with SP, each moving (t-1)/t of s·b·h activations per
# rank in a ring. Full recomputation repeats the forward's 4.
TP_COLLECTIVES_PER_LAYER = 8
TP_RECOMPUTE_COLLECTIVES = 4

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


@dataclass(frozen=True)
class Calibration:
    compute_efficiency: float
    """Fraction of peak FLOP/s reached on the model's FLOPs (recomputation included)."""
    step_overhead_s: float
    """Seconds per step beyond modelled compute and communication (optimizer, clipping, host sync, misses)."""
    source: str = "fitted"


@dataclass(frozen=True, order=True)
class Layout:
    tensor: int
    pipeline: int
    data: int
    sequence_parallel: bool
    zero1: bool
    activation_checkpointing: Checkpointing
    micro_batch: int

    def overrides(self) -> dict[str, Any]:
        """The config fields that train this layout, one to one with what NxD is given."""
        return {
            "parallelism.tensor": self.tensor,
            "parallelism.pipeline": self.pipeline,
            "parallelism.sequence_parallel": self.sequence_parallel,
            "parallelism.zero1": self.zero1,
            "parallelism.activation_checkpointing": self.activation_checkpointing,
            "training.micro_batch_size": self.micro_batch,
        }

    def label(self) -> str:
        parts = [f"TP{self.tensor}", f"PP{self.pipeline}", f"DP{self.data}"]
        parts += ["SP"] if self.sequence_parallel else []
        parts += ["ZeRO-1"] if self.zero1 else []
        parts += [f"AC:{self.activation_checkpointing}", f"mb{self.micro_batch}"]
        return " ".join(parts)


@dataclass(frozen=True)
class Memory:
    """Bytes per NeuronCore."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    capacity: float
    """Usable bytes: HBM per core x planner.hbm_usable_fraction."""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by where they go."""

    compute: float
    tensor_comm: float
    pipeline_comm: float
    bubble: float
    data_comm: float
    overhead: float

    @property
    def total(self) -> float:
        return self.compute + self.tensor_comm + self.pipeline_comm + self.bubble + self.data_comm + self.overhead


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: Memory
    step: StepTime
    tokens_per_s: float
    mfu: float
    usd_per_hour: float

    @property
    def tokens_per_usd(self) -> float | None:
        return self.tokens_per_s * 3600 / self.usd_per_hour if self.usd_per_hour else None

    def row(self) -> dict[str, Any]:
        """A flat record for tables, JSON and Prefect artifacts."""
        lay, gib = self.layout, 1024**3
        return {
            "tensor": lay.tensor,
            "pipeline": lay.pipeline,
            "data": lay.data,
            "sequence_parallel": lay.sequence_parallel,
            "zero1": lay.zero1,
            "checkpointing": lay.activation_checkpointing,
            "micro_batch": lay.micro_batch,
            "memory_gib": round(self.memory.total / gib, 2),
            "step_s": round(self.step.total, 3),
            "tokens_per_s": round(self.tokens_per_s),
            "mfu": round(self.mfu, 4),
            "tokens_per_usd": round(self.tokens_per_usd) if self.tokens_per_usd else None,
        }


@dataclass(frozen=True)
class Rejected:
    layout: Layout
    kind: str
    """Short reason class: 'heads', 'layers', 'cores', 'batch', 'memory'."""
    reason: str


REJECTION_KINDS = {
    "heads": "TP does not split the attention heads",
    "tensor": "TP larger than a node, or SP without TP",
    "layers": "PP does not divide the layers",
    "cores": "TP x PP does not divide the NeuronCores",
    "batch": "global batch not a multiple of DP x micro-batch",
    "memory": "out of memory per NeuronCore",
}


@dataclass
class Plan:
    preset: str
    instance_type: str
    nodes: int
    usd_per_node_hour: float
    calibration: Calibration
    ranked: list[Estimate]
    rejected: list[Rejected]
    configured: Estimate | Rejected | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Estimate:
        if not self.ranked:
            raise PlanError(f"no layout of {self.preset} fits on {self.nodes} x {self.instance_type}")
        return self.ranked[0]

    def gap(self, estimate: Estimate) -> float:
        """How much slower than the best, as a fraction (0: the best)."""
        return 1.0 - estimate.tokens_per_s / self.best.tokens_per_s

    def rank_of(self, estimate: Estimate) -> int:
        """1 + the number of layouts strictly faster (layouts predicted equally fast share a rank)."""
        return 1 + sum(e.tokens_per_s > estimate.tokens_per_s * (1 + 1e-9) for e in self.ranked)

    def best_with(self, tensor: int, pipeline: int) -> tuple[int, Estimate] | None:
        """Rank and estimate of the fastest layout with these TP and PP degrees."""
        for est in self.ranked:
            if est.layout.tensor == tensor and est.layout.pipeline == pipeline:
                return self.rank_of(est), est
        return None

    def rejection_summary(self) -> list[tuple[str, int, str]]:
        """(kind, how many, one example reason), most common first."""
        counts = Counter(r.kind for r in self.rejected)
        example = {r.kind: r.reason for r in reversed(self.rejected)}
        return [(kind, n, example[kind]) for kind, n in counts.most_common()]

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        ranked = self.ranked if top is None else self.ranked[:top]
        configured: dict[str, Any] | None = None
        if isinstance(self.configured, Estimate):
            configured = {
                "fits": True,
                "rank": self.rank_of(self.configured),
                "gap": round(self.gap(self.configured), 4),
                **self.configured.row(),
            }
        elif isinstance(self.configured, Rejected):
            configured = {"fits": False, "layout": self.configured.layout.label(), "reason": self.configured.reason}
        return {
            "preset": self.preset,
            "instance_type": self.instance_type,
            "nodes": self.nodes,
            "usd_per_node_hour": self.usd_per_node_hour,
            "calibration": asdict(self.calibration),
            "ranked": [{"rank": self.rank_of(e), **e.row()} for e in ranked],
            "fitting": len(self.ranked),
            "rejected": len(self.rejected),
            "rejected_by_reason": [{"kind": k, "count": n, "example": ex} for k, n, ex in self.rejection_summary()],
            "configured": configured,
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------------------------------
# Model arithmetic


def block_params(config: HlatConfig) -> int:
    """Parameters of one transformer block (ModelConfig.block_params)."""
    return config.model.block_params()


def stage_params(config: HlatConfig, pipeline: int) -> int:
    """Parameters of the largest pipeline stage: its blocks plus the embedding or output layer at the ends."""
    m = config.model
    if pipeline == 1:
        return m.num_params()
    # With tied embeddings the first and last stages each hold a copy (as Megatron does).
    head = m.padded_vocab_size * m.d_model + m.final_norm_params()
    return m.n_layers // pipeline * block_params(config) + head


def layer_flops_per_token(config: HlatConfig) -> float:
    """Forward + backward FLOPs of one block per token at the run's sequence length (ModelConfig's count)."""
    return config.model.layer_flops_per_token(config.training.seq_len)


def head_flops_per_token(config: HlatConfig) -> float:
    """Output layer and final norm, forward + backward (ModelConfig's count)."""
    return config.model.head_flops_per_token()


def flops_per_token(config: HlatConfig) -> float:
    """Model FLOPs per token (no recomputation) at the run's sequence length (ModelConfig's count)."""
    return config.model.flops_per_token(config.training.seq_len)


def recompute_flops_per_token(config: HlatConfig, checkpointing: Checkpointing) -> float:
    """Extra FLOPs per layer and token from recomputation: attention's QKᵀ and AV (selective) or the forward (full)."""
    if checkpointing == "selective":
        return 4 * config.model.d_model * config.training.seq_len
    if checkpointing == "full":
        return layer_flops_per_token(config) / 3
    return 0.0


def activation_bytes_per_layer(
    seq: int, micro_batch: int, hidden: int, heads: int, tensor: int, sequence_parallel: bool, checkpointing: str
) -> float:
    """Korthikanti et al. 2022 activation bytes of one layer for one micro-batch (16-bit activations)."""
    sbh = seq * micro_batch * hidden
    if checkpointing == "full":
        return FULL_CHECKPOINT_BYTES * sbh / (tensor if sequence_parallel else 1)
    if sequence_parallel:
        linear = (KORTHIKANTI_REPLICATED + KORTHIKANTI_SHARDED) / tensor
    else:
        linear = KORTHIKANTI_REPLICATED + KORTHIKANTI_SHARDED / tensor
    scores = 0.0 if checkpointing == "selective" else KORTHIKANTI_SCORES * heads * seq / (hidden * tensor)
    return sbh * (linear + scores)


def micro_batches(config: HlatConfig, layout: Layout) -> int:
    return config.training.global_batch_size // (layout.data * layout.micro_batch)


def memory_per_core(config: HlatConfig, layout: Layout, topology: Topology, usable_fraction: float) -> Memory:
    """What one NeuronCore holds for this layout (the first/last pipeline stage, the fullest)."""
    m, s = config.model, config.training.seq_len
    states = STATE_BYTES[config.precision.mode]
    params = stage_params(config, layout.pipeline) / layout.tensor
    optimizer = params * states.optimizer / (layout.data if layout.zero1 else 1)
    # Korthikanti's bytes assume 16-bit activations; FP32 training doubles them.
    scale = 2.0 if config.precision.mode == "fp32" else 1.0
    per_layer = scale * activation_bytes_per_layer(
        s, layout.micro_batch, m.d_model, m.n_heads, layout.tensor, layout.sequence_parallel,
        layout.activation_checkpointing,
    )  # fmt: skip
    in_flight = min(layout.pipeline, micro_batches(config, layout))
    activations = per_layer * (m.n_layers // layout.pipeline) * in_flight
    if layout.activation_checkpointing == "full":
        # Backward recomputes one layer at a time: its activations exist once on top of the stored inputs.
        activations += scale * activation_bytes_per_layer(
            s, layout.micro_batch, m.d_model, m.n_heads, layout.tensor, layout.sequence_parallel, "none"
        )
    activations += LOGIT_BYTES * s * layout.micro_batch * m.padded_vocab_size / layout.tensor
    return Memory(
        weights=params * states.weights,
        grads=params * states.grads,
        optimizer=optimizer,
        activations=activations,
        capacity=topology.memory_per_core_bytes * usable_fraction,
    )


def step_time(config: HlatConfig, layout: Layout, topology: Topology, calibration: Calibration) -> StepTime:
    """Seconds per optimizer step of this layout (see the module docstring for the model)."""
    m, s = config.model, config.training.seq_len
    t, p, b = layout.tensor, layout.pipeline, layout.micro_batch
    ac = layout.activation_checkpointing
    act_bytes = 4 if config.precision.mode == "fp32" else 2
    link = topology.link_bytes_per_s_per_core
    layers = m.n_layers // p

    # One micro-batch on the last stage, the slowest: its layers (with recomputation) and the output layer.
    stage_flops = layers * (layer_flops_per_token(config) + recompute_flops_per_token(config, ac))
    stage_flops += head_flops_per_token(config)
    peak = topology.peak_flops_per_core(fp32=config.precision.mode == "fp32")
    mb_compute = s * b * stage_flops / t / (peak * calibration.compute_efficiency)

    mb_tp = 0.0
    if t > 1:
        collectives = TP_COLLECTIVES_PER_LAYER + (TP_RECOMPUTE_COLLECTIVES if ac == "full" else 0)
        mb_tp = layers * collectives * (t - 1) / t * s * b * m.d_model * act_bytes / link

    mb_p2p = 0.0
    replica = t * p
    cores = topology.cores_per_node
    if p > 1:
        boundary = s * b * m.d_model * act_bytes  # one stage's output, split over its t cores
        # A replica wider than a node has stage boundaries that cross nodes: one per node, over EFA.
        one_way = boundary / topology.efa_bytes_per_s if replica > cores else boundary / t / link
        mb_p2p = 2 * one_way  # activations forward, their gradients backward

    n_micro = micro_batches(config, layout)
    per_micro = mb_compute + mb_tp + mb_p2p

    # Data parallel: reduce inside the node over NeuronLink first, then across nodes over EFA.
    states = STATE_BYTES[config.precision.mode]
    per_param = (states.grads + states.weights) if layout.zero1 else 2 * states.grads
    core_params = m.num_params() / replica
    local = cores // replica if replica < cores and cores % replica == 0 else 1
    remote = layout.data // local
    data_comm = 0.0
    if local > 1:
        data_comm += (local - 1) / local * per_param * core_params / link
    if remote > 1:
        node_params = m.num_params() * min(1.0, cores / replica)
        data_comm += (remote - 1) / remote * per_param * node_params / topology.efa_bytes_per_s

    return StepTime(
        compute=n_micro * mb_compute,
        tensor_comm=n_micro * mb_tp,
        pipeline_comm=n_micro * mb_p2p,
        bubble=(p - 1) * per_micro,
        data_comm=data_comm,
        overhead=calibration.step_overhead_s,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Validity and enumeration


def layout_problem(config: HlatConfig, nodes: int, layout: Layout, topology: Topology) -> tuple[str, str] | None:
    """(kind, reason) when the layout cannot run at all; None when it is valid (it may still not fit)."""
    m, t = config.model, layout.tensor
    cores = nodes * topology.cores_per_node
    if t > topology.cores_per_node:
        spans = f"TP {t} spans more than a node's {topology.cores_per_node} NeuronCores"
        return "tensor", f"{spans} (TP stays on NeuronLink)"
    if (heads := heads_problem(m.n_heads, m.kv_heads, t)) is not None:
        return "heads", heads
    if (layers := layers_problem(m.n_layers, layout.pipeline)) is not None:
        return "layers", layers
    try:
        dims = ParallelDims.of_world(t, layout.pipeline, cores, layout.sequence_parallel)
    except LayoutError as exc:
        return ("tensor" if layout.sequence_parallel and t == 1 else "cores"), f"{exc} (NeuronCores of {nodes} node(s))"
    if dims.data != layout.data:
        return "cores", f"{dims} uses {dims.world_size} NeuronCores, not DP {layout.data}"
    if (batch := dims.batch_problem(config.training.global_batch_size, layout.micro_batch)) is not None:
        return "batch", batch
    return None


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(config: HlatConfig, nodes: int, topology: Topology) -> Iterator[Layout]:
    """Every layout the planner weighs; SP only with TP, ZeRO-1 only with DP."""
    cores = nodes * topology.cores_per_node
    m = config.model
    pipelines = sorted({*_divisors(m.n_layers), *(2**k for k in range(int(math.log2(m.n_layers)) + 1))})
    for t in _divisors(topology.cores_per_node):
        for p in pipelines:
            if t * p > cores:
                continue
            data = max(1, cores // (t * p))
            for sp in (False, True) if t > 1 else (False,):
                for zero1 in (False, True) if data > 1 else (False,):
                    for ac in CHECKPOINTING:
                        for b in sorted(set(config.planner.micro_batch_sizes)):
                            yield Layout(t, p, data, sp, zero1, ac, b)


def configured_layout(config: HlatConfig, nodes: int, topology: Topology) -> Layout:
    """The layout the config asks for, on this many nodes."""
    par = config.parallelism
    cores = nodes * topology.cores_per_node
    return Layout(
        par.tensor,
        par.pipeline,
        max(1, cores // (par.tensor * par.pipeline)),  # may not divide: layout_problem then says so
        par.sequence_parallel,
        par.zero1,
        par.activation_checkpointing,
        config.training.micro_batch_size,
    )


def evaluate(
    config: HlatConfig,
    layout: Layout,
    nodes: int,
    topology: Topology,
    calibration: Calibration,
    usd_per_node_hour: float = 0.0,
) -> Estimate | Rejected:
    """One layout: rejected with its reason, or its memory, step time and throughput."""
    problem = layout_problem(config, nodes, layout, topology)
    if problem:
        return Rejected(layout, *problem)
    mem = memory_per_core(config, layout, topology, config.planner.hbm_usable_fraction)
    if not mem.fits:
        gib = 1024**3
        return Rejected(
            layout,
            "memory",
            f"needs {mem.total / gib:.1f} GiB of {mem.capacity / gib:.1f} GiB usable per NeuronCore (states "
            f"{(mem.weights + mem.grads + mem.optimizer) / gib:.1f}, activations {mem.activations / gib:.1f})",
        )
    step = step_time(config, layout, topology, calibration)
    tokens = config.tokens_per_step / step.total
    cores = nodes * topology.cores_per_node
    mfu = flops_per_token(config) * tokens / (cores * topology.peak_flops_per_core())
    return Estimate(layout, mem, step, tokens, mfu, usd_per_node_hour * nodes)


# ---------------------------------------------------------------------------------------------------------------------
# Calibration


def published_config(run: PublishedRun) -> HlatConfig:
    """The preset laid out as the published run was."""
    from hlat.core.presets import load_config

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
    topology = _topology(config.job.instance_type)
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


# ---------------------------------------------------------------------------------------------------------------------
# Planning, time and cost


def _topology(instance_type: str) -> Topology:
    instance = CATALOG.get(instance_type)
    if instance is None or instance.topology is None or instance.topology.kind != "neuron":
        raise PlanError(
            f"the planner models Trainium nodes (NeuronCores over NeuronLink and EFA); {instance_type!r} is not one "
            f"in the catalog (known: {', '.join(n for n, i in CATALOG.items() if _is_neuron(i))})"
        )
    return instance.topology


def _is_neuron(instance: Instance) -> bool:
    return instance.topology is not None and instance.topology.kind == "neuron"


def plannable(instance_type: str) -> bool:
    """Whether the planner has a Trainium topology for this instance type."""
    instance = CATALOG.get(instance_type)
    return instance is not None and _is_neuron(instance)


DEFAULT_INSTANCE = "ml.trn1.32xlarge"


def planning_instance(config: HlatConfig) -> tuple[str, str | None]:
    """The instance type to plan on: the run's own if Trainium, else trn1.32xlarge (with a note)."""
    if plannable(config.job.instance_type):
        return config.job.instance_type, None
    return DEFAULT_INSTANCE, (
        f"{config.preset} runs on {config.job.instance_type!r}; planned as if on {DEFAULT_INSTANCE}"
    )


def node_price(config: HlatConfig, instance_type: str) -> float:
    """Dollars per node-hour: planner.prices_usd_per_hour, else job.price_per_hour_usd for the run's own instance
    type, else the catalog."""
    listed = config.planner.prices_usd_per_hour.get(instance_type)
    if listed is not None:
        return listed
    own = config.job.price_per_hour_usd if instance_type == config.job.instance_type else None
    return price_per_hour(instance_type, own)


def price_source(config: HlatConfig, instance_type: str) -> str:
    """Where `node_price` takes its figure from: the overriding setting or the catalog's provenance."""
    if instance_type in config.planner.prices_usd_per_hour:
        return f"{instance_type}: planner.prices_usd_per_hour"
    if instance_type == config.job.instance_type and config.job.price_per_hour_usd is not None:
        return f"{instance_type}: job.price_per_hour_usd"
    known = CATALOG.get(instance_type)
    if known is None or known.price is None:
        return f"{instance_type}: no price in the instance catalog"
    return f"{instance_type}: {known.price.describe()}"


def plan(config: HlatConfig, nodes: int | None = None, instance_type: str | None = None) -> Plan:
    """Rank every valid layout of the config's model on `nodes` x `instance_type` (default: the config's job)."""
    instance_type = instance_type or config.job.instance_type
    nodes = nodes or config.job.instance_count
    if nodes < 1:
        raise PlanError(f"nodes must be >= 1 (got {nodes})")
    topology = _topology(instance_type)
    calibration = calibration_for(config)
    price = node_price(config, instance_type)
    ranked: list[Estimate] = []
    rejected: list[Rejected] = []
    for layout in candidate_layouts(config, nodes, topology):
        result = evaluate(config, layout, nodes, topology, calibration, price)
        if isinstance(result, Estimate):
            ranked.append(result)
        else:
            rejected.append(result)
    # Ties (e.g. micro-batch sizes without a pipeline) go to the layout that needs less memory.
    ranked.sort(key=lambda e: (-round(e.tokens_per_s, 6), e.memory.total, e.layout))
    configured = evaluate(config, configured_layout(config, nodes, topology), nodes, topology, calibration, price)
    notes = [f"price: {price_source(config, instance_type)}"]
    return Plan(config.preset, instance_type, nodes, price, calibration, ranked, rejected, configured, notes)


def compare_instances(config: HlatConfig, the_plan: Plan, tokens: float) -> list[InstanceCost]:
    """Time and cost for `tokens` on the configured layout, the best one, and each catalog GPU on as many nodes."""
    rows: list[InstanceCost] = []
    if isinstance(the_plan.configured, Estimate):
        rows.append(layout_cost(the_plan, the_plan.configured, tokens, "configured"))
    best = the_plan.best
    if not rows or best.layout != rows[0].layout:
        rows.append(layout_cost(the_plan, best, tokens, "best"))
    for name, instance in CATALOG.items():
        row = gpu_cost(config, name, instance, the_plan.nodes, tokens)
        if row is not None:
            rows.append(row)
    return rows


def layout_cost(the_plan: Plan, estimate: Estimate, tokens: float, which: str) -> InstanceCost:
    return InstanceCost(
        the_plan.instance_type, the_plan.nodes, estimate.tokens_per_s, the_plan.usd_per_node_hour, tokens,
        f"{which} layout {estimate.layout.label()}, by the planner's model", layout=estimate.layout,
    )  # fmt: skip


def gpu_cost(config: HlatConfig, name: str, instance: Instance, nodes: int, tokens: float) -> InstanceCost | None:
    """`tokens` on `nodes` GPU nodes at the measured or assumed MFU; None without a figure."""
    topo = instance.topology
    if topo is None or topo.kind != "gpu" or not topo.comparison_mfu:
        return None
    mfu, basis = topo.comparison()
    rate = tokens_per_s_at(instance, nodes, mfu, flops_per_token(config))
    how, why = gpu_data_parallel(config, topo, nodes)
    return InstanceCost(name, nodes, rate, node_price(config, name), tokens, f"{basis}; {why}", how)


def run_cost(config: HlatConfig) -> InstanceCost | None:
    """Time and cost of the run's token budget on its own instances: what the dry run and `hlat plan` print. None when
    the catalog has no throughput or the layout cannot run."""
    job = config.job
    tokens = default_tokens(config)
    if plannable(job.instance_type):
        the_plan = plan(config)
        if not isinstance(the_plan.configured, Estimate):
            return None
        return layout_cost(the_plan, the_plan.configured, tokens, "configured")
    instance = CATALOG.get(job.instance_type)
    return None if instance is None else gpu_cost(config, job.instance_type, instance, job.instance_count, tokens)


def gpu_data_parallel(config: HlatConfig, topology: Topology, nodes: int) -> tuple[str, str]:
    """('ddp' or 'fsdp', why) for the model on GPUs in bf16-mixed. DDP while a replica's training state takes at most
    GPU_STATE_SHARE of a GPU, else FSDP2."""
    state = config.model.training_state_bytes("bf16-mixed")
    memory = topology.memory_per_device_gib * GIB
    if state <= GPU_STATE_SHARE * memory:
        return "ddp", f"DDP: {state / GIB:.0f} GiB of weights, gradients and AdamW states per GPU"
    gpus = nodes * topology.devices_per_node
    switch = "--set parallelism.fsdp=true"
    if config.precision.mode != "bf16-mixed":
        switch += " --set precision.mode=bf16-mixed"
    return "fsdp", (
        f"FSDP2 ({switch}): DDP would hold {state / GIB:.0f} GiB of weights, gradients and AdamW states on each "
        f"{topology.memory_per_device_gib:g} GiB GPU; sharded over {gpus} GPUs, {state / gpus / GIB:.2f} GiB each"
    )


GPU_STATE_SHARE = 0.5
"""Largest share of a GPU's memory the replicated training state may take under DDP; activations need the rest."""


def default_tokens(config: HlatConfig) -> int:
    """The run's token budget: training.max_steps x tokens per step."""
    return config.training.max_steps * config.tokens_per_step


# ---------------------------------------------------------------------------------------------------------------------
# Text


def _fmt_tokens(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def render(
    the_plan: Plan,
    costs: list[InstanceCost] | None = None,
    top: int = 10,
    also: Sequence[str] = (),
    sources: Sequence[str] = (),
) -> str:
    """The report: ranked table, misfits, configured layout, cost for a budget, and tokens per source."""
    p = the_plan
    gib = 1024**3
    cal = p.calibration
    lines = [
        f"plan: {p.preset} on {p.nodes} x {p.instance_type} ({p.nodes * _topology(p.instance_type).cores_per_node} "
        f"NeuronCores) at ${p.usd_per_node_hour:,.3f}/node-hour",
        f"model: compute at {cal.compute_efficiency:.1%} of peak, {cal.step_overhead_s:.2f} s/step overhead "
        f"({cal.source})",
        "",
    ]
    head = (
        "#", "TP", "PP", "DP", "SP", "ZeRO1", "AC", "mb", "GiB/core", "s/step", "tokens/s", "MFU", "tokens/$", "gap"
    )  # fmt: skip
    table = [head]
    for e in p.ranked[:top]:
        lay = e.layout
        table.append(
            (
                str(p.rank_of(e)), str(lay.tensor), str(lay.pipeline), str(lay.data),
                "y" if lay.sequence_parallel else "-", "y" if lay.zero1 else "-", lay.activation_checkpointing,
                str(lay.micro_batch),
                f"{e.memory.total / gib:.1f}", f"{e.step.total:.2f}", f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}",
                f"{e.tokens_per_usd:,.0f}" if e.tokens_per_usd else "-", f"{p.gap(e):.1%}",
            )
        )  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in table]
    lines.append(f"{len(p.ranked)} layouts fit; showing the top {min(top, len(p.ranked))}")
    if p.rejected:
        lines.append(f"{len(p.rejected)} do not fit or are not valid:")
        for kind, n, example in p.rejection_summary():
            lines.append(f"  {n:>5}  {REJECTION_KINDS.get(kind, kind)} (e.g. {example})")
    lines.append("")
    if not p.ranked:
        lines.append("no layout fits: more nodes, a smaller micro-batch or model, or ZeRO-1 / checkpointing may help")
    else:
        sets = " ".join(
            f"--set {k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in p.best.layout.overrides().items()
        )
        lines.append(f"best: {sets}")
    if p.ranked and isinstance(p.configured, Estimate):
        lines.append(
            f"configured: {p.configured.layout.label()}: rank {p.rank_of(p.configured)} of {len(p.ranked)}, "
            f"{p.configured.tokens_per_s:,.0f} tokens/s, {p.gap(p.configured):.1%} slower than the best"
        )
    elif isinstance(p.configured, Rejected):
        lines.append(f"configured: {p.configured.layout.label()}: does not run here: {p.configured.reason}")
    if costs:
        lines += ["", f"to train {_fmt_tokens(costs[0].tokens)} tokens on {costs[0].nodes} nodes:"]
        for c in costs:
            per_usd = f"{c.tokens_per_usd:,.0f} tokens/$" if c.tokens_per_usd else "no price"
            lines.append(
                f"  {c.instance_type:<18} {c.tokens_per_s:>12,.0f} tokens/s  {c.hours / 24:>8,.1f} days  "
                f"${c.usd:>14,.0f}  {per_usd}  ({c.basis}; ${c.usd_per_node_hour:,.3f}/node-hour)"
            )
        lines += [f"  {line}" for line in also]
    if sources:
        lines += ["", *sources]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
