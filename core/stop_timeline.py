"""The stop's timeline: SIGTERM to the committed checkpoint, phase by phase, against SageMaker's grace.

`stop_timeline` adds the phases up from the config and the job's measurements. The dry run prints it, the job logs it at
a stop, scale tests time stops with it. `OLD_PLAN` is the stop before issue 50, kept for comparison. Pure arithmetic.
Constants cite a source or say they are assumed; docs/multi-host.md has the figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hlat.core.config import HlatConfig
from hlat.core.environment import neuron_sdk, on_trainium, precision_by_flags
from hlat.core.storage import S3_MAX_POOL_CONNECTIONS

# -- constants, each with its source ----------------------------------------------------------------------

SAGEMAKER_GRACE_S = 120.0
"""Seconds from SIGTERM to the kill: "delays job termination for 120 seconds"
(https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_StopTrainingJob.html); MaxRuntimeInSeconds alike."""

WRITE_MB_S_PER_RANK = 200.0
"""Assumed S3 write rate of one rank streaming a file (one multipart upload); not measured on trn1."""

WRITE_GB_S_PER_HOST = 5.0
"""Assumed ceiling of one trn1.32xlarge host's S3 writes: under half of the ~100 Gb/s S3 serves a large instance
(https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html)."""

STAGING_GB_S_PER_RANK = 1.0
"""Assumed rate of one rank's device-to-host copy of its state; not measured on trn1."""

PART_BYTES = 512 << 20
"""Multipart part size of checkpoint files (a test checks it equals serialization.CHECKPOINT_PART_SIZE).

An upload can be cut only between parts, so superseding a save waits for at most one."""

RANK_FILE_BYTES = 64 << 10
"""A rank file without optimizer states: RNG states and the loader's position (tens of KiB)."""

S3_SMALL_REQUEST_S = 0.03
S3_SLOW_SHARE = 0.01
S3_SLOW_REQUEST_S = 2.0
"""Average seconds of a small S3 request: 30 ms, plus 1% retried after 2 s.

AWS: "median latencies are often in the tens of milliseconds range"
(https://docs.aws.amazon.com/whitepapers/latest/s3-optimizing-performance-best-practices/timeouts-and-retries-for-latency-sensitive-applications.html).
"""

S3_LIST_PAGE_KEYS = 1000
"""ListObjectsV2 returns at most 1,000 keys a request
(https://docs.aws.amazon.com/AmazonS3/latest/API/API_ListObjectsV2.html)."""

S3_LIST_PAGE_S = 0.1
"""Assumed time of one 1,000-key listing page: twice a small request."""

COMMIT_POLL_S = 0.5
"""Rank 0's longest wait between listings while it waits for every rank's files (`_wait_for_files`)."""

S3FS_DEFAULT_POOL = 10
"""botocore's default max_pool_connections (https://docs.aws.amazon.com/botocore/latest/reference/config.html).

s3fs's client uses it, so it bounded rank 0's manifest reads before issue 50."""

WRITE_REQUESTS_PER_RANK = 2
"""Paced requests per rank: its rank file and its manifest."""


# -- what each rank writes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter a checkpoint holds, in torch's dtypes; under torch-xla's flags these differ from the
    device's."""

    weights: int
    optimizer: int
    """The optimizer's state: AdamW's two moments, plus master weights where saved."""
    optimizer_in_rank_files: bool
    """ZeRO-1: each data-parallel rank's part of the optimizer state is in its rank file, not with the weights."""


def state_bytes(config: HlatConfig) -> StateBytes:
    """Bytes per parameter of a checkpoint of `config`, by the training code's rules.

    Weights are BF16 for bf16-sr's cast model, else FP32. Moments match the weights, except FP64 masters and
    moments for bf16-mixed under XLA_DOWNCAST_BF16 (NxD trainer/trainer.py). ZeRO-1 masters are saved only where
    `zero1_masters_outrank_parameters` says; a test checks the rules agree."""
    mode = config.precision.mode
    flags = precision_by_flags(config, on_trainium(config) or config.training.device == "xla")
    weights = 2 if mode == "bf16-sr" and not flags else 4
    if not config.parallelism.zero1:
        optimizer = 24 if mode == "bf16-mixed" and flags else 2 * weights
        return StateBytes(weights, optimizer, optimizer_in_rank_files=False)
    sdk_flags = neuron_sdk(config).precision_flags
    dtype = 8 if mode == "bf16-mixed" and sdk_flags else 4
    masters_saved = (mode == "bf16-mixed" and sdk_flags) or (mode == "bf16-sr" and not sdk_flags)
    return StateBytes(weights, dtype * (3 if masters_saved else 2), optimizer_in_rank_files=True)


@dataclass(frozen=True)
class CheckpointShape:
    """One checkpoint of a job: who writes how many bytes, and where the writers sit."""

    world: int
    ranks_per_host: int
    writers: tuple[int, ...]
    """Global ranks that write a shard or shared file, in the manager's shard order; each also writes a rank file."""
    shard_bytes: int
    rank_bytes: int
    distributed: bool = False
    """FSDP2: every rank writes its own part of model and optimizer (DCP) in `rank_bytes`."""

    @property
    def files(self) -> int:
        """Objects in the step's folder at commit: shard files, rank files, manifests, meta.json."""
        return len(self.writers) + 2 * self.world

    def bytes_of(self, rank: int, writer: bool) -> int:
        return self.rank_bytes + (self.shard_bytes if writer else 0)


def checkpoint_shape(config: HlatConfig) -> CheckpointShape:
    """The files one checkpoint of `config` writes (training.checkpoint.formats).

    NxD: a shard file per (tensor, pipeline) position, written by rank p x data x tensor + t. FSDP2: an equal part
    per rank. Otherwise rank 0 writes one shared file."""
    dims = config.parallel_dims
    world = dims.world_size
    params = config.model.num_params()
    sb = state_bytes(config)
    per_host = max(1, config.job.processes_per_node)
    if config.parallelism.fsdp and world > 1:
        return CheckpointShape(
            world, per_host, (0,), RANK_FILE_BYTES, RANK_FILE_BYTES + params * (sb.weights + sb.optimizer) // world,
            distributed=True,
        )  # fmt: skip
    if dims.splits_model or config.parallelism.zero1:
        shards = dims.tensor * dims.pipeline
        names = sorted((t, p) for t in range(dims.tensor) for p in range(dims.pipeline))  # tpNN-ppNN, sorted
        writers = tuple(p * dims.data * dims.tensor + t for t, p in names)
        optimizer_in_shard = 0 if sb.optimizer_in_rank_files else sb.optimizer
        rank_optimizer = params * sb.optimizer // world if sb.optimizer_in_rank_files else 0
        return CheckpointShape(
            world, per_host, writers, params * (sb.weights + optimizer_in_shard) // shards,
            RANK_FILE_BYTES + rank_optimizer,
        )  # fmt: skip
    return CheckpointShape(world, per_host, (0,), params * (sb.weights + sb.optimizer), RANK_FILE_BYTES)


# -- how the job goes about a stop -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StopPlan:
    name: str
    manifest_connections: int
    """Rank 0's manifest reads in flight at once."""
    supersede_in_flight: bool
    """An async save running at the stop is cut at its next part and left uncommitted, not waited for."""
    writers_first: bool
    """Pacing puts shard writers first (`write_start_seconds`), not every rank in rank order."""
    steps_to_stop: int = 2
    """Worst-case steps from SIGTERM to the stop boundary: 1 for a per-step vote, 2 for a stop step agreed via the
    store."""
    write_rate: float = 2000.0
    """Requests a second that all ranks together start (the manager's write_rate)."""


OLD_PLAN = StopPlan(
    "before issue 50", S3FS_DEFAULT_POOL, supersede_in_flight=False, writers_first=False, steps_to_stop=1
)
PLAN = StopPlan("now", S3_MAX_POOL_CONNECTIONS, supersede_in_flight=True, writers_first=True, steps_to_stop=2)


def write_start_seconds(
    rank: int, world_size: int, rate: float | None, writer_index: int | None = None, writers: int = 0
) -> float:
    """Seconds after a save begins that `rank` first writes, pacing all ranks to about `rate` requests a second.

    S3 takes 3,500 PUTs a second per prefix (https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html).
    Shard writers (`writer_index`) go first, as they have most to write."""
    if not rate or world_size <= 1:
        return 0.0
    position = writer_index if writer_index is not None else writers + rank
    return position * WRITE_REQUESTS_PER_RANK / rate


# -- the timeline ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    note: str = ""


@dataclass(frozen=True)
class StopTimeline:
    """A stop's phases from SIGTERM, worst case, in order; `total` is their sum."""

    phases: tuple[Phase, ...]
    grace: float
    plan: StopPlan
    measured: tuple[str, ...] = field(default=())
    """Which figures came from the job's own measurements."""

    @property
    def total(self) -> float:
        return sum(p.seconds for p in self.phases)

    def seconds(self, name: str) -> float:
        return sum(p.seconds for p in self.phases if p.name == name)

    def fits(self, grace: float | None = None) -> bool:
        return self.total <= (self.grace if grace is None else grace)

    def line(self) -> str:
        """`stop: 33 s of the 120 s grace from SIGTERM, fits: to the vote 9.3 s + ... (plan: now)`."""
        verdict = (
            "fits"
            if self.fits()
            else "does NOT fit: the stop ends in SIGKILL and loses the steps since the last checkpoint"
        )
        parts = " + ".join(f"{p.name} {p.seconds:,.1f} s" + (f" ({p.note})" if p.note else "") for p in self.phases)
        return f"stop: {self.total:,.0f} s of the {self.grace:g} s grace from SIGTERM, {verdict}: {parts}"


def grace_seconds(config: HlatConfig) -> float:
    """Seconds from SIGTERM to SIGKILL: SageMaker's 120, or the local backend's job.stop_grace_seconds."""
    return config.job.stop_grace_seconds if config.job.backend == "local" else SAGEMAKER_GRACE_S


def _writes(shape: CheckpointShape, plan: StopPlan) -> tuple[float, str]:
    """When the last rank's files are written: paced starts at the per-rank rate, capped by the host's ceiling."""
    rank_s = WRITE_MB_S_PER_RANK * 1e6
    host_s = WRITE_GB_S_PER_HOST * 1e9
    writer_of = {rank: i for i, rank in enumerate(shape.writers)}
    hosts = -(-shape.world // shape.ranks_per_host)
    host_bytes = [shape.rank_bytes * min(shape.ranks_per_host, shape.world - h * shape.ranks_per_host)
                  for h in range(hosts)]  # fmt: skip
    for rank in shape.writers:
        host_bytes[rank // shape.ranks_per_host] += shape.shard_bytes

    def start(rank: int) -> float:
        if plan.writers_first:
            return write_start_seconds(rank, shape.world, plan.write_rate, writer_of.get(rank), len(shape.writers))
        return write_start_seconds(rank, shape.world, plan.write_rate)

    def done(rank: int) -> float:
        own = shape.bytes_of(rank, rank in writer_of) / rank_s
        return start(rank) + max(own, host_bytes[rank // shape.ranks_per_host] / host_s)

    # The latest finisher is a writer, or the last rank of some host in pacing order (same bytes as its peers).
    candidates = set(shape.writers) | {min(shape.world, (h + 1) * shape.ranks_per_host) - 1 for h in range(hosts)}
    last = max(candidates, key=done)
    busiest = max(host_bytes)
    note = (
        f"the last rank starts {max(start(r) for r in candidates):,.1f} s in; {shape.shard_bytes / 1e9:,.2f} GB a "
        f"shard, {shape.rank_bytes / 1e6:,.1f} MB a rank file, {busiest / 1e9:,.1f} GB on the busiest host"
    )
    return done(last), note


def _commit(shape: CheckpointShape, plan: StopPlan) -> tuple[float, str]:
    """Rank 0's commit after the last file: a poll wait, a full listing, every manifest, meta.json, COMMITTED."""
    pages = math.ceil(shape.files / S3_LIST_PAGE_KEYS)
    listing = COMMIT_POLL_S + 2 * pages * S3_LIST_PAGE_S
    request = S3_SMALL_REQUEST_S + S3_SLOW_SHARE * S3_SLOW_REQUEST_S
    manifests = shape.world - 1
    reads = math.ceil(manifests / max(1, plan.manifest_connections)) * request
    marker = 2 * request
    note = (
        f"listing {pages} page{'s' if pages != 1 else ''} {listing:,.1f} s, {manifests:,} manifests over "
        f"{plan.manifest_connections} connections {reads:,.1f} s"
    )
    return listing + reads + marker, note


def _staging(shape: CheckpointShape) -> float:
    busiest = shape.bytes_of(0, True) if shape.writers else shape.rank_bytes
    return busiest / (STAGING_GB_S_PER_RANK * 1e9)


def _cut(shape: CheckpointShape) -> float:
    """Worst-case time to supersede an in-flight save: each writer on the busiest host finishes its current part."""
    part = min(PART_BYTES, shape.shard_bytes + shape.rank_bytes)
    writers_per_host = max(
        sum(1 for r in shape.writers if r // shape.ranks_per_host == h)
        for h in {r // shape.ranks_per_host for r in shape.writers}
    )
    return max(part / (WRITE_MB_S_PER_RANK * 1e6), writers_per_host * part / (WRITE_GB_S_PER_HOST * 1e9))


def stop_timeline(
    config: HlatConfig,
    step_seconds: float | None = None,
    *,
    save_seconds: float | None = None,
    since_sigterm: float | None = None,
    in_flight: bool | None = None,
    in_flight_left_s: float | None = None,
    plan: StopPlan = PLAN,
    grace: float | None = None,
) -> StopTimeline:
    """The stop's worst case from SIGTERM for `config` under `plan`.

    Given figures replace modelled ones: `step_seconds` (None: left out), `since_sigterm`, `save_seconds` and
    `in_flight_left_s`. `in_flight` None assumes the worst case when async checkpoints are on."""
    shape = checkpoint_shape(config)
    measured: list[str] = []
    phases: list[Phase] = []
    if since_sigterm is not None:
        measured.append("to the vote")
        phases.append(Phase("to the vote", since_sigterm, "since SIGTERM"))
    elif step_seconds is None:
        phases.append(Phase("to the vote", 0.0, "step time unknown: add up to a step"))
    else:
        steps = plan.steps_to_stop
        note = "the step in progress" if steps <= 1 else f"up to {steps} steps: the one in progress and the next"
        phases.append(Phase("to the vote", steps * step_seconds, note))
    writes, writes_note = _writes(shape, plan)
    commit, commit_note = _commit(shape, plan)
    staging = _staging(shape)
    if in_flight is None:
        in_flight = config.training.async_checkpoint
    if in_flight:
        whole = writes + commit  # an async save's background part: staged already, then written and committed
        left = whole if in_flight_left_s is None else max(0.0, in_flight_left_s)
        if in_flight_left_s is not None:
            measured.append("in-flight save")
        if plan.supersede_in_flight:
            phases.append(Phase("in-flight save", min(left, _cut(shape)), "superseded: cut at its next part"))
        else:
            phases.append(Phase("in-flight save", left, "waited for"))
    if save_seconds is not None:
        measured.append("save")
        phases.append(Phase("save", save_seconds, "as measured"))
    else:
        phases += [
            Phase("staging", staging, "to host memory"),
            Phase("writes", writes, writes_note),
            Phase("commit", commit, commit_note),
        ]
    return StopTimeline(
        tuple(phases), grace_seconds(config) if grace is None else grace, plan, measured=tuple(measured)
    )
