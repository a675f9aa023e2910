"""Importing Hugging Face checkpoints (model.init_from) into neuronx-distributed's layouts (CPU mode, gloo ranks): a
tiny random LlamaForCausalLM and GPTNeoXForCausalLM checkpoint (`tests.hf_checkpoints.write_checkpoint`: this tier's
environment has no transformers; the unit tier shows transformers loads that layout and that the dense import gives
its logits), imported by the Trainer's own resume into TP2 (each rank its slices, NxD's parallel layers) and PP2
(each rank its stage), give the dense import's logits (TP: the vocabulary-parallel logits gathered) or its loss (PP:
through NxD's pipeline), and the checkpoint saved right after the import (one shard per TP/PP position) exports
bitwise to the original tensors.

The ranks run this module (`python -m tests.nxd.test_hf_import <out> <json args>` under torchrun), with the Neuron
stand-ins installed first, as tests/nxd/worker.py's scenarios do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hlat.core.run import Run
from tests.hf_checkpoints import (
    ARCHS,
    VOCAB,
    assert_first_checkpoint_exports_the_original,
    config_overrides,
    dense_import,
    write_checkpoint,
    write_import_record,
)
from tests.nxd.conftest import PROJECT, cpu_mode_environment, make_run

os.environ["HF_HUB_OFFLINE"] = "1"

LAYOUTS = {
    "tp2": {"parallelism.tensor": 2, "job.processes_per_node": 2},
    "pp2": {"parallelism.pipeline": 2, "job.processes_per_node": 2},
}
COMMON = {"training.global_batch_size": 8, "training.micro_batch_size": 2, "training.async_checkpoint": False}
VOCAB_MULTIPLE = 128
"""320 rows padded to 384: each TP rank's slice of the vocabulary 192 rows, the second one's half padding."""


def tokens(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed tokens of the checkpoints' vocabulary: (inputs, targets) of `rows` x 32."""
    x = torch.randint(0, VOCAB, (rows, 33), generator=torch.Generator().manual_seed(17))
    return x[:, :-1], x[:, 1:]


def run_import_ranks(
    processes: int, out: Path, run: Path, scenario: str = "layout", env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """`scenario` of this module (`SCENARIOS`) on `processes` torchrun ranks in NxD's CPU mode (`env` added); each
    rank's result, in rank order."""
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "-m", "tests.nxd.test_hf_import", scenario, str(out), json.dumps({"run": str(run)}),
    ]  # fmt: skip
    environment = {**cpu_mode_environment(), **(env or {})}
    done = subprocess.run(command, cwd=PROJECT, env=environment, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"import on {processes} ranks exited {done.returncode}:\n{done.stderr[-6000:]}")
    return [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in range(processes)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_an_import_into_tp2_and_pp2_gives_the_dense_logits_and_its_checkpoint_exports_bitwise(
    arch: str, layout: str, prepared: Path, tmp_path: Path
) -> None:

    folder = tmp_path / "hf"
    write_checkpoint(arch, folder, seed=31)
    overrides = {**config_overrides(folder, VOCAB_MULTIPLE), **COMMON, **LAYOUTS[layout]}
    run = make_run(prepared, tmp_path, layout, **overrides)
    write_import_record(Run.at(str(run)), folder)
    ranks = run_import_ranks(2, tmp_path / "ranks", run)

    inputs, targets = tokens(ranks[0]["rows"])
    with torch.no_grad():
        logits = dense_import(folder, VOCAB_MULTIPLE)(inputs)[..., :VOCAB]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    for rank, result in enumerate(ranks):
        assert abs(result["loss"] - loss) <= 1e-5 * loss, (rank, result["loss"], loss)
        if layout == "tp2":  # the vocabulary-parallel logits of both ranks, gathered
            assert result["logits"].shape[-1] == 384
            assert (result["logits"][..., :VOCAB] - logits).abs().max().item() < 1e-5
            assert torch.isneginf(result["logits"][..., VOCAB:]).all()
    if layout == "pp2":  # each stage filled its own parameters only
        stages = [set(r["names"]) for r in ranks]
        assert not stages[0] & stages[1] and "embed.weight" in stages[0] and "output.weight" in stages[1]

    assert_first_checkpoint_exports_the_original(run, folder)


@pytest.mark.parametrize("precision", ["fp32", "bf16-sr"])
def test_zero1_master_weights_are_the_imported_parameters(precision: str, prepared: Path, tmp_path: Path) -> None:
    """NxD's ZeRO-1 optimizer (XLA:CPU, one process, as tests/nxd/test_zero1.py runs it) made its master weights from
    the parameters when it was built: after the import they are the imported weights, not the random init's."""
    from hlat.core.environment import xla_precision_environment
    from tests.nxd.conftest import SDK

    folder = tmp_path / "hf"
    write_checkpoint("llama", folder, seed=33)
    config = {"parallelism.zero1": True, "precision.mode": precision, "training.grad_clip": 0.0}
    run = make_run(prepared, tmp_path, "zero1", **config_overrides(folder), **COMMON, **config)
    write_import_record(Run.at(str(run)), folder)
    env = xla_precision_environment(precision, SDK.precision_flags)  # set before torch_xla is imported
    (result,) = run_import_ranks(1, tmp_path / "ranks", run, scenario="zero1", env=env)
    assert result["masters_are_the_parameters"], result
    dense = dense_import(folder).state_dict()
    for name, value in result["parameters"].items():
        # bf16-sr: a BF16 model (2.28), or FP32-typed parameters held in BF16 on the device (2.24's XLA_USE_BF16).
        expected = dense[name].to(torch.bfloat16) if precision == "bf16-sr" else dense[name]
        assert torch.equal(value, expected.to(value.dtype)), name


# -- one rank -----------------------------------------------------------------------------------------------------
def zero1_main(out: Path, args: dict[str, Any]) -> None:
    """One process: the model on XLA:CPU with NxD's ZeRO-1 optimizer (as the Trainer builds them on XLA), then
    `import_weights`; the master weights against the parameters, and the parameters, on the host."""
    import torch.distributed as dist

    from hlat.core.contract import read_job_config
    from hlat.core.environment import precision_by_flags
    from hlat.training import xla
    from hlat.training.checkpoint.hf_import import import_weights
    from hlat.training.model import Transformer
    from hlat.training.optim import optimizer_recipe, trainable_parameters
    from hlat.training.parallel.distributed import close_world, init_world
    from hlat.training.parallel.neuron import parallel_optimizer
    from tests.nxd import worker  # installs the Neuron stand-ins (nothing above imports NxD)

    cfg = read_job_config(f"{args['run']}/config.json").config
    dist.init_process_group("gloo")  # NxD forms its groups (each of one rank) inside torch.distributed's
    world = init_world("cpu", cfg)
    try:
        device, flags = xla.device(), precision_by_flags(cfg, on_xla=True)
        model = Transformer(cfg.model)
        model.init_weights(worker.SEED)
        if cfg.precision.mode == "bf16-sr" and not flags:  # as the trainer does
            model = model.to(torch.bfloat16)
        model = model.to(device)
        params = trainable_parameters(model)
        kind, arguments = optimizer_recipe(params, cfg.training, cfg.precision.mode, "xla", zero1=True, flags=flags)
        optimizer = parallel_optimizer(world.nxd, kind, params, **arguments)
        trainer = SimpleNamespace(
            cfg=cfg, run=Run.at(args["run"]), world=world, model=model, wrapped=model, optimizer=optimizer
        )
        import_weights(trainer)
        zero1 = optimizer.optimizer  # NxD's NxDOptimizer around its NeuronZero1Optimizer
        masters = xla.to_host([p.detach() for group in zero1.base_optimizer.param_groups for p in group["params"]])
        parameters = xla.to_host([p.detach() for p in params])
        names = {id(p): n for n, p in model.named_parameters()}
        result = {
            "masters_are_the_parameters": len(masters) == len(parameters)
            and all(torch.equal(m, p.to(m.dtype)) for m, p in zip(masters, parameters, strict=True)),
            "parameters": {names[id(p)]: v for p, v in zip(params, parameters, strict=True)},
        }
        torch.save(result, out / f"rank-{world.rank}.pt")
    finally:
        close_world()


def rank_main(out: Path, args: dict[str, Any]) -> None:
    """One rank: the Trainer of the run (its resume imports the checkpoint), the loss (and under TP the gathered
    logits) on `tokens`, then a checkpoint of step 0; the results in `<out>/rank-<rank>.pt`."""
    import torch.distributed as dist

    from hlat.core.contract import read_job_config
    from hlat.training.checkpoint.hf_import import rank_parameters
    from hlat.training.parallel.distributed import close_world, init_world
    from tests.nxd import worker  # installs the Neuron stand-ins (nothing above imports NxD)

    cfg = read_job_config(f"{args['run']}/config.json").config
    world = init_world("cpu", cfg)
    try:
        trainer = worker.trainer_for(cfg, world, args["run"])
        assert trainer.resume() == 0  # no checkpoint: it imports model.init_from
        rows = cfg.gradient_accumulation * cfg.training.micro_batch_size
        inputs, targets = tokens(rows)
        result: dict[str, Any] = {"rows": rows, "names": sorted(rank_parameters(trainer))}
        with torch.no_grad():
            if world.layout.pipeline > 1:
                result["loss"] = float(trainer.wrapped.run_eval(tokens=inputs, targets=targets))
            else:
                local = trainer.model(inputs)
                result["loss"] = float(trainer.model.loss(local, targets))
                pieces = [torch.empty_like(local) for _ in range(world.layout.tensor)]
                dist.all_gather(pieces, local.contiguous(), group=worker.tp_group())
                result["logits"] = torch.cat(pieces, dim=-1)
        trainer.save_checkpoint(0)
        trainer.ckpt.wait()
        trainer.loader.close()
        torch.save(result, out / f"rank-{world.rank}.pt")
    finally:
        close_world()


SCENARIOS = {"layout": rank_main, "zero1": zero1_main}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](Path(sys.argv[2]), json.loads(sys.argv[3]))
