"""Instance catalog: node prices, peak throughput and topology, for costs, budgets, estimates and the planner.

Prices are SageMaker training on-demand dollars per node-hour, from infra/cost/prices.json with their provenance. Config
fields override them. Time to train comes from `infra.cost.planner` or a GPU's MFU, not from here (docs/planning.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

GIB = 1024**3
PRICES = Path(__file__).with_name("prices.json")
"""Each instance type's price and its provenance; `hlat prices --record` rewrites it."""
MEASURED = Path(__file__).with_name("measured.json")
"""Throughput measured by benchmarks/ (with machine, date and command), used by the estimates."""


def measured(section: str) -> dict[str, Any]:
    """One section of infra/cost/measured.json ('prepare_data', 'train_step'); {} when absent."""
    data: dict[str, Any] = json.loads(MEASURED.read_text()).get(section, {})
    return data


@dataclass(frozen=True)
class Topology:
    """One node as the parallelism planner sees it. Bandwidths are per direction, as vendors quote them."""

    kind: Literal["neuron", "gpu"]
    devices_per_node: int
    cores_per_device: int
    """Ranks per device: 2 NeuronCores per Trainium chip, 1 per GPU."""
    memory_per_device_gib: float
    """Accelerator memory (HBM) of one device, GiB."""
    peak_bf16_flops_per_device: float
    """Dense BF16 FLOP/s of one device."""
    peak_fp32_flops_per_device: float
    """Dense FP32 FLOP/s of one device (`precision.mode = 'fp32'`)."""
    device_link_gib_per_s: float
    """Device-to-device bandwidth inside a node, GiB/s per device (NeuronLink-v2, NVLink)."""
    efa_gbit_per_s: float
    """Network bandwidth of the node to the others, Gbit/s (EFA)."""
    comparison_mfu: float = 0.0
    """MFU assumed for an instance the planner does not model (GPUs), from a published comparable run; 0: modelled."""
    device_name: str = ""
    """The device's name as torch reports it; an MFU measured under it (infra/cost/measured.json) replaces
    `comparison_mfu`."""

    def comparison(self) -> tuple[float, str]:
        """(MFU, its source): measured on this device, else `comparison_mfu`."""
        figure = measured("train_step").get(self.device_name) if self.device_name else None
        if figure:
            return float(figure["mfu"]), (
                f"measured {figure['mfu']:.0%} MFU: {figure['label']} on one {self.device_name}, {figure['measured']}, "
                "benchmarks/bench_train; one GPU, no collectives counted"
            )
        return self.comparison_mfu, f"assumed {self.comparison_mfu:.0%} MFU"

    @property
    def cores_per_node(self) -> int:
        return self.devices_per_node * self.cores_per_device

    @property
    def memory_per_core_bytes(self) -> float:
        return self.memory_per_device_gib * GIB / self.cores_per_device

    @property
    def link_bytes_per_s_per_core(self) -> float:
        """The device's link bandwidth shared by its cores."""
        return self.device_link_gib_per_s * GIB / self.cores_per_device

    @property
    def efa_bytes_per_s(self) -> float:
        return self.efa_gbit_per_s * 1e9 / 8

    def peak_flops_per_core(self, fp32: bool = False) -> float:
        per_device = self.peak_fp32_flops_per_device if fp32 else self.peak_bf16_flops_per_device
        return per_device / self.cores_per_device


# trn1.32xlarge, from the AWS Neuron documentation (Trainium and Trn1/Trn1n architecture pages, read 2026): 16
# Trainium chips of 2 NeuronCore-v2 each; 190 BF16 / 47.5 FP32 TFLOP/s and 32 GiB HBM per chip (512 GB per node, as
# 16 GiB per NeuronCore); NeuronLink-v2 384 GiB/s per chip (2D torus); EFA 800 Gbit/s per node.
TRN1_TOPOLOGY = Topology(
    kind="neuron",
    devices_per_node=16,
    cores_per_device=2,
    memory_per_device_gib=32,
    peak_bf16_flops_per_device=190e12,
    peak_fp32_flops_per_device=47.5e12,
    device_link_gib_per_s=384,
    efa_gbit_per_s=800,
)

# p4d.24xlarge: 8 x A100 40GB (https://aws.amazon.com/ec2/instance-types/p4/). NVIDIA A100 datasheet: 312 TFLOP/s
# dense BF16, 19.5 FP32, NVLink 600 GB/s
# per GPU; EC2 Capacity Blocks pricing page: 400 Gbit/s EFA. Comparison MFU 0.42 is an assumption: Korthikanti et al.
# 2022 (arXiv 2205.05198, abstract) report 42.1% MFU with full recomputation and 54.2% with selective recomputation
# for a 530B GPT on A100s; 7-70B models on 40 GB A100s are taken at the lower figure.
P4D_TOPOLOGY = Topology(
    kind="gpu",
    devices_per_node=8,
    cores_per_device=1,
    memory_per_device_gib=40,
    peak_bf16_flops_per_device=312e12,
    peak_fp32_flops_per_device=19.5e12,
    device_link_gib_per_s=600e9 / GIB,
    efa_gbit_per_s=400,
    comparison_mfu=0.42,
)

# p5.48xlarge: 8 x H100 SXM 80GB. NVIDIA H100 datasheet: 989 TFLOP/s dense BF16 (1,979 with sparsity), 67 FP32,
# NVLink 900 GB/s per GPU; EC2 Capacity Blocks pricing page: 640 GB HBM3, 3200 Gbit/s EFA.
# Comparison MFU: our own measurement on an H100 (infra/cost/measured.json, benchmarks/bench_train) when recorded; else
# 0.40,
# an assumption from Llama 3 (Dubey et al. 2024, arXiv 2407.21783): 38-43% BF16 MFU on H100s.
P5_TOPOLOGY = Topology(
    kind="gpu",
    devices_per_node=8,
    cores_per_device=1,
    memory_per_device_gib=80,
    peak_bf16_flops_per_device=989e12,
    peak_fp32_flops_per_device=67e12,
    device_link_gib_per_s=900e9 / GIB,
    efa_gbit_per_s=3200,
    comparison_mfu=0.40,
    device_name="NVIDIA H100 80GB HBM3",
)


PriceBasis = Literal["price-list", "derived", "recalled"]


@dataclass(frozen=True)
class PriceSource:
    """One instance type's price and provenance."""

    usd_per_hour: float
    region: str
    basis: PriceBasis
    """'price-list': read from the AWS Price List API; 'derived' (from EC2's rate) or 'recalled': not read."""
    note: str = ""
    effective: str = ""
    """The on-demand term's effectiveDate (price-list only)."""
    sku: str = ""
    read_at: str = ""
    """When the Price List API was asked, UTC (price-list only)."""

    def describe(self) -> str:
        if self.basis == "price-list":
            return (
                f"${self.usd_per_hour:,.3f}/h in {self.region}: the AWS Price List API's SageMaker training on-demand "
                f"price (SKU {self.sku}, effective {self.effective}), read {self.read_at}"
            )
        return (
            f"${self.usd_per_hour:,.3f}/h in {self.region}, {self.basis}, not read from AWS "
            "(how: infra/cost/prices.json); "
            "`hlat prices --record` reads SageMaker's own from the AWS Price List API"
        )


def load_prices(path: Path = PRICES) -> dict[str, PriceSource]:
    entries = json.loads(path.read_text())["prices"]
    return {name: PriceSource(**entry) for name, entry in entries.items()}


@dataclass(frozen=True)
class Instance:
    name: str
    price_per_hour_usd: float
    accelerators: int
    """Devices per node: Trainium chips or GPUs (2 NeuronCores per chip)."""
    peak_bf16_flops: float
    """Peak dense BF16 FLOP/s of one node."""
    topology: Topology | None = None
    """Devices, memory and links of one node, for the planner; None where unknown (local)."""
    price: PriceSource | None = None
    """Where price_per_hour_usd comes from (None: local, free)."""


def _instance(name: str, accelerators: int, peak_bf16_flops: float, topology: Topology | None = None) -> Instance:
    price = _PRICES[name]
    return Instance(name, price.usd_per_hour, accelerators, peak_bf16_flops, topology, price)


_PRICES = load_prices()


CATALOG: dict[str, Instance] = {
    i.name: i
    for i in (
        # Prices and their sources: infra/cost/prices.json.
        _instance("ml.trn1.32xlarge", 16, 16 * 190e12, TRN1_TOPOLOGY),
        _instance("ml.p4d.24xlarge", 8, 8 * 312e12, P4D_TOPOLOGY),
        _instance("ml.p5.48xlarge", 8, 8 * 989e12, P5_TOPOLOGY),
        # CPU instances for the prepare-data job: set data.price_per_hour_usd for your region and discounts.
        *(_instance(name, 0, 0.0) for name in ("ml.c5.2xlarge", "ml.c5.4xlarge", "ml.c5.9xlarge", "ml.c5.18xlarge")),
        _instance("ml.m5.4xlarge", 0, 0.0),
        Instance("local", 0.0, 1, 0.0),
    )
}


def price_per_hour(instance_type: str, override: float | None = None) -> float:
    """Dollars per node-hour: the override, else the catalog.

    An unknown type without an override costs 0; budgets then cannot be enforced, and the stage says so."""
    if override is not None:
        return override
    known = CATALOG.get(instance_type)
    return known.price_per_hour_usd if known else 0.0


def job_cost(billable_seconds: float, instance_count: int, price: float) -> float:
    """SageMaker bills BillableTimeInSeconds x InstanceCount at the node-hour price."""
    return billable_seconds * instance_count * price / 3600.0


def tokens_per_s_at(instance: Instance, nodes: int, mfu: float, flops_per_token: float) -> float:
    """Training tokens/s of `nodes` nodes of `instance` at model-FLOPs utilisation `mfu`."""
    return nodes * instance.peak_bf16_flops * mfu / flops_per_token


@dataclass(frozen=True)
class InstanceCost:
    """Time and cost to train a token budget on `nodes` nodes of one instance type: the one cost arithmetic."""

    instance_type: str
    nodes: int
    tokens_per_s: float
    usd_per_node_hour: float
    tokens: float
    basis: str
    """How tokens_per_s was got: the planner's best layout, or a measured or assumed MFU."""
    data_parallel: str = ""
    """GPU rows: 'ddp' when a replica's weights, gradients and AdamW states fit one GPU, else 'fsdp'."""
    layout: Any = None
    """Trainium rows: the planner's Layout the throughput is for."""

    @property
    def hours(self) -> float:
        return self.tokens / self.tokens_per_s / 3600

    @property
    def usd(self) -> float:
        return self.hours * self.nodes * self.usd_per_node_hour

    @property
    def tokens_per_usd(self) -> float | None:
        return self.tokens / self.usd if self.usd else None

    def row(self) -> dict[str, Any]:
        return {
            "instance_type": self.instance_type,
            "nodes": self.nodes,
            "tokens_per_s": round(self.tokens_per_s),
            "days": round(self.hours / 24, 2),
            "usd": round(self.usd),
            "usd_per_node_hour": self.usd_per_node_hour,
            "tokens_per_usd": round(self.tokens_per_usd) if self.tokens_per_usd else None,
            "basis": self.basis,
            **({"data_parallel": self.data_parallel} if self.data_parallel else {}),
        }
