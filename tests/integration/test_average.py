"""`hlat average`: the mean of a run's last 3 checkpoints equals the one computed by hand, for a run's dense
checkpoints and for FSDP2's sharded ones (two gloo ranks), and it exports (`hlat export`) and evaluates
(training/evaluate.py); incomplete checkpoints are never used, and checkpoints of different configs or layouts are
refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.cli import main as cli
from hlat.core.config import validate_config
from hlat.core.layout import CheckpointError, CheckpointIndex, locate_checkpoint
from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training.checkpoint import CheckpointManager
from hlat.training.checkpoint.average import average_checkpoints
from hlat.training.checkpoint.hf_export import read_checkpoint, to_hf_state_dict
from tests.integration.test_fsdp import RUN as FSDP_RUN
from tests.integration.test_fsdp import torchrun
from tests.jobs import make_run, train


def by_hand(models: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The mean of the models' tensors, summed in float32 in step order and cast back."""
    out = {}
    for name, first in models[0].items():
        total = first.to(torch.float32)
        for model in models[1:]:
            total = total + model[name].to(torch.float32)
        out[name] = (total / len(models)).to(first.dtype)
    return out


def leave_a_torn_checkpoint(checkpoints: Path, newest: int) -> None:
    """A newer checkpoint folder without its marker, as a job killed mid-save leaves it: never averaged."""
    torn = checkpoints / f"step-{newest + 1:09d}"
    shutil.copytree(checkpoints / f"step-{newest:09d}", torn)
    (torn / "COMMITTED").unlink()


def exports_and_evaluates(run: Path, averaged: str, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """`hlat export` of the averaged checkpoint (the run's tokenizer found from it) loads in transformers with its
    weights; training/evaluate.py scores it as `--averaged` does (in a run folder with the run's data and tokenizer
    and a config asking for perplexity, whose averaged/ the average is written to). Returns the averaged model's
    dense state and the evaluation's results."""
    from transformers import AutoModelForCausalLM

    from hlat.training.evaluate import evaluate_checkpoint

    ref = locate_checkpoint(averaged)
    shared, config = read_checkpoint(ref)
    assert "optimizer" not in shared

    out = tmp_path / "hf"
    assert cli(["export", averaged, str(out)]) == 0  # the run's tokenizer, found from <run>/averaged
    hf = AutoModelForCausalLM.from_pretrained(out)
    expected = to_hf_state_dict(shared["model"], config.model)
    for name, tensor in hf.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)

    scored = tmp_path / "scored"
    for part in ("data", "tokenizer"):
        shutil.copytree(run / part, scored / part)
    stored = json.loads((run / "config.json").read_text())
    stored["evaluation"] = {**stored.get("evaluation", {}), "perplexity_tokens": 2000, "tasks": []}
    (scored / "config.json").write_text(json.dumps(stored))
    average_checkpoints(str(run), 3, out=str(scored / "averaged"))
    cfg = validate_config(stored)
    results = evaluate_checkpoint(Run.at(str(scored)), cfg, ref.step, torch.device("cpu"), averaged=True)
    assert results["step"] == ref.step and results["averaged"] and results["perplexity"]["tokens"] > 0
    assert (scored / "eval" / f"averaged-step-{ref.step:09d}" / "results.json").is_file()
    assert 1 < results["perplexity"]["perplexity"] < config.model.vocab_size * 4
    return shared["model"], results


@pytest.mark.slow
def test_the_average_of_a_runs_last_3_dense_checkpoints_is_their_mean_and_exports_and_evaluates(
    prepared: Path, tmp_path: Path
) -> None:
    run = make_run(prepared, tmp_path, "dense", max_steps=8, checkpoint_every=2, keep_checkpoints=5, eval_every=0,
                   warmup_steps=2, schedule="wsd")  # fmt: skip
    code, out = train(run)
    assert code == 0, out[-3000:]
    leave_a_torn_checkpoint(run / "checkpoints", 8)

    assert cli(["average", str(run), "--last", "3"]) == 0
    averaged = run / "averaged" / "step-000000008"
    meta = CheckpointIndex(Storage(str(run / "averaged"))).read_meta(8)
    assert meta["averaged"]["steps"] == [4, 6, 8]
    manager = CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1)
    expected = by_hand([manager.load_shared(step)["model"] for step in (4, 6, 8)])
    model, _ = exports_and_evaluates(run, str(averaged), tmp_path)
    assert model.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(model[name], tensor), name
    newest = manager.load_shared(8)["model"]
    assert any(not torch.equal(model[n], newest[n]) for n in newest)  # an average, not the newest checkpoint


@pytest.mark.slow
def test_fsdp2_checkpoints_are_averaged_shard_by_shard_and_export_and_evaluate(prepared: Path, tmp_path: Path) -> None:
    run = make_run(prepared, tmp_path, "fsdp", **{**FSDP_RUN, "max_steps": 6, "checkpoint_every": 2,
                                                  "keep_checkpoints": 3, "eval_every": 0})  # fmt: skip
    code, out = torchrun(run)
    assert code == 0, out[-3000:]
    leave_a_torn_checkpoint(run / "checkpoints", 6)

    averaged = average_checkpoints(str(run), 3)
    assert (averaged.steps, averaged.layout) == ([2, 4, 6], "distributed")
    files = set(CheckpointIndex(averaged.folder).read_meta(6)["files"])
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pt"} == files  # no optimizer, no rank files
    manager = CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1)
    expected = by_hand([manager.load_distributed_full(step)["model"] for step in (2, 4, 6)])
    model, _ = exports_and_evaluates(run, averaged.uri, tmp_path)
    assert model.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(model[name], tensor), name


# -- refusals, on checkpoints written directly -------------------------------------------------------------------
def save(checkpoints: Path, step: int, config: Any, value: float, shards: tuple[str, ...] = ()) -> None:
    """A checkpoint of a two-tensor 'model' (bf16 and fp32) under a config, unsharded or in NxD's shard files."""
    model = {"w": torch.full((2, 3), value, dtype=torch.bfloat16), "b": torch.full((3,), value)}
    shared = {"step": step, "config": config.model_dump(mode="json"), "model": model, "optimizer": {"m": 1}}
    if not shards:
        CheckpointManager(Storage(str(checkpoints)), keep_last=9).save(step, shared, {"rank": 0})
        return
    for rank in reversed(range(len(shards))):  # rank 0 commits once the other's files are there
        manager = CheckpointManager(Storage(str(checkpoints)), keep_last=9, rank=rank, world_size=len(shards),
                                    shard=shards[rank], shard_writer=True, shards=shards)  # fmt: skip
        manager.save(step, {**shared, "model": {k: v + rank for k, v in model.items()}}, {"rank": rank})


def test_averaging_uses_complete_checkpoints_of_one_config_and_layout(tmp_path: Path) -> None:
    config = load_config("tiny", storage=str(tmp_path))
    checkpoints = tmp_path / "run" / "checkpoints"
    for step, value in ((1, 1.0), (2, 2.0), (3, 4.0)):
        save(checkpoints, step, config, value)
    leave_a_torn_checkpoint(checkpoints, 3)
    averaged = average_checkpoints(str(tmp_path / "run"), 2)
    state = CheckpointManager(averaged.folder, keep_last=1).load_shared(3)
    assert averaged.steps == [2, 3] and averaged.uri.endswith("run/averaged/step-000000003")
    assert state["model"]["b"].tolist() == [3.0] * 3 and state["model"]["w"].dtype == torch.bfloat16
    assert "optimizer" not in state and state["averaged_steps"] == [2, 3]

    with pytest.raises(CheckpointError, match=r"3 complete checkpoint\(s\) \(steps 1, 2, 3\), fewer than the 4"):
        average_checkpoints(str(tmp_path / "run"), 4)
    save(checkpoints, 5, load_config("tiny", {"training.lr": 0.004}, storage=str(tmp_path)), 8.0)
    with pytest.raises(CheckpointError, match="trained with different configs"):
        average_checkpoints(str(tmp_path / "run"), 2)
    save(checkpoints, 6, config, 8.0, shards=("tp00-pp00", "tp01-pp00"))
    with pytest.raises(CheckpointError, match="saved in different layouts"):
        average_checkpoints(str(tmp_path / "run"), 2)


def test_nxd_shard_files_are_averaged_one_shard_at_a_time(tmp_path: Path) -> None:
    config = load_config("tiny", storage=str(tmp_path))
    shards = ("tp00-pp00", "tp01-pp00")
    checkpoints = tmp_path / "run" / "checkpoints"
    for step, value in ((2, 1.0), (4, 2.0), (6, 6.0)):
        save(checkpoints, step, config, value, shards=shards)
    averaged = average_checkpoints(str(checkpoints), 3, out=str(tmp_path / "avg"))
    assert averaged.layout == "sharded" and CheckpointIndex(averaged.folder).read_meta(6)["shards"] == list(shards)
    states = CheckpointManager(averaged.folder, keep_last=1).load_shards(6)
    for rank, name in enumerate(shards):
        assert states[name]["model"]["b"].tolist() == [3.0 + rank] * 3
        assert "optimizer" not in states[name]
