"""The torch-xla seam: every call into torch_xla that the job programs make, in one thin module.

torch-xla exists in the Neuron training container (with torch-neuronx: the NeuronCores) and in the environment
`scripts/install.sh xla-2.28` (or `xla`, for neuron.sdk=2.24.1) makes (PJRT_DEVICE=CPU: XLA:CPU, the local
rehearsal of the trn1 code path). Nothing here is imported unless the job runs on the XLA device
(`training.device=xla`, or `auto` inside a Neuron container), so CPU and CUDA jobs never need torch-xla.

What an XLA training loop must respect (PyTorch/XLA's "Lazy tensor" and "Troubleshooting" docs,
https://pytorch.org/xla/; Neuron's training developer guide, https://awsdocs-neuron.readthedocs-hosted.com/en/latest/
frameworks/torch/torch-neuronx/programming-guide/training/pytorch-neuron-programming-guide.html): the step is traced
lazily and compiled into graphs cut by `mark_step()`, by default one per micro-batch with the last one before the
optimizer step (HLAT's cuts, training.xla_graph_cuts=micro-batch; 'step' makes it one graph per optimizer step), the
same graphs every step; reading a device tensor on the host
(`float(t)`, `.item()`, `.cpu()`) cuts the graph and waits for the device, so the loop reads its scalars only at its
sync points, in one batched transfer (`to_host`); collectives take device tensors (`all_reduce`); activation
checkpointing needs torch-xla's own checkpoint; batches reach the device from a background thread (`device_loader`).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from hlat.core.config import ConfigError
from hlat.core.environment import NeuronSdk, environment_sdk, torch_xla_release

XLA_CPU_NOTE = (
    "XLA:CPU (PJRT_DEVICE=CPU) runs one process: torch-xla does not run collectives across CPU processes "
    "(pytorch/xla#5005); set job.processes_per_node=1 and job.instance_count=1 for the local rehearsal"
)


class XlaUnavailable(ImportError):
    """torch-xla is not installed in this environment."""


def xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def require_xla() -> None:
    if not xla_available():
        raise XlaUnavailable(
            "training.device=xla needs torch-xla, which this Python lacks: on trn1 it comes with the Neuron "
            "training image; for the local rehearsal on XLA:CPU run `scripts/install.sh xla-2.28` (neuron.sdk=2.28.0, "
            "the default; `xla` for 2.24.1) and use .venv-xla-2.28/bin/python (the local job backend does when "
            "training.device=xla)"
        )


def require_release(sdk: NeuronSdk) -> None:
    """Fail in one line when the installed torch-xla is not the release of the config's Neuron SDK (neuron.sdk): a
    2.24 job's precision flags are unsupported after Neuron 2.24 (torch-xla 2.9 still reads XLA_USE_BF16, with a
    deprecation warning, but Neuron no longer supports it), and a 2.28 job run where the flags are set would have
    its own cast or autocast overridden by them (Neuron's migration guide: do not set them together)."""
    found = torch_xla_release()
    if found is not None and found != sdk.torch_xla:
        other = environment_sdk()
        fix = f"set neuron.sdk={other.version}" if other else f"run it on torch-xla {sdk.torch_xla}"
        raise ConfigError(
            f"neuron.sdk={sdk.version} expects torch-xla {sdk.torch_xla} (its image's), but this environment has "
            f"torch-xla {found}: {fix}, or use the SDK's environment ({sdk.local_python} locally: "
            f"`scripts/install.sh {sdk.install_target}`)"
        )


def prepare_environment(precision_env: Mapping[str, str], on_neuron: bool) -> None:
    """Set what torch-xla reads at import (the precision flags; PJRT_DEVICE=CPU off trn1) unless the job's
    environment already says otherwise. Must run before torch_xla is first imported."""
    for key, value in precision_env.items():
        os.environ.setdefault(key, value)
    # torch-xla warns at import that these will go away (2.7, and 2.9 still reads them): only a neuron.sdk=2.24.1 job
    # sets them, chosen for them.
    warnings.filterwarnings("ignore", message=r"XLA_(USE|DOWNCAST)_BF16 will be deprecated")
    if not on_neuron:
        os.environ.setdefault("PJRT_DEVICE", "CPU")


def initialize_cache(folder: str, readonly: bool) -> None:
    """torch-xla's persistent compilation cache in `folder` (one file per compiled graph, keyed by the graph's
    hash): graphs found there are loaded, not compiled; `readonly` jobs add none. Must run before the first
    computation (https://pytorch.org/xla/release/r2.7/learn/api-guide.html, `torch_xla.runtime.initialize_cache`)."""
    import torch_xla.runtime as xr

    xr.initialize_cache(folder, readonly=readonly)


def device() -> torch.device:
    require_xla()
    import torch_xla.core.xla_model as xm

    return torch.device(xm.xla_device())


def init_process_group(timeout: Any = None) -> None:
    """Join torchrun's processes through the `xla` backend of torch.distributed (on trn1: NeuronLink and EFA), with
    `timeout` (a timedelta: job.collective_timeout_minutes) for the store's rendezvous instead of torch's default."""
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)

    if not dist.is_initialized():
        if timeout is None:
            dist.init_process_group("xla", init_method="xla://")
        else:
            dist.init_process_group("xla", init_method="xla://", timeout=timeout)


def mark_step() -> None:
    """Cut the traced graph here and launch it: after each micro-batch's backward by default (HLAT's cuts), or once
    per optimizer step (training.xla_graph_cuts=step)."""
    import torch_xla.core.xla_model as xm

    xm.mark_step()


def rendezvous(tag: str) -> None:
    """Block until every process reaches the rendezvous named `tag` (an all-gather over the devices, after a
    mark_step): the barrier of an XLA job."""
    import torch_xla.core.xla_model as xm

    xm.rendezvous(tag)


def wait() -> None:
    """Block until every launched graph has finished (for timers)."""
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()


def to_host(tree: Any) -> Any:
    """A copy of `tree` whose XLA tensors are CPU tensors, all fetched in one transfer (pending computations that
    produce them run first, as one graph). torch.save or `.cpu()` would fetch them one by one."""
    import torch_xla.core.xla_model as xm

    # torch-xla's own xm.save uses this to move a whole state dict at once; it is not exported under a public name.
    return xm._maybe_convert_to_cpu(tree)


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce a device tensor over every process (a new tensor). With one process it is a copy, unless
    XLA_ALWAYS_ALLREDUCE=1, which makes a single process run the real collective (tests)."""
    import torch_xla.core.xla_model as xm

    kind = {"sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX}[op]
    return xm.all_reduce(kind, tensor)


def reduce_gradients(params: Iterable[torch.Tensor], world_size: int) -> None:
    """Average the gradients over the data-parallel processes (what DDP does on CPU and CUDA), in place."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        import torch_xla.core.xla_model as xm

        xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / world_size)


def checkpoint_function() -> Callable[..., Any]:
    """Activation checkpointing that works on XLA (torch.utils.checkpoint's does not)."""
    from torch_xla.utils.checkpoint import checkpoint

    return checkpoint


def device_loader(batches: Iterable[Any], device: torch.device, batches_per_execution: int) -> Iterable[Any]:
    """`batches` (tuples and dicts of CPU tensors) sent to the device by a background thread, a few ahead.

    MpDeviceLoader cuts the graph itself every `batches_per_execution` batches unless the loop already did: set
    to the micro-batches of one optimizer step, its cut coincides with the loop's own and adds none."""
    import torch_xla.distributed.parallel_loader as pl

    return pl.MpDeviceLoader(batches, device, batches_per_execution=batches_per_execution)


def rng_state() -> int:
    import torch_xla.core.xla_model as xm

    return int(xm.get_rng_state())


def set_rng_state(seed: int) -> None:
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(int(seed))


def in_use() -> bool:
    """True once this process has imported torch_xla (its RNG state then belongs in checkpoints)."""
    import sys

    return "torch_xla" in sys.modules


def counters() -> dict[str, float]:
    """What the loop's tests and benchmark count: graph compilations, executions, device-to-host transfers and
    collectives so far (torch_xla.debug.metrics)."""
    import torch_xla.debug.metrics as met

    def samples(name: str) -> float:
        data = met.metric_data(name)
        return float(data[0]) if data else 0.0

    out = {
        "compilations": samples("CompileTime"),
        "persistent_cache_hits": float(met.counter_value("PersistentCacheHit") or 0),
        "executions": samples("ExecuteTime"),
        "transfers_to_host": samples("TransferFromDeviceTime"),
    }
    out["all_reduces"] = float(
        sum(met.counter_value(name) or 0 for name in met.counter_names() if "all_reduce" in name.lower())
    )
    return out
