"""The compile cache's key, its statuses (hit, stale, corrupt, missing, off) and the node-local Neuron cache copy."""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from infra.storage import Storage
from training.compile_cache import (
    ARTIFACTS_FILE,
    CACHE_DIR,
    LATEST_FILE,
    MANIFEST_FILE,
    cache_key,
    key_differences,
    key_digest,
    load_torch_cache,
    localize_neuron_cache,
    torch_cache_dir,
    use_node_local_neuron_cache,
    write_torch_cache,
)
from training.config import HlatConfig
from training.distributed import World
from training.presets import load_config

ARTIFACTS = b"compiled graphs" * 100


def config(**overrides: Any) -> HlatConfig:
    return load_config("tiny", {"training.compile": True, **overrides})


def key_of(cfg: HlatConfig, world_size: int = 1, device_type: str = "cpu") -> dict[str, Any]:
    return cache_key(cfg, world_size, device_type)


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Bytes handed to torch.compiler.load_cache_artifacts (a stand-in that accepts them)."""
    calls: list[bytes] = []

    def load(data: bytes) -> SimpleNamespace:
        calls.append(data)
        return SimpleNamespace(artifacts={"inductor": ["a", "b"], "aot_autograd": ["c"]})

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    return calls


def write(run: Storage, cfg: HlatConfig, data: bytes | None = ARTIFACTS) -> dict[str, Any]:
    return write_torch_cache(run.child(CACHE_DIR), key_of(cfg), data, steps=2, seconds=1.5)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"model.n_layers": 3}, "model.n_layers"),
        ({"model.d_model": 256}, "model.d_model"),
        ({"model.n_kv_heads": 2}, "model.n_kv_heads"),
        ({"model.vocab_size": 4096}, "model.vocab_size"),
        ({"model.rotary_fraction": 0.5}, "model.rotary_fraction"),
        ({"training.seq_len": 64}, "training.seq_len"),
        ({"training.micro_batch_size": 2}, "training.micro_batch_size"),
        ({"training.global_batch_size": 16}, "gradient_accumulation"),
        ({"training.compile": False}, "training.compile"),
        ({"training.document_masking": True}, "training.document_masking"),
        ({"parallelism.activation_checkpointing": "selective"}, "parallelism.activation_checkpointing"),
        ({"precision.mode": "bf16-mixed"}, "precision.mode"),
    ],
)
def test_the_digest_changes_with_every_config_field_that_changes_the_graphs(
    override: dict[str, Any], field: str
) -> None:
    base, changed = key_of(config()), key_of(config(**override))
    assert key_digest(base) != key_digest(changed)
    assert field in [d.split(" ")[0] for d in key_differences(base, changed)]


def test_the_digest_changes_with_the_job_and_the_software(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config()
    base = key_of(cfg)
    assert key_differences(base, key_of(cfg, world_size=2)) == ["world_size 1 -> 2"]
    assert "device_type cpu -> cuda" in key_differences(base, key_of(cfg, device_type="cuda"))
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    assert key_differences(base, key_of(cfg)) == [f"torch {base['torch']} -> 2.14.0"]
    monkeypatch.setattr(platform, "python_version", lambda: "3.10.14")
    assert f"python {base['python']} -> 3.10.14" in key_differences(base, key_of(cfg))
    xla = key_of(cfg, device_type="xla")
    assert xla["NEURON_CC_FLAGS"] == os.environ.get("NEURON_CC_FLAGS", "")  # versions only where installed


@pytest.mark.parametrize(
    "override",
    [
        {"training.lr": 1e-3},
        {"training.max_steps": 7},
        {"training.seed": 1},
        {"training.checkpoint_every": 3},
        {"training.eval_every": 5},
        {"evaluation.limit": 3},
        {"data.max_documents": 10},
        {"precompile.steps": 5},
        {"job.max_restarts": 2},
    ],
)
def test_the_digest_ignores_what_does_not_change_the_graphs(override: dict[str, Any]) -> None:
    assert key_digest(key_of(config(**override))) == key_digest(key_of(config()))


def test_write_lays_out_artifacts_manifest_and_latest(tmp_path: Path) -> None:
    run = Storage(str(tmp_path))
    manifest = write(run, config())
    digest = key_digest(key_of(config()))
    folder = tmp_path / CACHE_DIR / torch_cache_dir(digest)
    assert (folder / ARTIFACTS_FILE).read_bytes() == ARTIFACTS
    assert json.loads((folder / MANIFEST_FILE).read_text()) == manifest
    assert (manifest["digest"], manifest["size"], manifest["steps"], manifest["nothing_to_compile"]) == (
        digest,
        len(ARTIFACTS),
        2,
        False,
    )
    latest = json.loads((tmp_path / CACHE_DIR / LATEST_FILE).read_text())
    assert latest["digest"] == digest and latest["manifest"] == f"torch/{digest}/{MANIFEST_FILE}"


def test_a_matching_cache_is_a_hit_and_loaded(
    tmp_path: Path, loaded: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    run, cfg = Storage(str(tmp_path)), config()
    write(run, cfg)
    with caplog.at_level(logging.INFO, logger="hlat.train"):
        status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "hit" and loaded == [ARTIFACTS]
    assert status.metrics()["compile_cache"] == "hit" and status.metrics()["compile_cache_bytes"] == len(ARTIFACTS)
    assert "compile cache: hit, loaded 1.5 kB of torch.compile artifacts (1 aot_autograd, 2 inductor)" in caplog.text


def test_a_cache_built_for_another_config_is_stale_and_names_the_fields(
    tmp_path: Path, loaded: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    run = Storage(str(tmp_path))
    write(run, config())
    with caplog.at_level(logging.INFO, logger="hlat.train"):
        status = load_torch_cache(run, config(**{"training.seq_len": 64, "model.n_layers": 3}), 1, "cpu")
    assert status.status == "stale" and loaded == []
    assert status.differences == ["model.n_layers 2 -> 3", "training.seq_len 128 -> 64"]
    assert status.metrics()["compile_cache_stale"] == "model.n_layers 2 -> 3, training.seq_len 128 -> 64"
    assert "compile cache: stale" in caplog.text and "training.seq_len 128 -> 64" in caplog.text
    assert caplog.records[-1].levelno == logging.WARNING


def test_an_edited_manifest_key_is_stale(tmp_path: Path, loaded: list[bytes]) -> None:
    run, cfg = Storage(str(tmp_path)), config()
    manifest = write(run, cfg)
    path = tmp_path / CACHE_DIR / torch_cache_dir(manifest["digest"]) / MANIFEST_FILE
    edited = {**manifest, "key": {**manifest["key"], "torch": "2.12.0"}}
    path.write_text(json.dumps(edited))
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "stale" and loaded == []
    assert status.differences == [f"torch 2.12.0 -> {torch.__version__}"]


def test_a_nothing_to_compile_manifest_is_stale_once_compile_is_turned_on(tmp_path: Path) -> None:
    run = Storage(str(tmp_path))
    write(run, config(**{"training.compile": False}), data=None)
    assert not list((tmp_path / CACHE_DIR).rglob(ARTIFACTS_FILE))
    status = load_torch_cache(run, config(), 1, "cpu")
    assert (status.status, status.differences) == ("stale", ["training.compile false -> true"])


def test_bytes_that_do_not_match_their_manifest_are_corrupt(tmp_path: Path, loaded: list[bytes]) -> None:
    run, cfg = Storage(str(tmp_path)), config()
    manifest = write(run, cfg)
    artifacts = tmp_path / CACHE_DIR / torch_cache_dir(manifest["digest"]) / ARTIFACTS_FILE
    artifacts.write_bytes(b"X" + ARTIFACTS[1:])
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "corrupt" and "sha256" in status.message and loaded == []
    artifacts.unlink()
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "corrupt" and "is missing" in status.message
    (artifacts.parent / MANIFEST_FILE).write_text('{"key": ')  # a torn manifest
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "corrupt" and "unreadable JSON" in status.message


def test_bytes_torch_cannot_read_are_corrupt(tmp_path: Path) -> None:
    run, cfg = Storage(str(tmp_path)), config()
    write(run, cfg, data=b"not torch.compile artifacts")  # the sha256 matches; torch's deserializer refuses them
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "corrupt" and "not loaded" in status.message


def test_missing_and_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = Storage(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="hlat.train"):
        assert load_torch_cache(run, config(), 1, "cpu").status == "missing"
        off = load_torch_cache(run, config(**{"training.compile": False}), 1, "cpu")
    assert off.status == "off" and off.metrics() == {"compile_cache": "off"}
    assert "compile cache: missing" in caplog.text and "compile cache: off" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hlat.train"):
        load_torch_cache(run, config(), 1, "cpu", log_status=False)  # ranks other than 0 stay quiet
    assert caplog.text == ""


def test_localize_copies_the_folder_tree_and_then_only_what_changed(tmp_path: Path) -> None:
    shared = tmp_path / "shared" / "compile-cache" / "neuron"
    files = {
        "manifest.json": b"{}",
        "neuronxcc-2.15/MODULE_1/model.neff": b"neff" * 1000,
        "neuronxcc-2.15/MODULE_1/model.hlo_module.pb": b"hlo",
        "neuronxcc-2.15/MODULE_2/model.neff": b"other",
    }
    for rel, data in files.items():
        (shared / rel).parent.mkdir(parents=True, exist_ok=True)
        (shared / rel).write_bytes(data)
    local = tmp_path / "local"
    assert localize_neuron_cache(str(shared), str(local)) == str(local)
    copied = {str(p.relative_to(local)): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    assert copied == files
    (shared / "neuronxcc-2.15/MODULE_2/model.neff").write_bytes(b"recompiled")
    kept = local / "neuronxcc-2.15/MODULE_1/model.neff"
    os.utime(kept, (0, 0))
    localize_neuron_cache(str(shared), str(local))
    assert (local / "neuronxcc-2.15/MODULE_2/model.neff").read_bytes() == b"recompiled"
    assert kept.stat().st_mtime == 0  # same size: not copied again
    assert not [p for p in local.rglob("*.tmp-*")]


def test_each_node_points_the_neuron_compiler_at_its_local_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    (shared / "graphs").mkdir(parents=True)
    (shared / "graphs" / "model.neff").write_bytes(b"neff")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(shared))
    monkeypatch.setenv("HLAT_LOCAL_NEURON_CACHE", str(tmp_path / "node"))
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    assert use_node_local_neuron_cache(world) == str(tmp_path / "node")
    assert os.environ["NEURON_COMPILE_CACHE_URL"] == str(tmp_path / "node")
    assert (tmp_path / "node" / "graphs" / "model.neff").read_bytes() == b"neff"
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL")
    assert use_node_local_neuron_cache(world) is None
