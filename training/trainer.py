"""The training loop: a short step function with side effects (checkpoints, evaluation, metrics) as hooks.

Fault tolerance follows HLAT: state is checkpointed every `training.checkpoint_every` steps (model,
optimizer, scheduler, step, each rank's data-loader and RNG state); a job resumes from the newest complete
checkpoint; a NaN/inf loss exits non-zero (or skips the step) so the job restarts from the last checkpoint;
SIGTERM (sent by SageMaker before it stops a job) checkpoints and exits 0.
"""

from __future__ import annotations

import logging
import math
import signal
import time
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from infra.storage import Storage
from training.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from training.config import ConfigError, HlatConfig
from training.data import PackedLoader
from training.devices import memory_gb, peak_flops
from training.distributed import World
from training.exit_codes import EXIT_NAN, EXIT_UNHEALTHY
from training.faults import inject_nan
from training.health import UnhealthyCollective, periodic_health_check
from training.metrics import MetricsLog
from training.model import Transformer, flops_per_token
from training.optim import build_optimizer, build_scheduler, clip_grad_norm
from training.parallelize import parallelize
from training.sagemaker import write_failure

log = logging.getLogger("hlat.train")


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf."""


@dataclass
class Hook:
    fn: Callable[[int], object]
    every: int


@dataclass
class Trainer:
    cfg: HlatConfig
    run: Storage
    checkpoints: Storage
    world: World
    tokenizer_model: str
    tensorboard_dir: str | None = None
    hooks: list[Hook] = field(default_factory=list)
    data: Storage | None = None
    """The prepared data (default: the run's data/); inside a job, the folder of its data channel."""

    def __post_init__(self) -> None:
        self._built_at = time.perf_counter()  # time to first step counts from here (first_step_seconds)
        cfg, world = self.cfg, self.world
        if world.world_size != cfg.world_size:
            raise ConfigError(
                f"this job has {world.world_size} processes but job.instance_count x job.processes_per_node = "
                f"{cfg.world_size}; launch {cfg.world_size} processes or fix the config"
            )
        torch.manual_seed(cfg.training.seed)
        model = Transformer(cfg.model)
        model.init_weights()
        if cfg.precision.mode == "bf16-sr":
            model = model.to(torch.bfloat16)  # pure BF16: weights and optimizer states
        self.model = model.to(world.device)
        self.wrapped = parallelize(self.model, cfg, world)
        self.optimizer = build_optimizer(self.model, cfg.training, cfg.precision.mode)
        self.scheduler = build_scheduler(self.optimizer, cfg.training)
        self.loader = self._loader("train")
        self.ckpt = CheckpointManager(
            self.checkpoints,
            keep_last=cfg.training.keep_checkpoints,
            keep_every=cfg.training.keep_every,
            rank=world.rank,
            world_size=world.world_size,
            barrier=world.barrier,
            async_save=cfg.training.async_checkpoint,
        )
        self.metrics = MetricsLog(self.run, enabled=world.is_main, tensorboard_dir=self.tensorboard_dir)
        self.step = 0
        self.saved_step: int | None = None
        self.stop_requested = False
        # Recorded with this job's first step, next to first_step_seconds (e.g. the compile cache's status).
        self.first_step_metrics: dict[str, Any] = {}
        self._flops_per_token = flops_per_token(cfg.model, cfg.training.seq_len)
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
    def _loader(self, split: str) -> PackedLoader:
        t = self.cfg.training
        return PackedLoader(
            self.data or self.run.child("data"),
            self.tokenizer_model,
            seq_len=t.seq_len,
            micro_batch_size=t.micro_batch_size,
            seed=t.seed,
            dp_rank=self.world.rank,
            dp_size=self.world.world_size,
            split=split,
            document_masking=t.document_masking,
        )

    def add_hook(self, fn: Callable[[int], object], every: int) -> None:
        """Run fn(step) after every `every`-th optimizer step."""
        self.hooks.append(Hook(fn, every))

    def autocast(self) -> AbstractContextManager[Any]:
        if self.cfg.precision.mode == "bf16-mixed":
            return torch.autocast(self.world.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def resume(self) -> int:
        """Load the newest complete checkpoint, if any; return the step to continue from."""
        step = self.ckpt.latest_step()
        if step is None:
            log.info("no complete checkpoint under %s: starting from scratch", self.checkpoints.url)
            self.metrics.resume_at(0)
            return 0
        shared, mine = self.ckpt.load(step)
        self.model.load_state_dict(shared["model"])
        self.optimizer.load_state_dict(shared["optimizer"])
        self.scheduler.load_state_dict(shared["scheduler"])
        self.loader.load_state_dict(mine["loader"])
        restore_rng_state(mine["rng"])
        self.step = self.saved_step = int(shared["step"])
        self.metrics.resume_at(self.step)
        log.info("resumed from step %d of %s", self.step, self.checkpoints.url)
        return self.step

    # -- the loop ----------------------------------------------------------------------------------------
    def train_step(self, batches: Any) -> dict[str, Any]:
        """One optimizer step over `gradient_accumulation` micro-batches; loss normalised by tokens."""
        accum = self.cfg.gradient_accumulation
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        crc = 0
        for i in range(accum):
            batch = next(batches)
            # A checksum of the tokens seen: resumed and uninterrupted runs must consume the same samples.
            crc = zlib.crc32(batch.inputs.numpy().tobytes(), crc)
            inputs = batch.inputs.to(self.world.device)
            targets = batch.targets.to(self.world.device)
            doc_ids = batch.doc_ids.to(self.world.device) if batch.doc_ids is not None else None
            # DDP all-reduces gradients on the last micro-batch only.
            no_sync = getattr(self.wrapped, "no_sync", None)
            skip_sync = no_sync is not None and i < accum - 1
            with self.autocast(), no_sync() if skip_sync else nullcontext():  # type: ignore[misc]
                logits = self.wrapped(inputs, doc_ids)  # (B, T, V)
                # Every micro-batch holds the same number of tokens (packed, no padding), so the mean over a
                # micro-batch divided by the accumulation steps is the mean over all the step's tokens.
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / accum
                loss.backward()
            total += float(loss.detach())
        if self.world.is_main and inject_nan(self.run, self.step + 1):
            total = float("nan")
        loss_mean = self.world.all_reduce_mean(total)
        if not math.isfinite(loss_mean):
            raise NonFiniteLoss(f"loss is {loss_mean} at step {self.step + 1}")
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.training.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return {"loss": loss_mean, "grad_norm": grad_norm, "samples_crc32": crc}

    def fit(self) -> int:
        """Train to training.max_steps; return the process exit code."""
        t = self.cfg.training
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        log.info(
            "training %s: %d params, precision %s, %d rank(s) x %d micro-batch x %d accumulation, seq %d",
            self.cfg.preset, self.model.num_params(), self.cfg.precision.mode, self.world.world_size,
            t.micro_batch_size, self.cfg.gradient_accumulation, t.seq_len,
        )  # fmt: skip
        batches = iter(self.loader)
        first_step = self.step
        try:
            while self.step < t.max_steps:
                start = time.perf_counter()
                try:
                    stats = self.train_step(batches)
                except NonFiniteLoss as exc:
                    if t.nan_policy == "exit":
                        log.error("%s: exiting so the job restarts from the last checkpoint", exc)
                        return EXIT_NAN
                    log.warning("%s: step skipped (training.nan_policy=skip)", exc)
                    self.optimizer.zero_grad(set_to_none=True)
                    self.scheduler.step()
                    stats = {"loss": float("nan"), "grad_norm": float("nan"), "skipped": True}
                self.step += 1
                if self.step == first_step + 1:
                    # Time to first step: build, compile (or load the compile cache), resume, one step. Recorded
                    # whatever log_every says: it is what precompilation saves a job.
                    stats = {**stats, "first_step_seconds": time.perf_counter() - self._built_at}
                    stats.update(self.first_step_metrics)
                if self.step % t.log_every == 0 or self.step == t.max_steps or self.step == first_step + 1:
                    self._record(stats, time.perf_counter() - start)
                try:
                    for hook in self.hooks:
                        if self.step % hook.every == 0:
                            hook.fn(self.step)
                except UnhealthyCollective as exc:
                    log.error("%s: exiting so the job restarts from the last checkpoint", exc)
                    write_failure(f"UnhealthyCollective: {exc}")
                    return EXIT_UNHEALTHY
                if self.world.any_rank(self.stop_requested):
                    log.warning("SIGTERM: checkpointing step %d and exiting", self.step)
                    self.save_checkpoint(self.step)
                    return 0
            if self.step > first_step and (not t.eval_every or self.step % t.eval_every):
                self.evaluate(self.step)
            # Decided from local state, not by listing storage: every rank must make the same choice.
            if self.saved_step != self.step:
                self.save_checkpoint(self.step)
            return 0
        finally:
            self.ckpt.wait()
            self.metrics.close()
            self.loader.close()
            signal.signal(signal.SIGTERM, previous)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    def _record(self, stats: dict[str, Any], seconds: float) -> None:
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
        self.metrics.record(self.step, values)
        if self.world.is_main:
            log.info(
                "step %d loss %.4f grad_norm %.3f lr %.2e %.0f tok/s",
                self.step, stats["loss"], stats["grad_norm"], values["lr"], tokens_per_s,
            )  # fmt: skip

    # -- hooks -------------------------------------------------------------------------------------------
    def health_check(self, step: int) -> None:
        """Time and verify an all-reduce (burn_in.health_check_every); raises UnhealthyCollective on every rank
        when any rank saw a wrong sum or a bandwidth below its instance type's floor. Touches no RNG or state."""
        b = self.cfg.burn_in
        instance_type = self.cfg.job.instance_type
        periodic_health_check(self.world, b.health_allreduce_mb, b.thresholds.get(instance_type), step, instance_type)

    def save_checkpoint(self, step: int) -> None:
        shared = {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "config_fingerprint": self.cfg.fingerprint(),
            "config": self.cfg.model_dump(mode="json"),
        }
        mine = {"loader": self.loader.state_dict(), "rng": capture_rng_state()}
        self.ckpt.save(step, shared, mine)
        self.saved_step = step
        self.metrics.flush()

    @torch.no_grad()
    def evaluate(self, step: int) -> float:
        """Mean loss over the first eval_batches micro-batches of the held-out split (the same each time)."""
        loader = self._loader("validation")
        self.wrapped.eval()
        total, count = 0.0, 0
        try:
            for batch, _ in zip(loader, range(self.cfg.training.eval_batches), strict=False):
                doc_ids = batch.doc_ids.to(self.world.device) if batch.doc_ids is not None else None
                with self.autocast():
                    logits = self.model(batch.inputs.to(self.world.device), doc_ids)
                total += float(
                    F.cross_entropy(logits.float().flatten(0, 1), batch.targets.to(self.world.device).flatten())
                )
                count += 1
        finally:
            loader.close()
            self.wrapped.train()
        if count == 0:
            log.warning("the held-out split has no tokens: no validation loss at step %d", step)
            return float("nan")
        val_loss = self.world.all_reduce_mean(total / count)
        self.metrics.record(step, {"val_loss": val_loss})
        if self.world.is_main:
            log.info("step %d val_loss %.4f", step, val_loss)
        return val_loss
