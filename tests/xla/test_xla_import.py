"""Importing a Hugging Face checkpoint (model.init_from) into a model already on the XLA device (XLA:CPU): the
Trainer's resume gives each parameter its tensor as device data, compiling and executing nothing and leaving no
operation pending for the loop's first graph; the imported model gives the dense import's logits (on the host; the
unit tier shows they are transformers'), and a checkpoint saved right after exports bitwise to the original tensors.
The checkpoint is `tests.hf_checkpoints.write_checkpoint`'s: this tier's environment has no transformers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hlat.core.config import validate_config
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training import xla
from hlat.training.loop import Trainer
from hlat.training.parallel.distributed import init_world
from tests.hf_checkpoints import (
    ARCHS,
    VOCAB,
    assert_first_checkpoint_exports_the_original,
    config_overrides,
    dense_import,
    write_checkpoint,
    write_import_record,
)
from tests.xla.conftest import make_run

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.mark.parametrize("arch", ARCHS)
def test_an_import_on_the_xla_device_runs_no_graph_and_gives_the_dense_logits(
    arch: str, prepared: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "hf"
    write_checkpoint(arch, folder, seed=41)
    overrides = {**config_overrides(folder, 64), "training.async_checkpoint": False}
    run = make_run(prepared, tmp_path, arch, **overrides)
    write_import_record(Run.at(str(run)), folder)
    cfg = validate_config(Storage(str(run)).read_json("config.json"))
    trainer = Trainer(
        cfg=cfg,
        run=Run.at(str(run)),
        checkpoints=Storage(str(run / "checkpoints")),
        world=init_world(cfg.training.device, cfg),
        tokenizer_model=str(run / "tokenizer" / "tokenizer.model"),
    )
    xla.mark_step()  # what building the trainer left pending
    xla.wait()
    before = xla.counters()
    assert trainer.resume() == 0  # no checkpoint: the import
    assert all(p.device.type == "xla" for p in trainer.model.parameters())
    # Nothing pending: a graph cut right after the import has nothing to compile or execute.
    xla.mark_step()
    xla.wait()
    after = xla.counters()
    assert after["compilations"] == before["compilations"] and after["executions"] == before["executions"]

    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = trainer.model(x.to(trainer.world.device)).cpu()
        diff = (ours - dense_import(folder, 64)(x)).abs().max().item()
    assert diff < 1e-5, diff

    trainer.save_checkpoint(0)
    trainer.ckpt.wait()
    trainer.loader.close()
    assert_first_checkpoint_exports_the_original(run, folder)
