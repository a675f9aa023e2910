"""The torch-xla seam: every call into torch_xla that the job programs make, in one thin module.

Imported only when the job runs on the XLA device, so CPU and CUDA jobs never need torch-xla.
Rules an XLA loop keeps (https://pytorch.org/xla/; Neuron's training programming guide):
- the step is traced lazily and cut into graphs by `mark_step()`, the same graphs every step.
- reading a device tensor on the host cuts the graph and waits, so reads happen only at sync points (`to_host`).
- collectives take device tensors; activation checkpointing needs torch-xla's own.
- batches reach the device from a background thread (`device_loader`).
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
    """Fail in one line when torch-xla is not the release of neuron.sdk: the precision flags differ between them."""
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
    """Set what torch-xla reads at import unless already set; run before torch_xla is imported."""
    for key, value in precision_env.items():
        os.environ.setdefault(key, value)
    # torch-xla warns at import that these will go away (2.7, and 2.9 still reads them): only a neuron.sdk=2.24.1 job
    # sets them, chosen for them.
    warnings.filterwarnings("ignore", message=r"XLA_(USE|DOWNCAST)_BF16 will be deprecated")
    if not on_neuron:
        os.environ.setdefault("PJRT_DEVICE", "CPU")


def initialize_cache(folder: str, readonly: bool) -> None:
    """torch-xla's persistent compilation cache in `folder` (`readonly`: add none); run before any computation.

    See https://pytorch.org/xla/release/r2.7/learn/api-guide.html, `torch_xla.runtime.initialize_cache`.
    """
    import torch_xla.runtime as xr

    xr.initialize_cache(folder, readonly=readonly)


def device() -> torch.device:
    require_xla()
    import torch_xla.core.xla_model as xm

    return torch.device(xm.xla_device())


def init_process_group(timeout: Any = None) -> None:
    """Join torchrun's processes through the `xla` backend, with `timeout` (job.collective_timeout_minutes)."""
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)

    if not dist.is_initialized():
        if timeout is None:
            dist.init_process_group("xla", init_method="xla://")
        else:
            dist.init_process_group("xla", init_method="xla://", timeout=timeout)


def mark_step() -> None:
    """Cut the traced graph here and launch it."""
    import torch_xla.core.xla_model as xm

    xm.mark_step()


def rendezvous(tag: str) -> None:
    """Block until every process reaches rendezvous `tag`: an XLA job's barrier."""
    import torch_xla.core.xla_model as xm

    xm.rendezvous(tag)


def wait() -> None:
    """Block until every launched graph has finished (for timers)."""
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()


def to_host(tree: Any) -> Any:
    """A copy of `tree` with XLA tensors as CPU tensors, in one transfer."""
    import torch_xla.core.xla_model as xm

    # torch-xla's own xm.save uses this to move a whole state dict at once; it is not exported under a public name.
    return xm._maybe_convert_to_cpu(tree)


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce a device tensor over every process (a new tensor)."""
    import torch_xla.core.xla_model as xm

    kind = {"sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX}[op]
    return xm.all_reduce(kind, tensor)


def reduce_gradients(params: Iterable[torch.Tensor], world_size: int) -> None:
    """Average the gradients over data-parallel processes, in place."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        import torch_xla.core.xla_model as xm

        xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / world_size)


def checkpoint_function() -> Callable[..., Any]:
    """Activation checkpointing that works on XLA (torch.utils.checkpoint's does not)."""
    from torch_xla.utils.checkpoint import checkpoint

    return checkpoint


def device_loader(batches: Iterable[Any], device: torch.device, batches_per_execution: int) -> Iterable[Any]:
    """`batches` sent to the device by a background thread; `batches_per_execution` matches the loop's cuts."""
    import torch_xla.distributed.parallel_loader as pl

    return pl.MpDeviceLoader(batches, device, batches_per_execution=batches_per_execution)


def rng_state() -> int:
    import torch_xla.core.xla_model as xm

    return int(xm.get_rng_state())


def set_rng_state(seed: int) -> None:
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(int(seed))


def in_use() -> bool:
    """True once torch_xla is imported (its RNG state then belongs in checkpoints)."""
    import sys

    return "torch_xla" in sys.modules


def counters() -> dict[str, float]:
    """Graph compilations, executions, device-to-host transfers and collectives so far (torch_xla.debug.metrics)."""
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
