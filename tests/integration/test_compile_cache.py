"""The precompile program and training's use of its cache, as jobs run them: real processes, real torch.compile.

torch.compile on CPU costs 10-20 s a process, so one precompiled run is shared by the module, and the runs whose
own compilation is beside the point share one Inductor disk cache, extracted from the precompile's tarball. The
run that must show the cache working is given an empty Inductor cache, so only compile-cache/ can help it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hlat.core.layout import MANIFEST_FILE
from hlat.training.compile_cache import ARTIFACTS_FILE, CACHE_DIR, KERNELS_FILE, LATEST_FILE, unpack_cache_folder
from tests.jobs import make_run, metrics, train

pytestmark = pytest.mark.slow

RUN = {"compile": True, "max_steps": 3, "eval_every": 0, "eval_batches": 1, "checkpoint_every": 100}


@dataclass(frozen=True)
class Job:
    run: Path
    code: int
    output: str

    @property
    def cache(self) -> Path:
        return self.run / CACHE_DIR


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compile-cache")


def inductor_env(folder: Path) -> dict[str, str]:
    return {"TORCHINDUCTOR_CACHE_DIR": str(folder)}


def precompile(run: Path, inductor: Path) -> Job:
    proc = subprocess.run(
        [sys.executable, "-m", "hlat.training.precompile", "--config", str(run / "config.json")],
        env={**os.environ, "OMP_NUM_THREADS": "1", **inductor_env(inductor)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        check=False,
    )
    return Job(run, proc.returncode, proc.stdout)


@pytest.fixture(scope="module")
def precompiled(prepared: Path, root: Path) -> Job:
    job = precompile(make_run(prepared, root, "precompiled", **RUN), root / "inductor")
    assert job.code == 0, job.output[-3000:]
    return job


@pytest.fixture(scope="module")
def shared_inductor(precompiled: Job, root: Path) -> Path:
    """An Inductor disk cache holding the precompile's kernels, for runs that need not show their own compiling."""
    folder = root / "shared-inductor"
    unpack_cache_folder(str(digest_folder(precompiled.cache) / KERNELS_FILE), str(folder))
    return folder


@pytest.fixture(scope="module")
def uncached(prepared: Path, root: Path, shared_inductor: Path) -> Job:
    """The same training without compile-cache/ (with the precompile's kernels in its Inductor cache: only faster)."""
    run = make_run(prepared, root, "uncached", **RUN)
    code, out = train(run, inductor_env(shared_inductor))
    return Job(run, code, out)


def with_cache_of(precompiled: Job, prepared: Path, root: Path, run_id: str) -> Path:
    run = make_run(prepared, root, run_id, **RUN)
    shutil.copytree(precompiled.cache, run / CACHE_DIR)
    return run


def digest_folder(cache: Path) -> Path:
    return cache / json.loads((cache / LATEST_FILE).read_text())["manifest"].rsplit("/", 1)[0]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in metrics(run) if "loss" in r]


def first_record(run: Path) -> dict[str, Any]:
    return metrics(run)[0]


def test_precompile_writes_the_cache_and_nothing_else(precompiled: Job, root: Path) -> None:
    folder = digest_folder(precompiled.cache)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    artifacts = (folder / ARTIFACTS_FILE).read_bytes()
    assert folder.name == manifest["digest"] and manifest["steps"] == 4 and manifest["size"] == len(artifacts) > 0
    assert manifest["key"]["training.compile"] is True and manifest["key"]["training.seq_len"] == 128
    kernels = (folder / KERNELS_FILE).read_bytes()
    assert (
        manifest["inductor_bytes"] == len(kernels)
        and manifest["inductor_sha256"] == hashlib.sha256(kernels).hexdigest()
    )
    with tarfile.open(folder / KERNELS_FILE) as tar:
        names = tar.getnames()
    assert names == sorted(names) and len(names) == manifest["inductor_files"]
    assert any(n.endswith(".so") for n in names) and any(n.startswith("fxgraph/") for n in names)  # kernels, graphs
    summary = re.search(
        r"^precompile: 4 steps traced in [\d.]+ s, [\d.]+ [kMG]B of artifacts and [\d.]+ [kMG]B of Inductor cache "
        r"\(\d+ files\) -> (.+)$",
        precompiled.output,
        re.M,
    )
    assert summary and summary.group(1) == str(folder), precompiled.output[-2000:]
    assert not (root / "inductor").exists()  # it compiled into a fresh folder of its own, not the one it was given
    # Its trainer wrote to a throwaway folder: the run has no metrics, checkpoints or TensorBoard events.
    leftovers = {p.name for p in precompiled.run.iterdir()} - {"config.json", "data", "tokenizer", CACHE_DIR}
    assert leftovers == set()


def test_a_missing_cache_is_reported_and_training_goes_on(uncached: Job) -> None:
    assert uncached.code == 0, uncached.output[-3000:]
    assert "compile cache: missing" in uncached.output
    first = first_record(uncached.run)
    assert first["step"] == 1 and first["compile_cache"] == "missing" and float(first["first_step_seconds"]) > 0
    assert len(losses(uncached.run)) == 3


def test_training_hits_the_cache_and_learns_the_same(
    precompiled: Job, uncached: Job, prepared: Path, root: Path, tmp_path: Path
) -> None:
    run = with_cache_of(precompiled, prepared, root, "hit")
    given = tmp_path / "empty-inductor-cache"
    code, out = train(run, inductor_env(given))
    assert code == 0, out[-3000:]
    hit = re.search(
        r"compile cache: hit, loaded .* of Inductor cache \(\d+ files, compiled kernels included\) into (\S+)", out
    )
    assert hit, out[-3000:]
    folder = digest_folder(run / CACHE_DIR)
    first = first_record(run)
    assert first["compile_cache"] == "hit" and first["compile_cache_bytes"] == len(
        (folder / ARTIFACTS_FILE).read_bytes()
    )
    assert first["compile_cache_kernels_bytes"] == (folder / KERNELS_FILE).stat().st_size > 0
    # Everything it compiled or looked up went to its extracted copy, which it removed on exit.
    assert not given.exists() or not any(given.iterdir())
    assert not Path(hit.group(1)).exists()
    assert losses(run) == pytest.approx(losses(uncached.run), rel=1e-5)


def test_a_stale_cache_names_what_changed_and_is_not_used(
    precompiled: Job, uncached: Job, prepared: Path, root: Path, shared_inductor: Path
) -> None:
    run = with_cache_of(precompiled, prepared, root, "stale")
    manifest_path = digest_folder(run / CACHE_DIR) / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["key"]["torch"] = "2.12.0"  # as if an older torch had built it
    manifest_path.write_text(json.dumps(manifest))
    code, out = train(run, inductor_env(shared_inductor))
    assert code == 0, out[-3000:]
    assert "compile cache: stale" in out and "torch 2.12.0 -> " in out, out[-3000:]
    first = first_record(run)
    assert first["compile_cache"] == "stale" and str(first["compile_cache_stale"]).startswith("torch 2.12.0 -> ")
    assert losses(run) == pytest.approx(losses(uncached.run), rel=1e-5)


def test_a_corrupt_cache_is_not_loaded_and_training_goes_on(
    precompiled: Job, prepared: Path, root: Path, shared_inductor: Path
) -> None:
    run = with_cache_of(precompiled, prepared, root, "corrupt")
    kernels = digest_folder(run / CACHE_DIR) / KERNELS_FILE
    data = bytearray(kernels.read_bytes())
    data[len(data) // 2] ^= 0xFF
    kernels.write_bytes(bytes(data))
    code, out = train(run, inductor_env(shared_inductor))
    assert code == 0, out[-3000:]
    assert f"compile cache: corrupt ({kernels}: " in out and first_record(run)["compile_cache"] == "corrupt"
    assert len(losses(run)) == 3


def test_without_torch_compile_precompile_records_that_there_is_nothing_to_compile(
    prepared: Path, tmp_path: Path
) -> None:
    job = precompile(make_run(prepared, tmp_path, "eager", **{**RUN, "compile": False}), tmp_path / "inductor")
    assert job.code == 0, job.output[-3000:]
    assert "precompile: nothing to compile (training.compile is false" in job.output
    folder = digest_folder(job.cache)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["nothing_to_compile"] is True and not (folder / ARTIFACTS_FILE).exists()
    assert not (job.run / "metrics.jsonl").exists()
