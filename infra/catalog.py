"""Instance catalog: node prices and peak throughput, for cost accounting, budgets and dry-run estimates.

Prices are on-demand dollars per node-hour from FACTS.md (trn1.32xlarge about $21.50, p4d.24xlarge $32.77); a
run's `job.price_per_hour_usd` overrides them (reserved or negotiated rates, other instance types).
`estimate_mfu` is the model-FLOPs utilisation assumed when estimating time to train before anything has run: for
trn1 it is derived from the published GPT-NeoX 20B and Pythia 6.9B throughput in FACTS.md (212 seq/s x 2048
tokens on 64 nodes: 6 x 20.6B x 434k tok/s over 64 x 3.04 PFLOP/s = 27%; Pythia 6.9B on 4 nodes: 25%).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Instance:
    name: str
    price_per_hour_usd: float
    accelerators: int
    """Devices per node: Trainium chips or GPUs (NeuronCores are 2 per chip)."""
    peak_bf16_flops: float
    """Peak dense BF16 FLOP/s of one node."""
    estimate_mfu: float


CATALOG: dict[str, Instance] = {
    i.name: i
    for i in (
        Instance("ml.trn1.32xlarge", 21.50, 16, 16 * 190e12, 0.25),
        # No measured or published training throughput for our models on p4d here: no time estimate (MFU 0).
        Instance("ml.p4d.24xlarge", 32.77, 8, 8 * 312e12, 0.0),
        Instance("local", 0.0, 1, 0.0, 0.0),
    )
}


def price_per_hour(instance_type: str, override: float | None = None) -> float:
    """Dollars per node-hour: the override when given, else the catalog; an unknown type without an override
    costs 0 (budgets then cannot be enforced, and the stage says so)."""
    if override is not None:
        return override
    known = CATALOG.get(instance_type)
    return known.price_per_hour_usd if known else 0.0


def job_cost(billable_seconds: float, instance_count: int, price: float) -> float:
    """SageMaker bills BillableTimeInSeconds x InstanceCount at the node-hour price."""
    return billable_seconds * instance_count * price / 3600.0
