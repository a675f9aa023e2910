"""Import-time stand-ins for the Neuron-only binaries that neuronx-distributed 0.13 and 0.17 import, for its CPU mode
(NXD_CPU_MODE=1): the tests run NxD's real source (../shared/vendor) with these in place of torch-neuronx,
neuronx-cc and libneuronxla, which exist only in the Neuron container.

Usage: `install()` first thing in a rank (tests/nxd/worker.py), then import neuronx_distributed.

Nothing here is *called* by the CPU-mode paths of initialize_model_parallel / Column/RowParallelLinear /
ParallelEmbedding / GQAQKVColumnParallelLinear / NxDPPModel / clip_grad_norm / NxDOptimizer / checkpoint, except
  - torch_neuronx.utils.get_platform_target()  -> "trn1"   (parallel_state.initialize_model_parallel, pad, qkv_linear)
  - neuronxcc.nki._pre_prod_kernels.collectives.CollectivesConfig(replica_groups=...).rank_src_tgt_pairs[rank]
                                               (parallel_state.initialize_model_parallel, context-parallel ring pairs)
  - torch_neuronx.xla_impl.ops.nki_jit(**kw)(fn)  (called at import of parallel_layers/mappings.py: decorator factory)
  - NxD 0.17: neuronxcc.nki.jit / nki.jit(**kw) and nki.compiler.skip_middle_end_transformations, decorating NKI
    kernels at import of kernels/*.py and modules/moe/moe_fused_tkg_mx.py (they return the function unchanged)
Everything else only has to exist as a name at import time.
"""

from __future__ import annotations

import enum
import sys
import types


def _mod(name: str, **attrs) -> types.ModuleType:
    """Create (or reuse) a stub module, register it in sys.modules and on its parent package."""
    m = sys.modules.get(name)
    if m is None:
        m = types.ModuleType(name)
        m.__path__ = []  # a package, so that submodules resolve through sys.modules
        sys.modules[name] = m
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(_mod(parent), child, m)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def _placeholder(name: str):
    """A named class that can be constructed but does nothing (only used as a type / import name)."""
    return type(name, (), {"__init__": lambda self, *a, **k: None})


def _types_module(name: str) -> types.ModuleType:
    """A stub module whose every public attribute is a placeholder class (protobuf message types used in
    annotations that are evaluated at import time: hlo_pb2.HloModuleProto, metaneff_pb2.MetaNeff, ...)."""
    m = _mod(name)

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        cls = _placeholder(attr)
        setattr(m, attr, cls)
        return cls

    m.__getattr__ = __getattr__
    return m


def _unavailable(name: str):
    def f(*a, **k):
        raise RuntimeError(f"{name}: Neuron-only (stubbed for NXD_CPU_MODE)")

    f.__name__ = name
    return f


class CollectivesConfig:
    """neuronxcc's CollectivesConfig: NxD only reads .rank_src_tgt_pairs[rank] (ring send/recv pairs for CP)."""

    def __init__(self, replica_groups, **_):
        self.replica_groups = replica_groups
        self.rank_src_tgt_pairs = {}
        for group in replica_groups:
            n = len(group)
            for i, r in enumerate(group):
                self.rank_src_tgt_pairs[r] = [[group[(i - 1) % n], group[(i + 1) % n]]] if n > 1 else []


def _nki_jit(*args, **kwargs):
    # used as nki_jit(experimental_flags=...)(fn) at import time of parallel_layers/mappings.py
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


def install() -> None:
    # torch_xla probes `from libneuronxla.libneuronpjrt_path import libneuronpjrt_path` when it is imported; if
    # that succeeds it switches to PJRT_DEVICE=NEURON. Import torch_xla first (its probe then sees no libneuronxla),
    # and in any case never give the stub a `libneuronpjrt_path` submodule (so the probe fails even if the stub is
    # in sys.modules first: the stub below is a plain module, not a package).
    import torch
    import torch_xla  # noqa: F401

    # --- libneuronxla (trace/model_builder.py: `from libneuronxla import neuron_xla_compile`)
    lib = types.ModuleType("libneuronxla")  # deliberately NOT a package: no libneuronpjrt_path
    lib.neuron_xla_compile = _unavailable("neuron_xla_compile")
    sys.modules["libneuronxla"] = lib

    # --- torch_neuronx
    target = lambda *a, **k: "trn1"  # noqa: E731  (neuronx_distributed.utils.utils.hardware("trn1"))
    _mod("torch_neuronx", BucketModelConfig=_placeholder("BucketModelConfig"))
    _mod("torch_neuronx.utils", get_platform_target=target)
    _mod("torch_neuronx.utils.utils", get_platform_target=target, SUPPORTED_TYPES=())
    structure = _types_module("torch_neuronx.xla_impl.structure")  # Packer, Flattener
    _mod("torch_neuronx.xla_impl", structure=structure)
    _mod("torch_neuronx.xla_impl.ops", nki_jit=_nki_jit)
    _mod("torch_neuronx.xla_impl.base", xla_call=_unavailable("xla_call"))
    _mod(
        "torch_neuronx.xla_impl.trace",
        HloArtifacts=_placeholder("HloArtifacts"),
        NeffArtifacts=_placeholder("NeffArtifacts"),
        generate_neff=_unavailable("generate_neff"),
        get_torch_dtype=_unavailable("get_torch_dtype"),
        hlo_entry_computation=_unavailable("hlo_entry_computation"),
        get_hlo_computation_by_id=_unavailable("get_hlo_computation_by_id"),
        get_hlo_root_instruction=_unavailable("get_hlo_root_instruction"),
        XLA_DTYPE_TO_METANEFF_DTYPE={},
    )
    _mod("torch_neuronx.xla_impl.bucket_trace", create_bucket_model=_unavailable("create_bucket_model"))
    _mod("torch_neuronx.xla_impl.torchscript", replace_weights=_unavailable("replace_weights"))
    _types_module("torch_neuronx.proto.metaneff_pb2")  # MetaNeff, MetaTensor
    _types_module("torch_neuronx.pyhlo.hlo_pb2")  # HloModuleProto, HloComputationProto, ...
    _types_module("torch_neuronx.pyhlo.xla_data_pb2")  # PrimitiveType
    _mod("torch_neuronx.experimental.profiler.v2_x.custom_op_name", hlo_debug=_unavailable("hlo_debug"))

    # --- neuronxcc (nki)
    # `import neuronxcc.nki.language as nl` (used inside kernels; NxD 0.17's kernels also read dtypes such as
    # nl.int32 as default arguments at import time, and neuronxcc.nki.isa / .typing as annotations)
    for kernel_api in ("neuronxcc.nki.language", "neuronxcc.nki.isa", "neuronxcc.nki.typing"):
        _types_module(kernel_api)
    _mod("neuronxcc.nki.nccl")  # `import neuronxcc.nki.nccl as nccl`
    _mod(
        "neuronxcc.nki.compiler.backends.neuron.dimensions",
        CCPipeline=_placeholder("CCPipeline"),
        VNC=_placeholder("VNC"),
    )
    _mod("neuronxcc.nki.kernels.attention", FlashConfig=_placeholder("FlashConfig"))
    _mod("neuronxcc.nki._pre_prod_kernels.collectives", CollectivesConfig=CollectivesConfig)
    # MoE (imported by trace -> quantization -> modules.moe): enum default values read at import time
    _mod(
        "neuronxcc.nki._private_kernels.blockwise_mm",
        BlockShardStrategy=enum.Enum("BlockShardStrategy", "HI_LO PING_PONG"),
        SkipMode=_placeholder("SkipMode"),
        ExpertAffinityScaleMode=enum.Enum("ExpertAffinityScaleMode", "NO_SCALE POST_SCALE PRE_SCALE", start=0),
    )

    # --- NxD 0.17 (Neuron 2.28) imports these besides
    _mod("neuronxcc.nki", jit=_nki_jit)  # modules/moe/nki_import.py: `from neuronxcc.nki import jit` (kernels only)
    # kernels/*.py import NKI's private instructions and MX dtypes by name (inline_asm_bytes, sendrecv, nc_matmul_mx,
    # quantize_mx, float8_e4m3fn_x4, ...), used only inside NKI kernels
    _types_module("neuronxcc.nki._private.private_api")
    # modules/moe/moe_fused_tkg_mx.py decorates its kernels with it at import time
    _mod("neuronxcc.nki.compiler", skip_middle_end_transformations=lambda fn: fn)
    # modules/moe/blockwise.py reads these enums' members for dataclass defaults at import time, found through
    # nki_import.import_nki in neuronxcc.nki._pre_prod_kernels (and blockwise_mm in _private_kernels, above)
    _mod(
        "neuronxcc.nki._pre_prod_kernels",
        ExpertAffinityScaleMode=enum.Enum("ExpertAffinityScaleMode", "NO_SCALE POST_SCALE PRE_SCALE", start=0),
        ActFnType=enum.Enum("ActFnType", "SiLU GELU GELU_Tanh_Approx Swish"),
        RouterActFnType=enum.Enum("RouterActFnType", "SIGMOID SOFTMAX"),  # modules/moe/moe_fused_tkg.py
    )

    # --- torch.classes.neuron.* (registered by torch_neuronx's C++ library; used in annotations at import time
    #     by trace/spmd.py and trace/nxd_model/base_nxd_model.py)
    torch.classes.neuron = types.SimpleNamespace(
        LayoutTransformation=_placeholder("LayoutTransformation"), SPMDModel=_placeholder("SPMDModel")
    )


def patch_gqa_collectives() -> None:
    """NxD's GQAQKVColumnParallelLinear calls torch-xla's collectives directly (xm.all_reduce of the key/value
    gradients over the KV-shared groups, xm.all_gather of the sequence), not the CPU-mode wrappers its other layers
    use; on CPU tensors torch-xla's would do nothing. Route that module's calls through torch.distributed on the
    same NxD groups (looked up at each call: patch any time after install)."""
    import neuronx_distributed.modules.qkv_linear_utils as qkv_utils
    import torch
    import torch.distributed as dist
    from neuronx_distributed.parallel_layers import parallel_state as ps

    def group_of(replica_groups: list[list[int]]) -> object:
        if replica_groups == ps.get_kv_shared_replica_groups():
            return ps.get_kv_shared_group()
        if replica_groups == ps.get_tensor_model_parallel_replica_groups():
            return ps.get_tensor_model_parallel_group()
        raise AssertionError(f"no NxD group for {replica_groups}")

    class XmOnCpu:
        REDUCE_SUM = "sum"

        @staticmethod
        def all_reduce(op, tensors, scale=1.0, groups=None, pin_layout=False):
            assert op == "sum" and scale == 1.0
            out = [t.clone() for t in tensors]
            for t in out:
                dist.all_reduce(t, group=group_of(groups))
            return out

        @staticmethod
        def reduce_scatter(
            reduce_type, input, scale, scatter_dim, shard_count, groups=None, output=None, pin_layout=False
        ):
            assert reduce_type == "sum"
            group = group_of(groups)
            total = input.clone()
            dist.all_reduce(total, group=group)  # gloo has no reduce-scatter: reduce, then keep this rank's part
            mine = total.chunk(shard_count, dim=scatter_dim)[dist.get_rank(group)] * scale
            return mine if output is None else output.copy_(mine)

        @staticmethod
        def all_gather(tensor, groups=None, pin_layout=False, dim=0):
            group = group_of(groups)
            pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, tensor.contiguous(), group=group)
            return torch.cat(pieces, dim=dim)

    qkv_utils.xm = XmOnCpu()


def patch_sequence_layout() -> None:
    """NxD gathers and reduce-scatters along a sequence dimension other than 0 through a transpose, and its linear
    layers' backward `.view`s what comes out: on an XLA tensor (no strides: on trn1) that works, on a CPU tensor
    a transposed view cannot be viewed. Make those results contiguous for CPU mode; nothing else changes."""
    from neuronx_distributed.parallel_layers import layers_utils, mappings

    for name in ("_gather_along_dim", "_reduce_scatter_along_dim"):
        original = getattr(mappings, name)

        def contiguous(*args, _original=original, **kwargs):
            return _original(*args, **kwargs).contiguous()

        setattr(mappings, name, contiguous)
        if hasattr(layers_utils, name):
            setattr(layers_utils, name, contiguous)
