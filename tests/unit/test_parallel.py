"""One parallel layout (`core.parallel.ParallelDims`): its degrees and rules, as the config, the planner, the NxD
settings and `World` read them."""

from __future__ import annotations

import pytest
import torch

from hlat.core.config import ConfigError
from hlat.core.parallel import LayoutError, ParallelDims, heads_problem, kv_replicas, layers_problem
from hlat.core.presets import load_config
from hlat.training.parallel.distributed import World


def test_data_parallelism_takes_the_ranks_the_model_split_leaves() -> None:
    dims = ParallelDims.of_world(8, 1, 64 * 32, sequence_parallel=True)  # hlat-7b on 64 nodes
    assert (dims.tensor, dims.pipeline, dims.data, dims.world_size) == (8, 1, 256, 2048)
    assert str(dims) == "TP 8 x PP 1 x DP 256 SP" and dims.splits_model
    assert dims.accumulation(1024, 1) == 4 and dims.batch_problem(1024, 1) is None
    assert dims.batch_problem(1000, 1) == "global batch 1000 is not a multiple of DP 256 x micro-batch 1"
    with pytest.raises(LayoutError, match=r"TP 8 x PP 4 = 32 does not divide the 48 ranks"):
        ParallelDims.of_world(8, 4, 48)
    with pytest.raises(LayoutError, match="sequence parallelism needs TP > 1"):
        ParallelDims(1, 2, 1, sequence_parallel=True)
    with pytest.raises(LayoutError, match="at least 1"):
        ParallelDims(0)


def test_the_heads_and_layers_rules() -> None:
    assert heads_problem(64, 8, 32) is None and kv_replicas(8, 32) == 4  # hlat-70b: each KV head on 4 ranks
    assert heads_problem(32, 32, 8) is None and kv_replicas(32, 8) == 1
    assert heads_problem(32, 32, 3) == "TP 3 must divide the 32 heads and divide or be a multiple of the 32 KV heads"
    assert heads_problem(64, 8, 16) is None and heads_problem(64, 16, 32) is None
    assert heads_problem(96, 12, 8) is not None  # 8 neither divides nor is a multiple of 12 KV heads
    assert layers_problem(80, 8) is None and layers_problem(32, 3) == "PP 3 does not divide the 32 layers"
    assert ParallelDims(32, 8, 32).problem(64, 8, 80) is None
    assert ParallelDims(8, 3, 1).problem(32, 32, 32) == "PP 3 does not divide the 32 layers"


def test_what_a_library_formed_is_checked_against_the_config() -> None:
    mine = ParallelDims(2, 1, 2)
    mine.check(ParallelDims(2, 1, 2), "neuronx-distributed")
    with pytest.raises(
        LayoutError, match=r"neuronx-distributed formed TP 4 x PP 1 x DP 1, but the config asks for TP 2"
    ):
        mine.check(ParallelDims(4, 1, 1), "neuronx-distributed")


def test_the_config_reads_its_layout_and_names_the_fields_it_breaks() -> None:
    config = load_config("hlat-70b")
    assert config.parallel_dims == ParallelDims(32, 8, 32, sequence_parallel=True)
    assert config.gradient_accumulation == 1024 // 32
    cases = {
        "parallelism.tensor=3": "parallelism.tensor=3, parallelism.pipeline=8: TP 3 must divide the 64 heads",
        "parallelism.pipeline=3": "parallelism.pipeline=3: PP 3 does not divide the 80 layers",
        "job.instance_count=3": "parallelism.tensor x parallelism.pipeline: TP 32 x PP 8 = 256 does not divide the 96",
        "training.global_batch_size=1000": "training.global_batch_size: global batch 1000 is not a multiple of DP 32",
    }
    for override, expected in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config("hlat-70b", [override])
        assert expected in str(err.value), (override, str(err.value))
    with pytest.raises(ConfigError, match=r"sequence parallelism needs TP > 1.*set tensor > 1 or sequence_parallel"):
        load_config("tiny", ["parallelism.sequence_parallel=true"])


def test_a_world_is_all_data_parallel_unless_given_a_split_layout() -> None:
    cpu = torch.device("cpu")
    world = World(rank=1, world_size=4, local_rank=1, device=cpu)
    assert world.layout == ParallelDims(data=4) and world.data_rank == 1
    split = World(rank=3, world_size=4, local_rank=3, device=cpu, layout=ParallelDims(2, 1, 2), data_rank=1)
    assert split.layout.tensor == 2 and split.data_rank == 1
    with pytest.raises(ValueError, match="has 8 ranks, not 4"):
        World(rank=0, world_size=4, local_rank=0, device=cpu, layout=ParallelDims(2, 2, 2))
