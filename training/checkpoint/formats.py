"""Where a training job's state goes in a checkpoint: one format per way the model and optimizer are split, chosen
once per job (`checkpoint_format`), so the trainer saves and resumes the same way whatever the parallelism.

Every format saves what the trainer hands it, the shared state (step, scheduler, config: the same on every rank)
and the rank state (loader position, RNG states: rng.rank_state), and adds the model and optimizer where they
belong:

    Unsharded     model and optimizer in the shared train_state.pt, written by rank 0 (single process, DDP)
    ModelParallel NxD tensor/pipeline parallelism: one model-<tpNN-ppNN>.pt per model-parallel position, written by
                  its first data-parallel replica, with that position's optimizer state
    Zero1         ModelParallel with NxD's ZeRO-1 optimizer: each rank's optimizer shard (and master weights) in its
                  own rank file
    Distributed   FSDP2: the sharded model and optimizer through torch.distributed.checkpoint (dcp.py); the shared
                  train_state.pt keeps the rest

`layout` is what the `CheckpointManager` needs to know of the format (its shard, whether it writes it, every
shard's name; whether DCP files come with it). `save` hands the manager this rank's files; `load` puts a checkpoint's
model and optimizer back and returns the shared and rank states for the trainer to restore the rest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from torch import nn

from hlat.training.checkpoint.manager import CheckpointManager

State = dict[str, Any]


class CheckpointFormat(ABC):
    """How one job's model and optimizer are split into a checkpoint's files (see the module docstring)."""

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
    """The model and optimizer states in the shared file. `model_state` / `load_model_state` read and fill this
    rank's part of the model (default: the whole module's state dict)."""

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
        """The state the optimizer's state goes with: the shared one (every data-parallel replica holds it whole)."""
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
    """NxD's tensor and pipeline parallelism: this rank's part of the model (a pipeline stage's parameters under their
    original names, its TP slices) in its shard's file, as `layout` names it (shard, shard_writer, shards)."""

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
    """ZeRO-1: the optimizer states are sharded over the data-parallel ranks, so each rank keeps its own, with its
    shard of the master weights where the job saves them (`training.parallel.neuron.zero1_masters_outrank_parameters`:
    torch-xla's ZeroRedundancyOptimizer puts them in its state_dict as `sharded_master_weights`, and its
    load_state_dict copies them back over the shards it rebuilt from the parameters)."""

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
