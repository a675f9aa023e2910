"""The stop's timeline: from SIGTERM to the committed checkpoint, phase by phase, against the grace SageMaker gives.

SageMaker stops a job (StopTrainingJob, MaxRuntimeInSeconds, the budget's stop) with SIGTERM and ends it 120 s
later (`SAGEMAKER_GRACE_S`). In those seconds every rank reaches the stop vote, deals with an async save still in
flight, copies its state to the host, writes its files (paced), and rank 0 commits: it lists the step's folder,
reads every other rank's manifest, writes meta.json and COMMITTED. `stop_timeline` adds those phases up from the
config (what each rank's files hold, by the rules the checkpoint code follows) and from what the job measured when
it has it (its step time, its last save, how much of an async save is left). The dry run prints it
(`infra.stage_jobs.stop_fit`), the job logs it at a stop (`training/loop.py`), and the scale tests time each
simulated stop with it. Pure arithmetic: no torch, no Prefect, no I/O.

`StopPlan` is how the job goes about the stop: `PLAN` is what the code does now, `OLD_PLAN` what it did before
issue 50 (manifests read through s3fs's default pool of 10 connections, the in-flight save waited for, pacing in
global rank order), kept so the tests show the change: at hlat-70b's 256 hosts the old plan takes longer than the
grace in the worst case, the new one fits.

Every constant below says where it comes from; the ones marked as assumptions are not measurements on trn1, and a
job's log replaces them with what it measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hlat.core.config import HlatConfig
from hlat.core.environment import neuron_sdk, on_trainium, precision_by_flags
from hlat.core.storage import S3_MAX_POOL_CONNECTIONS

# -- constants, each with its source ----------------------------------------------------------------------

SAGEMAKER_GRACE_S = 120.0
"""StopTrainingJob: "SageMaker sends the algorithm the SIGTERM signal, which delays job termination for 120
seconds" (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_StopTrainingJob.html); MaxRuntimeInSeconds
stops a job the same way."""

WRITE_MB_S_PER_RANK = 200.0
"""Assumed S3 write rate of one rank streaming a checkpoint file (one s3fs multipart upload, parts sent one after
another): an assumption, not a measurement on trn1; the job logs the save time it measures."""

WRITE_GB_S_PER_HOST = 5.0
"""Assumed ceiling of one trn1.32xlarge host's S3 writes: its 800 Gbps EFA is not S3's path; S3 serves a large
instance about 100 Gb/s (https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html), of
which this takes less than half for one job's many streams."""

STAGING_GB_S_PER_RANK = 1.0
"""Assumed rate of one rank's copy of its state from the device to host memory (what `save` blocks on before a
synchronous write): an assumption, not a measurement on trn1 (the job's measured save time includes it)."""

PART_BYTES = 512 << 20
"""The multipart part size of checkpoint files (training.checkpoint.serialization.CHECKPOINT_PART_SIZE; a test
checks they agree): a part is the unit an upload can be cut at, so superseding a save waits for at most one."""

RANK_FILE_BYTES = 64 << 10
"""A rank file without optimizer states: its RNG states and the data loader's position (tens of KiB)."""

S3_SMALL_REQUEST_S = 0.03
S3_SLOW_SHARE = 0.01
S3_SLOW_REQUEST_S = 2.0
"""A small S3 request (under 512 KB: a manifest, meta.json, the marker): "median latencies are often in the tens of
milliseconds range", and the slowest 1% are worth retrying after 2 s (AWS, "Timeouts and Retries for
Latency-Sensitive Applications",
https://docs.aws.amazon.com/whitepapers/latest/s3-optimizing-performance-best-practices/timeouts-and-retries-for-latency-sensitive-applications.html).
Taken as 30 ms each, plus 1% of them at 2 s: 50 ms a request on average over thousands."""

S3_LIST_PAGE_KEYS = 1000
"""ListObjectsV2 returns at most 1,000 keys a request
(https://docs.aws.amazon.com/AmazonS3/latest/API/API_ListObjectsV2.html), so listing a step's folder takes one
request per thousand files, one after another."""

S3_LIST_PAGE_S = 0.1
"""Assumed time of one ListObjectsV2 page of 1,000 keys (a response of ~250 KB of XML): an assumption, twice a small
request."""

COMMIT_POLL_S = 0.5
"""Rank 0's longest wait between two listings while it waits for every rank's files
(training.checkpoint.manager, `_wait_for_files`)."""

S3FS_DEFAULT_POOL = 10
"""Connections of one S3 client unless configured: botocore's max_pool_connections defaults to 10
(https://docs.aws.amazon.com/botocore/latest/reference/config.html), and aiobotocore, under s3fs, uses it as its
aiohttp connector's limit: how many of rank 0's manifest reads were in flight at once before issue 50."""

WRITE_REQUESTS_PER_RANK = 2
"""The paced requests of each rank: its rank file and its manifest (the pacing's unit)."""


# -- what each rank writes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateBytes:
    """Bytes per model parameter as a checkpoint holds them: in torch's dtypes (what `torch.save` writes), which
    under torch-xla's precision flags are not the device's."""

    weights: int
    """The model's weights."""
    optimizer: int
    """The optimizer's state: AdamW's two moments, and master weights where they are saved."""
    optimizer_in_rank_files: bool
    """ZeRO-1: the optimizer state is split over the data-parallel ranks, each rank's part in its rank file;
    otherwise it goes with the weights (the shard or shared file)."""


def state_bytes(config: HlatConfig) -> StateBytes:
    """Bytes per parameter of a checkpoint of `config`, by the rules the training code follows:

    - the weights: BF16 (2) only for bf16-sr's cast model (`training.optim`: `model.to(torch.bfloat16)`); FP32 (4)
      otherwise, including under torch-xla's precision flags (Neuron 2.24: XLA_USE_BF16 / XLA_DOWNCAST_BF16 keep
      FP32-typed tensors in torch whatever the device holds; `core.environment.precision_by_flags`);
    - without ZeRO-1, AdamW's moments are like the weights (`torch.optim.AdamW`, `AdamWStochasticRounding`: BF16
      under bf16-sr, 2 x 2), except bf16-mixed under the flags, where `MasterWeightAdamW` keeps FP64-typed masters and
      moments (3 x 8);
    - under ZeRO-1 (NxD's optimizer), the moments and master weights are in the optimizer's dtype: FP64 for
      bf16-mixed under XLA_DOWNCAST_BF16 (neuronx-distributed, trainer/trainer.py: `optimizer_dtype=torch.double`),
      else FP32 (torch-xla's ZeroRedundancyOptimizer's default); the masters are saved only where they hold more
      than the parameters (`training.parallel.neuron.zero1_masters_outrank_parameters`, the same rule, checked
      against it by a test).
    """
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
    """The global ranks that write a shard or shared file (one per shard, in the manager's shard order), each
    besides its rank file."""
    shard_bytes: int
    """Bytes of one shard (or the shared) file."""
    rank_bytes: int
    """Bytes of one rank file."""
    distributed: bool = False
    """FSDP2: every rank writes its own part of the model and optimizer (DCP), in `rank_bytes`."""

    @property
    def files(self) -> int:
        """Objects in the step's folder at commit: shard files, rank files, manifests, meta.json."""
        return len(self.writers) + 2 * self.world

    def bytes_of(self, rank: int, writer: bool) -> int:
        return self.rank_bytes + (self.shard_bytes if writer else 0)


def checkpoint_shape(config: HlatConfig) -> CheckpointShape:
    """The files one checkpoint of `config` writes (training.checkpoint.formats): under NxD (tensor or pipeline
    parallelism, ZeRO-1) one shard file per (tensor, pipeline) position, written by its first data-parallel replica
    (neuronx-distributed's rank order: pipeline outermost, then data, then tensor, so the writer of (t, p) is rank
    p x data x tensor + t), with ZeRO-1's optimizer states in every rank's file; under FSDP2 every rank an equal
    part; otherwise one shared file written by rank 0."""
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
    """The choices that decide a stop's length."""

    name: str
    manifest_connections: int
    """Rank 0's manifest reads in flight at once (its S3 client's connection pool and reader threads)."""
    supersede_in_flight: bool
    """An async save still running at the stop is cut at its next part and left uncommitted, instead of waited
    for (`CheckpointManager.supersede`)."""
    writers_first: bool
    """Pacing puts the shard writers first (`write_start_seconds`), instead of every rank in global rank order."""
    steps_to_stop: int = 2
    """Steps from SIGTERM to the boundary every rank stops at, in the worst case. A vote at every step boundary
    stops after the step in progress (1); the stop step agreed once through the job's store
    (training/stop_vote.py) stops after it, or after the next when a rank went past its boundary before it heard (2)."""
    write_rate: float = 2000.0
    """Requests a second all ranks together start at (the manager's write_rate)."""


OLD_PLAN = StopPlan(
    "before issue 50", S3FS_DEFAULT_POOL, supersede_in_flight=False, writers_first=False, steps_to_stop=1
)
PLAN = StopPlan("now", S3_MAX_POOL_CONNECTIONS, supersede_in_flight=True, writers_first=True, steps_to_stop=2)


def write_start_seconds(
    rank: int, world_size: int, rate: float | None, writer_index: int | None = None, writers: int = 0
) -> float:
    """Seconds after a save begins that `rank` sends its first write, so that `world_size` ranks, two paced
    requests each, start at about `rate` a second together (S3 takes 3,500 PUTs a second per prefix,
    https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html). The `writers` ranks that
    write a shard (`writer_index`: this rank's place among them, None for the others) go first: they have the most
    to write, so a shard writer of the last pipeline stage does not wait behind thousands of small rank files; the
    others follow in rank order. 0 with no rate or one rank."""
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
    """The time between SIGTERM and SIGKILL: SageMaker's fixed 120 s, or the local backend's job.stop_grace_seconds."""
    return config.job.stop_grace_seconds if config.job.backend == "local" else SAGEMAKER_GRACE_S


def _writes(shape: CheckpointShape, plan: StopPlan) -> tuple[float, str]:
    """When the last rank's files are written: each rank starts at its paced time and writes at the per-rank rate,
    or slower when its host's writes together pass the host's ceiling."""
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
    """Rank 0's commit once the last file is written: the listing it was polling misses that file, so a poll's
    wait and one more full listing; every other rank's manifest read through its connections; meta.json and
    COMMITTED."""
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
    """How long superseding an in-flight save takes at most: the part each writer has in flight finishes (an upload
    is cut between parts), on a host whose writers all have one in flight."""
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

    `step_seconds`: the step time (measured by the job, or the plan's estimate; None: left out, the line says so);
    `plan.steps_to_stop` steps come before the stop's boundary in the worst case (`since_sigterm`: the seconds that
    actually passed, where the job measured them); `save_seconds`: a measured save
    (staging, pacing, writes and commit in one figure) in place of the modelled phases; `in_flight`: whether an
    async save is running at the stop (None: the worst case, whenever training.async_checkpoint is on);
    `in_flight_left_s`: how long it has left, when the job knows (else all of a save); `grace`: default
    `grace_seconds(config)`."""
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
