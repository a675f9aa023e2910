"""The simulated SageMaker's one model of time, bandwidth and price: every figure the simulation (tests/scale/sim.py)
runs on, each with where it comes from. Where the project's own code computes a figure (the plan's step time, the
price, the checkpoint write estimate, the stop's timeline, the watchdog's bound), this module calls that code; what
is left are assumptions about the platform, named as such.

Sources:
- SageMaker's job statuses and secondary statuses (Starting, Downloading, Training, Stopping, Stopped,
  MaxRuntimeExceeded, Completed, Failed) and FailureReason's 1,024 characters: DescribeTrainingJob,
  https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_DescribeTrainingJob.html
- The stop: SIGTERM, then SIGKILL 120 s later (StopTrainingJob, and MaxRuntimeInSeconds through it):
  https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_StopTrainingJob.html
- FailureReason is the failure file (/opt/ml/output/failure) with "AlgorithmError: " before it (as the SageMaker
  training toolkit reports a user script's failure; the project's emulator does the same):
  https://docs.aws.amazon.com/sagemaker/latest/dg/your-algorithms-training-algo-output.html
- S3: 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD requests per second per partitioned prefix:
  https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html
- gloo's ring all-reduce: 2(P-1) sequential hops, each a message to the next rank
  (https://github.com/facebookincubator/gloo, gloo/allreduce_ring.h); a full-mesh ProcessGroupGloo has every rank
  connect to every other: P-1 sockets per rank per group (https://pytorch.org/docs/stable/distributed.html, "Gloo").
- Prices: the project's instance catalog (`infra.cost.catalog.price_per_hour`); the step time: the planner's estimate
  for the preset's layout (`infra.cost.estimates.estimate`, the figure the dry run prints); the checkpoint write:
  `infra.cost.estimates.checkpoint_write_seconds` (the dry run's estimate).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from hlat.core.config import HlatConfig
from hlat.core.contract import MAX_FAILURE_REASON
from hlat.core.presets import load_config
from hlat.infra.cost.catalog import price_per_hour
from hlat.infra.cost.estimates import checkpoint_write_seconds, estimate

RANKS_PER_HOST = 32
"""trn1.32xlarge: 16 Trainium chips x 2 NeuronCores, one rank per NeuronCore (the presets' processes_per_node)."""

STOP_GRACE_S = 120.0
"""SageMaker's time between SIGTERM and SIGKILL (StopTrainingJob)."""
FAILURE_REASON_MAX = MAX_FAILURE_REASON
"""DescribeTrainingJob's FailureReason: at most 1,024 characters."""
ALGORITHM_ERROR = "AlgorithmError: "
"""What SageMaker puts before the failure file's text in FailureReason."""

S3_PUT_PER_S = 3500.0
S3_GET_PER_S = 5500.0
"""S3's request rates per partitioned prefix."""

# -- assumptions about the platform (no AWS figure exists; each scenario may change them) -----------------------------
STARTING_S = 300.0
"""Assumed: SageMaker's Starting (provisioning the instances) for a large trn1 cluster."""
DOWNLOADING_S = 300.0
"""Assumed: Downloading (image pull and input channels: code, tokenizer; the data is streamed)."""
STARTUP_S = 900.0
"""Assumed: Training to the first step (torchrun rendezvous, process groups, the compile cache's graphs loaded,
the checkpoint read)."""
FAILURE_SEEN_S = 60.0
"""Assumed: from a rank's failure to SageMaker's Failed (the other ranks' collectives fail, torchrun and the
driver exit, the instances are released)."""
PEER_RECORD_S = 5.0
"""Assumed: from the first rank's failure to its peers' 'connection closed by peer' records."""
GLOO_HOP_S = 20e-6
"""Assumed: one message of gloo's ring (a 1-element tensor) between two ranks on the cluster network: 10-30 us is
TCP's round trip inside one placement group; the middle is taken."""
STORE_OP_S = 1e-3
"""Assumed: one small request to torchrun's TCPStore from a rank on another host (a round trip and the store's
work): what a stop vote through the store would pay per step for each request it sent at a step boundary."""
GLOO_MESH_INIT_S_AT_8192 = 46 * 60.0
"""ProcessGroupGloo's full-mesh formation at 8,192 ranks as pytorch/gloo PR #407 reports it (46 min; every rank
reads every other rank's address from one TCPStore, so it grows with P squared)."""
GLOO_TIMEOUT_S = 30 * 60.0
"""torch.distributed's default timeout of a gloo group (30 min): a formation longer than this fails."""
NOFILE_SOFT_LIMIT = 65536
"""Assumed: the open-file soft limit a container starts with (Docker's default for its daemon's containers is
1,048,576 on recent releases, 65,536 on older ones: the lower is taken)."""
BILLING_STARTS_AT = "Downloading"
"""Assumed: billing (BillableTimeInSeconds) starts when the instances are up, at Downloading, and MaxRuntimeInSeconds
counts from there too."""


def step_seconds(config: HlatConfig) -> float:
    """The planned step time: tokens per step over the planner's tokens/s for the preset's layout (the dry run's)."""
    tokens_per_s = estimate(config)["tokens_per_s"]
    if not tokens_per_s:
        raise ValueError(f"{config.preset}: the planner has no throughput for {config.job.instance_type}")
    return config.tokens_per_step / tokens_per_s


def gloo_vote_seconds(ranks: int) -> float:
    """One per-step stop vote as a full-world gloo all-reduce of one element: 2(P-1) sequential hops of the ring."""
    return 2 * (ranks - 1) * GLOO_HOP_S


def gloo_mesh_init_seconds(ranks: int) -> float:
    """Forming a full-mesh gloo group over `ranks` ranks, scaled from PR #407's 8,192-rank figure by P squared."""
    return GLOO_MESH_INIT_S_AT_8192 * (ranks / 8192) ** 2


def gloo_sockets_per_rank(ranks: int, groups: int = 1) -> int:
    """Sockets one rank holds for `groups` full-mesh gloo groups over `ranks` ranks (P-1 each)."""
    return groups * (ranks - 1)


@dataclass(frozen=True)
class Scale:
    """One preset at its full scale: its config and every figure the simulation runs it with."""

    preset: str
    hosts: int
    config: HlatConfig
    node_price: float
    """Dollars per node-hour (the catalog's)."""
    step_s: float
    save_s: float
    """One checkpoint's write and commit (the dry run's estimate of the write)."""
    starting_s: float = STARTING_S
    downloading_s: float = DOWNLOADING_S
    startup_s: float = STARTUP_S
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return self.hosts * RANKS_PER_HOST

    @property
    def hourly(self) -> float:
        """Dollars per hour of the whole job."""
        return self.node_price * self.hosts

    def usd(self, seconds: float) -> float:
        """What `seconds` of the whole job cost."""
        return seconds * self.hourly / 3600.0

    @property
    def checkpoint_every(self) -> int:
        return self.config.training.checkpoint_every

    @property
    def interval_s(self) -> float:
        """Seconds between two checkpoints."""
        return self.checkpoint_every * self.step_s

    def ideal_usd(self, steps: int) -> float:
        """The cost of training `steps` steps in one job with nothing going wrong: a start (billed from
        Downloading), the steps, and one checkpoint save per interval (synchronous: an upper bound)."""
        saves = math.ceil(steps / self.checkpoint_every)
        return self.usd(self.downloading_s + self.startup_s + steps * self.step_s + saves * self.save_s)


PRESETS = {"hlat-70b": 256, "hlat-7b": 64}
"""The presets the scenarios run at, and their hosts."""


@functools.cache
def scale(preset: str, **overrides: Any) -> Scale:
    """The preset at its own scale, with config overrides (dotted keys: job.poll_seconds...)."""
    config = load_config(preset, dict(overrides) or None, run_id=f"{preset}-sim")
    hosts = config.job.instance_count
    assert hosts == PRESETS[preset] and config.job.processes_per_node == RANKS_PER_HOST
    return Scale(
        preset=preset,
        hosts=hosts,
        config=config,
        node_price=price_per_hour(config.job.instance_type, config.job.price_per_hour_usd),
        step_s=step_seconds(config),
        save_s=checkpoint_write_seconds(config),
    )


def failure_reason(failure_file: str) -> str:
    """DescribeTrainingJob's FailureReason of a job whose reported host wrote `failure_file`."""
    return (ALGORITHM_ERROR + failure_file)[:FAILURE_REASON_MAX]
