"""Today's SageMaker training prices from the AWS Price List Query API (`hlat prices`).

The catalog's prices (`infra.cost.catalog`) are of one date and region; this asks AWS for now. `training_prices` reads
the
on-demand hourly price of each `ml.` type as a training instance ("ML Instance", `component` "Training";
https://docs.aws.amazon.com/aws-cost-management/latest/APIReference/API_pricing_GetProducts.html). The API answers in a
few regions only. It needs `pricing:GetProducts`; nothing else in a run calls it. `record_prices` writes the answers
into infra/cost/prices.json (`hlat prices --record`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hlat.infra.cost.catalog import PRICES, PriceSource

SERVICE_CODE = "AmazonSageMaker"
API_REGION = "us-east-1"
"""A region where the Price List Query API answers (ap-south-1 and eu-central-1 also do)."""


@dataclass(frozen=True)
class ListedPrice:
    instance_type: str
    region: str
    usd_per_hour: float
    effective: str
    """The on-demand term's `effectiveDate`."""
    sku: str


def price_filters(instance_type: str, region: str) -> list[dict[str, str]]:
    """GetProducts filters of one instance type as a SageMaker training instance in `region`."""
    terms = {"productFamily": "ML Instance", "component": "Training", "regionCode": region}
    terms["instanceName"] = instance_type
    return [{"Type": "TERM_MATCH", "Field": field, "Value": value} for field, value in terms.items()]


def on_demand_hourly(entry: dict[str, Any]) -> list[tuple[float, str, str]]:
    """(price, effective date, sku) per on-demand dimension of one Price List product, in USD per hour."""
    sku = entry.get("product", {}).get("sku", "")
    found = []
    for term in entry.get("terms", {}).get("OnDemand", {}).values():
        for dimension in term.get("priceDimensions", {}).values():
            usd = dimension.get("pricePerUnit", {}).get("USD")
            if usd is None or dimension.get("unit", "").lower() not in ("hrs", "hours", "hour"):
                continue
            found.append((float(usd), str(term.get("effectiveDate", ""))[:10], sku))
    return found


def training_prices(instance_types: Iterable[str], region: str, client: Any = None) -> dict[str, ListedPrice | None]:
    """On-demand SageMaker training price of each type in `region`; None where the type is not offered.

    `client` defaults to a us-east-1 `pricing` client. ValueError when one type lists several hourly prices."""
    if client is None:
        import boto3

        client = boto3.client("pricing", region_name=API_REGION)
    paginator = client.get_paginator("get_products")
    prices: dict[str, ListedPrice | None] = {}
    for instance_type in instance_types:
        listed: set[tuple[float, str, str]] = set()
        for page in paginator.paginate(
            ServiceCode=SERVICE_CODE, Filters=price_filters(instance_type, region), FormatVersion="aws_v1"
        ):
            for item in page.get("PriceList", []):
                listed.update(p for p in on_demand_hourly(json.loads(item)) if p[0] > 0)
        distinct = {p[0] for p in listed}
        if len(distinct) > 1:
            raise ValueError(
                f"{instance_type} in {region}: the price list has {len(distinct)} on-demand training prices "
                f"({', '.join(f'${p:g}' for p in sorted(distinct))}); set job.price_per_hour_usd to the one you pay"
            )
        if not listed:
            prices[instance_type] = None
            continue
        usd, effective, sku = max(listed, key=lambda p: p[1])
        prices[instance_type] = ListedPrice(instance_type, region, usd, effective, sku)
    return prices


def record_prices(listed: dict[str, ListedPrice | None], read_at: datetime, path: Path = PRICES) -> list[str]:
    """Write the Price List's answers into the price file at `path`; return the types recorded.

    Each figure gets its region, SKU, effective date and `read_at` (UTC); unpriced types keep their entry. The file
    is replaced atomically."""
    document = json.loads(path.read_text())
    when = read_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    recorded = []
    for name, price in listed.items():
        if price is None:
            continue
        source = PriceSource(
            usd_per_hour=price.usd_per_hour,
            region=price.region,
            basis="price-list",
            note="pricing:GetProducts, service AmazonSageMaker, product family ML Instance, component Training",
            effective=price.effective,
            sku=price.sku,
            read_at=when,
        )
        document["prices"][name] = asdict(source)
        recorded.append(name)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".prices-", suffix=".json")
    with os.fdopen(fd, "w") as out:
        json.dump(document, out, indent=2)
        out.write("\n")
    os.replace(temporary, path)
    return recorded
