"""The planner's performance model of one layout: bytes per NeuronCore and seconds per step.

A layout is TP, PP, DP, SP, ZeRO-1, checkpointing and micro-batch. The model is arithmetic on the config and a trn1
topology, with no search. Its formulas are in docs/planning.md. Constants come from the papers named beside them,
or `infra.cost.catalog`, or say they are assumptions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hlat.core.config import HlatConfig
from hlat.infra.cost.catalog import CATALOG, Instance, Topology

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
# Layouts and topologies


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


def neuron_topology(instance_type: str) -> Topology:
    """The Trainium topology the model computes with; PlanError for an instance type without one."""
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
