"""FSDP2 (parallelism.fsdp) on CPU with gloo: two sharded ranks give one rank's step; a job killed while writing a
sharded checkpoint and relaunched ends bitwise equal to one never interrupted; `hlat export` consolidates the shards."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from hlat.core.layout import CheckpointIndex
from hlat.core.presets import load_config
from hlat.core.storage import Storage
from tests.integration.conftest import free_port
from tests.integration.test_distributed import run_layout
from tests.jobs import make_run, metrics

pytestmark = pytest.mark.slow


def test_an_fsdp2_step_on_two_gloo_ranks_equals_the_single_process_step(prepared: Path, tmp_path: Path) -> None:
    results = {}
    for world_size in (1, 2):
        out = tmp_path / f"ws{world_size}.pt"
        args = (world_size, free_port(), str(prepared), str(out), {"parallelism.fsdp": True})
        mp.start_processes(run_layout, args=args, nprocs=world_size, start_method="spawn")
        results[world_size] = torch.load(out, weights_only=True)
    one, two = results[1], results[2]
    assert not one["sharded"] and two["sharded"]  # one process has nothing to shard over; two hold DTensor shards
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-5)
    for name, tensor in one["model"].items():
        # Reduce-scatter vs one rank's accumulation: summation order differs, then Adam divides by sqrt(v).
        torch.testing.assert_close(two["model"][name], tensor, rtol=1e-5, atol=3e-6, msg=name)


# -- a sharded job, killed and relaunched ---------------------------------------------------------------------
# The hlat-7b model's shape (LLaMA-7B: SwiGLU at 8/3 d, 32 heads of 128... here 4 heads of 32), scaled down.
SEVEN_B_SHAPE = {
    "model.n_layers": 3,
    "model.d_model": 128,
    "model.n_heads": 4,
    "model.ffn_hidden": 344,
    "model.max_seq_len": 256,
}
RUN = {
    "max_steps": 12,
    "checkpoint_every": 4,
    "keep_checkpoints": 2,
    "eval_every": 6,  # the held-out loss runs through the sharded model on every rank
    "warmup_steps": 3,
    "global_batch_size": 8,
    "micro_batch_size": 2,
    "parallelism.fsdp": True,
    "job.processes_per_node": 2,
    **SEVEN_B_SHAPE,
}


def torchrun(run: Path, env: dict[str, str] | None = None, timeout: float = 600) -> tuple[int, str]:
    """The training program on two ranks, as a job's torchrun starts it."""
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(port), "-m", "hlat.training.train", "--config", str(run / "config.json"),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return proc.returncode, out


def consolidated(run: Path) -> dict[str, Any]:
    from hlat.training.checkpoint import CheckpointManager

    manager = CheckpointManager(Storage(str(run / "checkpoints")), keep_last=1)
    step = manager.latest_step()
    assert step is not None
    state: dict[str, Any] = manager.load_distributed_full(step)
    return state


def test_a_sharded_job_killed_mid_checkpoint_resumes_bitwise_and_exports(prepared: Path, tmp_path: Path) -> None:
    reference = make_run(prepared, tmp_path, "uninterrupted", **RUN)
    code, out = torchrun(reference)
    assert code == 0, out[-3000:]
    step_12 = reference / "checkpoints" / "step-000000012"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rank-00000.pt", "rank-00001.pt"} <= set(os.listdir(step_12))
    meta = CheckpointIndex(Storage(str(reference / "checkpoints"))).read_meta(12)
    assert meta["distributed"] is True
    # The commit records DCP's .metadata sha256 (issue 51: loads check it before parsing the pickle).
    metadata = reference / "checkpoints" / "step-000000012" / ".metadata"
    assert meta["files"][".metadata"]["sha256"] == hashlib.sha256(metadata.read_bytes()).hexdigest()

    chaos = make_run(prepared, tmp_path, "chaos", **RUN)
    # Rank 0 dies after step 8's files (both ranks' shards included), before its commit marker.
    code, out = torchrun(chaos, {"HLAT_FAULT_KILL_BEFORE_COMMIT": "8"})
    assert code != 0, out[-3000:]
    assert not (chaos / "checkpoints/step-000000008/COMMITTED").exists()
    assert (chaos / "checkpoints/step-000000008/.metadata").exists()  # the torn checkpoint's shards are there
    code, out = torchrun(chaos)
    assert code == 0, out[-3000:]
    assert "resumed from step 4" in out

    def history(run: Path) -> list[tuple[int, float, int]]:
        return [(r["step"], r["loss"], r["samples_crc32"]) for r in metrics(run) if "samples_crc32" in r]

    assert history(chaos) == history(reference)
    ours, theirs = consolidated(chaos), consolidated(reference)
    assert ours["model"].keys() == theirs["model"].keys() and ours["optimizer"].keys() == theirs["optimizer"].keys()
    for name in theirs["model"]:
        assert torch.equal(ours["model"][name], theirs["model"][name]), name

    # Export: the shards gathered into a Hugging Face Llama folder that transformers loads.
    from transformers import LlamaForCausalLM

    from hlat.infra.inputs.tokenizer import export_hf_tokenizer
    from hlat.training.checkpoint.hf_export import export_checkpoint, to_hf_state_dict

    out_dir, ref = export_checkpoint(str(chaos), tmp_path / "hf", build_tokenizer_json=export_hf_tokenizer)
    assert ref.step == 12
    hf = LlamaForCausalLM.from_pretrained(out_dir)
    expected = to_hf_state_dict_of(theirs["model"], chaos, to_hf_state_dict)
    for name, tensor in hf.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)

    # Issue 51: a .metadata planted in a committed checkpoint (a pickle whose loading would create a file) is refused
    # by `hlat export` and `hlat average` as a user runs them, in one line naming the file; the payload never runs.
    import pickle

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (open, (str(marker), "w"))

    size = metadata.stat().st_size  # the same size, so that the checkpoint still looks complete (pickle stops early)
    planted = pickle.dumps(Payload())
    metadata.write_bytes(planted + b"\0" * (size - len(planted)))
    hlat = [sys.executable, "-m", "hlat.cli"]
    for command in (
        ["export", str(reference), str(tmp_path / "hf-planted")],
        ["average", str(reference), "--last", "2"],
    ):
        done = subprocess.run([*hlat, *command], capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode != 0, command
        (error,) = [line for line in done.stderr.splitlines() if line.startswith("hlat: error:")]
        assert "step-000000012/.metadata" in error and "sha256" in error and "Traceback" not in done.stderr, error
        assert not marker.exists()


def to_hf_state_dict_of(model_state: dict[str, torch.Tensor], run: Path, convert: Any) -> dict[str, torch.Tensor]:
    """Our dense state dict in Hugging Face's names, through a model of the run's config."""
    from hlat.core.config import validate_config
    from hlat.training.model import Transformer

    config = validate_config(Storage(str(run)).read_json("config.json"))
    model = Transformer(config.model, device="cpu")
    model.load_state_dict(model_state)
    converted: dict[str, torch.Tensor] = convert(model)
    return converted


def test_fsdp_refuses_what_it_cannot_combine_with() -> None:
    from hlat.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"parallelism\.fsdp does not combine with parallelism\.zero1"):
        load_config("tiny", {"parallelism.fsdp": True, "parallelism.zero1": True})
    with pytest.raises(ConfigError, match=r"use precision\.mode=bf16-mixed"):
        load_config("tiny", {"parallelism.fsdp": True, "precision.mode": "bf16-sr"})
