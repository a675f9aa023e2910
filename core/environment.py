"""The environment a job runs in on Trainium or XLA:CPU: what torch-xla, neuronx-cc and the Neuron runtime read,
as the config sets it, and whether the Neuron packages are there at all.

torch-neuronx / torch-xla / neuronx-distributed exist only inside the Neuron training container; they are
imported only after `neuron_available()` says so, so that everything else runs on CPU and CUDA. Part of the job
contract: the control plane sets this environment (`infra/backends.py`), the job programs read it. No torch here.
"""

from __future__ import annotations

import importlib.util

from hlat.core.config import HlatConfig


def neuron_available() -> bool:
    """True inside a Neuron container (torch-neuronx and torch-xla installed). A stand-in module without a spec (the
    NxD tests' stubs of torch-neuronx) does not count."""

    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ValueError:  # in sys.modules without a __spec__: not an installed package
            return False

    return installed("torch_neuronx") and installed("torch_xla")


def xla_precision_environment(precision: str) -> dict[str, str]:
    """What torch-xla and the Neuron runtime read for a precision mode, as HLAT ran it (set before torch_xla is
    imported). bf16-sr (HLAT 7B): every FP32 tensor is BF16 on the device (XLA_USE_BF16=1) and the NeuronCore
    rounds stochastically. bf16-mixed (HLAT 70B): FP32 tensors are downcast to BF16 and FP64 ones to FP32 on the
    device (XLA_DOWNCAST_BF16=1), which is how the optimizer keeps FP32 master weights; rounding to nearest.
    fp32: none of it. XLA_USE_BF16 and XLA_DOWNCAST_BF16 are honoured up to Neuron SDK 2.24 (torch-xla 2.7)."""
    use_bf16, downcast, sr = tuple({"bf16-sr": "101", "bf16-mixed": "010", "fp32": "000"}[precision])
    return {"XLA_USE_BF16": use_bf16, "XLA_DOWNCAST_BF16": downcast, "NEURON_RT_STOCHASTIC_ROUNDING_EN": sr}


def on_trainium(config: HlatConfig) -> bool:
    """The jobs run on Trainium instances (trn1): the test `infra.backends.on_neuron` makes too."""
    return "trn" in config.job.instance_type


def neuron_environment(config: HlatConfig, compile_cache: str | None = None) -> dict[str, str]:
    """The environment of a trn1 job (set before torch_xla is imported), as HLAT's launch scripts set it: the
    precision flags of precision.mode, then the compiler, runtime and EFA settings of the `neuron` section (with
    `--auto-cast=none` for fp32, and functionalization for ZeRO-1, as NxD's and NxDT's scripts set them), then
    neuron.env (last, so it overrides any of them), and NEURON_COMPILE_CACHE_URL when `compile_cache` is given."""
    n = config.neuron
    env = xla_precision_environment(config.precision.mode)
    env["NEURON_CC_FLAGS"] = n.compiler_flags
    if config.precision.mode == "fp32" and "--auto-cast" not in n.compiler_flags:
        # neuronx-cc casts FP32 matmuls to BF16 unless told not to ("By default, the compiler automatically casts
        # internal FP32 operations to BF16": the Neuron guide to migrating from XLA_DOWNCAST_BF16); NxDT's
        # training_orchestrator.py adds the same flag for fp32.
        env["NEURON_CC_FLAGS"] += " --auto-cast=none"
    if config.parallelism.zero1:
        # Functionalization on for ZeRO-1 (torch-xla's default, set explicitly against an image that turns it off):
        # NxD's 70B tp_pp launch scripts and NxDT's train_setup.sh set it, "needed to close 3% convergence gap
        # compared to PT1.13 for ZeRO1".
        env["XLA_DISABLE_FUNCTIONALIZATION"] = "0"
    if n.fuse_softmax:
        env["NEURON_FUSE_SOFTMAX"] = "1"
    env["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] = str(n.async_inflight_requests)
    env["NEURON_RT_EXEC_TIMEOUT"] = str(n.exec_timeout)
    if n.malloc_arena_max is not None:
        env["MALLOC_ARENA_MAX"] = str(n.malloc_arena_max)
    if n.compress_rg:
        env["NEURON_EXPERIMENTAL_COMPRESS_RG"] = "1"
    if not n.dist_init_barrier:
        env["TORCH_DIST_INIT_BARRIER"] = "0"
    if n.efa:
        env.update(FI_PROVIDER="efa", FI_EFA_USE_DEVICE_RDMA="1")
    if n.efa_fork_safe:
        env["FI_EFA_FORK_SAFE"] = "1"
    env.update(n.env)
    if compile_cache:
        env["NEURON_COMPILE_CACHE_URL"] = compile_cache
    return env


def xla_cpu_environment(precision: str) -> dict[str, str]:
    """The environment of a job on XLA:CPU (training.device=xla off trn1, the local rehearsal of the trn1 code
    path): torch-xla on the host's CPU with the precision flags a trn1 job gets, and no Neuron runtime settings
    (there is no Neuron runtime)."""
    return {**xla_precision_environment(precision), "PJRT_DEVICE": "CPU"}


def xla_job_environment(config: HlatConfig, compile_cache: str | None = None) -> dict[str, str]:
    """The environment the config gives a job that runs on XLA: trn1's (`neuron_environment`, with the Neuron
    compile cache) on Trainium instances, else XLA:CPU's (`compile_cache` unused)."""
    if on_trainium(config):
        return neuron_environment(config, compile_cache)
    return xla_cpu_environment(config.precision.mode)


_RUNTIME_ONLY_PREFIXES = ("NEURON_RT_", "FI_", "RDMAV_")
_RUNTIME_ONLY = frozenset({"MALLOC_ARENA_MAX", "TORCH_DIST_INIT_BARRIER", "NEURON_COMPILE_CACHE_URL"})


def shapes_graphs(name: str) -> bool:
    """Whether an environment variable of an XLA job can change the graphs it compiles. The Neuron runtime's
    (NEURON_RT_*: timeouts, queue depth, stochastic rounding), libfabric's, malloc's, the process-group barrier and
    where the cache lives cannot; the precision flags, NEURON_CC_FLAGS, NEURON_FUSE_SOFTMAX, compress-RG and any
    variable neuron.env adds are taken to (the compile cache's key holds them)."""
    return name not in _RUNTIME_ONLY and not name.startswith(_RUNTIME_ONLY_PREFIXES)
