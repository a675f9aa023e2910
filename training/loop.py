"""The training loop: the step, gradient accumulation, the checkpoint cadence and resume.

The Trainer is given its model and optimizer (`training/assembly.py`). Its side concerns are callbacks, called
in a stated order at named hook points (`training/callbacks.py`): the NaN and spike policies, first-step
metrics, metrics logging, and the stop protocol (`training/stop_protocol.py`). A logged step writes the step
line of `core/contract.py`, which the supervisor reads.

Rules:
- No host round trip inside a step, on any device. The loss, norm and non-finite tally stay on the device
  (`StepTally`); batches arrive there from a background thread; on XLA the step is cut where
  `training.xla_graph_cuts` says, so every step runs the same compiled graphs.
- The host reads the device at sync points only, in one transfer: logged steps, steps with a hook (checkpoint,
  evaluation, health check), the job's first and last step, and a step whose stop vote passed.
- Callbacks judge what a sync point read before any hook runs, so no checkpoint saves a NaN or a spike's weights.
- Fault tolerance follows HLAT: a checkpoint every `training.checkpoint_every` steps, and a job resumes from the
  newest complete one. After every step the loop asks, without I/O, whether a background save failed.
- Under graph extraction (neuron_parallel_compile's trial run, `extracting_graphs`) every step, hook and host
  read happens as in a job, so every graph is traced; no value is acted on and nothing is written.

docs/stages.md ("The training loop") gives the order, the stop's timeline and the sources.
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
from typing import Any

import torch

from hlat.core.config import HlatConfig
from hlat.core.contract import (
    EXIT_UNHEALTHY,
    note_step,
    write_failure,
)
from hlat.core.environment import neuron_available
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training.assembly import BuiltModel, build_model, check_world
from hlat.training.callbacks import Callback, FirstStepMetrics, MetricsLogging, NanPolicy, SpikePolicy, SyncPoint
from hlat.training.checkpoint import (
    CheckpointFormat,
    CheckpointManager,
    Distributed,
    ModelParallel,
    Unsharded,
    Zero1,
    rank_state,
    restore_rank_state,
)
from hlat.training.data.loader import PackedLoader
from hlat.training.health import UnhealthyCollective, periodic_health_check
from hlat.training.hooks import hooks
from hlat.training.metrics import MetricsLog
from hlat.training.optim import (
    build_scheduler,
    clip_grad_norm,
    masked_step,
)
from hlat.training.parallel.distributed import World
from hlat.training.parallel.parallelize import reduce_gradients
from hlat.training.spikes import SpikeDetector, Verdict
from hlat.training.stop_protocol import SaveTimes, StopProtocol
from hlat.training.watchdog import Progress

log = logging.getLogger("hlat.train")

EXTRACT_GRAPHS_ONLY = "NEURON_EXTRACT_GRAPHS_ONLY"


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

    built: BuiltModel | None = None
    """The model, its wrapping and optimizer (`training/assembly.py build_model`); None: the Trainer builds them."""

    def __post_init__(self) -> None:
        cfg, world = self.cfg, self.world
        check_world(cfg, world)
        built = self.built if self.built is not None else build_model(cfg, world)
        self._built_at = built.started_at  # time to first step counts from here (first_step_seconds)
        self.extracting_graphs = extracting_graphs()
        """neuron_parallel_compile's trial run: trace everything, act on no value, write nothing (module docstring)."""
        if self.extracting_graphs:
            log.warning(
                "%s is set: extracting graphs (the outputs are invalid): no health verdict, NaN exit, checkpoint, "
                "metrics or failure file in this process", EXTRACT_GRAPHS_ONLY
            )  # fmt: skip
        self.model, self.wrapped, self.optimizer = built.model, built.wrapped, built.optimizer
        self.precision_flags, self.fsdp = built.precision_flags, built.fsdp
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
        self._loader_state: dict[str, Any] | None = None  # of the last batch a step consumed
        self.saved_step: int | None = None
        self.saves = SaveTimes()
        # Recorded with this job's first step, next to first_step_seconds (e.g. the compile cache's status).
        self.first_step_metrics: dict[str, Any] = {}
        self.callbacks = self._callbacks()
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
    def _callbacks(self) -> list[Callback]:
        """The loop's side concerns, in the order they are called (`training/callbacks.py`)."""
        cfg, extracting = self.cfg, self.extracting_graphs
        t = cfg.training
        self.stopping = StopProtocol(
            cfg, self.world, self.ckpt, self.checkpoints, self.save_checkpoint, self.saves, self.progress, extracting
        )
        callbacks: list[Callback] = [self.stopping, NanPolicy(t.nan_policy, extracting)]
        if self.spikes is not None:
            callbacks.append(SpikePolicy(self.spikes, t.spike_max_consecutive, t.spike_zscore, extracting))
        callbacks.append(FirstStepMetrics(self._built_at, self.first_step_metrics))
        lr = lambda: self.scheduler.get_last_lr()[0]  # noqa: E731
        callbacks.append(MetricsLogging(cfg, self.world, self.metrics, lr, self._source_tokens, extracting))
        return callbacks

    def _spike_detector(self) -> SpikeDetector | None:
        """training.spike_skip's detector on the job's device (None when off)."""
        t = self.cfg.training
        if not t.spike_skip:
            return None
        return SpikeDetector(t.spike_window, t.spike_zscore, t.spike_max_consecutive, self.world.device)

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
        previous = signal.signal(signal.SIGTERM, self.stopping.on_sigterm)  # the stop protocol's, while fit runs
        self._announce()
        # After the compile cache is loaded (train.py): the throwaway step compiles what the first step would.
        self._settle_gradient_buckets()
        batches = self.device_batches(self.loader, self.cfg.gradient_accumulation)
        first_step = self.step
        since, since_step = time.perf_counter(), self.step
        pace = hooks().step_seconds()  # tests' stand-in for a big model's step (None here)
        try:
            for callback in self.callbacks:
                callback.on_fit_start(self.step)
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
                # Every step boundary, on every rank: a stop must not wait log_every steps for a sync point. Every
                # callback is told (a list, not a short-circuit).
                stop = any([callback.on_step_end(self.step) for callback in self.callbacks])
                if not stop and not self._sync_point(first_step):
                    continue
                seconds = (time.perf_counter() - since) / (self.step - since_step)
                point = self._read_sync_point(stats, first_step, seconds)
                for callback in self.callbacks:
                    code = callback.on_sync(point)
                    if code is not None:
                        return code
                if stop:
                    for callback in self.callbacks:
                        callback.on_stop(point)
                    return 0
                code = self._run_hooks()
                if code is not None:
                    return code
                since, since_step = time.perf_counter(), self.step  # hooks do not count as step time
            self._finish(first_step)
            return 0
        finally:
            for callback in self.callbacks:
                callback.on_fit_end()
            self.ckpt.wait()
            self.metrics.close()
            self.loader.close()
            signal.signal(signal.SIGTERM, previous)

    def _announce(self) -> None:
        """The job's shape, once, as fit starts."""
        t = self.cfg.training
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

    def _finish(self, first_step: int) -> None:
        """After the last step: an evaluation unless one just ran, and its checkpoint unless one was just saved."""
        t = self.cfg.training
        if self.step > first_step and (not t.eval_every or self.step % t.eval_every):
            self.progress.beat(self.step, "evaluate")
            self.evaluate(self.step)
        # Decided from local state, not by listing storage: every rank must make the same choice.
        if self.saved_step != self.step:
            self.progress.beat(self.step, "save_checkpoint")
            self.save_checkpoint(self.step)

    def _read_sync_point(self, stats: dict[str, Any], first_step: int, seconds: float) -> SyncPoint:
        """The sync point: everything the host needs of the steps since the last one, in one transfer."""
        t = self.cfg.training
        tensors = {k: stats[k] for k in ("loss", "grad_norm", "finite")} | self.tally.tensors()
        for callback in self.callbacks:
            tensors |= callback.sync_tensors()
        seen = self.world.to_host(tensors)
        self.progress.step_s = seconds
        values: dict[str, Any] = {
            "loss": float(seen["loss"]),
            "grad_norm": float(seen["grad_norm"]),
            "samples_crc32": stats["samples_crc32"],
        }
        first = self.step == first_step + 1
        logged = self.step % t.log_every == 0 or self.step == t.max_steps or first
        return SyncPoint(self.step, first, seen, values, seconds, logged)

    def _run_hooks(self) -> int | None:
        """The hooks due at this step (health check, evaluation, checkpoint, in that order); an exit code when the
        health check failed."""
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
        return None

    def request_stop(self, why: str) -> None:
        """Stop at the next step boundary as on SIGTERM (`StopProtocol.request`)."""
        self.stopping.request(why)

    def stop_margin_seconds(self) -> float:
        """How long before a hard limit a stop must be asked for (`StopProtocol.margin_seconds`)."""
        return self.stopping.margin_seconds()

    @property
    def stopped_at(self) -> int | None:
        """The step a stop checkpointed (None: no stop)."""
        return self.stopping.stopped_at

    def _sync_point(self, first_step: int) -> bool:
        """Whether the host reads the device after this step: the same steps on every rank (the stop vote and the
        hooks' collectives must line up)."""
        s, t = self.step, self.cfg.training
        hooks = any(s % hook.every == 0 for hook in self.hooks)
        return hooks or s % t.log_every == 0 or s == t.max_steps or s == first_step + 1

    def _note_save(self) -> None:
        """The watchdog's save time: the last save timed to its end (a synchronous one, or an async one at a stop)."""
        if self.saves.last is not None:
            self.progress.save_s = self.saves.last[1]

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
        # An async save is timed to its end when the loop waits for it (a stop), else from its meta.json.
        self.saves.began(step, began, self.ckpt.async_save)

    def _shared_state(self, step: int) -> dict[str, Any]:
        """What every rank holds alike besides the model and optimizer, and what the callbacks add (`on_checkpoint`)."""
        state: dict[str, Any] = {
            "step": step,
            "scheduler": self.scheduler.state_dict(),
            "config_fingerprint": self.cfg.fingerprint(),
            "config": self.cfg.model_dump(mode="json"),
        }
        for callback in self.callbacks:
            callback.on_checkpoint(state)
        return state

    def _rank_state(self) -> dict[str, Any]:
        # The state after the last batch a step consumed: the device loader may have fetched more.
        return rank_state(self._loader_state if self._loader_state is not None else self.loader.state_dict())

    def _restore(self, shared: dict[str, Any], mine: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(shared["scheduler"])
        restore_rank_state(mine, self.loader)
        for callback in self.callbacks:
            callback.on_resume(shared)

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
