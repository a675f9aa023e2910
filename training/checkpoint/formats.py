"""Where a job's state goes in a checkpoint: one format per way the model and optimizer are split.

The format is chosen once per job (`checkpoint_format`), so the trainer saves and resumes alike.
Each adds the model and optimizer to the trainer's shared and rank states:

    Unsharded      train_state.pt, written by rank 0 (single process, DDP).
    ModelParallel  NxD TP/PP: one model-<tpNN-ppNN>.pt per position, with its optimizer state.
    Zero1          ModelParallel, with each rank's optimizer shard in its rank file.
    Distributed    FSDP2 through torch.distributed.checkpoint (dcp.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from torch import nn

from hlat.training.checkpoint.manager import CheckpointManager

State = dict[str, Any]


class CheckpointFormat(ABC):
    """How one job's model and optimizer are split into a checkpoint's files."""

    def __init__(self, model: nn.Module, optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self.layout: dict[str, Any] = {}

    @abstractmethod
    def save(self, manager: CheckpointManager, step: int, shared: State, mine: State) -> None:
        """Checkpoint `step`: the trainer's shared and rank states, with the model and optimizer added."""

    @abstractmethod
    def load(self, manager: CheckpointManager, step: int) -> tuple[State, State]:
        """Load the model and optimizer of committed checkpoint `step`; return its (shared, rank) states."""


class Unsharded(CheckpointFormat):
    """The model and optimizer in the shared file; `model_state` / `load_model_state` choose this rank's part."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        layout: dict[str, Any] | None = None,
        model_state: Callable[[], State] | None = None,
        load_model_state: Callable[[State], Any] | None = None,
    ) -> None:
        super().__init__(model, optimizer)
        self.layout = dict(layout or {})
        self._model_state = model_state or model.state_dict
        self._load_model_state = load_model_state or model.load_state_dict

    def _optimizer_files(self, shared: State, mine: State) -> State:
        """The state the optimizer goes with: the shared one (every data-parallel replica holds it whole)."""
        return shared

    def save(self, manager: CheckpointManager, step: int, shared: State, mine: State) -> None:
        shared = {**shared, "model": self._model_state()}
        mine = dict(mine)
        self._optimizer_files(shared, mine)["optimizer"] = self.optimizer.state_dict()
        manager.save(step, shared, mine)

    def load(self, manager: CheckpointManager, step: int) -> tuple[State, State]:
        shared, mine = manager.load(step)
        self._load_model_state(shared["model"])
        self.optimizer.load_state_dict(self._optimizer_files(shared, mine)["optimizer"])
        return shared, mine


class ModelParallel(Unsharded):
    """NxD tensor and pipeline parallelism: this rank's part of the model in its shard's file."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        layout: dict[str, Any],
        model_state: Callable[[], State],
        load_model_state: Callable[[State], Any],
    ) -> None:
        super().__init__(model, optimizer, layout, model_state, load_model_state)


class Zero1(ModelParallel):
    """ZeRO-1: each rank keeps its optimizer shard, with its master weights where the job saves them.

    torch-xla's ZeroRedundancyOptimizer stores them as `sharded_master_weights` and restores them on load
    (`training.parallel.neuron.zero1_masters_outrank_parameters`).
    """

    def _optimizer_files(self, shared: State, mine: State) -> State:
        return mine


class Distributed(CheckpointFormat):
    """FSDP2: every rank's shards of the model and optimizer states through torch.distributed.checkpoint."""

    def __init__(self, model: nn.Module, optimizer: Any) -> None:
        super().__init__(model, optimizer)
        self.layout = {"distributed": True}

    def _state(self) -> State:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def save(self, manager: CheckpointManager, step: int, shared: State, mine: State) -> None:
        manager.save(step, shared, mine, distributed_state=self._state())

    def load(self, manager: CheckpointManager, step: int) -> tuple[State, State]:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        shared, mine = manager.load(step)
        state = self._state()
        manager.load_distributed(step, state)  # each rank reads its shards (a collective)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return shared, mine
