"""`hlat prices`: today's SageMaker prices from the AWS Price List API, beside the catalog's."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from hlat.commands.planning import columns
from hlat.core.config import ConfigError
from hlat.core.presets import load_config
from hlat.infra.cost.catalog import CATALOG, PRICES
from hlat.infra.cost.pricing import API_REGION, ListedPrice, record_prices, training_prices


def prices(args: argparse.Namespace, overrides: dict[str, Any]) -> int:

    config = load_config(args.preset, overrides)
    region = args.region or config.job.region
    types = args.instance_types or [name for name in CATALOG if name.startswith("ml.")]
    try:
        listed = training_prices(types, region)
    except (BotoCoreError, ClientError) as exc:  # no credentials, no network, access denied: one line, the cause
        raise ConfigError(
            f"the AWS Price List API ({API_REGION}) did not answer: {type(exc).__name__}: {exc}; it needs AWS "
            "credentials allowed pricing:GetProducts"
        ) from exc
    print(prices_table(types, region, listed, config.job.instance_type))
    if args.record:
        recorded = record_prices(listed, datetime.now(UTC))
        print(f"recorded {len(recorded)} price(s) from the AWS Price List API ({region}) in {PRICES}")
    return 0


def prices_table(types: list[str], region: str, listed: dict[str, ListedPrice | None], run_type: str) -> str:
    """The catalog's price of each type beside the Price List's, and the setting that uses the listed one."""

    rows = [("instance type", "catalog $/h", "catalog's source", f"AWS Price List, {region}, $/h", "since")]
    for name in types:
        known, now = CATALOG.get(name), listed.get(name)
        source: str = known.price.basis if known and known.price else "-"
        if known and known.price and known.price.basis == "price-list":
            source = f"price list, {known.price.region}, read {known.price.read_at[:10]}"
        rows.append(
            (
                name,
                f"{known.price_per_hour_usd:,.3f}" if known else "-",
                source,
                f"{now.usd_per_hour:,.3f}" if now else "not offered",
                now.effective if now else "",
            )
        )
    lines = columns(rows)
    ours = listed.get(run_type)
    if ours is not None:
        lines.append(f"this run ({run_type}): --set job.price_per_hour_usd={ours.usd_per_hour:g}")
    others = {n: p.usd_per_hour for n, p in listed.items() if p is not None}
    if others:
        lines.append(f"the planner: --set 'planner.prices_usd_per_hour={json.dumps(others)}'")
    return "\n".join(lines)
