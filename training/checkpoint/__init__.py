"""Atomic training checkpoints under a `Storage` (the run's `checkpoints/` folder), split the way the parts change:

    manager.py        the commit protocol and retention (CheckpointManager: save, commit, find, load, prune)
    formats.py        one format per way the model and optimizer are split (unsharded, NxD shards, ZeRO-1, FSDP2's
                      DCP), chosen once per job
    serialization.py  one file: what may be saved, staging to CPU, the digesting writer, reading back
    rng.py            the per-rank state: RNG states and the loader's position
    dcp.py            FSDP2's files through torch.distributed.checkpoint, sync and async

Layout of one checkpoint (`step-000001000/` for step 1000, 9 digits so names sort by step):

    train_state.pt   unsharded (the default): the shared state, written by rank 0 only: model, optimizer,
                     scheduler, step... (torch.save)
    model-tp00.pt    sharded (tensor/pipeline parallel), instead of train_state.pt: one file per model-parallel
    model-tp01.pt    shard, with whatever that shard's writer passes as its shared state (its slices of the model,
                     its optimizer shard, step, config...), written by one data-parallel replica of the shard
    __0_0.distcp     FSDP2 only: each rank's shards of the model and optimizer (torch.distributed.checkpoint), and
    .metadata        their index, beside rank 0's train_state.pt (step, scheduler, config)
    rank-00000.pt    one per rank: what differs between ranks (data-loader position, RNG states)
    rank-00001.pt
    manifest-00001.json  one per rank but 0: the sizes and sha256 of the files that rank wrote, and its host
    meta.json        step, world_size, the shard names (sharded only), time, config fingerprint, and every file's
                     size and sha256 (from the manifests; older checkpoints: sizes, and sha256 of rank 0's files)
    COMMITTED        the commit marker: {"step", "meta_sha256"}, written last

Sharding: each rank is given its shard's name (`shard`, e.g. "tp01-pp00"), whether it writes that shard
(`shard_writer`: one data-parallel replica per shard does) and every shard name (`shards`). Data-parallel replicas
hold the same weights, so they share one shard file; on resume every rank reads its own shard's file and its own
rank file. A checkpoint is loaded only by a job with the same layout (shard names and world size): the message
names both. `load_shards` reads every shard (what an exporter consolidates:
`training.parallel.tensor_slices.consolidate`); `load_shared` reads the single shared state of an unsharded checkpoint.

Beside the step folders, `pins/step-NNNNNNNNN` marks a checkpoint retention must keep (queued for evaluation).
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
