"""Parallelism planner: how to lay a model out on N trn1 nodes, decided before launch.

It enumerates TP, PP, DP, SP, ZeRO-1, checkpointing and micro-batch, and drops layouts that do not fit. It ranks the
rest by the tokens/s `infra.cost.perf_model` predicts. `compare_instances` prices the best layout beside GPU
instances. `render` writes the table `hlat plan` prints."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hlat.core.config import HlatConfig
from hlat.core.parallel import LayoutError, ParallelDims, heads_problem, layers_problem
from hlat.infra.cost.calibration import calibration_for
from hlat.infra.cost.catalog import CATALOG, GIB, Instance, InstanceCost, Topology, price_per_hour, tokens_per_s_at
from hlat.infra.cost.perf_model import (
    CHECKPOINTING,
    Calibration,
    Layout,
    Memory,
    PlanError,
    StepTime,
    configured_layout,
    flops_per_token,
    memory_per_core,
    neuron_topology,
    plannable,
    step_time,
)


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
# Planning, time and cost


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
    topology = neuron_topology(instance_type)
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
    cores = p.nodes * neuron_topology(p.instance_type).cores_per_node
    lines = [
        f"plan: {p.preset} on {p.nodes} x {p.instance_type} ({cores} "
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
