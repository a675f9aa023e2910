"""Atomic training checkpoints under a `Storage` (the run's `checkpoints/` folder).

    manager.py        the commit protocol and retention (CheckpointManager).
    formats.py        one format per way the model and optimizer are split, chosen once per job.
    serialization.py  one file: what may be saved, staging to CPU, digesting writes, reading back.
    rng.py            per-rank state: RNG states and the loader's position.
    dcp.py            FSDP2's files through torch.distributed.checkpoint.

A step folder's files are drawn in docs/stages.md (the run tree). COMMITTED is written last.
A checkpoint loads only into a job with the same shard names and world size.
"""

from hlat.core.layout import CHECKPOINT_MARKER as MARKER
from hlat.core.layout import CHECKPOINT_META as META
from hlat.core.layout import CheckpointError, shard_file, step_dir
from hlat.training.checkpoint.dcp import METADATA as DCP_METADATA
from hlat.training.checkpoint.formats import CheckpointFormat, Distributed, ModelParallel, Unsharded, Zero1
from hlat.training.checkpoint.manager import (
    FORMAT_VERSION,
    SHARED_FILE,
    CheckpointManager,
    checkpoint_requests,
    host_of,
    manifest_file,
    rank_file,
    read_requests,
    request_offset,
    retention,
)
from hlat.training.checkpoint.rng import capture_rng_state, rank_state, restore_rank_state, restore_rng_state
from hlat.training.checkpoint.serialization import CHECKPOINT_PART_SIZE, StagingBuffers, check_loadable, stage_to_cpu

__all__ = [
    "CHECKPOINT_PART_SIZE",
    "DCP_METADATA",
    "FORMAT_VERSION",
    "MARKER",
    "META",
    "SHARED_FILE",
    "CheckpointError",
    "CheckpointFormat",
    "CheckpointManager",
    "Distributed",
    "ModelParallel",
    "StagingBuffers",
    "Unsharded",
    "Zero1",
    "capture_rng_state",
    "check_loadable",
    "checkpoint_requests",
    "host_of",
    "manifest_file",
    "rank_file",
    "rank_state",
    "read_requests",
    "request_offset",
    "restore_rank_state",
    "restore_rng_state",
    "retention",
    "shard_file",
    "stage_to_cpu",
    "step_dir",
]
