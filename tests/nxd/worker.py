"""One torchrun rank of an NxD-tier scenario: `python -m tests.nxd.worker <scenario> <out dir> <json args>`.

Installs the Neuron stand-ins, joins gloo and NxD's groups through the project's own `init_world`, runs the
scenario and writes what it found to `<out dir>/rank-<rank>.pt` for the test to check.
"""

from __future__ import annotations

from tests.nxd import stubs

stubs.install()  # before anything imports neuronx_distributed
stubs.patch_gqa_collectives()
stubs.patch_sequence_layout()

import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hlat.core.config import HlatConfig  # noqa: E402
from hlat.core.contract import read_job_config  # noqa: E402
from hlat.core.presets import load_config  # noqa: E402
from hlat.core.run import Run  # noqa: E402
from hlat.core.storage import Storage  # noqa: E402
from hlat.training.model import Transformer  # noqa: E402
from hlat.training.parallel.distributed import World, close_world, init_world  # noqa: E402
from hlat.training.parallel.neuron import NxdLayers  # noqa: E402
from hlat.training.parallel.tensor_slices import dense_parameters, unshard  # noqa: E402
from tests.nxd.conftest import SDK, SMALL_MODEL  # noqa: E402

SEED = 7


def config(args: dict[str, Any], processes: int) -> HlatConfig:
    changes = {**SMALL_MODEL, "job.processes_per_node": processes, **args.get("config", {})}
    return load_config("tiny", {"neuron.sdk": SDK.version, **changes})  # the SDK under test (conftest.SDK)


def tp_group() -> Any:
    from neuronx_distributed.parallel_layers import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def gather_dense(model: Transformer, world: World, grads: bool) -> dict[str, torch.Tensor]:
    """The dense state (or gradients) of a tensor-parallel model: every parameter's slices gathered over the TP
    group and put back together (`training.parallel.tensor_slices.unshard`)."""
    out = {}
    for param in dense_parameters(model.cfg):
        local = model.get_parameter(model.parallel.local_name(param.name))
        value = (local.grad if grads else local).detach().contiguous()
        pieces = [torch.empty_like(value) for _ in range(world.layout.tensor)]
        dist.all_gather(pieces, value, group=tp_group())
        out[param.name] = unshard(param, pieces, model.cfg)
    return out


def batch(cfg: HlatConfig, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.training.seq_len + 1), generator=g)
    # Three documents per row, for document masking.
    doc_ids = (torch.arange(cfg.training.seq_len) * 3 // cfg.training.seq_len).expand(rows, -1)
    return tokens[:, :-1], tokens[:, 1:], doc_ids


def tp_equals_dense(cfg: HlatConfig, world: World, args: dict[str, Any]) -> dict[str, Any]:
    """Forward and backward of the tensor-parallel model against the dense one, from the same seed."""
    layers = NxdLayers(cfg)
    model = Transformer(cfg.model, layers=layers)
    model.init_weights(SEED)
    dense = Transformer(cfg.model)
    dense.init_weights(SEED)
    inputs, targets, doc_ids = batch(cfg, 2, seed=11)
    masks = doc_ids if args.get("document_masking") else None
    logits = model(inputs, masks)  # this rank's slice of the vocabulary: the loss is NxD's parallel one
    loss = model.loss(logits, targets)
    loss.backward()
    ref = F.cross_entropy(dense(inputs, masks).flatten(0, 1), targets.flatten())
    ref.backward()
    # Sequence parallelism: each rank saw part of the sequence through the norms; NxD's optimizer sums their
    # gradients over the TP group (allreduce_sequence_parallel_gradients): do the same here.
    for p in model.parameters():
        if getattr(p, "sequence_parallel_enabled", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=tp_group())
    weights, grads = gather_dense(model, world, grads=False), gather_dense(model, world, grads=True)
    dense_weights = dict(dense.named_parameters())
    return {
        "loss": float(loss),
        "dense_loss": float(ref),
        "local_heads": (model.layers[0].attn.n_heads, model.layers[0].attn.n_kv_heads),
        "logits_shape": list(logits.shape),
        "weight_error": max(float((weights[n] - dense_weights[n]).abs().max()) for n in weights),
        "grad_error": {n: float((grads[n] - dense_weights[n].grad).abs().max()) for n in grads},
        "grad_scale": max(float(dense_weights[n].grad.abs().max()) for n in grads),
        "tp": (world.tensor_rank, world.layout.tensor),
        "padded_vocab_size": cfg.model.padded_vocab_size,
    }


def trainer_for(cfg: HlatConfig, world: World, run: str) -> Any:
    from hlat.training.loop import Trainer

    return Trainer(
        cfg=cfg,
        run=Run.at(run),
        checkpoints=Storage(f"{run}/checkpoints"),
        world=world,
        tokenizer_model=f"{run}/tokenizer/tokenizer.model",
    )


def dense_weights(trainer: Any, world: World) -> dict[str, torch.Tensor]:
    """The dense model from every rank's state (its pipeline stage, its TP slices), as an exporter consolidates it."""
    from hlat.training.parallel.tensor_slices import consolidate

    local = {k: v.detach().clone() for k, v in trainer.model_state().items()}
    everyone: list[Any] = [(world.tensor_rank, local)]
    if world.world_size > 1:
        everyone = [None] * world.world_size
        dist.all_gather_object(everyone, (world.tensor_rank, local))
    by_tensor_rank: dict[int, dict[str, torch.Tensor]] = {}
    for tensor_rank, state in everyone:
        by_tensor_rank.setdefault(tensor_rank, {}).update(state)
    return consolidate([by_tensor_rank[r] for r in sorted(by_tensor_rank)], trainer.cfg.model)


def one_step(cfg: HlatConfig, world: World, args: dict[str, Any]) -> dict[str, Any]:
    """The first batch this rank's loader gives (its checksum), then one optimizer step of the Trainer on a fixed
    global batch, this data-parallel rank's share of it; the dense weights after the step (gathered over TP)."""
    import zlib

    from hlat.training.loop import DeviceBatch

    trainer = trainer_for(cfg, world, args["run"])
    first = next(iter(trainer.loader))
    trainer.loader.close()
    t = cfg.training
    inputs, targets, _ = batch(cfg, t.global_batch_size, seed=23)
    share = t.global_batch_size // world.layout.data  # rows of this data-parallel rank, in micro-batches
    rows = slice(world.data_rank * share, (world.data_rank + 1) * share)
    micro = [
        DeviceBatch(inputs[rows][i : i + t.micro_batch_size], targets[rows][i : i + t.micro_batch_size], None, {}, 0)
        for i in range(0, share, t.micro_batch_size)
    ]
    stats = trainer.train_step(iter(micro))
    weights = dense_weights(trainer, world)
    return {
        "first_batch_crc": zlib.crc32(first.inputs.numpy().tobytes()),
        "loss": float(stats["loss"]),
        "grad_norm": float(stats["grad_norm"]),
        "weights": weights,
        "coordinates": {
            "dp": (world.data_rank, world.layout.data),
            "tp": (world.tensor_rank, world.layout.tensor),
            "pp": (world.pipeline_rank, world.layout.pipeline),
        },
        "local_parameters": sorted(trainer.model_state()),
        # Parameters given storage in this process (under PP, this stage's only: the rest stay on the meta device).
        "materialised": sorted(n for n, p in trainer.model.named_parameters() if p.device.type != "meta"),
    }


def zero1_is_thin(cfg: HlatConfig, world: World, args: dict[str, Any]) -> dict[str, Any]:
    """What NxD is given for ZeRO-1 (which needs the XLA device), and the clear refusal in CPU mode."""
    from hlat.training.parallel.neuron import NeuronUnavailable

    assert world.nxd is not None
    try:
        trainer_for(cfg, world, args["run"])
    except NeuronUnavailable as exc:
        refusal = str(exc)
    else:
        refusal = ""
    return {
        "optimizer_config": world.nxd["optimizer_config"],
        "mixed_precision_config": world.nxd["mixed_precision_config"],
        "refusal": refusal,
    }


HOST_READS = ("cpu", "item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")
"""The methods of torch.Tensor that read a tensor on the host: on an XLA device each runs the pending graph and copies
its result back. NxD's CPU mode has no device, so what is counted is these calls, on tensors that would be on it."""

HOST_VALUES = {
    # torch.optim keeps Adam's step count on the host unless capturable or fused (torch/optim/adam.py, _init_group:
    # `torch.tensor(0.0, dtype=_get_scalar_dtype())`), on XLA as anywhere, and reads it with .item() here.
    ("torch/optim/optimizer.py", "_get_value"),
    # NxD's get_grad_norm asks whether its Python norm_type is infinite: `torch.isinf(torch.tensor(norm_type))`.
    ("neuronx_distributed/parallel_layers/grads.py", "torch.isinf(torch.tensor(norm_type"),
}
"""Host reads of tensors that live on the host on trn1 too: (file, function or source text) of the call."""


def _on_host(file: str, function: str, source: str) -> bool:
    return any(file.endswith(where) and (what == function or what in source) for where, what in HOST_VALUES)


@contextlib.contextmanager
def counting_host_reads(reads: list[str]) -> Iterator[None]:
    """Append "<method> at <file>:<line>: <source>" to `reads` for every call of a `HOST_READS` method while inside,
    but those of `HOST_VALUES`."""
    import linecache

    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            code, line = sys._getframe(1).f_code, sys._getframe(1).f_lineno
            source = linecache.getline(code.co_filename, line).strip()
            if not _on_host(code.co_filename, code.co_name, source):
                reads.append(f"{name} at {code.co_filename}:{line}: {source}")
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def pipeline_host_reads(cfg: HlatConfig, world: World, args: dict[str, Any]) -> dict[str, Any]:
    """Optimizer steps of the Trainer through NxD's pipeline, counting the host reads (`HOST_READS`) made inside each
    (`Trainer.train_step`: the pipeline's schedule, its loss, the optimizer), and the loss each step hands back."""
    trainer = trainer_for(cfg, world, args["run"])
    batches = trainer.device_batches(trainer.loader, cfg.gradient_accumulation, background=False)
    steps = []
    for _ in range(args["steps"]):
        # Taken from the loader first: its host-side work (the tokens' checksum) reads host tensors, not the device.
        micro = [next(batches) for _ in range(cfg.gradient_accumulation)]
        reads: list[str] = []
        with counting_host_reads(reads):
            stats = trainer.train_step(iter(micro))
        steps.append({"reads": reads, "loss_device": str(stats["loss"].device), "loss": float(stats["loss"])})
    trainer.loader.close()
    return {"steps": steps, "pp": (world.pipeline_rank, world.layout.pipeline)}


def zero1_masters_round_trip(cfg: HlatConfig, world: World, args: dict[str, Any]) -> dict[str, Any]:
    """NxD's ZeRO-1 optimizer (torch-xla's ZeroRedundancyOptimizer) on XLA:CPU, one rank: two optimizer steps of the
    model in the config's precision (as the trainer sets it up on XLA: the flags of the SDK under test come with the
    environment), a checkpoint through the trainer's ZeRO-1 format (`training.checkpoint.Zero1`: the optimizer
    state in the rank file), then a fresh model and optimizer loaded from it. Its master weights before the save and
    after the load, and what the rank file held."""
    from hlat.core.environment import precision_by_flags
    from hlat.training import xla
    from hlat.training.checkpoint import CheckpointManager, Zero1
    from hlat.training.optim import optimizer_recipe, trainable_parameters
    from hlat.training.parallel.neuron import parallel_optimizer, shard_name, shard_names

    device, flags = xla.device(), precision_by_flags(cfg, on_xla=True)

    def build() -> tuple[Transformer, Any]:
        model = Transformer(cfg.model)
        model.init_weights(SEED)
        if cfg.precision.mode == "bf16-sr" and not flags:  # as the trainer does
            model = model.to(torch.bfloat16)
        model = model.to(device)
        params = trainable_parameters(model)
        kind, arguments = optimizer_recipe(params, cfg.training, cfg.precision.mode, "xla", zero1=True, flags=flags)
        return model, parallel_optimizer(world.nxd, kind, params, **arguments)

    def masters(optimizer: Any) -> list[torch.Tensor]:
        zero1 = optimizer.optimizer  # NxD's NxDOptimizer around its NeuronZero1Optimizer
        return xla.to_host([p.detach() for group in zero1.base_optimizer.param_groups for p in group["params"]])

    model, optimizer = build()
    inputs, targets, _ = batch(cfg, 2, seed=11)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        model.loss(model(inputs.to(device)), targets.to(device)).backward()
        optimizer.step()
        xla.mark_step()
    before = masters(optimizer)
    parameters = xla.to_host([p.detach() for p in trainable_parameters(model)])
    layout = {"shard": shard_name(0, 0), "shard_writer": True, "shards": shard_names(world.layout)}
    manager = CheckpointManager(Storage(args["checkpoints"]), keep_last=1, **layout)
    Zero1(model, optimizer, layout, model.state_dict, model.load_state_dict).save(manager, 2, {"step": 2}, {})
    saved = manager.load(2)[1]["optimizer"]

    fresh, fresh_optimizer = build()
    Zero1(fresh, fresh_optimizer, layout, fresh.state_dict, fresh.load_state_dict).load(manager, 2)
    after = masters(fresh_optimizer)
    return {
        "saved": "sharded_master_weights" in saved,
        "dtypes": sorted({str(m.dtype) for m in before}),
        # One rank: each master shard is its whole parameter. The host gets what the device holds (BF16 values of
        # FP32-typed parameters under XLA_DOWNCAST_BF16).
        "masters_are_the_parameters": all(
            torch.equal(m, p.to(m.dtype)) for m, p in zip(before, parameters, strict=True)
        ),
        "bitwise": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "max_error": max(float((a.double() - b.double()).abs().max()) for a, b in zip(before, after, strict=True)),
    }


SCENARIOS: dict[str, Callable[[HlatConfig, World, dict[str, Any]], dict[str, Any]]] = {
    "pipeline_host_reads": pipeline_host_reads,
    "zero1_is_thin": zero1_is_thin,
    "zero1_masters_round_trip": zero1_masters_round_trip,
    "tp_equals_dense": tp_equals_dense,
    "one_step": one_step,
}


def main() -> None:
    scenario, out, raw = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    args = json.loads(raw)
    processes = int(os.environ["WORLD_SIZE"])
    cfg = read_job_config(f"{args['run']}/config.json").config if "run" in args else config(args, processes)
    if processes == 1 and args.get("group_of_one"):
        dist.init_process_group("gloo")  # NxD forms its groups (here each of one rank) inside torch.distributed's
    world = init_world("cpu", cfg)
    try:
        result = SCENARIOS[scenario](cfg, world, args)
        torch.save(result, out / f"rank-{world.rank}.pt")
    finally:
        close_world()


if __name__ == "__main__":
    main()
