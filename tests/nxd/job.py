"""A job program of the NxD tier: `python -m tests.nxd.job <program> --config ...` runs training.<program> (train,
precompile, burn_in) with the Neuron stand-ins installed first, as the ranks of a real job in NxD's CPU mode."""

from __future__ import annotations

import runpy
import sys

from tests.nxd import stubs

stubs.install()
stubs.patch_gqa_collectives()
stubs.patch_sequence_layout()

if __name__ == "__main__":
    program = sys.argv.pop(1)
    runpy.run_module(f"hlat.training.{program}", run_name="__main__")
