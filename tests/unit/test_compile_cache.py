"""The compile cache's key, its statuses (hit, stale, corrupt, missing, off), the Inductor cache tarball, torch-xla's
persistent cache of the XLA:CPU rehearsal and the node-local Neuron cache copy."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hlat.core.config import HlatConfig
from hlat.core.layout import MANIFEST_FILE
from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training.compile_cache import (
    ARTIFACTS_FILE,
    CACHE_DIR,
    INDUCTOR_CACHE_ENV,
    KERNELS_FILE,
    LATEST_FILE,
    NeuronGraphSharing,
    NodeLocalCache,
    _put_if_absent,
    cache_key,
    fetch_xla_cache,
    human_bytes,
    key_differences,
    key_digest,
    load_torch_cache,
    localize_neuron_cache,
    node_local_neuron_cache_dir,
    pack_cache_folder,
    sync_new_neuron_graphs,
    torch_cache_dir,
    unpack_cache_folder,
    use_node_local_neuron_cache,
    write_torch_cache,
    write_xla_cache,
    xla_cache_dir,
)
from tests.integration.conftest import S3Env, s3_env, s3_server  # noqa: F401 (fixtures: a moto S3 server)

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


def write(
    run: Run, cfg: HlatConfig, data: bytes | None = ARTIFACTS, inductor_dir: Path | None = None
) -> dict[str, Any]:
    inductor = None if inductor_dir is None else str(inductor_dir)
    return write_torch_cache(
        run.storage.child(CACHE_DIR), key_of(cfg), data, steps=2, seconds=1.5, inductor_dir=inductor
    )


KERNELS = {  # an Inductor disk cache as a CPU compile leaves it
    "fxgraph/ab/fabc/entry": b"graph" * 50,
    "aotautograd/aqd/entry": b"joint graph",
    "ab/cabc.main.cpp": b'extern "C" void kernel() {}',
    "ab/cabc.main.so": b"\x7fELF" + bytes(range(256)) * 4,
    "zz/czz.py": b"def call(args): ...",
}


@pytest.fixture
def inductor_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "inductor"
    for rel, data in KERNELS.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    (folder / "locks").mkdir()
    (folder / "locks" / "cabc.lock").write_bytes(b"")
    (folder / "ab" / "link.so").symlink_to(folder / "ab" / "cabc.main.so")
    return folder


@pytest.fixture
def inductor_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The Inductor cache folder the job was given (restored after the test: loading a tarball replaces it)."""
    given = tmp_path / "given-inductor-cache"
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(given))
    return given


def files_under(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def extracted_folders() -> set[Path]:
    """This process's folders of extracted Inductor caches."""
    return set(Path(tempfile.gettempdir()).glob(f"hlat-inductor-{os.getpid()}-*"))


def tarball_of(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for info, data in members:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buffer.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


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
    monkeypatch.setenv("NEURON_CC_FLAGS", "--from-the-shell")  # the key is the config's, not this process's
    xla = key_of(cfg, device_type="xla")  # tiny: XLA:CPU (versions of the Neuron packages only where installed)
    assert xla["PJRT_DEVICE"] == "CPU" and "XLA_USE_BF16" not in xla  # the default SDK, 2.28.0, has no flags
    xla = key_of(config(**{"neuron.sdk": "2.24.1"}), device_type="xla")  # 2.24.1 has them
    assert {k: xla[k] for k in ("PJRT_DEVICE", "XLA_USE_BF16", "XLA_DOWNCAST_BF16")} == {
        "PJRT_DEVICE": "CPU",
        "XLA_USE_BF16": "0",
        "XLA_DOWNCAST_BF16": "0",
    }
    assert "NEURON_CC_FLAGS" not in xla and "PJRT_DEVICE" not in key_of(cfg)


def trn1(**overrides: Any) -> HlatConfig:
    """tiny with trn1's Neuron environment (its jobs' instance type)."""
    return config(**{"job.instance_type": "ml.trn1.32xlarge", **overrides})


def flat(key: dict[str, Any]) -> bool:
    return all(isinstance(v, str | int | float | bool | None) for v in key.values())


def test_on_trn1_the_key_holds_the_neuron_environment_the_config_gives_the_job() -> None:
    key = key_of(trn1(), device_type="xla")
    # fp32 here: neuronx-cc would cast its matmuls to BF16 without --auto-cast=none.
    assert key["NEURON_CC_FLAGS"] == "--model-type transformer --distribution-strategy=llm-training --auto-cast=none"
    assert key["NEURON_FUSE_SOFTMAX"] == "1" and "XLA_USE_BF16" not in key  # 2.28.0 (the default): no flags
    # Runtime, network and host settings do not change a graph; neither does where the cache lives.
    assert not [k for k in key if k.startswith(("NEURON_RT_", "FI_", "MALLOC_", "TORCH_DIST", "NEURON_COMPILE"))]
    assert flat(key)  # still {dotted name: plain value}


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"neuron.compiler_flags": "--model-type transformer -O1"}, "NEURON_CC_FLAGS"),
        ({"neuron.compress_rg": True}, "NEURON_EXPERIMENTAL_COMPRESS_RG"),
        ({"neuron.fuse_softmax": False}, "NEURON_FUSE_SOFTMAX"),
        ({"neuron.env.NEURON_CC_FLAGS": "--model-type transformer"}, "NEURON_CC_FLAGS"),
        ({"neuron.env.XLA_IR_DEBUG": 1}, "XLA_IR_DEBUG"),
        ({"precision.mode": "bf16-sr"}, "NEURON_CC_FLAGS"),  # 2.28: FP32 accumulation instead of --auto-cast=none
        ({"precision.mode": "bf16-sr", "neuron.sdk": "2.24.1"}, "XLA_USE_BF16"),
    ],
)
def test_a_changed_neuron_setting_that_shapes_the_graphs_makes_the_cache_stale(
    tmp_path: Path, loaded: list[bytes], override: dict[str, Any], field: str
) -> None:
    run = Run.at(str(tmp_path))
    write_torch_cache(run.storage.child(CACHE_DIR), key_of(trn1(), device_type="xla"), ARTIFACTS, steps=2, seconds=1.0)
    status = load_torch_cache(run, trn1(**override), 1, "xla")
    assert status.status == "stale" and loaded == []
    assert field in [d.split(" ")[0] for d in status.differences]


@pytest.mark.parametrize(
    "override",
    [
        {"neuron.exec_timeout": 9000},
        {"neuron.async_inflight_requests": 31},
        {"neuron.malloc_arena_max": None},
        {"neuron.dist_init_barrier": False},
        {"neuron.efa": False},
        {"neuron.env.NEURON_RT_LOG_LEVEL": "INFO"},
    ],
)
def test_runtime_only_neuron_settings_keep_the_cache(override: dict[str, Any]) -> None:
    assert key_digest(key_of(trn1(**override), device_type="xla")) == key_digest(key_of(trn1(), device_type="xla"))


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
    run = Run.at(str(tmp_path))
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
    run, cfg = Run.at(str(tmp_path)), config()
    write(run, cfg)
    with caplog.at_level(logging.INFO, logger="hlat.train"):
        status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "hit" and loaded == [ARTIFACTS]
    assert status.metrics()["compile_cache"] == "hit" and status.metrics()["compile_cache_bytes"] == len(ARTIFACTS)
    assert "compile cache: hit, loaded 1.5 kB of torch.compile artifacts (1 aot_autograd, 2 inductor)" in caplog.text


def test_a_cache_built_for_another_config_is_stale_and_names_the_fields(
    tmp_path: Path, loaded: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    run = Run.at(str(tmp_path))
    write(run, config())
    with caplog.at_level(logging.INFO, logger="hlat.train"):
        status = load_torch_cache(run, config(**{"training.seq_len": 64, "model.n_layers": 3}), 1, "cpu")
    assert status.status == "stale" and loaded == []
    assert status.differences == ["model.n_layers 2 -> 3", "training.seq_len 128 -> 64"]
    assert status.metrics()["compile_cache_stale"] == "model.n_layers 2 -> 3, training.seq_len 128 -> 64"
    assert "compile cache: stale" in caplog.text and "training.seq_len 128 -> 64" in caplog.text
    assert caplog.records[-1].levelno == logging.WARNING


def test_an_edited_manifest_key_is_stale(tmp_path: Path, loaded: list[bytes]) -> None:
    run, cfg = Run.at(str(tmp_path)), config()
    manifest = write(run, cfg)
    path = tmp_path / CACHE_DIR / torch_cache_dir(manifest["digest"]) / MANIFEST_FILE
    edited = {**manifest, "key": {**manifest["key"], "torch": "2.12.0"}}
    path.write_text(json.dumps(edited))
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "stale" and loaded == []
    assert status.differences == [f"torch 2.12.0 -> {torch.__version__}"]


def test_a_nothing_to_compile_manifest_is_stale_once_compile_is_turned_on(tmp_path: Path) -> None:
    run = Run.at(str(tmp_path))
    write(run, config(**{"training.compile": False}), data=None)
    assert not list((tmp_path / CACHE_DIR).rglob(ARTIFACTS_FILE))
    status = load_torch_cache(run, config(), 1, "cpu")
    assert (status.status, status.differences) == ("stale", ["training.compile false -> true"])


def test_bytes_that_do_not_match_their_manifest_are_corrupt(tmp_path: Path, loaded: list[bytes]) -> None:
    run, cfg = Run.at(str(tmp_path)), config()
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
    run, cfg = Run.at(str(tmp_path)), config()
    write(run, cfg, data=b"not torch.compile artifacts")  # the sha256 matches; torch's deserializer refuses them
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "corrupt" and "not loaded" in status.message


def test_missing_and_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = Run.at(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="hlat.train"):
        assert load_torch_cache(run, config(), 1, "cpu").status == "missing"
        off = load_torch_cache(run, config(**{"training.compile": False}), 1, "cpu")
    assert off.status == "off" and off.metrics() == {"compile_cache": "off"}
    assert "compile cache: missing" in caplog.text and "compile cache: off" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hlat.train"):
        load_torch_cache(run, config(), 1, "cpu", log_status=False)  # ranks other than 0 stay quiet
    assert caplog.text == ""


def test_the_inductor_cache_packs_its_files_in_path_order_and_extracts_to_the_same_files(
    tmp_path: Path, inductor_dir: Path
) -> None:
    tarball = tmp_path / KERNELS_FILE
    assert pack_cache_folder(str(inductor_dir), str(tarball)) == len(KERNELS)
    with tarfile.open(tarball) as tar:
        names = tar.getnames()
        assert {(m.uid, m.gid, m.uname, m.gname) for m in tar.getmembers()} == {(0, 0, "", "")}
    assert names == sorted(KERNELS)  # no lock files, no links
    assert unpack_cache_folder(str(tarball), str(tmp_path / "out")) == len(KERNELS)
    assert files_under(tmp_path / "out") == KERNELS
    assert os.access(tmp_path / "out" / "ab" / "cabc.main.so", os.R_OK)
    empty = tmp_path / "empty"
    (empty / "locks").mkdir(parents=True)
    assert pack_cache_folder(str(empty), str(tmp_path / "none.tar.gz")) == 0
    assert not (tmp_path / "none.tar.gz").exists()


@pytest.mark.parametrize(
    "unsafe",
    [
        member("../outside.so"),
        member("fxgraph/../../outside.so"),
        member("/tmp/absolute.so"),
        member("ab/link.so", tarfile.SYMTYPE, "/etc/passwd"),
        member("ab/hard.so", tarfile.LNKTYPE, "../../outside.so"),
        member("ab/device", tarfile.CHRTYPE),
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "symlink", "hardlink", "device"],
)
def test_unpacking_refuses_members_that_are_not_plain_files_below_the_folder(
    tmp_path: Path, unsafe: tarfile.TarInfo
) -> None:
    tarball = tmp_path / "kernels" / KERNELS_FILE
    tarball.parent.mkdir()
    tarball.write_bytes(tarball_of([(member("ab/cabc.main.so"), b"so"), (unsafe, b"evil")]))
    with pytest.raises(ValueError, match="unsafe member"):
        unpack_cache_folder(str(tarball), str(tmp_path / "out" / "inductor"))
    assert files_under(tmp_path) == {"kernels/" + KERNELS_FILE: tarball.read_bytes()}  # nothing extracted


def test_write_packs_the_inductor_cache_next_to_the_artifacts(tmp_path: Path, inductor_dir: Path) -> None:
    run = Run.at(str(tmp_path))
    manifest = write(run, config(), inductor_dir=inductor_dir)
    tarball = (tmp_path / CACHE_DIR / torch_cache_dir(manifest["digest"]) / KERNELS_FILE).read_bytes()
    assert manifest["inductor_files"] == len(KERNELS)
    assert (
        manifest["inductor_bytes"] == len(tarball)
        and manifest["inductor_sha256"] == hashlib.sha256(tarball).hexdigest()
    )
    assert json.loads((tmp_path / CACHE_DIR / LATEST_FILE).read_text())["inductor_bytes"] == len(tarball)
    (tmp_path / "nothing").mkdir()
    manifest = write(Run.at(str(tmp_path / "other")), config(), inductor_dir=tmp_path / "nothing")
    assert (manifest["inductor_files"], manifest["inductor_bytes"], manifest["inductor_sha256"]) == (0, 0, None)
    assert not (tmp_path / "other" / CACHE_DIR / torch_cache_dir(manifest["digest"]) / KERNELS_FILE).exists()


def test_a_hit_extracts_the_kernels_into_a_fresh_folder_before_loading_the_artifacts(
    tmp_path: Path, inductor_dir: Path, inductor_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, cfg = Run.at(str(tmp_path)), config()
    manifest = write(run, cfg, inductor_dir=inductor_dir)
    seen: list[str] = []

    def load(data: bytes) -> SimpleNamespace:
        seen.append(os.environ[INDUCTOR_CACHE_ENV])  # torch writes what it loads into the folder of the moment
        return SimpleNamespace(artifacts={"inductor": ["a"]})

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "hit" and status.kernels_dir is not None
    assert seen == [status.kernels_dir] == [os.environ[INDUCTOR_CACHE_ENV]] and status.kernels_dir != str(inductor_env)
    assert files_under(Path(status.kernels_dir)) == KERNELS
    assert status.metrics()["compile_cache_kernels_bytes"] == manifest["inductor_bytes"]
    assert (
        f"loaded 1.5 kB of torch.compile artifacts (1 inductor) and {human_bytes(manifest['inductor_bytes'])} of "
        f"Inductor cache ({len(KERNELS)} files, compiled kernels included) into {status.kernels_dir}"
    ) in status.message
    again = load_torch_cache(run, cfg, 1, "cpu")  # another rank of the node: a copy of its own
    assert again.kernels_dir not in (None, status.kernels_dir)


def test_a_cache_without_kernels_loads_the_artifacts_alone(
    tmp_path: Path, loaded: list[bytes], inductor_env: Path
) -> None:
    run, cfg = Run.at(str(tmp_path)), config()
    (tmp_path / "nothing").mkdir()
    write(run, cfg, inductor_dir=tmp_path / "nothing")
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "hit" and loaded == [ARTIFACTS] and status.kernels_dir is None
    assert "compile_cache_kernels_bytes" not in status.metrics()
    assert os.environ[INDUCTOR_CACHE_ENV] == str(inductor_env)


def test_a_kernels_tarball_that_does_not_match_its_manifest_is_corrupt_and_nothing_is_loaded(
    tmp_path: Path, inductor_dir: Path, loaded: list[bytes], inductor_env: Path
) -> None:
    run, cfg = Run.at(str(tmp_path)), config()
    manifest = write(run, cfg, inductor_dir=inductor_dir)
    tarball = tmp_path / CACHE_DIR / torch_cache_dir(manifest["digest"]) / KERNELS_FILE
    data = bytearray(tarball.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tarball.write_bytes(bytes(data))
    before = extracted_folders()
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "corrupt" and KERNELS_FILE in status.message and "sha256" in status.message
    assert extracted_folders() == before  # the fresh folder is gone again
    assert loaded == [] and os.environ[INDUCTOR_CACHE_ENV] == str(inductor_env)
    assert status.metrics() == {"compile_cache": "corrupt"}
    tarball.unlink()
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "corrupt" and "is missing" in status.message and loaded == []


def test_an_unsafe_kernels_tarball_is_corrupt_even_when_its_sha256_matches(
    tmp_path: Path, loaded: list[bytes], inductor_env: Path
) -> None:
    run, cfg = Run.at(str(tmp_path)), config()
    manifest = write(run, cfg)
    folder = tmp_path / CACHE_DIR / torch_cache_dir(manifest["digest"])
    evil = tarball_of([(member("../outside.so"), b"evil")])  # extracted into <tmp>/hlat-inductor-*: <tmp>/outside.so
    (folder / KERNELS_FILE).write_bytes(evil)
    manifest.update(inductor_files=1, inductor_bytes=len(evil), inductor_sha256=hashlib.sha256(evil).hexdigest())
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    before = extracted_folders()
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "corrupt" and "unsafe member '../outside.so'" in status.message
    assert loaded == [] and os.environ[INDUCTOR_CACHE_ENV] == str(inductor_env)
    assert not (Path(tempfile.gettempdir()) / "outside.so").exists() and extracted_folders() == before


def test_artifacts_torch_cannot_read_leave_the_inductor_folder_as_it_was(
    tmp_path: Path, inductor_dir: Path, inductor_env: Path
) -> None:
    run, cfg = Run.at(str(tmp_path)), config()
    write(run, cfg, data=b"not torch.compile artifacts", inductor_dir=inductor_dir)
    before = extracted_folders()
    status = load_torch_cache(run, cfg, 1, "cpu")
    assert status.status == "corrupt" and os.environ[INDUCTOR_CACHE_ENV] == str(inductor_env)
    assert extracted_folders() == before


XLA_GRAPHS = {"155613381744397654026836937588331290869": b"executable" * 300, "7925590052605381958": b"hlo" * 99}


def xla_run(tmp_path: Path, graphs: dict[str, bytes] = XLA_GRAPHS) -> tuple[Run, HlatConfig, dict[str, Any]]:
    """A run whose precompile job left torch-xla's persistent cache (`graphs`) for the tiny preset on XLA."""
    local = tmp_path / "persistent"
    local.mkdir()
    for name, data in graphs.items():
        (local / name).write_bytes(data)
    # 2.24.1: only its torch-xla (2.7) loads cached graphs on XLA:CPU (NeuronSdk.cpu_cache_loads)
    run, cfg = Run.at(str(tmp_path / "run")), load_config("tiny", {"training.device": "xla", "neuron.sdk": "2.24.1"})
    manifest = write_xla_cache(run.storage.child(CACHE_DIR), cache_key(cfg, 1, "xla"), str(local), steps=4, seconds=3.0)
    return run, cfg, manifest


def test_the_xla_persistent_cache_is_packed_under_its_key_and_extracted_whole_for_a_matching_job(
    tmp_path: Path,
) -> None:
    run, cfg, manifest = xla_run(tmp_path)
    assert manifest["kind"] == "xla" and manifest["graphs"] == 2 and manifest["steps"] == 4
    assert (
        run.storage.read_json(f"{CACHE_DIR}/{LATEST_FILE}")["manifest"]
        == f"{xla_cache_dir(manifest['digest'])}/manifest.json"
    )
    found = fetch_xla_cache(run, cfg, world_size=1)
    assert found.status == "hit" and found.kernels_dir is not None
    assert {p.name: p.read_bytes() for p in Path(found.kernels_dir).iterdir()} == XLA_GRAPHS
    assert found.metrics()["compile_cache"] == "hit"


def test_an_xla_cache_for_another_layout_is_stale_and_a_tampered_one_corrupt(tmp_path: Path) -> None:
    run, cfg, manifest = xla_run(tmp_path)
    other = cfg.model_copy(update={"training": cfg.training.model_copy(update={"xla_graph_cuts": "step"})})
    stale = fetch_xla_cache(run, other, world_size=1)
    assert stale.status == "stale" and stale.kernels_dir is None
    assert stale.differences == ["training.xla_graph_cuts micro-batch -> step"]
    tarball = tmp_path / "run" / CACHE_DIR / xla_cache_dir(manifest["digest"]) / "xla-cache.tar.gz"
    tarball.write_bytes(tarball.read_bytes()[:-10])
    corrupt = fetch_xla_cache(run, cfg, world_size=1)
    assert corrupt.status == "corrupt" and "sha256" in corrupt.message and corrupt.kernels_dir is None
    assert fetch_xla_cache(Run.at(str(tmp_path / "none")), cfg, world_size=1).status == "missing"


def test_a_neuron_2_28_job_on_xla_cpu_does_not_load_the_cache_its_torch_xla_cannot_read(tmp_path: Path) -> None:
    """torch-xla 2.9's CPU client cannot deserialize cached graphs: the job says so in one line instead of
    extracting them and logging a warning per graph."""
    run, cfg, _ = xla_run(tmp_path)
    newer = cfg.model_copy(update={"neuron": cfg.neuron.model_copy(update={"sdk": "2.28.0"})})
    found = fetch_xla_cache(run, newer, world_size=1)
    assert found.status == "off" and found.kernels_dir is None
    assert found.message.startswith("compile cache: not loaded (torch-xla 2.9's XLA:CPU cannot load cached graphs)")


def test_an_empty_xla_persistent_cache_is_an_error_not_an_empty_cache(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="compiled nothing"):
        xla_run(tmp_path, graphs={})


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


def neuron_entry(folder: Path, name: str, neff: bytes, done: bool = True) -> dict[str, bytes]:
    """A Neuron persistent-cache entry as the compiler leaves it (model.done only once complete)."""
    files = {"model.hlo_module.pb": b"hlo " + name.encode(), "compile_flags.json": b"[]", "model.neff": neff}
    if done:
        files["model.done"] = b""
    for file, data in files.items():
        path = folder / "neuronxcc-2.23" / name / file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return {f"neuronxcc-2.23/{name}/{file}": data for file, data in files.items()}


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_each_node_copies_the_shared_cache_once_per_job_and_points_the_compiler_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared, node = tmp_path / "shared", tmp_path / "node"
    expected = neuron_entry(shared, "MODULE_a", b"neff a")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(shared))
    monkeypatch.setenv("HLAT_LOCAL_NEURON_CACHE", str(node))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    assert use_node_local_neuron_cache() == NodeLocalCache(shared=str(shared), local=str(node))
    assert os.environ["NEURON_COMPILE_CACHE_URL"] == str(node)
    assert {k: v for k, v in tree(node).items() if not k.startswith(".hlat")} == expected
    # Another local rank of the same job finds the copy made: nothing is copied again.
    neuron_entry(shared, "MODULE_b", b"neff b")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(shared))
    use_node_local_neuron_cache()
    assert not (node / "neuronxcc-2.23" / "MODULE_b").exists()
    # The next job on the same node copies what is new.
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(shared))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
    use_node_local_neuron_cache()
    assert (node / "neuronxcc-2.23" / "MODULE_b" / "model.neff").read_bytes() == b"neff b"
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL")
    assert use_node_local_neuron_cache() is None


LOCAL_RANK = """
import os, sys, time
import hlat.training.compile_cache as compile_cache

copies, gate = sys.argv[1], sys.argv[2]
real = compile_cache.localize_neuron_cache


def counted(url, local_dir, workers=16):
    with open(copies, "a") as f:  # one line per copy made
        f.write(f"{os.getpid()}\\n")
    time.sleep(0.5)  # a copy takes a while: a rank without the lock would start its own meanwhile
    return real(url, local_dir, workers)


compile_cache.localize_neuron_cache = counted
open(os.path.join(gate, str(os.getpid())), "w").close()
while len(os.listdir(gate)) < 4:  # all four imported: they reach the cache together
    time.sleep(0.01)
assert compile_cache.use_node_local_neuron_cache() is not None
"""
"""One local rank of a node: copies the cache as a job's rank does, counting the copies it makes."""


@pytest.mark.slow
def test_without_a_process_group_the_local_ranks_of_a_node_copy_the_cache_once(tmp_path: Path) -> None:
    """Four local ranks start together (processes of one parent, as torchrun starts them): one copies, the others
    wait on the node-local lock and find the copy made."""
    shared, node, copies = tmp_path / "shared", tmp_path / "node", tmp_path / "copies.txt"
    expected = neuron_entry(shared, "MODULE_a", b"neff" * 10_000)
    env = {**os.environ, "NEURON_COMPILE_CACHE_URL": str(shared), "HLAT_LOCAL_NEURON_CACHE": str(node)}
    gate = tmp_path / "gate"
    gate.mkdir()
    command = [sys.executable, "-c", LOCAL_RANK, str(copies), str(gate)]
    ranks = [subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errors = [rank.communicate(timeout=120)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0] * 4, errors
    assert len(copies.read_text().split()) == 1
    assert {k: v for k, v in tree(node).items() if not k.startswith(".hlat")} == expected


def test_the_node_local_cache_is_on_the_instance_storage_in_a_sagemaker_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HLAT_LOCAL_NEURON_CACHE", raising=False)
    monkeypatch.delenv("SM_TRAINING_ENV", raising=False)
    monkeypatch.delenv("SM_CURRENT_HOST", raising=False)
    assert node_local_neuron_cache_dir() == os.path.join(tempfile.gettempdir(), "hlat-neuron-cache")
    monkeypatch.setenv("SM_CURRENT_HOST", "algo-1")
    assert node_local_neuron_cache_dir() == "/opt/ml/input/data/hlat-neuron-cache"  # the NVMe, never uploaded
    monkeypatch.setenv("HLAT_LOCAL_NEURON_CACHE", "/scratch/neuron")
    assert node_local_neuron_cache_dir() == "/scratch/neuron"


def node_with_new_graphs(tmp_path: Path, shared: Storage) -> tuple[NodeLocalCache, dict[str, bytes]]:
    """A node whose copy of `shared` (entry MODULE_a) gained a graph compiled on a miss (MODULE_new), and holds one
    compile cut short (MODULE_cut, no model.done) and the copy's own bookkeeping."""
    node = tmp_path / "node"
    neuron_entry(node, "MODULE_a", b"neff a")
    new = neuron_entry(node, "MODULE_new", b"neff new")
    neuron_entry(node, "MODULE_cut", b"half a ne", done=False)
    (node / ".hlat-localized.json").write_text("{}")
    (node / "neuronxcc-2.23" / "MODULE_new" / "model.neff.lock").write_text("")
    for rel, data in neuron_entry(tmp_path / "first", "MODULE_a", b"neff a").items():
        shared.write_bytes(rel, data)
    return NodeLocalCache(shared=shared.url, local=str(node)), new


def check_sync(tmp_path: Path, shared: Storage) -> None:
    cache, new = node_with_new_graphs(tmp_path, shared)
    before = {rel: shared.read_bytes(rel) for rel in shared.walk_files()}
    assert sync_new_neuron_graphs(cache) == 1
    after = {rel: shared.read_bytes(rel) for rel in shared.walk_files()}
    assert after == {**before, **new}  # the complete new entry only: no lock, no bookkeeping, no cut compile
    assert sync_new_neuron_graphs(cache) == 0  # nothing new the second time
    # Another node compiled the same graph (other bytes): its entry is there already, nothing is overwritten.
    other = tmp_path / "other"
    neuron_entry(other, "MODULE_new", b"neff new, compiled elsewhere")
    assert sync_new_neuron_graphs(NodeLocalCache(shared=shared.url, local=str(other))) == 0
    assert shared.read_bytes("neuronxcc-2.23/MODULE_new/model.neff") == b"neff new"
    # Two nodes racing on one entry (both listed it as absent): each file is written only if absent.
    racing = tmp_path / "racing"
    neuron_entry(racing, "MODULE_race", b"neff race 1")
    shared.write_bytes("neuronxcc-2.23/MODULE_race/model.neff", b"neff race 2")  # the other node's, first
    assert sync_new_neuron_graphs(NodeLocalCache(shared=shared.url, local=str(racing))) == 1
    assert shared.read_bytes("neuronxcc-2.23/MODULE_race/model.neff") == b"neff race 2"
    assert shared.exists("neuronxcc-2.23/MODULE_race/model.done")
    # ... and when the other node's file lands after this one listed the cache, the write itself refuses it.
    late, other_file = racing / "late.neff", racing / "other.neff"
    late.write_bytes(b"neff late 1")
    other_file.write_bytes(b"neff late 2")
    assert _put_if_absent(shared, str(late), "neuronxcc-2.23/MODULE_late/model.neff")
    assert not _put_if_absent(shared, str(other_file), "neuronxcc-2.23/MODULE_late/model.neff")
    assert shared.read_bytes("neuronxcc-2.23/MODULE_late/model.neff") == b"neff late 1"
    assert not [rel for rel in shared.walk_files() if ".tmp-" in rel]


def test_graphs_compiled_on_a_miss_reach_a_shared_folder_once_and_are_never_overwritten(tmp_path: Path) -> None:
    check_sync(tmp_path, Storage(str(tmp_path / "shared")))


def test_graphs_compiled_on_a_miss_reach_s3_once_and_are_never_overwritten(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """On a moto S3 server: S3's conditional PUT (If-None-Match: *) keeps the first copy of each file."""
    env: S3Env = request.getfixturevalue("s3_env")
    check_sync(tmp_path, Storage(f"{env.url}/compile-cache/neuron"))


def test_a_running_job_shares_new_graphs_in_the_background_and_once_more_when_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared, node = tmp_path / "shared", tmp_path / "node"
    neuron_entry(shared, "MODULE_a", b"neff a")
    cache = NodeLocalCache(shared=str(shared), local=str(node))
    monkeypatch.setenv("LOCAL_RANK", "0")
    done = shared / "neuronxcc-2.23"
    with NeuronGraphSharing(cache, every=1e9) as sharing:  # no periodic round within the test
        neuron_entry(node, "MODULE_late", b"compiled at the end")
        assert not (done / "MODULE_late").exists()
    assert (done / "MODULE_late" / "model.done").exists() and sharing.rounds == 1  # the last round
    with NeuronGraphSharing(cache, every=0.01) as sharing:
        neuron_entry(node, "MODULE_early", b"compiled at step 1")
        deadline = time.monotonic() + 60  # a safety net, not a speed requirement
        while not (done / "MODULE_early" / "model.done").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (done / "MODULE_early" / "model.done").exists()  # shared while the job still runs
    monkeypatch.setenv("LOCAL_RANK", "1")  # the node's other ranks leave it to local rank 0
    neuron_entry(node, "MODULE_other", b"not from this rank")
    with NeuronGraphSharing(cache, every=0.01) as other:
        pass
    assert other.rounds == 0 and not (done / "MODULE_other").exists()


def test_a_trn1_job_copies_the_cache_before_the_process_group_and_shares_its_new_graphs_however_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training program's order, with init_world standing in for trn1's (the process group's first graphs
    compile there, on a miss here) and failing after it: the copy was in place before it ran, and the graph it
    compiled reached the shared cache all the same."""
    import hlat.training.train as train

    run, shared, node = tmp_path / "run", tmp_path / "shared", tmp_path / "node"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(load_config("tiny").model_dump(mode="json")))
    neuron_entry(shared, "MODULE_a", b"neff a")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(shared))
    monkeypatch.setenv("HLAT_LOCAL_NEURON_CACHE", str(node))
    monkeypatch.setenv("LOCAL_RANK", "0")
    seen: list[str] = []

    def trn1_init_world(*args: Any, **kwargs: Any) -> None:
        seen.append(os.environ["NEURON_COMPILE_CACHE_URL"])
        assert (node / "neuronxcc-2.23" / "MODULE_a" / "model.neff").exists()
        neuron_entry(node, "MODULE_init", b"the init all-reduce")  # compiled on a miss, into the local copy
        raise RuntimeError("the process group could not form")

    monkeypatch.setattr(train, "neuron_available", lambda: True)
    monkeypatch.setattr(train, "init_world", trn1_init_world)
    with pytest.raises(RuntimeError, match="could not form"):
        train._train(str(run / "config.json"), "cpu")
    assert seen == [str(node)]
    assert (shared / "neuronxcc-2.23" / "MODULE_init" / "model.done").exists()


def test_a_node_copies_an_s3_cache_from_one_listing(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """On a moto S3 server: the files and their sizes come from one listing; a second copy fetches nothing."""
    env: S3Env = request.getfixturevalue("s3_env")
    shared = Storage(f"{env.url}/compile-cache/neuron")
    expected = neuron_entry(tmp_path / "compiled", "MODULE_a", b"neff" * 1000)
    for rel, data in expected.items():
        shared.write_bytes(rel, data)
    node = tmp_path / "node"
    localize_neuron_cache(shared.url, str(node))
    assert tree(node) == expected
    kept = node / "neuronxcc-2.23" / "MODULE_a" / "model.neff"
    os.utime(kept, (0, 0))
    localize_neuron_cache(shared.url, str(node))
    assert kept.stat().st_mtime == 0
