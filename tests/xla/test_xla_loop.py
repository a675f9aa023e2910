"""The training loop on the XLA device (XLA:CPU): one graph per step, no host reads between sync points, the
eager CPU run's losses, collectives on device tensors, one transfer per checkpoint, bitwise kill-and-resume.

Counts come from torch_xla.debug.metrics (training/xla.py: `counters`). Executions are asynchronous, so each
step's counts are taken after waiting for the device."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.config import HlatConfig, validate_config
from hlat.core.contract import EXIT_NAN
from hlat.core.environment import environment_sdk
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training import xla
from hlat.training.checkpoint import CheckpointManager
from hlat.training.loop import Trainer
from hlat.training.parallel.distributed import World, init_world
from tests.xla.conftest import make_run

STEPS = 20
PROJECT = Path(__file__).resolve().parents[2]
SDK = environment_sdk()
if SDK is None:
    raise RuntimeError("the XLA tier runs in a Neuron SDK's environment: .venv-xla (2.24.1) or .venv-xla-2.28 (2.28.0)")
PRECISION_FLAGS = SDK.precision_flags
"""Neuron 2.24 (torch-xla 2.7) sets precision with XLA_USE_BF16 / XLA_DOWNCAST_BF16; 2.28 (torch-xla 2.9) casts."""


def build(run: Path) -> Trainer:
    cfg: HlatConfig = validate_config(Storage(str(run)).read_json("config.json"))
    world = init_world(cfg.training.device, cfg)
    return Trainer(
        cfg=cfg,
        run=Run.at(str(run)),
        checkpoints=Storage(str(run / "checkpoints")),
        world=world,
        tokenizer_model=str(run / "tokenizer" / "tokenizer.model"),
    )


def counted_fit(trainer: Trainer) -> tuple[int, list[dict[str, float]]]:
    """Run `fit()`; the XLA counters after each step's train_step (device work finished) and at the end."""
    marks: list[dict[str, float]] = []
    step = trainer.train_step

    def train_step(batches: Any) -> dict[str, Any]:
        out = step(batches)
        xla.wait()
        marks.append(xla.counters())
        return out

    trainer.train_step = train_step  # type: ignore[method-assign]
    code = trainer.fit()
    xla.wait()
    marks.append(xla.counters())
    return code, marks


def deltas(marks: list[dict[str, float]]) -> list[dict[str, float]]:
    """deltas[k]: what happened between the end of step k and the end of step k+1 (1-based k): the sync work of
    step k, if any, and the whole of step k+1."""
    return [{key: b[key] - a[key] for key in b} for a, b in itertools.pairwise(marks)]


VARIANTS = {
    # tiny: global batch 8, micro-batch 4 -> 2 micro-batches per step
    "fp32-accumulation-document-masking-selective": {
        "training.document_masking": True,
        "parallelism.activation_checkpointing": "selective",
    },
    "fp32-no-accumulation-full-checkpointing": {
        "training.micro_batch_size": 8,
        "parallelism.activation_checkpointing": "full",
    },
    "bf16-sr-accumulation": {"precision.mode": "bf16-sr"},
    "fp32-accumulation-one-graph-per-step": {"training.xla_graph_cuts": "step"},
    "bf16-mixed-accumulation-full-checkpointing": {
        "precision.mode": "bf16-mixed",
        "parallelism.activation_checkpointing": "full",
    },
    "fp32-gpt-neox-padded-vocabulary-document-masking-selective": {
        "model.arch": "gpt_neox",
        "model.rotary_fraction": 0.25,
        "model.vocab_multiple": 96,
        "training.document_masking": True,
        "parallelism.activation_checkpointing": "selective",
    },
}
GPT_NEOX = {"model.arch": "gpt_neox", "model.rotary_fraction": 0.25, "model.vocab_multiple": 96}
"""GPT-NeoX blocks with a padded vocabulary (the tests' tokenizer's rows padded to a multiple of 96)."""


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_same_graphs_every_step_and_no_host_read_between_sync_points(
    prepared: Path, tmp_path: Path, variant: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hlat")
    log_every = 5
    run = make_run(
        prepared, tmp_path, variant, **VARIANTS[variant],
        **{"training.max_steps": STEPS, "training.log_every": log_every, "training.checkpoint_every": 10},
    )  # fmt: skip
    trainer = build(run)
    code, marks = counted_fit(trainer)
    assert code == 0
    steps = deltas(marks)  # steps[k - 1]: step k's sync work, then step k + 1
    # From the end of step 2 to the end of step 20 (what follows the loop, the final evaluation, has graphs of its
    # own: the held-out forward pass, compiled once).
    after_step_2 = steps[1:-1]
    assert len(after_step_2) == STEPS - 2
    assert sum(d["compilations"] for d in after_step_2) == 0, after_step_2
    sync = {1, *range(log_every, STEPS + 1, log_every)}
    # Step k + 1 follows a step without a sync point; the stop vote and the check for a failed background save,
    # after every step, must add nothing there.
    quiet = [k for k in range(2, STEPS) if k not in sync]
    assert quiet, "the run has steps that do not log"
    # HLAT's cuts: a graph per micro-batch, then the optimizer's; or one graph for the whole step.
    cfg = trainer.cfg
    graphs = 1 if cfg.training.xla_graph_cuts == "step" else cfg.gradient_accumulation + 1
    for k in quiet:
        d = steps[k - 1]
        assert d["executions"] == graphs and d["transfers_to_host"] == 0, (k + 1, graphs, d)
    print(f"{variant}: {graphs} graph(s) and executions per step, {cfg.gradient_accumulation} micro-batch(es)")
    # XLA:CPU rounds BF16 to nearest: the rehearsal says it checks HLAT's graph, not its rounding.
    assert ("rounds to nearest" in caplog.text) == variant.startswith("bf16-sr"), caplog.text[-2000:]
    # Who sets the precision: Neuron 2.24's flags keep an FP32-typed model (BF16 on the device); under 2.28 the
    # trainer casts bf16-sr's model and autocasts bf16-mixed's compute over FP32 parameters.
    dtypes = {p.dtype for p in trainer.model.parameters()}
    cast = cfg.precision.mode == "bf16-sr" and not PRECISION_FLAGS
    assert dtypes == {torch.bfloat16 if cast else torch.float32}, (variant, dtypes)


@pytest.mark.parametrize("model", [{}, GPT_NEOX], ids=["llama", "gpt-neox-padded-vocabulary"])
def test_fp32_losses_on_xla_equal_the_eager_cpu_run(prepared: Path, tmp_path: Path, model: dict[str, Any]) -> None:
    losses = {}
    for device in ("cpu", "xla"):
        trainer = build(make_run(prepared, tmp_path, device, device=device, **{"training.max_steps": STEPS}, **model))
        batches = trainer.device_batches(trainer.loader, trainer.cfg.gradient_accumulation)
        out = [trainer.train_step(batches)["loss"] for _ in range(STEPS)]
        losses[device] = [float(x) for x in trainer.world.to_host(out)]
        trainer.loader.close()
    cpu, on_xla = losses["cpu"], losses["xla"]
    assert on_xla[-1] < on_xla[0]
    worst = max(abs(a - b) / abs(a) for a, b in zip(cpu, on_xla, strict=True))
    assert worst <= 1e-5, (worst, cpu, on_xla)


def test_a_checkpoint_reaches_the_host_in_one_transfer_and_resumes_on_the_device(
    prepared: Path, tmp_path: Path
) -> None:
    run = make_run(prepared, tmp_path, "save", **{"training.max_steps": 4, "precision.mode": "bf16-mixed"})
    trainer = build(run)
    assert trainer.fit() == 0
    xla.wait()
    before = xla.counters()
    trainer.save_checkpoint(trainer.step + 1)  # model, optimizer (FP32 masters and moments), RNG: all at once
    trainer.ckpt.wait()  # an async save (the default): staged inside save(), committed in the background
    xla.wait()
    assert xla.counters()["transfers_to_host"] - before["transfers_to_host"] == 1
    shared, mine = CheckpointManager(Storage(str(run / "checkpoints")), keep_last=2).load(5)
    # Neuron 2.24's flags: FP64-typed masters (FP32 on the device under XLA_DOWNCAST_BF16). Neuron 2.28: the FP32
    # parameters under autocast are the masters, and the moments are FP32 too.
    key, dtype = ("master", torch.float64) if PRECISION_FLAGS else ("exp_avg", torch.float32)
    master = next(iter(shared["optimizer"]["state"].values()))[key]
    assert master.dtype == dtype and "xla" in mine["rng"]

    resumed = build(run)
    assert resumed.resume() == 5
    restored = next(iter(resumed.optimizer.state.values()))[key]
    assert restored.device.type == "xla" and restored.dtype == dtype  # not cast to another dtype
    assert torch.equal(restored.cpu(), master)


def test_nan_exit_and_skip_are_decided_at_the_sync_point(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("HLAT_FAULT_NAN_AT_STEP", "3")
    changes = {"training.max_steps": 8, "training.log_every": 4, "training.checkpoint_every": 4}
    trainer = build(make_run(prepared, tmp_path, "exit", **changes))
    assert trainer.fit() == EXIT_NAN  # found at step 4, the first sync point after the NaN
    assert "loss is nan at step 3" in caplog.text
    assert CheckpointManager(Storage(str(tmp_path / "exit" / "checkpoints")), keep_last=1).latest_step() is None

    skip = make_run(prepared, tmp_path, "skip", **changes, **{"training.nan_policy": "skip"})
    trainer = build(skip)
    assert trainer.fit() == 0
    weights = trainer.world.to_host(trainer.model.state_dict())
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert "1 step(s) skipped so far" in caplog.text


def test_with_xla_always_allreduce_the_loops_collectives_run_on_device_tensors(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XLA_ALWAYS_ALLREDUCE", "1")  # read at each all-reduce: one process runs the real collective
    run = make_run(
        prepared, tmp_path, "collectives",
        **{"training.max_steps": 6, "training.log_every": 3, "burn_in.health_check_every": 3,
           "burn_in.health_allreduce_mb": 1},
    )  # fmt: skip
    trainer = build(run)
    world: World = trainer.world
    assert world.collective and not torch.distributed.is_initialized()  # no CPU process group is involved
    seen: list[torch.device] = []
    reduce = world.all_reduce

    def recording(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        seen.append(tensor.device)
        return reduce(tensor, op)

    object.__setattr__(world, "all_reduce", recording)  # World is frozen: a test seam, not an API
    before = xla.counters()["all_reduces"]
    assert trainer.fit() == 0
    # loss mean every step (6); health check at 3 and 6 (2 x warm-up, timed runs, verdict). The stop vote is not
    # among them: it is host-side (a gloo group of CPU tensors), and on one process the flag itself.
    assert len(seen) >= 6 + 2 * 3
    assert {d.type for d in seen} == {"xla"}
    assert xla.counters()["all_reduces"] - before >= len(seen)
    xla.wait()
    counts = xla.counters()
    assert world.any_rank(True) and not world.any_rank(False)
    assert world.share_from_main({"step": 6}) == {"step": 6}
    assert xla.counters() == counts  # no graph, execution, transfer or all-reduce on the device


def job(run: Path, env: dict[str, str] | None = None, program: str = "train") -> subprocess.CompletedProcess[str]:
    """A job program (the training's, or `program`) as a job runs it, on XLA:CPU, in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", f"hlat.training.{program}", "--config", str(run / "config.json")],
        cwd=PROJECT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def final_state(run: Path) -> dict[str, Any]:
    manager = CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1)
    step = manager.latest_step()
    assert step is not None
    shared, _ = manager.load(step)
    return {"step": step, "model": shared["model"], "optimizer": shared["optimizer"]["state"]}


def test_killed_and_resumed_on_xla_the_weights_are_bitwise_those_of_an_uninterrupted_run(
    prepared: Path, tmp_path: Path
) -> None:
    changes = {"training.max_steps": 12, "training.checkpoint_every": 4, "training.log_every": 2}
    straight = make_run(prepared, tmp_path, "straight", **changes)
    broken = make_run(prepared, tmp_path, "broken", **changes)
    if SDK.cpu_cache_loads:  # the three jobs start on graphs precompiled once, as trn1 jobs do (and compile less)
        built = job(straight, program="precompile")
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        shutil.copytree(straight / "compile-cache", broken / "compile-cache")
    done = job(straight)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    killed = job(broken, {"HLAT_FAULT_KILL_BEFORE_COMMIT": "8"})  # dies writing step 8's commit marker
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = job(broken)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4" in resumed.stderr + resumed.stdout

    a, b = final_state(straight), final_state(broken)
    assert a["step"] == b["step"] == 12
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for index, state in a["optimizer"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b["optimizer"][index][key]), (index, key)


def test_the_xla_benchmark_runs_and_reports_its_executions_per_quiet_step() -> None:
    from benchmarks.bench_xla import main

    out = main(["--steps", "12", "--log-every", "4"])  # tiny: 2 micro-batches, HLAT's cuts: 3 graphs per step
    xla_row = next(line for line in out.splitlines() if line.startswith("| XLA:CPU"))
    assert [cell.strip() for cell in xla_row.split("|")[2:5]] == ["0", "3", "0"]


def test_the_trn1_precompile_rehearses_the_loop_with_its_health_check_checkpoints_and_validation(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the trn1 precompile job does under neuron_parallel_compile (which exists only on trn1, and sets
    NEURON_EXTRACT_GRAPHS_ONLY): the training loop itself for precompile.steps steps (HLAT: 4, a checkpoint at step
    3), every hook included, writing nothing. Then the same rehearsal without graph extraction compiles no graph the
    extracting one did not: every graph a job's steps, hooks and checkpoints run was traced (XLA:CPU executes the
    graphs, so both runs read valid values here; tests/integration/test_graph_extraction.py gives the loop invalid
    ones). The sequence length is this test's own, so no other test in this process compiled these graphs."""
    from hlat.training import precompile
    from hlat.training.compile_cache import CACHE_DIR, cache_key, key_digest
    from hlat.training.loop import EXTRACT_GRAPHS_ONLY

    run = make_run(prepared, tmp_path, "precompile", **{"burn_in.health_check_every": 50, "training.seq_len": 96})
    cfg = validate_config(Storage(str(run)).read_json("config.json"))
    cache = Storage(str(run / CACHE_DIR))
    monkeypatch.setattr(precompile, "neuron_available", lambda: True)
    with pytest.raises(RuntimeError, match="NEURON_COMPILE_CACHE_URL is not set"):
        precompile._precompile_xla(Run.at(str(run)), cfg, cache)

    calls: list[tuple[str, int]] = []
    for hook in ("health_check", "save_checkpoint", "evaluate"):
        original = getattr(Trainer, hook)

        def spy(self: Trainer, step: int, _name: str = hook, _original: Any = original) -> Any:
            calls.append((_name, step))
            return _original(self, step)

        monkeypatch.setattr(Trainer, hook, spy)
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(run / CACHE_DIR / "neuron"))
    monkeypatch.setenv(EXTRACT_GRAPHS_ONLY, "1")
    before_files = {p.relative_to(run) for p in run.rglob("*") if p.is_file()}
    before = xla.counters()
    assert precompile._precompile_xla(Run.at(str(run)), cfg, cache) == 0
    extracting = {k: v - before[k] for k, v in xla.counters().items()}
    assert calls == [
        ("health_check", 2),
        ("save_checkpoint", 3),
        ("health_check", 4),
        ("evaluate", 4),
        ("save_checkpoint", 4),
    ]
    manifest = cache.read_json("neuron/manifest.json")
    assert manifest["steps"] == 4 and manifest["digest"] == key_digest(cache_key(cfg, 1, "xla"))
    assert cache.read_json("latest.json")["kind"] == "neuron"
    written = sorted(
        str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and p.relative_to(run) not in before_files
    )
    assert written == ["compile-cache/latest.json", "compile-cache/neuron/manifest.json"]  # the manifest alone
    assert extracting["compilations"] > 0

    monkeypatch.delenv(EXTRACT_GRAPHS_ONLY)
    before = xla.counters()
    assert precompile._precompile_xla(Run.at(str(run)), cfg, cache) == 0
    executing = {k: v - before[k] for k, v in xla.counters().items()}
    assert executing["compilations"] == 0, (extracting, executing)  # nothing the extraction missed
    for counter in ("executions", "transfers_to_host", "all_reduces"):  # the same device work, graph for graph
        assert executing[counter] == extracting[counter], (counter, extracting, executing)
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()  # a throwaway trainer


def test_a_job_started_on_the_xla_cpu_precompile_cache_compiles_nothing(prepared: Path, tmp_path: Path) -> None:
    """XLA:CPU with one graph per step (the main suite's XLA DAG test covers HLAT's per-micro-batch cuts):
    precompile rehearses the loop into torch-xla's persistent cache, and a training job with checkpoints, a
    health check and validation passes, started on it, loads every graph and compiles none."""
    run = make_run(
        prepared, tmp_path, "cached", **{
            "training.xla_graph_cuts": "step", "training.max_steps": 8, "training.checkpoint_every": 3,
            "training.eval_every": 4, "training.eval_batches": 2, "burn_in.health_check_every": 5,
        }
    )  # fmt: skip
    done = job(run, program="precompile")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "precompile: 4 steps rehearsed in" in out and "compiled graphs" in out
    latest = Storage(str(run)).read_json("compile-cache/latest.json")
    assert latest["kind"] == "xla" and latest["steps"] == 4
    done = job(run)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 8
    if not SDK.cpu_cache_loads:
        # torch-xla 2.9's CPU client stores graphs but cannot load them back (PJRT's CPU client: "Deserializing
        # serialized executable not supported"): a 2.28 job on XLA:CPU says so in one line and compiles. On trn1 the
        # graphs come from the Neuron compile cache (NEURON_COMPILE_CACHE_URL), which this rehearsal cannot show.
        assert "compile cache: not loaded (torch-xla 2.9's XLA:CPU cannot load cached graphs)" in out, out[-3000:]
        assert "Deserializing" not in out, out[-3000:]
        pytest.skip("torch-xla 2.9's XLA:CPU client cannot deserialize compiled graphs: verified only on trn1")
    assert "compile cache: hit" in out
    loaded = re.search(r"xla: this job compiled (\d+) graph\(s\) and loaded (\d+)", out)
    assert loaded is not None, out[-3000:]
    assert loaded.group(1) == "0" and int(loaded.group(2)) > 0, out[-3000:]


def test_the_barrier_on_xla_is_torch_xlas_rendezvous_not_the_process_groups_no_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch-xla's `xla` process group answers barrier() with a finished work object and waits for nothing; the
    job's barrier (the compile-cache copy, the burn-in's clock, the checkpoint commit) must be xm.rendezvous."""
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_backend as backend

    monkeypatch.setenv("XLA_ALWAYS_ALLREDUCE", "1")  # one process takes the multi-process path
    tags: list[str] = []
    real = xm.rendezvous

    def rendezvous(tag: str, payload: bytes = b"", replicas: list[int] | None = None) -> list[bytes]:
        tags.append(tag)
        return real(tag, payload, replicas or [])

    def no_op_barrier(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the process group's barrier was called")

    monkeypatch.setattr(xm, "rendezvous", rendezvous)
    monkeypatch.setattr(backend.ProcessGroupXla, "barrier", no_op_barrier)
    monkeypatch.setattr(torch.distributed, "barrier", no_op_barrier)
    world = init_world("xla")
    assert world.on_xla and world.collective
    world.barrier()
    world.barrier("hlat-neuron-cache")
    assert tags == ["hlat-barrier", "hlat-neuron-cache"]  # and the real rendezvous ran, in one process
    monkeypatch.delenv("XLA_ALWAYS_ALLREDUCE")
    world.barrier()  # one process: nothing to wait for
    assert len(tags) == 2


def test_the_burn_in_timers_run_no_compilation_and_count_the_devices_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile inside a timer makes the burn-in's speeds meaningless (neuronx-cc takes minutes): each timed
    graph is warmed up first. The all-reduce result is checked exactly, whatever the device's float format."""
    from hlat.training.health import allreduce_check, matmul_check

    monkeypatch.setenv("XLA_ALWAYS_ALLREDUCE", "1")  # the collective path, in one process
    world = init_world("xla")
    before = xla.counters()["all_reduces"]
    reduced = allreduce_check(world, 0.25, iters=3)
    assert reduced["correct"] and reduced["timed_compilations"] == 0, reduced
    assert xla.counters()["all_reduces"] - before >= 1 + 1 + 3  # checked, warm-up, timed: real collectives
    assert reduced["mb"] == pytest.approx(0.25, rel=1e-3)
    product = matmul_check(world.device, 64, repeats=3, seed=1, batch=4)
    assert product["timed_compilations"] == 0 and product["rel_error"] < 1e-5, product
    # The cross-rank checksum's product is exact on the device in BF16 too (no rounding for SR to randomise), and
    # its bits are the CPU's.
    bf16 = matmul_check(world.device, 256, repeats=1, dtype=torch.bfloat16, seed=1)
    assert (
        bf16["exact"] and bf16["checksum"] == matmul_check(torch.device("cpu"), 256, 1, torch.bfloat16, 1)["checksum"]
    )
