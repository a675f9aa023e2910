"""Process-group set-up for a training job: torchrun's environment, gloo on CPU, nccl on CUDA.

A single process (no torchrun) runs without a process group; everything here then degrades to no-ops, so
the same loop runs on a laptop, under torchrun with several CPU ranks, or on GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when it is true on any: ranks must take the same branch (stop, checkpoint)."""
        if not (dist.is_available() and dist.is_initialized()):
            return flag
        t = torch.tensor([int(flag)], device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def all_reduce_mean(self, value: float) -> float:
        """Mean of a scalar over all ranks (for logging; not on the gradient path)."""
        if not (dist.is_available() and dist.is_initialized()):
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t)
        return float(t.item()) / self.world_size


def init_world(device_kind: str = "auto") -> World:
    """Join torchrun's process group when WORLD_SIZE > 1; pick the device for this rank."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def close_world() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
