"""The one place that decides a job program's device and process group, and how its collectives run.

Rules:
- device: `xla` in a Neuron container (or asked for), else CUDA when present, else CPU.
- process group: `xla`, nccl or gloo; a single process has none, and collectives are no-ops.
- device collectives keep tensors on the device; only `to_host`, at sync points, reads them.
- host-side collectives use a lazy gloo group beside the main one, never at a step boundary.
docs/trn1.md explains the gloo group and its lazy connection.
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
"""Open files a rank needs besides its gloo sockets."""


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    layout: ParallelDims = field(default_factory=ParallelDims)
    """The job's layout (`core.parallel`); by default all data-parallel."""
    data_rank: int = -1
    """This rank's data-parallel rank, what the loader shards by."""
    tensor_rank: int = 0
    pipeline_rank: int = 0
    nxd: dict[str, Any] | None = None
    """neuronx-distributed's trainer config when the model is split."""
    host_group: Any = None
    """The gloo group for host-side collectives; None: the main group is gloo."""
    store_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_MIN * 60
    """How long a store client (`connect_store`) waits to connect."""

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
        """Wait until every rank gets here; call it between steps.

        On XLA this is `xm.rendezvous`: the `xla` group's barrier does not wait (torch-xla 2.7).
        """
        if self.on_xla:
            if self.collective:
                from hlat.training import xla

                xla.rendezvous(tag)
            return
        if _grouped():
            dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`tensor` reduced over every rank ('sum' or 'max'), on the device; use the result."""
        if self.on_xla:
            from hlat.training import xla

            return xla.all_reduce(tensor, op)
        if _grouped():  # in place
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean over ranks of a device tensor, for metrics."""
        return self.all_reduce(tensor) / self.world_size

    @property
    def collective(self) -> bool:
        """Whether collectives run: several ranks, or XLA_ALWAYS_ALLREDUCE=1 (tests)."""
        if self.on_xla:
            return self.world_size > 1 or os.environ.get("XLA_ALWAYS_ALLREDUCE") == "1"
        return _grouped()

    def connect_store(self) -> Any:
        """A new client of the job's TCPStore, for a thread of its own; None alone."""
        if not _grouped():
            return None
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=self.store_timeout_s),
        )

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when true on any, so ranks branch alike; a whole-world collective, for rare decisions."""
        if not _grouped():
            return flag
        vote = torch.tensor([int(flag)], dtype=torch.int32)  # CPU, whatever the job's device
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._host_group())
        return bool(vote.item())

    def share_from_main(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank, broadcast over `host_group`."""
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
        """End of an optimizer step: on XLA, cut and launch the graph."""
        if self.on_xla:
            from hlat.training import xla

            xla.mark_step()

    def to_host(self, tree: Any) -> Any:
        """`tree` with its device tensors on the CPU, in one transfer on XLA."""
        if self.on_xla:
            from hlat.training import xla

            return xla.to_host(tree)
        if self.device.type == "cpu":
            return tree
        return _map_tensors(tree, lambda t: t.cpu())

    def seed(self, seed: int) -> None:
        """Seed every generator a checkpoint saves."""
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
    """'auto' made concrete: xla in a Neuron container, else cuda, else cpu."""
    if kind != "auto":
        return kind
    if neuron_available():
        return "xla"
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_world(
    device_kind: str = "auto", cfg: HlatConfig | None = None, xla_cache: tuple[str, bool] | None = None
) -> World:
    """Pick this rank's device and join torchrun's process group when WORLD_SIZE > 1.

    On XLA, set the precision flags and `xla_cache` first; on trn1, form NxD's groups.
    An XLA job refuses a torch-xla other than its neuron.sdk's.
    """
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
    """The gloo group for host-side collectives (None alone or under gloo); every rank makes it right after joining."""
    if not _grouped() or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=timeout or timedelta(minutes=DEFAULT_COLLECTIVE_TIMEOUT_MIN))


def open_files_needed(world_size: int, gloo_groups: int = 1) -> int:
    """Open files a rank may need: a socket per peer per gloo group, plus the rest."""
    return gloo_groups * max(0, world_size - 1) + FILES_BESIDE_SOCKETS


def raise_open_file_limit(world_size: int, gloo_groups: int = 1, log_it: bool = True) -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit, warning if still too low; return (before, after, needed)."""
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
    """Deterministic CUDA kernels, so resume stays bitwise (https://pytorch.org/docs/stable/notes/randomness.html)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def _model_parallel(world: World, cfg: HlatConfig | None) -> World:
    """`world` with NxD's groups when `cfg` splits the model."""
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
