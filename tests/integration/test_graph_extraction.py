"""The precompile rehearsal under graph extraction (neuron_parallel_compile's trial run), on CPU.

neuron_parallel_compile runs the job with NEURON_EXTRACT_GRAPHS_ONLY set; "no real execution is performed and the
outputs are invalid" (Neuron's neuron_parallel_compile guide). neuron_parallel_compile exists only on trn1, so here a
one-process CPU world stands in for the device's answers: every collective and every host read returns garbage
(NaN, or a huge count), as the extraction's would. The rehearsal itself (`training/precompile.py`'s `rehearse`, the
training loop with its health check, checkpoints and validation) is the real one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.config import validate_config
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training import precompile
from hlat.training.loop import EXTRACT_GRAPHS_ONLY, Trainer
from hlat.training.parallel.distributed import World
from tests.jobs import make_run

GARBAGE_COUNT = 2**20 + 3
"""What an integer read from the device holds here: a count no real step produces (a non-finite-step count above 0
makes the NaN exit fire, a busbw table entry far from anything measured)."""


def garbage(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point():
        return torch.full_like(tensor, float("nan"))
    if tensor.dtype == torch.bool:
        return torch.zeros_like(tensor)  # "not finite"
    return torch.full_like(tensor, GARBAGE_COUNT)


@dataclass(frozen=True)
class InvalidOutputs(World):
    """One CPU process that answers like a device whose graphs are extracted, not executed: the health check's
    all-reduces, the loss averaged over ranks, every sync point's read are garbage. Counts the collectives, which
    still run (the graphs a job runs are all traced)."""

    all_reduces: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def collective(self) -> bool:
        return True  # the multi-rank path, as on trn1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.all_reduces.append(tuple(tensor.shape))
        return garbage(tensor)

    def to_host(self, tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            return garbage(tree)
        if isinstance(tree, dict):
            return {k: self.to_host(v) for k, v in tree.items()}
        if isinstance(tree, list | tuple):
            return type(tree)(self.to_host(v) for v in tree)
        return tree


def files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def rehearsal(prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, list[Any]]]:
    """A run whose jobs check their collectives every 50 steps (the rehearsal: at step 2 and 4), a failure file
    where the rehearsal would report, and spies on the hooks that write: what each left on disk right after it."""
    run = make_run(prepared, tmp_path, "extract", **{"burn_in.health_check_every": 50})
    monkeypatch.setenv("HLAT_FAILURE_FILE", str(tmp_path / "failure"))
    seen: list[Any] = []
    for hook in ("health_check", "save_checkpoint", "evaluate"):
        original = getattr(Trainer, hook)

        def spy(self: Trainer, step: int, _name: str = hook, _original: Any = original) -> Any:
            out = _original(self, step)
            self.ckpt.wait()  # an async save has written what it was going to write
            local = Path(self.run.storage.url)
            seen.append((_name, step, files(run / precompile.REHEARSAL_CHECKPOINTS), files(local)))
            return out

        monkeypatch.setattr(Trainer, hook, spy)
    yield run, seen


def test_extracting_graphs_the_rehearsal_traces_every_hook_acts_on_no_value_and_writes_nothing(
    rehearsal: tuple[Path, list[Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, seen = rehearsal
    cfg = validate_config(Storage(str(run)).read_json("config.json"))
    world = InvalidOutputs(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    before = files(run)
    monkeypatch.setenv(EXTRACT_GRAPHS_ONLY, "1")
    seconds = precompile.rehearse(Run.at(str(run)), cfg, world)  # no NaN exit, no UnhealthyCollective
    assert seconds > 0
    assert [(name, step) for name, step, _, _ in seen] == [
        ("health_check", 2),
        ("save_checkpoint", 3),
        ("health_check", 4),
        ("evaluate", 4),
        ("save_checkpoint", 4),
    ]
    for name, step, checkpoints, scratch in seen:  # nothing written at any point: no checkpoint, no metrics line
        assert checkpoints == {} and scratch == {}, (name, step, checkpoints, scratch)
    assert files(run) == before  # the run folder, file for file and byte for byte
    assert not (tmp_path / "failure").exists()
    # The collectives still ran: the loss mean of every step, the health checks' (1 checked, 1 warm-up, 5 timed, the
    # verdict table) and validation's mean.
    table = (1, 3)  # per rank: wrong sum, busbw, best busbw
    assert world.all_reduces.count(table) == 2
    assert len(world.all_reduces) >= 4 + 2 * (1 + 1 + 5 + 1) + 1


def test_the_same_garbage_without_graph_extraction_ends_the_rehearsal(
    rehearsal: tuple[Path, list[Any]], tmp_path: Path
) -> None:
    """The same outputs read as real ones: the first sync point sees non-finite steps and the job exits for a
    relaunch (what the rehearsal did under neuron_parallel_compile before it checked NEURON_EXTRACT_GRAPHS_ONLY)."""
    run, seen = rehearsal
    assert not os.environ.get(EXTRACT_GRAPHS_ONLY)
    cfg = validate_config(Storage(str(run)).read_json("config.json"))
    world = InvalidOutputs(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="exit code 3"):
        precompile.rehearse(Run.at(str(run)), cfg, world)
    assert seen == []
