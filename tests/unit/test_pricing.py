"""`hlat prices`: SageMaker training prices from the AWS Price List API, through the seam AWS cannot be reached at:
botocore's Stubber checks each GetProducts request against the `pricing` service model and answers with price-list
entries in the API's documented format."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from hlat.infra.cost.pricing import SERVICE_CODE, price_filters, training_prices


def entry(instance: str, region: str, usd: str, effective: str = "2026-10-01T00:00:00Z", sku: str = "SKU1") -> str:
    """One PriceList item as GetProducts returns it: a JSON string (product, on-demand terms, price dimensions)."""
    term = f"{sku}.JRTCKXETXF"
    return json.dumps(
        {
            "product": {
                "productFamily": "ML Instance",
                "attributes": {"instanceName": instance, "component": "Training", "regionCode": region},
                "sku": sku,
            },
            "serviceCode": SERVICE_CODE,
            "terms": {
                "OnDemand": {
                    term: {
                        "priceDimensions": {
                            f"{term}.6YS6EN2CT7": {
                                "unit": "Hrs",
                                "description": f"${usd} per {instance} training instance hour",
                                "pricePerUnit": {"USD": usd},
                            }
                        },
                        "sku": sku,
                        "effectiveDate": effective,
                        "offerTermCode": "JRTCKXETXF",
                    }
                }
            },
        }
    )


@pytest.fixture
def pricing() -> Iterator[tuple[Any, Stubber]]:
    client = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")
    with Stubber(client) as stub:
        yield client, stub


def expect(stub: Stubber, instance: str, region: str, items: list[str], token: str | None = None) -> None:
    params: dict[str, Any] = {
        "ServiceCode": SERVICE_CODE, "Filters": price_filters(instance, region), "FormatVersion": "aws_v1"
    }  # fmt: skip
    if token:
        params["NextToken"] = token
    stub.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": items}, params)


def test_each_type_gets_its_on_demand_training_price_in_the_region(pricing: tuple[Any, Stubber]) -> None:
    client, stub = pricing
    expect(stub, "ml.trn1.32xlarge", "us-west-2", [entry("ml.trn1.32xlarge", "us-west-2", "24.7250000000")])
    expect(stub, "ml.p4d.24xlarge", "us-west-2", [])  # not offered there
    prices = training_prices(["ml.trn1.32xlarge", "ml.p4d.24xlarge"], "us-west-2", client)
    stub.assert_no_pending_responses()
    trn1 = prices["ml.trn1.32xlarge"]
    assert trn1 is not None and (trn1.usd_per_hour, trn1.effective, trn1.region) == (24.725, "2026-10-01", "us-west-2")
    assert prices["ml.p4d.24xlarge"] is None


def test_a_type_listed_at_two_prices_is_refused_with_the_setting_to_use(pricing: tuple[Any, Stubber]) -> None:
    client, stub = pricing
    two = [entry("ml.trn1.32xlarge", "us-east-1", usd, sku=sku) for usd, sku in (("24.725", "A"), ("30", "B"))]
    expect(stub, "ml.trn1.32xlarge", "us-east-1", two)
    with pytest.raises(ValueError, match=r"2 on-demand training prices \(\$24.725, \$30\); set job.price_per_hour_usd"):
        training_prices(["ml.trn1.32xlarge"], "us-east-1", client)


def test_the_table_shows_both_prices_and_the_settings_that_use_todays() -> None:
    from hlat.commands.prices import prices_table
    from hlat.infra.cost.pricing import ListedPrice

    listed = {
        "ml.trn1.32xlarge": ListedPrice("ml.trn1.32xlarge", "us-west-2", 21.0, "2026-10-01", "A"),
        "ml.p5.48xlarge": None,
    }
    text = prices_table(["ml.trn1.32xlarge", "ml.p5.48xlarge"], "us-west-2", listed, "ml.trn1.32xlarge")
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:3]}
    assert rows["ml.trn1.32xlarge"] == ["ml.trn1.32xlarge", "24.725", "derived", "21.000", "2026-10-01"]
    assert rows["ml.p5.48xlarge"] == ["ml.p5.48xlarge", "113.068", "derived", "not", "offered"]
    assert "this run (ml.trn1.32xlarge): --set job.price_per_hour_usd=21" in text
    assert """--set 'planner.prices_usd_per_hour={"ml.trn1.32xlarge": 21.0}'""" in text


def test_without_aws_the_command_fails_in_one_line_naming_the_permission(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hlat.cli import main
    from tests.integration.conftest import free_port

    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # a closed port: nothing leaves
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    assert main(["prices", "--preset", "hlat-7b", "--instance-type", "ml.trn1.32xlarge"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hlat: error: the AWS Price List API (us-east-1) did not answer: ")
    assert err[0].endswith("it needs AWS credentials allowed pricing:GetProducts")


def test_recorded_prices_replace_derived_ones_with_what_the_list_said_and_when(tmp_path: Path) -> None:
    """`hlat prices --record`: the listed figure, its SKU, effective date and the time it was read go into the price
    file; types the list did not price keep their entry, and the catalog then describes the figure as the list's."""
    from hlat.infra.cost.catalog import PRICES, load_prices
    from hlat.infra.cost.pricing import ListedPrice, record_prices

    path = tmp_path / "prices.json"
    shutil.copy(PRICES, path)
    before = load_prices(path)
    assert before["ml.trn1.32xlarge"].basis == "derived"
    assert "derived, not read from AWS" in before["ml.trn1.32xlarge"].describe()
    listed = {
        "ml.trn1.32xlarge": ListedPrice("ml.trn1.32xlarge", "us-east-1", 24.7251, "2026-10-01", "SKU7"),
        "ml.p5.48xlarge": None,
    }
    read_at = datetime(2026, 11, 27, 23, 0, tzinfo=UTC)
    assert record_prices(listed, read_at, path) == ["ml.trn1.32xlarge"]
    after = load_prices(path)
    trn1 = after["ml.trn1.32xlarge"]
    assert (trn1.usd_per_hour, trn1.basis, trn1.sku, trn1.effective, trn1.read_at) == (
        24.7251,
        "price-list",
        "SKU7",
        "2026-10-01",
        "2026-11-27T23:00:00Z",
    )
    assert trn1.describe().startswith("$24.725/h in us-east-1: the AWS Price List API's SageMaker training")
    assert after["ml.p5.48xlarge"] == before["ml.p5.48xlarge"]
    assert [p.name for p in tmp_path.iterdir()] == ["prices.json"]  # no temporary file left


def test_every_catalog_price_says_where_it_comes_from() -> None:
    from hlat.infra.cost.catalog import CATALOG

    for name, instance in CATALOG.items():
        if name == "local":
            continue
        price = instance.price
        assert price is not None and price.usd_per_hour == instance.price_per_hour_usd, name
        assert price.region and (price.note if price.basis != "price-list" else price.sku and price.read_at), name


def test_the_plan_says_where_its_price_comes_from() -> None:
    from hlat.core.presets import load_config
    from hlat.infra.cost.planner import plan, price_source

    assert plan(load_config("hlat-7b"), nodes=4).notes == [f"price: {price_source(load_config('hlat-7b'), TRN1)}"]
    assert "derived, not read from AWS" in price_source(load_config("hlat-7b"), TRN1)
    own = load_config("hlat-7b", {"job.price_per_hour_usd": 20.0})
    assert price_source(own, TRN1) == f"{TRN1}: job.price_per_hour_usd"
    listed = load_config("hlat-7b", {"planner.prices_usd_per_hour": {TRN1: 19.0}})
    assert price_source(listed, TRN1) == f"{TRN1}: planner.prices_usd_per_hour"


TRN1 = "ml.trn1.32xlarge"


def test_the_dry_run_says_where_the_node_price_comes_from() -> None:
    from hlat.core.presets import load_config
    from hlat.infra.dry_run import dry_run

    storage = {"storage.root": "s3://bucket/runs", "job.role_arn": "arn:aws:iam::123456789012:role/hlat"}
    lines = dry_run(load_config("hlat-7b", storage)).splitlines()
    price = lines[next(i for i, line in enumerate(lines) if line.startswith("cost: ")) + 1]
    assert price.startswith("price: $24.725/h in us-east-1, derived, not read from AWS"), price
    own = dry_run(load_config("hlat-7b", {**storage, "job.price_per_hour_usd": 20.0}))
    assert "price: job.price_per_hour_usd" in own.splitlines()
