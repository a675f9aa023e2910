"""The environment a job runs in on Trainium or XLA:CPU: what torch-xla, neuronx-cc and the Neuron runtime read,
as the config sets it, and whether the Neuron packages are there at all.

torch-neuronx / torch-xla / neuronx-distributed exist only inside the Neuron training container; they are
imported only after `neuron_available()` says so, so that everything else runs on CPU and CUDA. Part of the job
contract: the control plane sets this environment (`infra/stage_jobs.py`), the job programs read it. No torch here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from hlat.core.config import DEFAULT_NEURON_SDK, HlatConfig


@dataclass(frozen=True)
class NeuronSdk:
    """A Neuron SDK release a trn1 job can run on: its PyTorch training image (AWS's Neuron deep-learning container,
    github.com/aws-neuron/deep-learning-containers, pytorch/training/<pytorch>/Dockerfile.neuronx at the release's
    tag) and what decides how a job is set up on it."""

    version: str
    pytorch: str
    torch_xla: str
    """torch-xla's major.minor in the image (torch-neuronx requires that release)."""
    python: str
    ubuntu: str
    torch_neuronx: str
    neuronx_cc: str
    neuronx_distributed: str
    neuronx_distributed_training: str
    precision_flags: bool
    """Whether the release supports XLA_USE_BF16 / XLA_DOWNCAST_BF16. Neuron 2.24 is the last that does (Neuron's
    "end of support for XLA_USE_BF16 and XLA_DOWNCAST_BF16" announcement); later ones cast the model
    (`model.to(torch.bfloat16)`) or autocast, as Neuron's migration guide prescribes. Unsupported is not ignored:
    torch-xla 2.9 still reads XLA_USE_BF16 (a bf16 graph on XLA:CPU, with a deprecation warning), so a 2.28 job
    must not set them beside its own cast."""
    cpu_cache_loads: bool
    """Whether this release's torch-xla loads graphs back from its persistent cache on XLA:CPU (the local rehearsal
    of precompile): 2.7 does; 2.9's PJRT CPU client cannot ("Deserializing serialized executable not supported").
    On trn1 the Neuron compile cache serves the graphs either way."""
    install_target: str
    """The `scripts/install.sh` target of this image's local rehearsal ("xla", "xla-2.28"): it makes
    `.venv-<target>`, whose Python runs the local backend's jobs on XLA:CPU."""

    @property
    def local_python(self) -> str:
        """The local rehearsal's Python, relative to the project root."""
        return f".venv-{self.install_target}/bin/python"

    @property
    def image_tag(self) -> str:
        py = self.python.replace(".", "")
        return f"{self.pytorch}-neuronx-py{py}-sdk{self.version}-ubuntu{self.ubuntu}"

    @property
    def image_pins(self) -> str:
        """What the image pins (the file the job-requirements test resolves against), under deployments/."""
        return f"neuron-image-{self.version}.txt"

    @property
    def job_requirements(self) -> str:
        """What a training, precompile or burn-in job pip-installs on the image, under deployments/."""
        return f"job-requirements-{self.version}.txt"


NEURON_SDKS = {
    sdk.version: sdk
    for sdk in (
        # The last release that honours XLA_USE_BF16 / XLA_DOWNCAST_BF16 (Neuron's "end of support for
        # XLA_USE_BF16 and XLA_DOWNCAST_BF16" announcement): the closest selectable to HLAT's flag-based precision.
        # Not HLAT's own release: HLAT ran Neuron 2.20.0 (torch-neuronx 1.13.1, neuronx-cc 2.15, NxD 0.9, with its own
        # patches; awslabs/HLAT, common/install_2_20_0.sh), which has no PyTorch 2 image. Image tag and pins from
        # aws-neuron/deep-learning-containers at 2.24.1.
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
        # The default (config.DEFAULT_NEURON_SDK): the last release that trains with PyTorch/XLA and NxD (later ones
        # train through TorchNeuron, on trn2/trn3 only), and the one Neuron advises XLA-training users to stay on.
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
    """The installed torch-xla's major.minor ("2.7"), None without torch-xla; read from its package metadata, so
    nothing is imported (the precision flags must be set before torch_xla is)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torch-xla")
    except PackageNotFoundError:
        return None
    return ".".join(found.split("+")[0].split(".")[:2])


def environment_sdk() -> NeuronSdk | None:
    """The Neuron SDK release whose torch-xla this environment has (None: no torch-xla, or another release)."""
    release = torch_xla_release()
    return next((sdk for sdk in NEURON_SDKS.values() if sdk.torch_xla == release), None)


def rehearsal_sdk() -> NeuronSdk:
    """The Neuron SDK this environment rehearses when no config says: its torch-xla's, else the default."""
    return environment_sdk() or NEURON_SDKS[DEFAULT_NEURON_SDK]


def neuron_sdk(config: HlatConfig) -> NeuronSdk:
    """The Neuron SDK release of the config's trn1 jobs (neuron.sdk)."""
    return NEURON_SDKS[config.neuron.sdk]


def precision_by_flags(config: HlatConfig, on_xla: bool) -> bool:
    """Whether precision.mode is applied by torch-xla's environment flags (XLA_USE_BF16, XLA_DOWNCAST_BF16) rather
    than by the trainer: on an XLA device under an SDK that honours them. Otherwise the trainer casts the model to
    BF16 for bf16-sr and autocasts the compute for bf16-mixed, on XLA as on CPU and CUDA."""
    return on_xla and neuron_sdk(config).precision_flags


def neuron_available() -> bool:
    """True inside a Neuron container (torch-neuronx and torch-xla installed). A stand-in module without a spec (the
    NxD tests' stubs of torch-neuronx) does not count."""

    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ValueError:  # in sys.modules without a __spec__: not an installed package
            return False

    return installed("torch_neuronx") and installed("torch_xla")


def xla_precision_environment(precision: str, flags: bool = True) -> dict[str, str]:
    """What torch-xla and the Neuron runtime read for a precision mode, as HLAT ran it (set before torch_xla is
    imported). bf16-sr (HLAT 7B): every FP32 tensor is BF16 on the device (XLA_USE_BF16=1) and the NeuronCore
    rounds stochastically. bf16-mixed (HLAT 70B): FP32 tensors are downcast to BF16 and FP64 ones to FP32 on the
    device (XLA_DOWNCAST_BF16=1), which is how the optimizer keeps FP32 master weights; rounding to nearest.
    fp32: none of it. With `flags` off (an SDK after 2.24, `NeuronSdk.precision_flags`) only the runtime's
    stochastic rounding remains: the trainer casts the model itself, and Neuron's migration guide says not to set
    the two flags beside a cast or autocast."""
    use_bf16, downcast, sr = tuple({"bf16-sr": "101", "bf16-mixed": "010", "fp32": "000"}[precision])
    if not flags:
        return {"NEURON_RT_STOCHASTIC_ROUNDING_EN": sr}
    return {"XLA_USE_BF16": use_bf16, "XLA_DOWNCAST_BF16": downcast, "NEURON_RT_STOCHASTIC_ROUNDING_EN": sr}


MIXED_PRECISION_ACCUMULATION = "--enable-mixed-precision-accumulation"
"""neuronx-cc (2.13 on): reductions (dot, reduce) accumulate in FP32 whatever their operands' dtype, and the result is
cast back (Neuron Compiler 2.13.66.0 release notes)."""
NO_AUTO_CAST = "--auto-cast=none"
"""neuronx-cc computes in the model's own dtypes: by default it casts FP32 matmuls to BF16."""


def precision_compiler_flags(precision: str, sdk: NeuronSdk) -> list[str]:
    """The neuronx-cc options a precision mode needs on an SDK, as Neuron's own recipes set them.

    - fp32: `--auto-cast=none`, or neuronx-cc casts FP32 matmuls to BF16 ("By default, the compiler automatically
      casts internal FP32 operations to BF16": Neuron's guide to migrating from XLA_USE_BF16/XLA_DOWNCAST_BF16,
      https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/appnotes/torch-neuronx/migration-from-xla-downcast-bf16.html;
      NxDT's examples/training_orchestrator.py, precision type `fp32`).
    - bf16-mixed after 2.24 is torch.autocast: the compiler's own cast off (`--auto-cast=none`, the migration
      guide: autocast decides which ops run in BF16) and FP32 accumulation on, as NxDT's precision type `autocast`
      sets both (aws-neuron/neuronx-distributed-training, examples/training_orchestrator.py, unchanged from
      Neuron 2.20.0 to 2.26.0, the newest release in that repository).
    - bf16-sr after 2.24 is a BF16 model (`model.to(torch.bfloat16)`) with the runtime's stochastic rounding: FP32
      accumulation, as NxDT's `bf16SR`; nothing is FP32 for the compiler to cast.
    - Under 2.24's precision flags (bf16-sr: XLA_USE_BF16, bf16-mixed: XLA_DOWNCAST_BF16), HLAT's own compiler
      flags and nothing more: HLAT's 7B and 70B launch scripts (awslabs/HLAT) set only `--model-type transformer
      --distribution-strategy=llm-training`, and 2.24.1 is kept as the closest selectable to HLAT's flag-based
      precision. (NxDT adds FP32 accumulation to its flag modes too: neuron.compiler_flags can.)
    """
    if precision == "fp32":
        return [NO_AUTO_CAST]
    if sdk.precision_flags:
        return []
    if precision == "bf16-mixed":
        return [MIXED_PRECISION_ACCUMULATION, NO_AUTO_CAST]
    return [MIXED_PRECISION_ACCUMULATION]


def compiler_flags(config: HlatConfig) -> str:
    """NEURON_CC_FLAGS of the config's trn1 jobs: neuron.compiler_flags, then what precision.mode needs on
    neuron.sdk (`precision_compiler_flags`) unless the user's flags already choose it: a `--auto-cast` of their own
    (any mode) is kept, and an option already there is not repeated."""
    flags = config.neuron.compiler_flags
    options = {token.split("=")[0] for token in flags.split()}  # `--auto-cast none` and `--auto-cast=none` alike
    added = [
        flag
        for flag in precision_compiler_flags(config.precision.mode, neuron_sdk(config))
        if flag.split("=")[0] not in options
    ]
    return " ".join([flags, *added]).strip()


def on_trainium(config: HlatConfig) -> bool:
    """The jobs run on Trainium instances (trn1): the test `infra.stage_jobs.on_neuron` makes too."""
    return "trn" in config.job.instance_type


GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"
"""Set to 1 in every job process of several ranks, on every device (`training.parallel.distributed.init_world`, before
any gloo group exists; neuron.env may set it otherwise): gloo then connects a pair of ranks when a collective first
needs it, not every pair when a group is made (torch 2.9's ProcessGroupGloo reads it, `getDefaultGlooLazyInit`; torch
2.7, Neuron 2.24's, has no such switch). A runtime setting: it shapes no graph."""


def neuron_environment(config: HlatConfig, compile_cache: str | None = None) -> dict[str, str]:
    """The environment of a trn1 job (set before torch_xla is imported), as HLAT's launch scripts set it: the
    precision flags of precision.mode, then the compiler, runtime and EFA settings of the `neuron` section (with
    the compiler options precision.mode needs on the SDK, `compiler_flags`, and functionalization for ZeRO-1, as
    NxD's and NxDT's scripts set them), then
    neuron.env (last, so it overrides any of them), and NEURON_COMPILE_CACHE_URL when `compile_cache` is given."""
    n = config.neuron
    env = xla_precision_environment(config.precision.mode, neuron_sdk(config).precision_flags)
    env["NEURON_CC_FLAGS"] = compiler_flags(config)
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


NO_INDUCTOR_POOL = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
"""Inductor compiles in the process that asks, with no pool of compile-worker processes."""


def xla_cpu_environment(config: HlatConfig) -> dict[str, str]:
    """The environment of a job on XLA:CPU (training.device=xla off trn1, the local rehearsal of the trn1 code
    path): torch-xla on the host's CPU with the precision flags a trn1 job of the same SDK gets, and no Neuron
    runtime settings (there is no Neuron runtime). Importing torch_xla imports Inductor, which starts a pool of
    compile workers at once (each a Python with torch: ~5 s of CPU per job process, measured on torch-xla 2.7); the
    XLA path never compiles with Inductor, so the pool is not started."""
    flags = neuron_sdk(config).precision_flags
    return {**xla_precision_environment(config.precision.mode, flags), "PJRT_DEVICE": "CPU", **NO_INDUCTOR_POOL}


def xla_job_environment(config: HlatConfig, compile_cache: str | None = None) -> dict[str, str]:
    """The environment the config gives a job that runs on XLA: trn1's (`neuron_environment`, with the Neuron
    compile cache) on Trainium instances, else XLA:CPU's (`compile_cache` unused)."""
    if on_trainium(config):
        return neuron_environment(config, compile_cache)
    return xla_cpu_environment(config)


_RUNTIME_ONLY_PREFIXES = ("NEURON_RT_", "FI_", "RDMAV_")
_RUNTIME_ONLY = frozenset(
    {"MALLOC_ARENA_MAX", "TORCH_DIST_INIT_BARRIER", GLOO_LAZY_INIT, "NEURON_COMPILE_CACHE_URL", *NO_INDUCTOR_POOL}
)


def shapes_graphs(name: str) -> bool:
    """Whether an environment variable of an XLA job can change the graphs it compiles. The Neuron runtime's
    (NEURON_RT_*: timeouts, queue depth, stochastic rounding), libfabric's, malloc's, the process-group barrier and
    where the cache lives cannot; the precision flags, NEURON_CC_FLAGS, NEURON_FUSE_SOFTMAX, compress-RG and any
    variable neuron.env adds are taken to (the compile cache's key holds them)."""
    return name not in _RUNTIME_ONLY and not name.startswith(_RUNTIME_ONLY_PREFIXES)
