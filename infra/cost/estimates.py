"""A run's estimates before it starts: training time and cost, the prepare-data job, a checkpoint save and a stop.

The training figure is the planner's (`run_cost`), the one `hlat plan` prints too. Data throughput is measured
(`measured.json`); the save and stop phases come from `core.stop_timeline`. Nothing here sends or writes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hlat.core.config import HlatConfig
from hlat.core.stages import DATA
from hlat.core.stop_timeline import stop_timeline
from hlat.infra.cost.catalog import CATALOG, Instance, measured, price_per_hour
from hlat.infra.cost.planner import run_cost


def estimate(config: HlatConfig) -> dict[str, Any]:
    """Hourly cost, and time and cost to train to max_steps with where its throughput comes from
    (`infra.cost.planner.run_cost`: the figure `hlat plan` prints too); hours None when no throughput is known."""
    job = config.job
    hourly = price_per_hour(job.instance_type, job.price_per_hour_usd) * job.instance_count
    out: dict[str, Any] = {"hourly_usd": hourly, "tokens": config.training.max_steps * config.tokens_per_step}
    cost = run_cost(config)
    out.update(
        hours=None if cost is None else cost.hours,
        total_usd=None if cost is None else cost.usd,
        tokens_per_s=None if cost is None else cost.tokens_per_s,
        basis=None if cost is None else cost.basis,
    )
    return out


def checkpoint_write_seconds(config: HlatConfig) -> float:
    """Estimated time of one synchronous checkpoint save, from the bytes each rank's files hold (FP32 master
    weights and moments where the format saves them): the copy to host memory, the paced writes at the assumed
    per-rank and per-host S3 rates, and rank 0's commit (`core.stop_timeline`, where the figures and their
    sources are; the job logs the save time it measures)."""
    timeline = stop_timeline(config, None, in_flight=False)
    return timeline.seconds("staging") + timeline.seconds("writes") + timeline.seconds("commit")


def stop_fit(config: HlatConfig, tokens_per_s: float | None) -> str:
    """Whether a stop (StopTrainingJob, max runtime, the budget) checkpoints inside the grace between SIGTERM and
    SIGKILL, in the worst case and phase by phase (`core.stop_timeline`): up to two steps to the stop's boundary,
    an async save in flight superseded, the save's staging, paced writes and commit."""
    step = config.tokens_per_step / tokens_per_s if tokens_per_s else None
    return stop_timeline(config, step).line()


BYTES_PER_TOKEN = 4.0
"""UTF-8 bytes of raw text per token of a LLaMA-style 32k BPE on English web text (HLAT's 1.8T tokens are about
7 TB of text); what prepare-data reads per training token, before duplicates and bad rows are dropped."""


@dataclass(frozen=True)
class DataEstimate:
    """Time and cost of the prepare-data job for the text behind a token budget."""

    bytes: float
    workers: int
    instances: int
    instance_type: str
    mb_per_s_per_worker: float
    usd_per_node_hour: float | None
    basis: str
    curation_mb_per_s_per_worker: float | None = None
    """The curation phases' rate (data.curation: any rule on), after the units' validation; None: no curation."""

    @property
    def hours(self) -> float:
        seconds_per_mb = 1 / self.mb_per_s_per_worker + (
            1 / self.curation_mb_per_s_per_worker if self.curation_mb_per_s_per_worker else 0
        )
        return self.bytes / 1e6 * seconds_per_mb / self.workers / 3600

    @property
    def usd(self) -> float | None:
        return None if self.usd_per_node_hour is None else self.hours * self.instances * self.usd_per_node_hour

    def line(self) -> str:
        price = (
            f"${self.usd:,.2f} at ${self.usd_per_node_hour:,.3f}/node-hour"
            if self.usd is not None
            else f"no price for {self.instance_type} in the catalog: set data.price_per_hour_usd"
        )
        return (
            f"prepare-data: {self.bytes / 1e12:,.2f} TB of text in {self.hours:,.2f} h on {self.workers} worker(s) "
            f"({self.instances} x {self.instance_type}) at {self.mb_per_s_per_worker:g} MB/s per worker"
            + (
                f" to validate and {self.curation_mb_per_s_per_worker:g} MB/s to curate"
                if self.curation_mb_per_s_per_worker
                else ""
            )
            + f", {price} ({self.basis})"
        )


def data_estimate(config: HlatConfig, tokens: float | None = None) -> DataEstimate:
    """The prepare-data job for `tokens` (None: the run's training tokens) at BYTES_PER_TOKEN, with the per-worker
    throughput benchmarks/bench_prepare_data measured (infra/cost/measured.json)."""
    d = config.data
    tokens = config.training.max_steps * config.tokens_per_step if tokens is None else tokens
    figures = measured("prepare_data")
    sagemaker = config.job.backend == "sagemaker"
    instance_type = d.instance_type if sagemaker else "local"
    price = d.price_per_hour_usd if d.price_per_hour_usd is not None else CATALOG.get(instance_type, None)
    hourly = price.price_per_hour_usd if isinstance(price, Instance) else price
    return DataEstimate(
        bytes=tokens * BYTES_PER_TOKEN,
        workers=d.workers,
        instances=DATA.instance_count(config),
        instance_type=instance_type,
        mb_per_s_per_worker=float(figures["mb_per_s_per_worker"]),
        usd_per_node_hour=hourly,
        basis=f"{BYTES_PER_TOKEN:g} bytes/token; throughput measured {figures['measured']} on {figures['machine']}",
        curation_mb_per_s_per_worker=(
            float(measured("curation")["mb_per_s_per_worker"]) if d.curation.any_rule else None
        ),
    )


def for_tokens(config: HlatConfig, tokens: float) -> HlatConfig:
    """`config` trained for `tokens` (`hlat plan --tokens`): training.max_steps the steps that draw them."""
    steps = max(1, math.ceil(tokens / config.tokens_per_step))
    return config.model_copy(update={"training": config.training.model_copy(update={"max_steps": steps})})
