"""The one place that decides a job program's device and process group, and how its collectives run.

- Device (`init_world(kind)`): `xla` inside a Neuron container (or when asked: XLA:CPU elsewhere, the local
  rehearsal of trn1), else CUDA when present, else CPU; `--device` / `training.device` choose.
- Process group, under torchrun (WORLD_SIZE > 1): `xla` on XLA devices, nccl on CUDA, gloo on CPU. A single
  process (no torchrun) runs without one and every collective below degrades to a no-op, so the same loop runs on
  a laptop, under torchrun with several CPU ranks, on GPUs or on NeuronCores.
- Collectives take and return tensors on the job's device (`all_reduce`): nothing reaches the host unless the
  caller reads it, once, through `to_host` at its sync points. On CPU (gloo) the device is the host.
- Host-side collectives (`any_rank`; `share_from_main`, rank 0's objects on every rank, once at resume) run on CPU
  tensors over a gloo group beside the job's main group (`host_group`: made with `dist.new_group(backend="gloo")`
  when the main group is nccl or xla, the main group itself when it is gloo), so they never add a device op, an XLA
  graph or a device-to-host transfer. torch.distributed runs a group of another backend beside the default one
  (https://pytorch.org/docs/stable/distributed.html#torch.distributed.new_group), and neuronx-distributed makes such
  gloo groups under the `xla` group for its pipeline's metadata (parallel_state.initialize_pp_gloo_groups); that ours
  forms under `xla` on trn1 is checked only there. None runs at a step boundary: the stop is agreed through the
  job's store (`training/stop_vote.py`, through `World.connect_store`).
- Gloo groups are formed lazily and with a deadline. gloo's default connects every rank of a group to every other at
  its creation (a full mesh: P - 1 sockets per rank, each rank reading every other's address from the one store;
  pytorch/gloo#407 reports 46 min to form one at 8k ranks, past gloo's 30-min default timeout). TORCH_GLOO_LAZY_INIT=1
  (read by torch's ProcessGroupGloo when it makes its device: torch 2.9, Neuron 2.28's; torch 2.7, Neuron 2.24's,
  has no such switch and forms the full mesh) connects a pair only when a collective first needs it; every group gets
  job.collective_timeout_minutes as its timeout. The open-file limit is raised to its hard limit first
  (`raise_open_file_limit`), with a warning when even that is below what a full mesh of this world needs.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hlat.core.config import HlatConfig
from hlat.core.environment import (
    GLOO_LAZY_INIT,
    neuron_available,
    neuron_sdk,
    rehearsal_sdk,
    xla_precision_environment,
)
from hlat.core.parallel import ParallelDims

log = logging.getLogger("hlat.train")

DEFAULT_COLLECTIVE_TIMEOUT_MIN = 20.0
"""job.collective_timeout_minutes's default, for a World made without a config."""
FILES_BESIDE_SOCKETS = 4096
"""Open files a rank needs besides its gloo sockets: its checkpoint and data files, the store, the runtime's."""


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    layout: ParallelDims = field(default_factory=ParallelDims)
    """The job's layout (`core.parallel`); by default every rank is a data-parallel replica."""
    data_rank: int = -1
    """This rank's data-parallel rank (what the loader shards by): the rank itself unless the model is split."""
    tensor_rank: int = 0
    pipeline_rank: int = 0
    nxd: dict[str, Any] | None = None
    """neuronx-distributed's trainer config when the model is split (tensor/pipeline parallel, ZeRO-1)."""
    host_group: Any = None
    """The gloo group of host-side collectives when the main group is not gloo (init_world makes it); None: the
    main group, which must then be gloo."""
    store_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_MIN * 60
    """How long a client of the job's store (`connect_store`) waits to connect."""

    def __post_init__(self) -> None:
        if not self.layout.splits_model:
            object.__setattr__(self, "layout", ParallelDims(data=self.world_size))
        if self.layout.world_size != self.world_size:
            raise ValueError(f"a {self.layout} layout has {self.layout.world_size} ranks, not {self.world_size}")
        if self.data_rank < 0:
            object.__setattr__(self, "data_rank", self.rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def on_xla(self) -> bool:
        return self.device.type == "xla"

    def barrier(self, tag: str = "hlat-barrier") -> None:
        """Wait until every rank gets here. On XLA through torch-xla's rendezvous (`xm.rendezvous`, what HLAT's
        and NxD's training scripts call): the `xla` process group's own barrier returns a finished work object
        without waiting (torch-xla 2.7, `ProcessGroupXla.barrier` in torch_xla/distributed/xla_backend.py). The
        rendezvous launches the pending graph first (a mark_step): call it between steps, not inside one."""
        if self.on_xla:
            if self.collective:
                from hlat.training import xla

                xla.rendezvous(tag)
            return
        if _grouped():
            dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`tensor` (on this job's device) reduced over every rank, as a tensor on the device: 'sum' or 'max'. Use
        the result: on CPU and CUDA it is `tensor`, reduced in place; on XLA a new tensor."""
        if self.on_xla:
            from hlat.training import xla

            return xla.all_reduce(tensor, op)
        if _grouped():  # in place
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean over ranks of a device tensor (for metrics: never on the gradient path)."""
        return self.all_reduce(tensor) / self.world_size

    @property
    def collective(self) -> bool:
        """Whether collectives really run: several ranks, or one XLA process told to (XLA_ALWAYS_ALLREDUCE=1, which
        makes torch-xla emit a one-process all-reduce: how tests exercise the multi-process path)."""
        if self.on_xla:
            return self.world_size > 1 or os.environ.get("XLA_ALWAYS_ALLREDUCE") == "1"
        return _grouped()

    def connect_store(self) -> Any:
        """A new client of the job's TCPStore (torchrun's, at MASTER_ADDR:MASTER_PORT), for a thread of its own: a
        client's blocking wait holds its connection, so threads never share one with the process group's. None on
        one process."""
        if not _grouped():
            return None
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=self.store_timeout_s),
        )

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when it is true on any: ranks must take the same branch. Host-side: a CPU tensor
        all-reduced (MAX) over the gloo `host_group`, never a device op, but a collective over the whole world (at
        8,192 ranks a ring of 16,382 hops): for rare decisions, never at every step (the stop is agreed through the
        store: `training/stop_vote.py`). On one process, `flag` itself."""
        if not _grouped():
            return flag
        vote = torch.tensor([int(flag)], dtype=torch.int32)  # CPU, whatever the job's device
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._host_group())
        return bool(vote.item())

    def share_from_main(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (every rank calls it; the others' `obj` is ignored): a host-side broadcast
        of a picklable object over the gloo `host_group`; on one process, `obj` itself. How one rank's look at
        storage (the checkpoint listing at resume) serves every rank."""
        if not _grouped():
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._host_group())
        return box[0]

    def _host_group(self) -> Any:
        if self.host_group is not None:
            return self.host_group
        if dist.get_backend() != "gloo":
            raise RuntimeError(
                f"host-side collectives need a gloo group beside the {dist.get_backend()} one: build the World with "
                "init_world, which makes it"
            )
        return None  # the default group

    def mark_step(self) -> None:
        """End of an optimizer step: on XLA, cut and launch the step's graph; elsewhere nothing."""
        if self.on_xla:
            from hlat.training import xla

            xla.mark_step()

    def to_host(self, tree: Any) -> Any:
        """`tree` with its device tensors as CPU tensors, in one transfer on XLA (the one host read of a sync point)."""
        if self.on_xla:
            from hlat.training import xla

            return xla.to_host(tree)
        if self.device.type == "cpu":
            return tree
        return _map_tensors(tree, lambda t: t.cpu())

    def seed(self, seed: int) -> None:
        """Seed every generator whose state a checkpoint saves (training/checkpoint/rng.py): torch's (CPU, and CUDA
        through it), the XLA device's, Python's `random` and NumPy's global generator, so that a resumed run and an
        uninterrupted one hold the same states."""
        random.seed(seed)
        try:
            import numpy as np
        except ImportError:  # optional, as in rng.py: no state saved, none to seed
            pass
        else:
            np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        if self.on_xla:
            from hlat.training import xla

            xla.set_rng_state(seed)


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


def _map_tensors(tree: Any, fn: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_map_tensors(v, fn) for v in tree)
    return tree


def resolve_device_kind(kind: str) -> str:
    """'auto' made concrete: xla in a Neuron container, else cuda when present, else cpu."""
    if kind != "auto":
        return kind
    if neuron_available():
        return "xla"
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_world(
    device_kind: str = "auto", cfg: HlatConfig | None = None, xla_cache: tuple[str, bool] | None = None
) -> World:
    """Pick this rank's device and join torchrun's process group when WORLD_SIZE > 1. On XLA, the precision flags
    of `cfg` (`xla_precision_environment`) are set first, unless the job's environment already has them, then
    torch-xla's persistent compilation cache when `xla_cache` names one (folder, read-only); on trn1,
    neuronx-distributed's model-parallel groups are formed from `cfg.parallelism`. An XLA job refuses a torch-xla
    other than its neuron.sdk's: the precision flags would mean something else there."""
    precision = cfg.precision.mode if cfg is not None else "fp32"
    # Without a config, the release of the torch-xla installed (nothing to check it against)
    sdk = neuron_sdk(cfg) if cfg is not None else rehearsal_sdk()
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kind = resolve_device_kind(device_kind)
    minutes = cfg.job.collective_timeout_minutes if cfg is not None else DEFAULT_COLLECTIVE_TIMEOUT_MIN
    timeout = timedelta(minutes=minutes)
    if world_size > 1:
        # Before any gloo group exists: torch reads the switch when a group makes its device.
        os.environ.setdefault(GLOO_LAZY_INIT, "1")
        raise_open_file_limit(world_size, log_it=rank == 0)  # one gloo group: the main one or the host one
    if kind == "xla":
        from hlat.training import xla

        xla.require_xla()
        on_neuron = neuron_available()
        xla.require_release(sdk)
        xla.prepare_environment(xla_precision_environment(precision, sdk.precision_flags), on_neuron=on_neuron)
        if xla_cache is not None:
            xla.initialize_cache(*xla_cache)
        if world_size > 1:
            if not on_neuron and os.environ.get("PJRT_DEVICE") == "CPU":
                raise RuntimeError(f"this job has {world_size} processes: {xla.XLA_CPU_NOTE}")
            xla.init_process_group(timeout)
        world = World(
            rank, world_size, local_rank, xla.device(), host_group=_host_side_group(timeout),
            store_timeout_s=timeout.total_seconds(),
        )  # fmt: skip
        return _model_parallel(world, cfg)
    if kind == "cuda":
        if cfg is None or cfg.training.deterministic:
            use_deterministic_cuda()
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if kind == "cuda" else "gloo", rank=rank, world_size=world_size, timeout=timeout
        )
    world = World(
        rank, world_size, local_rank, device, host_group=_host_side_group(timeout),
        store_timeout_s=timeout.total_seconds(),
    )  # fmt: skip
    return _model_parallel(world, cfg)


def _host_side_group(timeout: timedelta | None = None) -> Any:
    """The gloo group for host-side collectives, made by every rank right after joining the main group (new_group
    is collective: every rank makes its groups in the same order, before neuronx-distributed makes its own), lazily
    connected (TORCH_GLOO_LAZY_INIT, set by init_world) and with `timeout` (job.collective_timeout_minutes). None
    on one process, or when the main group is gloo (it serves)."""
    if not _grouped() or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=timeout or timedelta(minutes=DEFAULT_COLLECTIVE_TIMEOUT_MIN))


def open_files_needed(world_size: int, gloo_groups: int = 1) -> int:
    """Open files a rank may need: a socket to every other rank per gloo group (a full mesh, what gloo forms without
    TORCH_GLOO_LAZY_INIT and the most a lazy group can reach), plus FILES_BESIDE_SOCKETS."""
    return gloo_groups * max(0, world_size - 1) + FILES_BESIDE_SOCKETS


def raise_open_file_limit(world_size: int, gloo_groups: int = 1, log_it: bool = True) -> tuple[int, int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (an unprivileged process may: getrlimit(2)); log
    one line with the figures (rank 0) and warn on every rank when the hard limit is below `open_files_needed`.
    (soft before, soft after, needed)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = open_files_needed(world_size, gloo_groups)
    raised = soft
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, needed)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            raised = target
        except (ValueError, OSError) as exc:
            log.warning("open files: could not raise the soft limit %d to %d: %s", soft, target, exc)
    shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    line = (
        f"open files: soft limit {soft} -> {raised} (hard {shown}); {world_size} ranks may need {needed} "
        f"({gloo_groups} gloo group(s) x {max(0, world_size - 1)} peer sockets as a full mesh + {FILES_BESIDE_SOCKETS})"
    )
    if hard != resource.RLIM_INFINITY and hard < needed:
        log.warning("%s: the hard limit is lower: raise the container's nofile ulimit", line)
    elif log_it:
        log.info("%s", line)
    return soft, raised, needed


def use_deterministic_cuda() -> None:
    """Deterministic CUDA kernels (https://pytorch.org/docs/stable/notes/randomness.html): an op without a
    deterministic kernel raises rather than silently break bitwise resume. cuBLAS reads its workspace setting when
    its first handle is made, so this runs before anything touches the device."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def _model_parallel(world: World, cfg: HlatConfig | None) -> World:
    """`world` with neuronx-distributed's groups formed and this rank's place in them, when `cfg` splits the model
    (on trn1, or in NxD's CPU mode); unchanged otherwise."""
    from hlat.training.parallel.neuron import needs_nxd

    if cfg is None or not needs_nxd(cfg):
        return world
    from hlat.training.parallel import neuron

    neuron.require_nxd()
    config = neuron.nxd_config(cfg)
    dims = cfg.parallel_dims
    dims.check(neuron.formed_dims(), "neuronx-distributed")
    tensor_rank, pipeline_rank, data_rank = neuron.coordinates()
    return replace(
        world, nxd=config, layout=dims, tensor_rank=tensor_rank, pipeline_rank=pipeline_rank, data_rank=data_rank
    )


def close_world() -> None:
    if _grouped():
        dist.destroy_process_group()
