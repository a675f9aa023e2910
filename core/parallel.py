"""One training job's parallel layout: its degrees, one name each, and their rules stated once.

Ranks split as tensor x pipeline x data (Megatron's and NxD's order), so a TP group stays inside a node. Config checks,
the planner, NxD and each rank's `World` read `ParallelDims`, after torchtitan's. What NxD forms is checked against it
(`check`), never read as a second source.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A layout that cannot run: the message names the setting and the rule."""


def heads_problem(n_heads: int, kv_heads: int, tensor: int) -> str | None:
    """Why `tensor` ranks cannot split the attention heads (None: they can).

    `tensor` divides the query heads, and divides or is a multiple of the KV heads (NxD replicates KV heads)."""
    if n_heads % tensor or (kv_heads % tensor and tensor % kv_heads):
        return f"TP {tensor} must divide the {n_heads} heads and divide or be a multiple of the {kv_heads} KV heads"
    return None


def layers_problem(n_layers: int, pipeline: int) -> str | None:
    """Why `pipeline` stages cannot hold whole, equal shares of the layers (None: they can)."""
    if n_layers % pipeline:
        return f"PP {pipeline} does not divide the {n_layers} layers"
    return None


def kv_replicas(kv_heads: int, tensor: int) -> int:
    """How many TP ranks hold each KV head: 1 unless TP exceeds the KV heads."""
    return max(1, tensor // kv_heads)


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a layout; sequence parallelism runs along the TP group."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "data"):
            if getattr(self, name) < 1:
                raise LayoutError(f"the {name}-parallel degree must be at least 1, not {getattr(self, name)}")
        if self.sequence_parallel and self.tensor == 1:
            raise LayoutError("sequence parallelism needs TP > 1 (it shards along the tensor-parallel group)")

    @classmethod
    def of_world(cls, tensor: int, pipeline: int, world_size: int, sequence_parallel: bool = False) -> ParallelDims:
        """`world_size` ranks with the model split `tensor` x `pipeline` ways, data the rest; else LayoutError."""
        split = tensor * pipeline
        if split < 1 or world_size % split:
            raise LayoutError(f"TP {tensor} x PP {pipeline} = {split} does not divide the {world_size} ranks")
        return cls(tensor, pipeline, world_size // split, sequence_parallel)

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data

    @property
    def splits_model(self) -> bool:
        """Whether tensor or pipeline parallelism splits each model copy."""
        return self.tensor * self.pipeline > 1

    def problem(self, n_heads: int, kv_heads: int, n_layers: int) -> str | None:
        """Why this layout cannot hold the model (None: it can): the heads rule, then whole layers per stage."""
        return heads_problem(n_heads, kv_heads, self.tensor) or layers_problem(n_layers, self.pipeline)

    def batch_problem(self, global_batch: int, micro_batch: int) -> str | None:
        """Why a global batch cannot be split into micro-batches over the data-parallel ranks (None: it can)."""
        if global_batch % (self.data * micro_batch):
            return f"global batch {global_batch} is not a multiple of DP {self.data} x micro-batch {micro_batch}"
        return None

    def accumulation(self, global_batch: int, micro_batch: int) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return global_batch // (self.data * micro_batch)

    def check(self, reported: ParallelDims, by: str) -> None:
        """Assert that a library's groups (`by`, e.g. NxD) formed exactly this layout."""
        if (reported.tensor, reported.pipeline, reported.data) != (self.tensor, self.pipeline, self.data):
            raise LayoutError(
                f"{by} formed TP {reported.tensor} x PP {reported.pipeline} x DP {reported.data}, but the config "
                f"asks for TP {self.tensor} x PP {self.pipeline} x DP {self.data}"
            )

    def __str__(self) -> str:
        return f"TP {self.tensor} x PP {self.pipeline} x DP {self.data}" + (" SP" if self.sequence_parallel else "")
