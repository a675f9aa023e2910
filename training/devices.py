"""What the device can do: peak FLOPs for MFU, memory in use, and the Trainium (Neuron) environment.

torch-neuronx / torch-xla / neuronx-distributed exist only inside the Neuron training container; they are
imported only through `neuron_available()` so that everything else runs on CPU and CUDA.
"""

from __future__ import annotations

import importlib.util
import os

import torch

# Dense BF16 peak FLOP/s per device (tensor cores / NeuronCore), from vendor data sheets.
_CUDA_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is lower (756e12): set HLAT_PEAK_FLOPS to override
    "A100": 312e12,
    "A10G": 125e12,
    "L4": 121e12,
}
TRN1_NEURONCORE_PEAK_BF16 = 95e12  # a Trainium chip is 190 TFLOP/s BF16 over its 2 NeuronCores


def peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of one device for MFU; HLAT_PEAK_FLOPS overrides; None when unknown (CPU)."""
    if "HLAT_PEAK_FLOPS" in os.environ:
        return float(os.environ["HLAT_PEAK_FLOPS"])
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in _CUDA_PEAK_BF16.items():
            if key in name:
                return flops
    if device.type == "xla":
        return TRN1_NEURONCORE_PEAK_BF16
    return None


def memory_gb(device: torch.device) -> float | None:
    """Peak memory allocated on the device so far, in GB (CUDA), else the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
    except (ImportError, OSError):
        return None


def neuron_available() -> bool:
    """True inside a Neuron container (torch-neuronx and torch-xla importable)."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch_neuronx", "torch_xla"))


def neuron_environment(precision: str, compile_cache: str | None = None) -> dict[str, str]:
    """Environment variables a trn1 job needs for the chosen precision (set before torch_xla is imported).

    bf16-sr: weights, states and compute in BF16 (XLA_USE_BF16=1) with stochastic rounding in the
    NeuronCore (NEURON_RT_STOCHASTIC_ROUNDING_EN=1), HLAT 7B. bf16-mixed keeps FP32 master weights and gets
    BF16 compute from autocast, so no XLA-wide downcast flag is set. fp32 turns stochastic rounding off.
    """
    env: dict[str, str] = {}
    if precision == "bf16-sr":
        env.update(XLA_USE_BF16="1", NEURON_RT_STOCHASTIC_ROUNDING_EN="1")
    elif precision == "fp32":
        env.update(NEURON_RT_STOCHASTIC_ROUNDING_EN="0")
    if compile_cache:
        env["NEURON_COMPILE_CACHE_URL"] = compile_cache
    return env
