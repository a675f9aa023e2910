"""The training loop: a short step function with side effects (checkpoints, evaluation, metrics) as hooks.

Fault tolerance follows HLAT: state is checkpointed every `training.checkpoint_every` steps (model,
optimizer, scheduler, step, each rank's data-loader and RNG state); a job resumes from the newest complete
checkpoint; a NaN/inf loss exits non-zero (or skips the step) so the job restarts from the last checkpoint;
SIGTERM (sent by SageMaker before it stops a job) checkpoints and exits 0.

The stop must fit SageMaker's grace: SIGTERM, then SIGKILL 120 s later
(https://docs.aws.amazon.com/sagemaker/latest/dg/your-algorithms-training-algo-running-container.html). So the ranks
agree on the step to stop after as soon as one asks, whatever `training.log_every` is, with no collective at the step
boundaries (`training/stop_vote.py`: the stop step is agreed once through the job's store, by a thread; at a boundary
the loop only compares numbers), so it adds no device op, graph, transfer or per-step network round trip. On a stop
every rank finishes its step, reads
the device once (the NaN check, as at any sync point), finishes an async save still in flight, writes the
checkpoint of that step synchronously (committed before it exits) and exits 0; rank 0 first logs whether the
write is expected to fit `job.stop_grace_seconds`, from the step and save times it measured. The job's stop rule
(`training/stop_rule.py`: the run's budget, its deadline, a silent supervisor) asks for the same stop from a thread
(`request_stop`): the same request, no other cost to the loop. After every step the
loop also asks the checkpoint manager, without I/O, whether a background save failed (`CheckpointManager.check`),
so a rank's failed upload fails the job within a step, not one checkpoint interval later.

No host round trip inside a step, on any device. A step is traced (XLA) or queued (CUDA) without reading a device
tensor: its loss, gradient norm and non-finite check stay on the device (`StepTally`), batches arrive on the
device from a background thread, and on XLA the step is cut where `training.xla_graph_cuts` says (after each
micro-batch's backward, HLAT's placement, or once at its end), so every step runs the same compiled graphs. The
host reads them at sync points only: steps that log (`training.log_every`), steps with a hook (checkpoint,
evaluation, health check), the job's first and last step. There, in one transfer, it learns the loss and whether
any step since the last sync was non-finite; under nan_policy=exit it then exits, and a checkpoint is only ever
saved after that check, so no checkpoint holds the NaN weights of the steps between. Under nan_policy=skip the
decision is made on the device (`masked_step`). A step whose stop vote passes becomes a sync point.

Loss spikes (training.spike_skip; `training/spikes.py`, after OLMo-core's skip-step optimizer): once the trailing
training.spike_window steps are known, a step whose loss or gradient norm is more than training.spike_zscore standard
deviations above their mean is not applied, decided on the device like nan_policy=skip (`masked_step`: the same graph
for a spiking step and a normal one, no host read), and its values stay out of the window. Under NxD, whose optimizer
clips inside step(), the norm exists only after the update: the loss alone decides there. The skipped steps are
counted on the device and read at the next sync point, which logs the newest ("step 1234: loss spike skipped (loss 9.1
vs window mean 3.2 +/- 0.1); 3 skipped so far") and records `spikes_skipped` in metrics.jsonl. As many spikes in a
row as training.spike_max_consecutive end the job at that sync point, before any hook saves a checkpoint: exit
EXIT_LOSS_SPIKES with a `LossSpikes: ...` failure record naming the steps, which the supervisor does not relaunch. The
window and counters go into every checkpoint's shared state, so a resumed run skips exactly the steps an
uninterrupted one does.

Under graph extraction (`extracting_graphs`: neuron_parallel_compile's trial run, where "no real execution is performed
and the outputs are invalid") the loop does every step, hook, collective and host read as a job would, so that every
graph a job runs is traced, and acts on none of the values and writes nothing: no health verdict, no NaN exit, no
checkpoint files (the state still reaches the host, as a save would fetch it), no metrics, TensorBoard or failure
files, and a stop ends the rehearsal without a checkpoint. HLAT's trn1 scripts skip their checkpoint writes and value
checks the same way (awslabs/HLAT, 70b/tp_zero1_llama2_70b_hf_pretrain.py: NEURON_EXTRACT_GRAPHS_ONLY).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import torch

from hlat.core.config import ConfigError, HlatConfig
from hlat.core.contract import EXIT_LOSS_SPIKES, EXIT_NAN, EXIT_UNHEALTHY, note_step, write_failure
from hlat.core.environment import neuron_available, precision_by_flags
from hlat.core.layout import CHECKPOINT_META
from hlat.core.run import Run
from hlat.core.stop_timeline import grace_seconds, stop_timeline
from hlat.core.storage import Storage
from hlat.training.checkpoint import (
    CheckpointFormat,
    CheckpointManager,
    Distributed,
    ModelParallel,
    Unsharded,
    Zero1,
    rank_state,
    restore_rank_state,
    step_dir,
)
from hlat.training.data.loader import PackedLoader
from hlat.training.devices import memory_gb, peak_flops
from hlat.training.health import UnhealthyCollective, periodic_health_check
from hlat.training.hooks import hooks
from hlat.training.metrics import MetricsLog
from hlat.training.model import Transformer
from hlat.training.optim import (
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    masked_step,
    optimizer_recipe,
    trainable_parameters,
)
from hlat.training.parallel.distributed import World
from hlat.training.parallel.parallelize import fsdp_active, model_layers, parallelize, reduce_gradients
from hlat.training.spikes import SpikeDetector, Verdict, describe_spike, spikes_reason
from hlat.training.stop_vote import StopVote
from hlat.training.watchdog import Progress

log = logging.getLogger("hlat.train")

EXTRACT_GRAPHS_ONLY = "NEURON_EXTRACT_GRAPHS_ONLY"
STOP_MARGIN = 1.25
"""A requested stop's margin over the measured step and save (`Trainer.stop_margin_seconds`)."""


def extracting_graphs() -> bool:
    """Whether this process is neuron_parallel_compile's trial run, which sets NEURON_EXTRACT_GRAPHS_ONLY in the
    processes it runs: graphs are extracted for compilation, not executed, and every value read from the device is
    invalid ("In this mode, no real execution is performed and the outputs are invalid":
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/frameworks/torch/torch-neuronx/api-reference-guide/training/pytorch-neuron-parallel-compile.html).
    HLAT's scripts test the variable for being set and non-empty; so does this. The Trainer reads it once."""
    return bool(os.environ.get(EXTRACT_GRAPHS_ONLY))


@dataclass
class Hook:
    fn: Callable[[int], object]
    every: int


@dataclass(frozen=True)
class DeviceBatch:
    """A micro-batch on the job's device, with what the host knows of it: the loader's state right after it and a
    checksum of the step's tokens so far (the CRC-32 chained over the micro-batches of its optimizer step)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    doc_ids: torch.Tensor | None
    state: dict[str, Any]
    crc: int


class StepTally:
    """What the loop tracks on the device across steps and reads only at sync points: the step counter, how many
    steps were non-finite, and the first such step and its loss. Integer counters: under XLA_USE_BF16 a float32
    counter would be BF16 on the device."""

    def __init__(self, device: torch.device, step: int) -> None:
        def counter(value: int) -> torch.Tensor:
            return torch.tensor(value, dtype=torch.int32, device=device)

        self.step, self.nonfinite, self.first_step = counter(step), counter(0), counter(0)
        self.first_loss = torch.zeros((), dtype=torch.float32, device=device)

    def update(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Count this step (on the device); return its 'finite' flag (a bool tensor)."""
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        first = ~finite & (self.nonfinite == 0)
        self.step += 1
        self.first_step = torch.where(first, self.step, self.first_step)
        self.first_loss = torch.where(first, loss.float(), self.first_loss)
        self.nonfinite += (~finite).int()
        return finite

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"nonfinite": self.nonfinite, "first_step": self.first_step, "first_loss": self.first_loss}


@dataclass
class Trainer:
    cfg: HlatConfig
    run: Run
    checkpoints: Storage
    world: World
    tokenizer_model: str
    """The run's tokenizer: its folder, or its tokenizer.model or tokenizer.json (`data.tokenizer.Tokenizer.load`)."""
    tensorboard_dir: str | None = None
    hooks: list[Hook] = field(default_factory=list)
    data: Storage | None = None
    """The prepared data (default: the run's data/); inside a job, the folder of its data channel."""
    progress: Progress = field(default_factory=Progress)
    """What the loop tells the job's hang watchdog (`training/watchdog.py`; the job program starts it): each step,
    evaluation batch, hook and stop."""

    def __post_init__(self) -> None:
        self._built_at = time.perf_counter()  # time to first step counts from here (first_step_seconds)
        cfg, world = self.cfg, self.world
        if world.world_size != cfg.world_size:
            raise ConfigError(
                f"this job has {world.world_size} processes but job.instance_count x job.processes_per_node = "
                f"{cfg.world_size}; launch {cfg.world_size} processes or fix the config"
            )
        world.seed(cfg.training.seed)
        self.extracting_graphs = extracting_graphs()
        """neuron_parallel_compile's trial run: trace everything, act on no value, write nothing (module docstring)."""
        if self.extracting_graphs:
            log.warning(
                "%s is set: extracting graphs (the outputs are invalid): no health verdict, NaN exit, checkpoint, "
                "metrics or failure file in this process", EXTRACT_GRAPHS_ONLY
            )  # fmt: skip
        # Built with its parallelism (each TP rank holds its slices), initialised on the host from the seed, so every
        # device and every split starts from the same weights. Under pipeline parallelism the model stays on the meta
        # device: NxD's pipeline materialises and initialises this rank's stage only.
        # With model.init_from the weights come from resume() (the import, or a checkpoint): no random init, and under
        # FSDP2 the model stays on the meta device until each rank materialises its own shards (no host holds it
        # whole).
        staged = world.layout.pipeline > 1
        imported = cfg.model.init_from is not None
        meta = staged or (imported and fsdp_active(cfg, world))
        model = Transformer(cfg.model, device="meta" if meta else "cpu", layers=model_layers(cfg, world))
        if not meta and not imported:
            model.init_weights(cfg.training.seed)
        self.precision_flags = precision_by_flags(cfg, world.on_xla)
        if cfg.precision.mode == "bf16-sr" and not self.precision_flags:
            model = model.to(torch.bfloat16)  # pure BF16: weights and optimizer states (Neuron 2.24: XLA_USE_BF16)
        self.fsdp = fsdp_active(cfg, world)
        # Under FSDP2 the whole model never goes to the device: it is sharded on the host, then each rank moves its
        # shards (parallelize).
        self.model = model if staged or self.fsdp else model.to(world.device)
        self.wrapped: Any = parallelize(self.model, cfg, world)
        if staged:  # after activation checkpointing: the stages keep the recomputing blocks
            from hlat.training.parallel.neuron import pipeline_model

            self.wrapped = pipeline_model(self.wrapped, cfg, init=model.initialiser(cfg.training.seed))
        self.optimizer = self._optimizer()
        self.scheduler = build_scheduler(self.optimizer, cfg.training)
        self.loader = self._loader("train")
        self.format = self._checkpoint_format()
        self.ckpt = CheckpointManager(
            self.checkpoints,
            keep_last=cfg.training.keep_checkpoints,
            keep_every=cfg.training.keep_every,
            rank=world.rank,
            world_size=world.world_size,
            barrier=world.barrier,
            async_save=cfg.training.async_checkpoint,
            commit_timeout_s=cfg.training.commit_timeout_s,
            stage_in_background=True,  # the state is copied while the next step runs: see _update
            share=world.share_from_main,  # at resume rank 0 alone lists the checkpoints (resume_point)
            extracting_graphs=self.extracting_graphs,
            **self.format.layout,
        )
        self.metrics = MetricsLog(
            self.run, enabled=world.is_main and not self.extracting_graphs, tensorboard_dir=self.tensorboard_dir
        )
        self._health_reference: float | None = None  # busbw of this job's first judged health check
        self.step = 0
        self.tally = StepTally(world.device, 0)
        self.spikes = self._spike_detector()
        self._spikes_restored = 0  # spikes skipped as the resumed checkpoint says (a host number: no device read)
        self._loader_state: dict[str, Any] | None = None  # of the last batch a step consumed
        self.saved_step: int | None = None
        self.stop_requested = False
        self.stop_why: str | None = None  # why this rank requested the stop, when not on SIGTERM (request_stop)
        self.vote: StopVote | None = None  # fit()'s: the stop agreed with the other ranks
        self.stopped_at: int | None = None  # the step a stop checkpointed (_stop)
        self.step_seconds: float | None = None  # the mean step time measured at the last sync point
        self._sigterm_at: float | None = None  # time.monotonic() of this process's first SIGTERM
        self._last_save: tuple[int, float] | None = None  # (step, seconds) of the last save timed to its end
        self._async_save: tuple[int, float] | None = None  # (step, perf_counter at its start) of the last async save
        self._async_started: list[tuple[int, float]] = []  # (step, time.time() at its start) of the last two
        # Recorded with this job's first step, next to first_step_seconds (e.g. the compile cache's status).
        self.first_step_metrics: dict[str, Any] = {}
        self._flops_per_token = cfg.model.flops_per_token(cfg.training.seq_len)
        self._peak = peak_flops(world.device)
        t = cfg.training
        # Health first: a wrong collective may have corrupted this step's gradients, so it must end the job before
        # a checkpoint saves them.
        if cfg.burn_in.health_check_every:
            self.add_hook(self.health_check, every=cfg.burn_in.health_check_every)
        # Evaluation before checkpointing, so a checkpoint's metrics history includes its own val_loss.
        if t.eval_every:
            self.add_hook(self.evaluate, every=t.eval_every)
        self.add_hook(self.save_checkpoint, every=t.checkpoint_every)

    # -- set-up ------------------------------------------------------------------------------------------
    def _spike_detector(self) -> SpikeDetector | None:
        """training.spike_skip's detector on the job's device (None when off)."""
        t = self.cfg.training
        if not t.spike_skip:
            return None
        return SpikeDetector(t.spike_window, t.spike_zscore, t.spike_max_consecutive, self.world.device)

    def _optimizer(self) -> Any:
        """AdamW as `training.optim` prescribes; when the model is split, through NxD's optimizer, which reduces the
        gradients over the data-parallel group and clips by the global norm across TP and PP (`grad_norm`)."""
        cfg, world = self.cfg, self.world
        if world.nxd is None:
            mode, flags = cfg.precision.mode, self.precision_flags
            return build_optimizer(self.model, cfg.training, mode, world.device.type, flags)
        from hlat.training.parallel.neuron import parallel_optimizer

        staged = world.layout.pipeline > 1
        params = list(self.wrapped.local_parameters()) if staged else trainable_parameters(self.model)
        zero1 = cfg.parallelism.zero1
        optimizer_class, arguments = optimizer_recipe(
            params, cfg.training, cfg.precision.mode, world.device.type, zero1=zero1, flags=self.precision_flags
        )
        return parallel_optimizer(world.nxd, optimizer_class, params, **arguments)

    def _settle_gradient_buckets(self) -> None:
        """DDP all-reduces the first backward's gradients in one bucket of every parameter in reverse order, and every
        later backward's in buckets rebuilt in the order the gradients became ready (torch.nn.parallel.distributed).
        Each element then sits elsewhere in the ring all-reduce and its ranks' values are summed in another order:
        with more than two ranks a job's first step would differ in the last bits from the step an uninterrupted
        job took at that point, and a resumed run would drift from it. One throwaway forward and backward on a
        batch of zeros, its gradients discarded, makes every real step run on the rebuilt buckets."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(self.wrapped, DistributedDataParallel):
            return
        t = self.cfg.training
        tokens = torch.zeros((t.micro_batch_size, t.seq_len), dtype=torch.long, device=self.world.device)
        doc_ids = torch.zeros_like(tokens) if t.document_masking else None
        with self.autocast():
            self.wrapped(tokens, doc_ids).float().sum().backward()
        self.model.zero_grad(set_to_none=True)

    def _loader(self, split: str) -> PackedLoader:
        t = self.cfg.training
        return PackedLoader(
            self.data or self.run.storage.child("data"),
            self.tokenizer_model,
            seq_len=t.seq_len,
            micro_batch_size=t.micro_batch_size,
            seed=t.seed,
            data_rank=self.world.data_rank,  # TP and PP peers read the same tokens
            data_degree=self.world.layout.data,
            split=split,
            document_masking=t.document_masking,
            # Batch b follows the mixture weights of optimizer step b // gradient_accumulation.
            micro_batches_per_step=self.cfg.gradient_accumulation,
        )

    def _checkpoint_format(self) -> CheckpointFormat:
        """Where this job's model and optimizer go in a checkpoint: FSDP2's shards through DCP; under NxD, one shard
        file per (TP, PP) position, written by its first data-parallel replica (the optimizer states in the rank
        files under ZeRO-1); otherwise one shared file."""
        world = self.world
        if self.fsdp:
            return Distributed(self.model, self.optimizer)
        if world.nxd is None:
            return Unsharded(self.model, self.optimizer)
        from hlat.training.parallel.neuron import shard_name, shard_names

        layout = {
            "shard": shard_name(world.tensor_rank, world.pipeline_rank),
            "shard_writer": world.data_rank == 0,
            "shards": shard_names(world.layout),
        }
        kind = Zero1 if self.cfg.parallelism.zero1 else ModelParallel
        return kind(self.model, self.optimizer, layout, self.model_state, self.load_model_state)

    def model_state(self) -> dict[str, Any]:
        """This rank's model state: its pipeline stage's parameters (original names) and its TP slices."""
        if self.world.layout.pipeline > 1:
            return dict(self.wrapped.local_state_dict())
        return self.model.state_dict()

    def load_model_state(self, state: dict[str, Any]) -> None:
        if self.world.layout.pipeline > 1:
            self.wrapped.load_state_dict(state, strict=True)
        else:
            self.model.load_state_dict(state)

    def add_hook(self, fn: Callable[[int], object], every: int) -> None:
        """Run fn(step) after every `every`-th optimizer step."""
        self.hooks.append(Hook(fn, every))

    def autocast(self) -> AbstractContextManager[Any]:
        # Under Neuron 2.24's flags, bf16-mixed is XLA_DOWNCAST_BF16 (the device computes in BF16), not autocast.
        if self.cfg.precision.mode == "bf16-mixed" and not self.precision_flags:
            return torch.autocast(self.world.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def device_batches(self, loader: PackedLoader, accumulation: int, background: bool = True) -> Iterator[DeviceBatch]:
        """The loader's batches on the device, each with its loader state and step checksum. On XLA a background
        thread sends them ahead (MpDeviceLoader, unless `background` is off); the checksum and state are computed
        on the host, before."""
        device = self.world.device

        def host_side() -> Iterator[tuple[Any, ...]]:
            crc = 0
            for i, batch in enumerate(loader):
                crc = zlib.crc32(batch.inputs.numpy().tobytes(), crc if i % accumulation else 0)
                doc_ids = batch.doc_ids if batch.doc_ids is not None else torch.zeros(0, dtype=torch.long)
                yield batch.inputs, batch.targets, doc_ids, {"state": batch.state, "crc": crc}

        items: Iterable[tuple[Any, ...]] = host_side()
        if self.world.on_xla and background:
            from hlat.training import xla

            # Never let the loader cut the graph itself: the loop's mark_steps are the only cuts.
            items = xla.device_loader(items, device, batches_per_execution=sys.maxsize)
        for inputs, targets, doc_ids, meta in items:
            yield DeviceBatch(
                inputs=inputs.to(device),
                targets=targets.to(device),
                doc_ids=doc_ids.to(device) if doc_ids.numel() else None,
                state=meta["state"],
                crc=meta["crc"],
            )

    def resume(self) -> int:
        """Load the newest complete checkpoint, if any; return the step to continue from. What an earlier attempt
        left past it is deleted first (CheckpointManager.discard_after)."""
        # Rank 0 alone lists the checkpoints and reads meta.json; the others get its finding (share_from_main).
        found = self.ckpt.resume_point()
        step = found[0] if found is not None else None
        self.ckpt.discard_after(step)
        if step is None:
            if self.cfg.model.init_from is not None:
                from hlat.training.checkpoint.hf_import import import_weights

                # Only when no checkpoint exists: a relaunch resumes from its own checkpoints, never re-imports.
                import_weights(self)
            else:
                log.info("no complete checkpoint under %s: starting from scratch", self.checkpoints.url)
            self.metrics.resume_at(0)
            return 0
        shared, mine = self.format.load(self.ckpt, step)
        self._restore(shared, mine)
        self.step = self.saved_step = int(shared["step"])
        self.tally = StepTally(self.world.device, self.step)
        self.metrics.resume_at(self.step)
        log.info("resumed from step %d of %s (read %d bytes)", self.step, self.checkpoints.url, self.ckpt.bytes_read)
        return self.step

    # -- the loop ----------------------------------------------------------------------------------------
    def train_step(self, batches: Iterator[DeviceBatch]) -> dict[str, Any]:
        """One optimizer step over `gradient_accumulation` micro-batches; loss normalised by tokens. Reads nothing
        from the device: returns the step's loss (mean over ranks), gradient norm and 'finite' flag as device
        tensors, and the host-side checksum of its tokens."""
        accum = self.cfg.gradient_accumulation
        self.optimizer.zero_grad(set_to_none=True)
        if self.world.layout.pipeline > 1:
            return self._pipeline_step(batches)
        total: torch.Tensor | None = None
        crc = 0
        for i in range(accum):
            batch = next(batches)
            # A checksum of the tokens seen: resumed and uninterrupted runs must consume the same samples.
            crc, self._loader_state = batch.crc, batch.state
            # DDP all-reduces gradients on the last micro-batch only.
            no_sync = getattr(self.wrapped, "no_sync", None)
            skip_sync = no_sync is not None and i < accum - 1
            with self.autocast(), no_sync() if skip_sync else nullcontext():  # type: ignore[misc]
                logits = self.wrapped(batch.inputs, batch.doc_ids)  # (B, T, V)
                # Every micro-batch holds the same number of tokens (packed, no padding), so the mean over a
                # micro-batch divided by the accumulation steps is the mean over all the step's tokens.
                loss = self.model.loss(logits, batch.targets) / accum
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
            if self.cfg.training.xla_graph_cuts == "micro-batch":
                self.world.mark_step()  # HLAT's cut: each micro-batch a graph, the last one before the optimizer
        assert total is not None
        if self.world.is_main:
            total = hooks().loss_of_step(total, self.run, self.step + 1)
        return self._update(self.world.mean(total), crc)

    def _pipeline_step(self, batches: Iterator[DeviceBatch]) -> dict[str, Any]:
        """The pipeline-parallel step: the step's micro-batches go through NxD's schedule together; the loss comes
        back averaged over them and the data-parallel group, on every stage."""
        micro = [next(batches) for _ in range(self.cfg.gradient_accumulation)]
        self._loader_state = micro[-1].state
        inputs = {"tokens": torch.cat([b.inputs for b in micro]), "targets": torch.cat([b.targets for b in micro])}
        if self.cfg.training.document_masking:
            inputs["doc_ids"] = torch.cat([b.doc_ids for b in micro if b.doc_ids is not None])
        loss = torch.as_tensor(self.wrapped.run_train(**inputs), dtype=torch.float32).reshape(())
        if self.world.is_main:
            loss = hooks().loss_of_step(loss, self.run, self.step + 1)
        return self._update(loss.to(self.world.device), micro[-1].crc)

    def _update(self, loss_mean: torch.Tensor, crc: int) -> dict[str, Any]:
        """The optimizer step after the gradients of `loss_mean` (the step's loss, averaged over every rank). Under
        nan_policy=skip a non-finite step, and under training.spike_skip a spiking one, is not applied: decided on
        the device (`masked_step`), the same ops either way. Under NxD the optimizer reduces and clips inside step(),
        so the norm exists only after the update: a spike is judged on the loss alone there, and the norm still
        enters the spike window."""
        # An async checkpoint copies the weights and optimizer states while this step's forward and backward ran:
        # the optimizer may change them once the copy is made.
        self.ckpt.wait_staged()
        skip = self.cfg.training.nan_policy == "skip"
        masked = skip or self.spikes is not None
        if self.world.nxd is None:
            reduce_gradients(self.model, self.world)
            grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.training.grad_clip)
            finite = self.tally.update(loss_mean, grad_norm)
            verdict = self.spikes.judge(loss_mean, grad_norm) if self.spikes is not None else None
            if masked:
                masked_step(self.optimizer, self._applied(finite if skip else None, verdict))
            else:  # a non-finite step is caught at the next sync point, before any checkpoint can save it
                self.optimizer.step()
            if self.spikes is not None and verdict is not None:
                self.spikes.record(self.tally.step, verdict)
        else:
            verdict = self.spikes.judge(loss_mean, None) if self.spikes is not None else None
            if masked:
                masked_step(self.optimizer, self._applied(torch.isfinite(loss_mean) if skip else None, verdict))
            else:
                self.optimizer.step()
            grad_norm = self.optimizer.grad_norm
            if grad_norm is None:  # no clipping asked for: the norm is only reported
                from neuronx_distributed.parallel_layers.grads import get_grad_norm

                grad_norm = get_grad_norm([p for group in self.optimizer.param_groups for p in group["params"]])
            grad_norm = grad_norm.reshape(())  # NxD's norm has shape (1,)
            finite = self.tally.update(loss_mean, grad_norm)
            if self.spikes is not None and verdict is not None:
                self.spikes.record(self.tally.step, verdict, grad_norm)
        self.scheduler.step()
        self.world.mark_step()
        return {"loss": loss_mean, "grad_norm": grad_norm, "finite": finite, "samples_crc32": crc}

    @staticmethod
    def _applied(finite: torch.Tensor | None, verdict: Verdict | None) -> torch.Tensor:
        """Whether the step's update is kept (a bool device tensor): finite (when nan_policy=skip) and no spike."""
        if verdict is None:
            assert finite is not None
            return finite
        return ~verdict.spike if finite is None else finite & ~verdict.spike

    def fit(self) -> int:
        """Train to training.max_steps; return the process exit code."""
        t = self.cfg.training
        if self.step >= t.max_steps:
            log.info(
                "nothing to train: the run is at step %d, training.max_steps is %d (raise it to train further)",
                self.step, t.max_steps,
            )  # fmt: skip
            self.ckpt.wait()
            self.metrics.close()
            self.loader.close()
            return 0
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        log.info(
            "training %s: %d params, precision %s, %d rank(s) x %d micro-batch x %d accumulation, seq %d on %s",
            self.cfg.preset, self.model.num_params(), self.cfg.precision.mode, self.world.world_size,
            t.micro_batch_size, self.cfg.gradient_accumulation, t.seq_len, self.world.device.type,
        )  # fmt: skip
        if self.world.on_xla and self.cfg.precision.mode == "bf16-sr" and not neuron_available():
            how = "XLA_USE_BF16" if self.precision_flags else "the BF16 model"
            log.info(
                "bf16-sr on XLA:CPU: %s gives the graph of HLAT's precision, but this device rounds to nearest "
                "(stochastic rounding is the NeuronCore's: NEURON_RT_STOCHASTIC_ROUNDING_EN)", how
            )  # fmt: skip
        # After the compile cache is loaded (train.py): the throwaway step compiles what the first step would.
        self._settle_gradient_buckets()
        batches = self.device_batches(self.loader, self.cfg.gradient_accumulation)
        first_step = self.step
        since, since_step, nonfinite_seen = time.perf_counter(), self.step, 0
        spikes_seen = self._spikes_restored  # skipped before this job (from its checkpoint): only new ones are logged
        pace = hooks().step_seconds()  # tests' stand-in for a big model's step (None here)
        vote = self.vote = StopVote(
            self.world.rank, self.world.world_size, t.max_steps, passed=self.step,
            connect=self.world.connect_store if self.world.world_size > 1 else None,
        )  # fmt: skip
        vote.start()
        if self.stop_requested:  # asked before the loop (the stop rule's thread, a SIGTERM during resume)
            vote.request()
        try:
            while self.step < t.max_steps:
                started = time.perf_counter()
                stats = self.train_step(batches)
                if pace:  # host side, after the step's work is launched
                    time.sleep(max(0.0, pace - (time.perf_counter() - started)))
                hooks().after_step(self.step + 1, self.world.rank)
                self.step += 1
                note_step(self.step)
                self.progress.beat(self.step)
                # No I/O, no device read: a rank whose background save failed (an upload) fails now, naming its rank,
                # host and key, rather than at the next save.
                self.ckpt.check()
                # Every step boundary, on every rank: a stop must not wait log_every steps for a sync point. Local
                # numbers only: the stop step is agreed by the vote's threads (training/stop_vote.py).
                stop = vote.at_boundary(self.step)
                if not stop and not self._sync_point(first_step):
                    continue
                # The sync point: everything the host needs of the steps since the last one, in one transfer.
                spikes = self.spikes.tensors() if self.spikes is not None else {}
                seen = self.world.to_host(
                    {k: stats[k] for k in ("loss", "grad_norm", "finite")} | self.tally.tensors() | spikes
                )
                seconds = (time.perf_counter() - since) / (self.step - since_step)
                self.step_seconds = self.progress.step_s = seconds
                nonfinite = int(seen["nonfinite"])
                if nonfinite > nonfinite_seen and not self.extracting_graphs:
                    where = f"loss is {float(seen['first_loss'])} at step {int(seen['first_step'])}"
                    if t.nan_policy == "exit":
                        log.error("%s: exiting so the job restarts from the last checkpoint", where)
                        return EXIT_NAN
                    log.warning("%s: %d step(s) skipped so far (training.nan_policy=skip)", where, nonfinite)
                    nonfinite_seen = nonfinite
                if spikes and not self.extracting_graphs:
                    if int(seen["spikes_tripped_at"]):  # before any hook: no checkpoint holds those steps
                        reason = spikes_reason(seen, t.spike_max_consecutive, t.spike_zscore)
                        log.error("%s", reason)
                        write_failure(reason)
                        return EXIT_LOSS_SPIKES
                    if int(seen["spikes_skipped"]) > spikes_seen:
                        spikes_seen = int(seen["spikes_skipped"])
                        log.warning(
                            "step %d: %s; %d skipped so far (training.spike_skip)",
                            int(seen["spike_step"]), describe_spike(seen, t.spike_zscore), spikes_seen,
                        )  # fmt: skip
                values: dict[str, Any] = {
                    "loss": float(seen["loss"]),
                    "grad_norm": float(seen["grad_norm"]),
                    "samples_crc32": stats["samples_crc32"],
                }
                if not bool(seen["finite"]):
                    values["skipped"] = True
                if spikes:
                    values["spikes_skipped"] = int(seen["spikes_skipped"])
                    if int(seen["spike_step"]) == self.step:
                        values["skipped"] = True
                if self.step == first_step + 1:
                    # Time to first step: build, compile (or load the compile cache), resume, one step. Recorded
                    # whatever log_every says: it is what precompilation saves a job.
                    values["first_step_seconds"] = time.perf_counter() - self._built_at
                    values.update(self.first_step_metrics)
                if self.step % t.log_every == 0 or self.step == t.max_steps or self.step == first_step + 1:
                    self._record(values, seconds)
                if stop:  # no evaluation or health check: the grace is for the checkpoint
                    self.progress.beat(self.step, "stop")
                    return self._stop(seconds)
                try:
                    for hook in self.hooks:
                        if self.step % hook.every == 0:
                            self.progress.beat(self.step, getattr(hook.fn, "__name__", "hook"))
                            hook.fn(self.step)
                            self._note_save()
                    self.progress.beat(self.step)
                except UnhealthyCollective as exc:
                    log.error("%s: exiting so the job restarts from the last checkpoint", exc)
                    write_failure(f"UnhealthyCollective: {exc}")
                    return EXIT_UNHEALTHY
                since, since_step = time.perf_counter(), self.step  # hooks do not count as step time
            if self.step > first_step and (not t.eval_every or self.step % t.eval_every):
                self.progress.beat(self.step, "evaluate")
                self.evaluate(self.step)
            # Decided from local state, not by listing storage: every rank must make the same choice.
            if self.saved_step != self.step:
                self.progress.beat(self.step, "save_checkpoint")
                self.save_checkpoint(self.step)
            return 0
        finally:
            vote.close()
            self.ckpt.wait()
            self.metrics.close()
            self.loader.close()
            signal.signal(signal.SIGTERM, previous)

    def _stop(self, step_seconds: float) -> int:
        """Every rank, once the stop vote passed after step `self.step`: supersede an async save still in flight
        (`CheckpointManager.supersede`: cut at its next part, never committed; waiting for it could take the grace,
        core/stop_timeline.py), save this step synchronously (committed before the process exits), return the exit
        code 0. Under graph extraction there is nothing real to save: the stop ends the rehearsal at this step."""
        if self.extracting_graphs:
            log.warning("SIGTERM while extracting graphs: stopping at step %d, no checkpoint", self.step)
            return 0
        grace = grace_seconds(self.cfg)
        # A stop voted for this rank by another is the SIGTERM every rank gets, or the stop rule's (rank 0 says why).
        log.warning("%s: checkpointing step %d and exiting", self.stop_why or "SIGTERM", self.step)
        if self.world.is_main:
            self._log_stop_budget(grace, step_seconds)
        if self._async_save is not None:
            step, began = self._async_save
            self._async_save = None
            if step == self.step:  # this very step's save is in flight: it is the stop's checkpoint
                self.ckpt.wait()
                log.warning("stop: step %d saved (its async save finished) in %.1f s; exiting 0", step,
                            time.perf_counter() - began)  # fmt: skip
                self.stopped_at = self.step
                return 0
            cut_from = time.perf_counter()
            # Every rank supersedes alike (each reaches this stop at the same step), so rank 0 never waits to commit
            # files the others stopped writing.
            superseded = self.ckpt.supersede()
            if superseded is not None:
                log.info(
                    "stop: the async save of step %d was in flight %.1f s: superseded (cut in %.1f s), not committed",
                    superseded, cut_from - began, time.perf_counter() - cut_from,
                )  # fmt: skip
        began = time.perf_counter()
        self.save_checkpoint(self.step)
        self.ckpt.wait()  # an async manager's save, made synchronous: this rank's files are written (rank 0: committed)
        self._last_save = (self.step, time.perf_counter() - began)
        self._async_save = None
        after = f", {time.monotonic() - self._sigterm_at:.1f} s after this rank's SIGTERM" if self._sigterm_at else ""
        log.warning(
            "stop: step %d saved in %.1f s%s (grace %.0f s); exiting 0", self.step, self._last_save[1], after, grace
        )
        self.stopped_at = self.step
        return 0

    def request_stop(self, why: str) -> None:
        """Stop at the next step boundary as on SIGTERM (a checkpoint, exit 0), for `why` (the stop rule's reason,
        from its thread: the vote's threads tell the other ranks)."""
        if not self.stop_requested:
            self.stop_why = why
            self.stop_requested = True
        if self.vote is not None:
            self.vote.request()

    def stop_margin_seconds(self) -> float:
        """How long before a hard limit a stop must be asked for: STOP_MARGIN x (a step + a save) as measured here,
        job.stop_grace_seconds until a synchronous save has been timed (an async save's length is known at a stop)."""
        if self._last_save is None or self.step_seconds is None:
            return self.cfg.job.stop_grace_seconds
        return STOP_MARGIN * (self.step_seconds + self._last_save[1])

    def _log_stop_budget(self, grace: float, step_seconds: float) -> None:
        """One line: the stop's timeline from SIGTERM (`core.stop_timeline`, as the dry run prints it) from what this
        job measured: the time since this rank's SIGTERM (else a whole step), an async save in flight (superseded:
        at most one part), the last save's time (else the modelled staging, writes and commit), and whether the
        checkpoint is expected to fit."""
        since = time.monotonic() - self._sigterm_at if self._sigterm_at is not None else None
        if self._last_save is None:
            self._last_save = self._async_save_seconds()
        save = self._last_save[1] if self._last_save is not None else None
        left = None
        if self._async_save is not None and save is not None:
            # What is left of the async save still running, if it takes as long as the last one did.
            left = max(0.0, save - (time.perf_counter() - self._async_save[1]))
        timeline = stop_timeline(
            self.cfg, step_seconds, since_sigterm=since, save_seconds=save,
            in_flight=self._async_save is not None, in_flight_left_s=left, grace=grace,
        )  # fmt: skip
        measured = f"step {step_seconds:.1f} s"
        sigterm = f", SIGTERM {since:.1f} s ago" if since is not None else ", no SIGTERM here (the worst case counted)"
        measured += sigterm
        last = self._last_save
        measured += f", last save {last[1]:.1f} s (step {last[0]})" if last else ", no save timed yet"
        line = f"stop at step {self.step}: {timeline.line().removeprefix('stop: ')}; measured: {measured}"
        if timeline.fits():
            log.info("%s", line)
        else:
            log.warning("%s: SIGKILL may come first", line)

    def _sync_point(self, first_step: int) -> bool:
        """Whether the host reads the device after this step: the same steps on every rank (the stop vote and the
        hooks' collectives must line up)."""
        s, t = self.step, self.cfg.training
        hooks = any(s % hook.every == 0 for hook in self.hooks)
        return hooks or s % t.log_every == 0 or s == t.max_steps or s == first_step + 1

    def _async_save_seconds(self) -> tuple[int, float] | None:
        """(step, seconds) of this job's newest committed async save, from its start here to the commit time rank 0
        wrote in its meta.json (to the second, so rounded up): one small read, at a stop only. None when there is
        none (or its meta.json cannot be read)."""
        for step, began in reversed(self._async_started):
            try:
                meta = self.checkpoints.read_json(f"{step_dir(step)}/{CHECKPOINT_META}")
                committed = datetime.fromisoformat(meta["time"])
            except Exception:  # not committed yet, pruned, unreadable: the one before, or nothing
                continue
            return step, max(0.0, committed.timestamp() - began) + 1.0
        return None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._sigterm_at is None:
            self._sigterm_at = time.monotonic()
        self.stop_requested = True
        if self.vote is not None:
            self.vote.request()  # an Event: safe in a signal handler

    def _note_save(self) -> None:
        """The watchdog's save time: the last save timed to its end (a synchronous one, or an async one at a stop)."""
        if self._last_save is not None:
            self.progress.save_s = self._last_save[1]

    def _record(self, stats: dict[str, Any], seconds: float) -> None:
        """Record a sync point's values; `seconds` is the mean step time since the previous sync point."""
        tokens = self.cfg.tokens_per_step
        tokens_per_s = tokens / seconds if seconds > 0 else float("nan")
        values: dict[str, Any] = {
            **stats,
            "lr": self.scheduler.get_last_lr()[0],
            "tokens_per_s": tokens_per_s,
            "step_seconds": seconds,
            "tokens": self.step * tokens,
            "memory_gb": memory_gb(self.world.device),
        }
        if self._peak:
            values["mfu"] = tokens_per_s * self._flops_per_token / (self._peak * self.world.world_size)
        values.update(self._source_tokens())
        self.metrics.record(self.step, values)
        if self.world.is_main and self.extracting_graphs:
            log.info("step %d traced (extracting graphs: its values are invalid)", self.step)
        elif self.world.is_main:
            log.info(
                "step %d loss %.4f grad_norm %.3f lr %.2e %.0f tok/s",
                self.step, stats["loss"], stats["grad_norm"], values["lr"], tokens_per_s,
            )  # fmt: skip

    def _source_tokens(self) -> dict[str, int]:
        """`tokens/<source>`: each source's training tokens so far on this rank, and `data_degree`. Host integers
        from the state of the last batch a step consumed (no device read, no collective). The records are rank 0's,
        so the counts are data rank 0's: a source's tokens over the whole run are about data_degree times them (each
        rank mixes its own documents by the same rule), and its share is the same."""
        state = self._loader_state
        if state is None:
            return {}
        counts = {f"tokens/{s['name']}": int(s["tokens"]) for s in state.get("sources", [])}
        return {**counts, "data_degree": self.world.layout.data} if counts else {}

    # -- hooks -------------------------------------------------------------------------------------------
    def health_check(self, step: int) -> None:
        """Time and verify an all-reduce (burn_in.health_check_every); raises UnhealthyCollective on every rank
        when any rank saw a wrong sum, a bandwidth below the floor for its size and rank count, or one below a
        fraction of this job's first check (`training/health.py`). Touches no RNG or model state."""
        b = self.cfg.burn_in
        instance_type = self.cfg.job.instance_type
        result = periodic_health_check(
            self.world,
            b.health_allreduce_mb,
            b.thresholds.get(instance_type),
            step,
            instance_type,
            reference_gbps=self._health_reference,
            judge=not self.extracting_graphs,
        )
        if result["judged"] and self._health_reference is None:
            self._health_reference = result["slowest_best_busbw_gbps"]

    def save_checkpoint(self, step: int) -> None:
        # The metrics first: a job killed between a commit and a later flush would resume past lines that never
        # reached an object store (S3 has no appends: metrics.jsonl is rewritten at each flush).
        self.metrics.flush()
        began = time.perf_counter()
        self.format.save(self.ckpt, step, self._shared_state(step), self._rank_state())
        self.saved_step = step
        if self.ckpt.async_save:  # timed to its end when the loop waits for it (a stop), else from its meta.json
            self._async_save = (step, began)
            self._async_started = [*self._async_started[-1:], (step, time.time())]
        else:
            self._last_save = (step, time.perf_counter() - began)

    def _shared_state(self, step: int) -> dict[str, Any]:
        """What every rank holds alike besides the model and optimizer (the spike detector's state too: the loss and
        the norm it judges are the same on every rank)."""
        state: dict[str, Any] = {
            "step": step,
            "scheduler": self.scheduler.state_dict(),
            "config_fingerprint": self.cfg.fingerprint(),
            "config": self.cfg.model_dump(mode="json"),
        }
        if self.spikes is not None:  # device tensors: staged to the host with the rest of the state
            state["spikes"] = self.spikes.state_dict()
        return state

    def _rank_state(self) -> dict[str, Any]:
        # The state after the last batch a step consumed: the device loader may have fetched more.
        return rank_state(self._loader_state if self._loader_state is not None else self.loader.state_dict())

    def _restore(self, shared: dict[str, Any], mine: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(shared["scheduler"])
        restore_rank_state(mine, self.loader)
        if self.spikes is not None and "spikes" in shared:
            self.spikes.load_state_dict(shared["spikes"])
            self._spikes_restored = int(shared["spikes"]["skipped"])
        elif self.spikes is not None:
            log.info("training.spike_skip: the checkpoint holds no spike window (saved with it off): it starts empty")

    def _held_out_loss(self, chunk: list[DeviceBatch]) -> torch.Tensor:
        if self.world.layout.pipeline > 1:  # averaged over the micro-batches and the data-parallel group, every stage
            inputs = {"tokens": torch.cat([b.inputs for b in chunk]), "targets": torch.cat([b.targets for b in chunk])}
            if self.cfg.training.document_masking:
                inputs["doc_ids"] = torch.cat([b.doc_ids for b in chunk if b.doc_ids is not None])
            return torch.as_tensor(self.wrapped.run_eval(**inputs), dtype=torch.float32).reshape(())
        (batch,) = chunk
        with self.autocast():
            logits = self.model(batch.inputs, batch.doc_ids)
        return self.model.loss(logits, batch.targets)

    @torch.no_grad()
    def evaluate(self, step: int) -> float:
        """Mean loss over the first eval_batches micro-batches of the held-out split (the same each time); one host
        read at the end."""
        loader = self._loader("validation")
        self.wrapped.eval()
        total: torch.Tensor | None = None
        count = 0
        # Under pipeline parallelism the stages score a step's worth of micro-batches at a time.
        group = self.cfg.gradient_accumulation if self.world.layout.pipeline > 1 else 1
        try:
            batches = self.device_batches(loader, accumulation=1, background=False)
            wanted = max(group, self.cfg.training.eval_batches // group * group)
            chunk: list[DeviceBatch] = []
            for batch, _ in zip(batches, range(wanted), strict=False):
                chunk.append(batch)
                if len(chunk) < group:
                    continue
                loss = self._held_out_loss(chunk)
                chunk = []
                total = loss if total is None else total + loss
                count += 1
                self.world.mark_step()  # one forward per graph: the same graph for every batch
                self.progress.beat(self.step, "evaluate")  # a long evaluation is progress too
        finally:
            loader.close()
            self.wrapped.train()
        if total is None:
            log.warning("the held-out split has no tokens: no validation loss at step %d", step)
            return float("nan")
        val_loss = float(self.world.to_host(self.world.mean(total / count)))
        self.metrics.record(step, {"val_loss": val_loss})
        if self.world.is_main and not self.extracting_graphs:
            log.info("step %d val_loss %.4f", step, val_loss)
        return val_loss
