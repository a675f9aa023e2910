"""The benchmarks keep running (small sizes) and their peers agree with the real code on results."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_prepare_data_benchmark_runs_and_agrees_with_its_peer() -> None:
    from benchmarks.bench_prepare_data import main

    out = main(["--documents", "120", "--repeats", "1"])  # asserts that both keep the same rows
    assert "plain Python peer" in out and "| 120  |" in out


def test_tokenizer_benchmark_runs_with_identical_ids() -> None:
    from benchmarks.bench_tokenizer import main

    out = main(["--vocab", "1000", "--sample-mb", "0.5", "--encode-mb", "0.1", "--repeats", "1"])
    assert "HF fast tokenizer" in out


def test_training_step_benchmark_runs() -> None:
    from benchmarks.bench_train import main

    out = main(["--batch", "2", "--seq", "32", "--steps", "1", "--repeats", "1"])
    assert all(name in out for name in ("hlat eager", "hlat compiled", "hlat compiled (doc-masked)", "HF eager"))


def test_precompile_benchmark_runs_cold_and_warm() -> None:
    from benchmarks.bench_precompile import main

    out = main(["--repeats", "1", "--no-artifacts-row"])  # asserts the warm start used the cache, kernels included
    assert "cold: nothing cached" in out and "warm: artifacts and Inductor cache" in out


def test_evaluate_benchmark_runs_with_the_same_nll_as_its_peer() -> None:
    from benchmarks.bench_evaluate import main

    args = ["--kb", "40", "--vocab", "512", "--layers", "2", "--d-model", "128", "--seq-len", "64", "--batch", "4"]
    out = main([*args, "--repeats", "1", "--harness-limit", "5", "--threads", "1"])  # asserts the NLLs agree
    assert "hlat score_stream" in out and "HF LlamaForCausalLM loop" in out and "limit 5 | " in out


def test_checkpoint_benchmark_runs_and_loads_back_what_its_peer_saved() -> None:
    from benchmarks.bench_checkpoint import main

    args = ["--layers", "1", "--d-model", "64", "--heads", "2", "--ffn", "128", "--vocab", "512"]
    out = main([*args, "--batch", "2", "--seq", "16", "--repeats", "1"])  # asserts the checkpoint equals the peer's
    assert "plain write of the tensor bytes + fsync (peer)" in out and "CheckpointManager, sync " in out
    assert "async: loop blocked, later saves" in out


def test_import_benchmark_runs_and_its_dense_import_holds_the_peers_weights() -> None:
    from benchmarks.bench_import import main

    args = ["--layers", "2", "--d-model", "128", "--heads", "4", "--ffn", "256", "--vocab", "1000"]
    out = main([*args, "--shard-mb", "0.3", "--tp", "2", "--pp", "2"])  # asserts the dense import equals the peer
    assert "dense (1 x 1)" in out and "tp1 pp1 of 2 x 2" in out and "load_file into the dense parameters (peer)" in out
