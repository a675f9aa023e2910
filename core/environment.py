"""The environment a job runs in on Trainium or XLA:CPU, and whether the Neuron packages are there.

Import Neuron packages only after `neuron_available()`. The control plane sets this environment; the job reads it. No
torch here. docs/trn1.md gives each setting's source.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from hlat.core.config import DEFAULT_NEURON_SDK, HlatConfig


@dataclass(frozen=True)
class NeuronSdk:
    """A Neuron SDK release a trn1 job can run on: its training image and job set-up."""

    version: str
    pytorch: str
    torch_xla: str
    """torch-xla's major.minor in the image."""
    python: str
    ubuntu: str
    torch_neuronx: str
    neuronx_cc: str
    neuronx_distributed: str
    neuronx_distributed_training: str
    precision_flags: bool
    """Whether the release honours XLA_USE_BF16 / XLA_DOWNCAST_BF16 (2.24 is the last; docs/trn1.md)."""
    cpu_cache_loads: bool
    """Whether torch-xla reloads graphs from its persistent cache on XLA:CPU (2.7 does, 2.9 cannot)."""
    install_target: str
    """The `scripts/install.sh` target ("xla", "xla-2.28") whose `.venv-<target>` runs local jobs on XLA:CPU."""

    @property
    def local_python(self) -> str:
        return f".venv-{self.install_target}/bin/python"

    @property
    def image_tag(self) -> str:
        py = self.python.replace(".", "")
        return f"{self.pytorch}-neuronx-py{py}-sdk{self.version}-ubuntu{self.ubuntu}"

    @property
    def image_pins(self) -> str:
        """The file the image pins, under deployments/; the job-requirements test resolves against it."""
        return f"neuron-image-{self.version}.txt"

    @property
    def job_requirements(self) -> str:
        """What a training, precompile or burn-in job pip-installs on the image, under deployments/."""
        return f"job-requirements-{self.version}.txt"


NEURON_SDKS = {
    sdk.version: sdk
    for sdk in (
        # The last release that honours XLA_USE_BF16 / XLA_DOWNCAST_BF16: the closest to HLAT's flag-based precision
        # (docs/trn1.md). Image tag and pins from aws-neuron/deep-learning-containers at 2.24.1.
        NeuronSdk(
            version="2.24.1",
            pytorch="2.7.0",
            torch_xla="2.7",
            python="3.10",
            ubuntu="22.04",
            torch_neuronx="2.7.0.2.8.6734",
            neuronx_cc="2.19.8089.0",
            neuronx_distributed="0.13.14393",
            neuronx_distributed_training="1.4.1",
            precision_flags=True,
            cpu_cache_loads=True,
            install_target="xla",
        ),
        # The default: the last release that trains with PyTorch/XLA and NxD, as Neuron advises (docs/trn1.md).
        # aws-neuron/deep-learning-containers at 2.28.0, pytorch/training/2.9.0/Dockerfile.neuronx.
        NeuronSdk(
            version="2.28.0",
            pytorch="2.9.0",
            torch_xla="2.9",
            python="3.12",
            ubuntu="24.04",
            torch_neuronx="2.9.0.2.12.22436",
            neuronx_cc="2.23.6484.0",
            neuronx_distributed="0.17.26814",
            neuronx_distributed_training="1.7.0",
            precision_flags=False,
            cpu_cache_loads=False,
            install_target="xla-2.28",
        ),
    )
}


def torch_xla_release() -> str | None:
    """The installed torch-xla's major.minor ("2.7"), or None, read without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torch-xla")
    except PackageNotFoundError:
        return None
    return ".".join(found.split("+")[0].split(".")[:2])


def environment_sdk() -> NeuronSdk | None:
    """The Neuron SDK release of this environment's torch-xla (None: none, or unknown)."""
    release = torch_xla_release()
    return next((sdk for sdk in NEURON_SDKS.values() if sdk.torch_xla == release), None)


def rehearsal_sdk() -> NeuronSdk:
    """The Neuron SDK this environment rehearses when no config says: its torch-xla's, else the default."""
    return environment_sdk() or NEURON_SDKS[DEFAULT_NEURON_SDK]


def neuron_sdk(config: HlatConfig) -> NeuronSdk:
    return NEURON_SDKS[config.neuron.sdk]


def precision_by_flags(config: HlatConfig, on_xla: bool) -> bool:
    """Whether torch-xla's flags apply precision.mode: on XLA under an SDK that honours them. Else the trainer casts."""
    return on_xla and neuron_sdk(config).precision_flags


def neuron_available() -> bool:
    """True inside a Neuron container; stand-in modules without a spec (test stubs) do not count."""

    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ValueError:  # in sys.modules without a __spec__: not an installed package
            return False

    return installed("torch_neuronx") and installed("torch_xla")


def xla_precision_environment(precision: str, flags: bool = True) -> dict[str, str]:
    """What torch-xla and the Neuron runtime read for a precision mode (docs/trn1.md); set before importing
    torch_xla."""
    use_bf16, downcast, sr = tuple({"bf16-sr": "101", "bf16-mixed": "010", "fp32": "000"}[precision])
    if not flags:
        return {"NEURON_RT_STOCHASTIC_ROUNDING_EN": sr}
    return {"XLA_USE_BF16": use_bf16, "XLA_DOWNCAST_BF16": downcast, "NEURON_RT_STOCHASTIC_ROUNDING_EN": sr}


MIXED_PRECISION_ACCUMULATION = "--enable-mixed-precision-accumulation"
"""neuronx-cc 2.13+: dot and reduce accumulate in FP32, then cast back (Neuron Compiler 2.13.66.0 release notes)."""
NO_AUTO_CAST = "--auto-cast=none"
"""neuronx-cc computes in the model's own dtypes; by default it casts FP32 matmuls to BF16."""


def precision_compiler_flags(precision: str, sdk: NeuronSdk) -> list[str]:
    """The neuronx-cc options a precision mode needs on an SDK, as Neuron's and NxDT's recipes set them
    (docs/trn1.md)."""
    if precision == "fp32":
        return [NO_AUTO_CAST]
    if sdk.precision_flags:
        return []
    if precision == "bf16-mixed":
        return [MIXED_PRECISION_ACCUMULATION, NO_AUTO_CAST]
    return [MIXED_PRECISION_ACCUMULATION]


def compiler_flags(config: HlatConfig) -> str:
    """NEURON_CC_FLAGS of trn1 jobs: neuron.compiler_flags, then `precision_compiler_flags`.

    A user `--auto-cast` is kept, and an option already present is not repeated."""
    flags = config.neuron.compiler_flags
    options = {token.split("=")[0] for token in flags.split()}  # `--auto-cast none` and `--auto-cast=none` alike
    added = [
        flag
        for flag in precision_compiler_flags(config.precision.mode, neuron_sdk(config))
        if flag.split("=")[0] not in options
    ]
    return " ".join([flags, *added]).strip()


def on_trainium(config: HlatConfig) -> bool:
    """The jobs run on Trainium (trn1), as `infra.stage_jobs.on_neuron` also tests."""
    return "trn" in config.job.instance_type


GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"
"""1 in every multi-rank job: gloo connects rank pairs at first use, not all at once (docs/trn1.md)."""


def neuron_environment(config: HlatConfig, compile_cache: str | None = None) -> dict[str, str]:
    """The environment of a trn1 job, as HLAT's launch scripts set it; neuron.env overrides the rest."""
    n = config.neuron
    env = xla_precision_environment(config.precision.mode, neuron_sdk(config).precision_flags)
    env["NEURON_CC_FLAGS"] = compiler_flags(config)
    if config.parallelism.zero1:
        # Functionalization on for ZeRO-1, set explicitly as NxD's 70B scripts do: "needed to close 3% convergence
        # gap compared to PT1.13 for ZeRO1".
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


NO_INDUCTOR_POOL = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
"""Inductor compiles in-process, with no compile-worker pool."""


def xla_cpu_environment(config: HlatConfig) -> dict[str, str]:
    """The environment of a job on XLA:CPU: trn1's precision flags, no Neuron runtime, no Inductor worker pool."""
    flags = neuron_sdk(config).precision_flags
    return {**xla_precision_environment(config.precision.mode, flags), "PJRT_DEVICE": "CPU", **NO_INDUCTOR_POOL}


def xla_job_environment(config: HlatConfig, compile_cache: str | None = None) -> dict[str, str]:
    """A config's XLA job environment: trn1's (with the compile cache) on Trainium, else XLA:CPU's."""
    if on_trainium(config):
        return neuron_environment(config, compile_cache)
    return xla_cpu_environment(config)


_RUNTIME_ONLY_PREFIXES = ("NEURON_RT_", "FI_", "RDMAV_")
_RUNTIME_ONLY = frozenset(
    {"MALLOC_ARENA_MAX", "TORCH_DIST_INIT_BARRIER", GLOO_LAZY_INIT, "NEURON_COMPILE_CACHE_URL", *NO_INDUCTOR_POOL}
)


def shapes_graphs(name: str) -> bool:
    """Whether an XLA job's environment variable can change its compiled graphs (and so keys the cache).

    Runtime, libfabric, malloc, barrier and cache-location settings cannot; anything else is taken to."""
    return name not in _RUNTIME_ONLY and not name.startswith(_RUNTIME_ONLY_PREFIXES)
