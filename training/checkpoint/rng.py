"""The per-rank state a checkpoint keeps: the RNG states and the loader's position, one rank file each."""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger("hlat.training.checkpoint")

State = dict[str, Any]


def capture_rng_state() -> State:
    """This process's RNG states as weights_only-loadable values: Python, NumPy, torch CPU, CUDA, XLA."""
    version, internal, gauss = random.getstate()
    state: State = {"python": {"version": version, "state": list(internal), "gauss_next": gauss}}
    try:
        import numpy as np
    except ImportError:  # numpy is optional here: nothing to capture when it is absent
        pass
    else:
        # The dict form of the legacy global generator's state (MT19937 keys, position, cached gaussian).
        np_state: dict[str, Any] = np.random.get_state(legacy=False)
        state["numpy"] = {
            "bit_generator": str(np_state["bit_generator"]),
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
    state["torch"] = torch.get_rng_state()
    if "torch_xla" in sys.modules:  # the XLA device's generator (a seed), once this process uses the device
        from hlat.training import xla

        state["xla"] = xla.rng_state()
    # Only when CUDA is already in use: querying it would otherwise initialise CUDA in a CPU-only process.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `capture_rng_state` captured (parts absent from `state` are left as they are)."""
    if "python" in state:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(v) for v in py["state"]), py["gauss_next"]))
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        key = torch.as_tensor(n["key"]).numpy().astype(np.uint32)
        np.random.set_state(
            {
                "bit_generator": n["bit_generator"],
                "state": {"key": key, "pos": int(n["pos"])},
                "has_gauss": int(n["has_gauss"]),
                "gauss": float(n["gauss"]),
            }
        )
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
    if "xla" in state and "torch_xla" in sys.modules:
        from hlat.training import xla

        xla.set_rng_state(int(state["xla"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = list(state["cuda"])
        if len(saved) != torch.cuda.device_count():
            log.warning(
                "checkpoint has CUDA RNG states for %d devices, this process sees %d: restoring the first %d",
                len(saved), torch.cuda.device_count(), min(len(saved), torch.cuda.device_count()),
            )  # fmt: skip
        for device, rng in enumerate(saved[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.as_tensor(rng, dtype=torch.uint8).cpu(), device)


def rank_state(loader_state: Mapping[str, Any]) -> State:
    """What one rank saves of its own: the data loader's position and the process's RNG states."""
    return {"loader": loader_state, "rng": capture_rng_state()}


def restore_rank_state(state: Mapping[str, Any], loader: Any) -> None:
    """Put a rank's saved state back: its loader (anything with load_state_dict) and its RNGs."""
    loader.load_state_dict(state["loader"])
    restore_rng_state(state["rng"])
