"""What the device can do: peak FLOPs for MFU and memory in use (the Trainium job environment: core/environment.py)."""

from __future__ import annotations

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
