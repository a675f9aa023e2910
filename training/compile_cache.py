"""The run's graph compile cache (`<run>/compile-cache/`): what precompile writes and training jobs load.

Rules:
- a cache is used only when its key (`cache_key`) equals the job's.
- a stale, missing or corrupt cache never fails a job: it compiles from scratch.
- bytes are written before their manifest, the manifest before latest.json.
- this module runs inside training jobs: no Prefect, Python 3.10.
docs/stages.md ("precompile") draws the folder and the trn1 Neuron cache.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import tarfile
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Literal

import torch

from hlat.core.config import HlatConfig, stable_hash
from hlat.core.contract import in_sagemaker
from hlat.core.environment import neuron_sdk, shapes_graphs, xla_job_environment
from hlat.core.layout import COMPILE_CACHE_DIR as CACHE_DIR
from hlat.core.layout import COMPILE_LATEST_FILE as LATEST_FILE
from hlat.core.layout import MANIFEST_FILE
from hlat.core.layout import NEURON_CACHE_DIR as NEURON_DIR
from hlat.core.layout import TORCH_CACHE_DIR as TORCH_DIR
from hlat.core.layout import XLA_CACHE_DIR as XLA_DIR
from hlat.core.run import Run
from hlat.core.storage import Storage, StorageError, StorageNotFound, storage_errors

log = logging.getLogger("hlat.train")

ARTIFACTS_FILE = "artifacts.bin"
KERNELS_FILE = "inductor.tar.gz"
XLA_CACHE_FILE = "xla-cache.tar.gz"

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Inductor's disk cache: FX graphs, generated code and compiled kernels."""

LOCAL_NEURON_CACHE_ENV = "HLAT_LOCAL_NEURON_CACHE"
"""Where each node keeps its copy of the Neuron cache (default: `node_local_neuron_cache_dir`)."""

NEURON_PACKAGES = ("neuronx-cc", "torch-neuronx", "torch-xla", "neuronx-distributed")
"""On trn1 the compiler and the XLA bridge shape the graphs too."""

Status = Literal["hit", "stale", "corrupt", "missing", "off"]


def cache_key(cfg: HlatConfig, world_size: int, device_type: str) -> dict[str, Any]:
    """Everything that changes the step's compiled graphs, flat, so a stale cache is explained field by field."""
    t = cfg.training
    # model.init_from names where the starting weights came from: the graphs are the model's shape, not its values.
    model = cfg.model.model_dump(mode="json", exclude={"init_from"})
    key: dict[str, Any] = {f"model.{k}": v for k, v in model.items()}
    key.update(
        {
            "training.seq_len": t.seq_len,
            "training.micro_batch_size": t.micro_batch_size,
            "training.compile": t.compile,
            "training.document_masking": t.document_masking,
            "training.xla_graph_cuts": t.xla_graph_cuts,
            # A skipped step's update is masked on the device (masked_step), and the spike detector's window is a
            # tensor of spike_window entries: both are ops of the step's graph.
            "training.nan_policy": t.nan_policy,
            "training.spike_skip": t.spike_skip,
            "training.spike_window": t.spike_window if t.spike_skip else None,
            # DDP skips the gradient all-reduce on all but the last micro-batch of a step.
            "gradient_accumulation": cfg.gradient_accumulation,
        }
    )
    key.update({f"parallelism.{k}": v for k, v in cfg.parallelism.model_dump(mode="json").items()})
    key["precision.mode"] = cfg.precision.mode
    key["world_size"] = world_size
    key["device_type"] = device_type
    if device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        key["cuda_capability"] = f"{major}.{minor}"  # Triton kernels are built for one architecture
    key["torch"] = torch.__version__
    key["python"] = platform.python_version()  # Dynamo traces bytecode, which changes between versions
    if device_type == "xla":
        for package in NEURON_PACKAGES:
            version = _installed_version(package)
            if version is not None:
                key[package] = version
        # The environment the config gives the job (compiler flags, precision flags, neuron.env), not this
        # process's: the precompile job and every training job compute the same key from the same config, and a
        # changed neuron.compiler_flags shows up as a stale cache naming NEURON_CC_FLAGS.
        env = xla_job_environment(cfg)
        key.update({name: env[name] for name in sorted(env) if shapes_graphs(name)})
    return key


def key_digest(key: dict[str, Any]) -> str:
    """sha256 of the key's canonical JSON: the cache's folder name."""
    return stable_hash(key)


def key_differences(cached: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'torch 2.13.0 -> 2.14.0' for each differing field, current fields first."""
    names = [*current, *(k for k in cached if k not in current)]
    return [
        f"{k} {_shown(cached.get(k))} -> {_shown(current.get(k))}" for k in names if cached.get(k) != current.get(k)
    ]


@dataclass(frozen=True)
class CacheStatus:
    """What a training job found in the compile cache, and the line it logged."""

    status: Status
    uri: str
    """The cache folder looked at."""
    message: str
    differences: list[str] = field(default_factory=list)
    """For `stale`: each differing key field, 'name cached -> current'."""
    size: int = 0
    """Bytes of artifacts loaded (for `hit`)."""
    kernels_size: int = 0
    """Bytes of the Inductor tarball extracted (0: none)."""
    kernels_dir: str | None = None
    """Where it was extracted: this process's TORCHINDUCTOR_CACHE_DIR from then on."""
    seconds: float = 0.0
    """Time spent reading, verifying and loading the cache."""

    def metrics(self) -> dict[str, Any]:
        """Recorded with the job's first step in metrics.jsonl."""
        out: dict[str, Any] = {"compile_cache": self.status}
        if self.differences:
            out["compile_cache_stale"] = ", ".join(self.differences)
        if self.status == "hit":
            out["compile_cache_bytes"] = self.size
            if self.kernels_dir is not None:
                out["compile_cache_kernels_bytes"] = self.kernels_size
            out["compile_cache_load_seconds"] = round(self.seconds, 4)
        return out


def torch_cache_dir(digest: str) -> str:
    return f"{TORCH_DIR}/{digest}"


def write_torch_cache(
    cache: Storage,
    key: dict[str, Any],
    artifacts: bytes | None,
    steps: int,
    seconds: float,
    note: str = "",
    inductor_dir: str | None = None,
) -> dict[str, Any]:
    """Write artifacts.bin and inductor.tar.gz, then their manifest, then latest.json; return the manifest.

    `artifacts` None records that nothing compiles, with `note` saying why.
    """
    digest = key_digest(key)
    folder = torch_cache_dir(digest)
    manifest: dict[str, Any] = {
        **_manifest_head("torch", key, steps, seconds),
        "nothing_to_compile": artifacts is None,
        "size": 0 if artifacts is None else len(artifacts),
        "sha256": None if artifacts is None else hashlib.sha256(artifacts).hexdigest(),
    }
    if note:
        manifest["note"] = note
    if artifacts is not None:
        cache.write_bytes(f"{folder}/{ARTIFACTS_FILE}", artifacts)
    if inductor_dir is not None:
        with tempfile.TemporaryDirectory(prefix="hlat-inductor-pack-") as tmp:
            tarball = os.path.join(tmp, KERNELS_FILE)
            files = pack_cache_folder(inductor_dir, tarball)
            manifest["inductor_files"] = files
            manifest["inductor_bytes"] = os.path.getsize(tarball) if files else 0
            manifest["inductor_sha256"] = _file_sha256(tarball) if files else None
            if files:
                cache.put_file(tarball, f"{folder}/{KERNELS_FILE}")
    cache.write_json(f"{folder}/{MANIFEST_FILE}", manifest)
    _write_latest(cache, manifest, f"{folder}/{MANIFEST_FILE}")
    return manifest


def write_neuron_manifest(cache: Storage, key: dict[str, Any], steps: int, seconds: float) -> dict[str, Any]:
    """Record the key the Neuron cache under neuron/ holds, and point latest.json at it."""
    manifest = _manifest_head("neuron", key, steps, seconds)
    cache.write_json(f"{NEURON_DIR}/{MANIFEST_FILE}", manifest)
    _write_latest(cache, manifest, f"{NEURON_DIR}/{MANIFEST_FILE}")
    return manifest


def xla_cache_dir(digest: str) -> str:
    return f"{XLA_DIR}/{digest}"


def write_xla_cache(cache: Storage, key: dict[str, Any], local_dir: str, steps: int, seconds: float) -> dict[str, Any]:
    """Pack torch-xla's persistent cache `local_dir` into xla/<digest>/, then its manifest and latest.json."""
    digest = key_digest(key)
    folder = xla_cache_dir(digest)
    manifest = _manifest_head("xla", key, steps, seconds)
    with tempfile.TemporaryDirectory(prefix="hlat-xla-pack-") as tmp:
        tarball = os.path.join(tmp, XLA_CACHE_FILE)
        graphs = pack_cache_folder(local_dir, tarball)
        if not graphs:
            raise RuntimeError(f"torch-xla's persistent cache at {local_dir} is empty: the steps compiled nothing")
        manifest.update(graphs=graphs, size=os.path.getsize(tarball), sha256=_file_sha256(tarball))
        cache.put_file(tarball, f"{folder}/{XLA_CACHE_FILE}")
    cache.write_json(f"{folder}/{MANIFEST_FILE}", manifest)
    _write_latest(cache, manifest, f"{folder}/{MANIFEST_FILE}")
    return manifest


def fetch_xla_cache(run: Run, cfg: HlatConfig, world_size: int, log_status: bool = True) -> CacheStatus:
    """Extract the run's torch-xla cache for this key into a fresh folder; never raises for a bad cache."""
    start = time.perf_counter()
    cache = run.storage.child(CACHE_DIR)
    key = cache_key(cfg, world_size, "xla")
    folder = cache.child(xla_cache_dir(key_digest(key)))
    sdk = neuron_sdk(cfg)
    if not sdk.cpu_cache_loads:
        message = (
            f"compile cache: not loaded (torch-xla {sdk.torch_xla}'s XLA:CPU cannot load cached graphs); compiling "
            "here, where a trn1 job reads the Neuron compile cache"
        )
        return _report(CacheStatus("off", folder.url, message), log_status)
    try:
        result = _fetch_xla(cache, folder, key)
    except StorageError as exc:  # unreadable or deleted while read: a job without its cache still trains
        result = CacheStatus("missing", folder.url, f"compile cache: missing ({exc}); compiling from scratch")
    except ValueError as exc:
        result = CacheStatus(
            "corrupt", folder.url, f"compile cache: corrupt (unreadable JSON under {cache.url}: {exc}); not loaded"
        )
    return _report(replace(result, seconds=time.perf_counter() - start), log_status)


def _fetch_xla(cache: Storage, folder: Storage, key: dict[str, Any]) -> CacheStatus:
    if not folder.exists(MANIFEST_FILE):
        return _missing_or_stale(cache, folder, key)
    manifest = folder.read_json(MANIFEST_FILE)
    if manifest.get("key") != key:
        return _stale(folder.url, manifest.get("key") or {}, key)
    try:
        graphs = _extract_tarball(folder, XLA_CACHE_FILE, manifest.get("size"), manifest.get("sha256"), "xla")
    except _Corrupt as exc:
        return CacheStatus("corrupt", folder.url, f"compile cache: corrupt ({exc}); not loaded, compiling from scratch")
    return CacheStatus(
        "hit",
        folder.url,
        f"compile cache: hit, {graphs.files} compiled XLA graph(s) ({human_bytes(graphs.size)}) from {folder.url} "
        f"into torch-xla's persistent cache at {graphs.folder}",
        size=graphs.size,
        kernels_size=graphs.size,
        kernels_dir=graphs.folder,
    )


def _manifest_head(kind: str, key: dict[str, Any], steps: int, seconds: float) -> dict[str, Any]:
    """What every cache manifest starts with: kind, key, digest, time and steps."""
    return {
        "kind": kind,
        "key": key,
        "digest": key_digest(key),
        "created": _now(),
        "steps": steps,
        "seconds": round(seconds, 3),
    }


def _write_latest(cache: Storage, manifest: dict[str, Any], manifest_path: str) -> None:
    fields = ("kind", "digest", "created", "steps", "nothing_to_compile")
    latest: dict[str, Any] = {k: manifest[k] for k in fields if k in manifest}
    latest["manifest"] = manifest_path
    for name in ("size", "inductor_bytes"):
        if name in manifest:
            latest[name] = manifest[name]
    cache.write_json(LATEST_FILE, latest)


def pack_cache_folder(folder: str, tarball: str) -> int:
    """Pack a cache folder's regular files, sorted and ownerless, into `tarball`; return the count (0: no tarball)."""
    files: list[str] = []
    for parent, dirs, names in os.walk(folder):
        dirs.sort()
        for name in names:
            path = os.path.join(parent, name)
            if name.endswith(".lock") or os.path.islink(path) or not os.path.isfile(path):
                continue
            files.append(os.path.relpath(path, folder).replace(os.sep, "/"))
    if not files:
        return 0
    with tarfile.open(tarball, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(files):
            info = tar.gettarinfo(os.path.join(folder, rel), arcname=rel)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(os.path.join(folder, rel), "rb") as f:
                tar.addfile(info, f)
    return len(files)


def unpack_cache_folder(tarball: str, folder: str) -> int:
    """Extract a `pack_cache_folder` tarball into `folder`; return the file count.

    A member that is not a plain file or folder below `folder` raises ValueError, extracting nothing.
    """
    with tarfile.open(tarball, "r:gz") as tar:
        members = tar.getmembers()
        for member in members:
            if os.path.isabs(member.name) or ".." in member.name.split("/"):
                raise ValueError(f"unsafe member {member.name!r} in {os.path.basename(tarball)}: a path outside it")
            if not (member.isfile() or member.isdir()):
                raise ValueError(f"unsafe member {member.name!r} in {os.path.basename(tarball)}: not a plain file")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(folder, members=members, filter="data")
        else:  # Python 3.10 before 3.10.12 has no extraction filters: the checks above stand in for it
            tar.extractall(folder, members=members)
    return sum(1 for member in members if member.isfile())


def use_inductor_cache_dir(folder: str | None) -> None:
    """Make `folder` Inductor's disk cache for later compiles in this process (None: unset); set before the first."""
    if folder is None:
        os.environ.pop(INDUCTOR_CACHE_ENV, None)
    else:
        os.environ[INDUCTOR_CACHE_ENV] = folder
    from torch._inductor.utils import clear_caches  # imported here: Inductor is loaded only when compiling

    clear_caches()


def load_torch_cache(
    run: Run, cfg: HlatConfig, world_size: int, device_type: str, log_status: bool = True
) -> CacheStatus:
    """Load the run's torch.compile artifacts and kernels for this key before the first compiled call.

    Returns the status; never raises for a bad cache. Each rank calls it; `log_status` lets one log.
    """
    start = time.perf_counter()
    cache = run.storage.child(CACHE_DIR)
    if not cfg.training.compile:
        result = CacheStatus("off", cache.url, "compile cache: off (training.compile is false: nothing is compiled)")
        return _report(result, log_status)
    key = cache_key(cfg, world_size, device_type)
    digest = key_digest(key)
    folder = cache.child(torch_cache_dir(digest))
    try:
        result = _load(cache, folder, key)
    except StorageNotFound as exc:  # deleted while we read it
        result = CacheStatus("missing", folder.url, f"compile cache: missing ({exc}); compiling from scratch")
    except StorageError as exc:  # unreadable (permissions, throttling): a job without its cache still trains
        result = CacheStatus(
            "missing", folder.url, f"compile cache: missing (could not read it: {exc}); compiling from scratch"
        )
    except ValueError as exc:  # a manifest or latest.json that is not JSON
        result = CacheStatus(
            "corrupt", folder.url, f"compile cache: corrupt (unreadable JSON under {cache.url}: {exc}); not loaded"
        )
    return _report(replace(result, seconds=time.perf_counter() - start), log_status)


def _load(cache: Storage, folder: Storage, key: dict[str, Any]) -> CacheStatus:
    if folder.exists(MANIFEST_FILE):
        manifest = folder.read_json(MANIFEST_FILE)
        if manifest.get("key") != key:  # the digest matched but not the key: an edited or colliding manifest
            return _stale(folder.url, manifest.get("key") or {}, key)
        if manifest.get("nothing_to_compile"):
            return CacheStatus(
                "missing", folder.url, f"compile cache: missing (the manifest at {folder.url} has no artifacts)"
            )
        if not folder.exists(ARTIFACTS_FILE):
            return CacheStatus(
                "corrupt", folder.url, f"compile cache: corrupt ({folder.uri(ARTIFACTS_FILE)} is missing); not loaded"
            )
        data = folder.read_bytes(ARTIFACTS_FILE)
        actual = hashlib.sha256(data).hexdigest()
        if len(data) != manifest.get("size") or actual != manifest.get("sha256"):
            return CacheStatus(
                "corrupt",
                folder.url,
                f"compile cache: corrupt ({folder.uri(ARTIFACTS_FILE)}: {len(data)} bytes with sha256 {actual[:12]}, "
                f"the manifest says {manifest.get('size')} bytes with sha256 {str(manifest.get('sha256'))[:12]}); "
                "not loaded, compiling from scratch",
            )
        try:
            kernels = _extract_kernels(folder, manifest)
        except _Corrupt as exc:
            return CacheStatus(
                "corrupt", folder.url, f"compile cache: corrupt ({exc}); not loaded, compiling from scratch"
            )
        previous = os.environ.get(INDUCTOR_CACHE_ENV)
        if kernels is not None:
            # Before loading the artifacts, which torch writes into the Inductor cache folder of the moment.
            use_inductor_cache_dir(kernels.folder)
        try:
            info = torch.compiler.load_cache_artifacts(data)
        except Exception as exc:
            info, error = None, f"{type(exc).__name__}: {exc}"
        else:
            error = "torch could not deserialize them"
        if info is None:
            if kernels is not None:  # not loaded means not loaded: the job compiles where it would have
                use_inductor_cache_dir(previous)
                shutil.rmtree(kernels.folder, ignore_errors=True)
            return CacheStatus(
                "corrupt", folder.url, f"compile cache: corrupt ({folder.uri(ARTIFACTS_FILE)}: {error}); not loaded"
            )
        counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(info.artifacts.items()))
        extracted = (
            ""
            if kernels is None
            else f" and {human_bytes(kernels.size)} of Inductor cache ({kernels.files} files, compiled kernels "
            f"included) into {kernels.folder}"
        )
        return CacheStatus(
            "hit",
            folder.url,
            f"compile cache: hit, loaded {human_bytes(len(data))} of torch.compile artifacts ({counts}){extracted} "
            f"from {folder.url}",
            size=len(data),
            kernels_size=0 if kernels is None else kernels.size,
            kernels_dir=None if kernels is None else kernels.folder,
        )
    return _missing_or_stale(cache, folder, key)


def _missing_or_stale(cache: Storage, folder: Storage, key: dict[str, Any]) -> CacheStatus:
    """No cache for this key: `stale` naming what differs from the newest one, else `missing`."""
    if cache.exists(LATEST_FILE):
        latest = cache.read_json(LATEST_FILE)
        manifest_path = latest.get("manifest") or f"{torch_cache_dir(str(latest.get('digest')))}/{MANIFEST_FILE}"
        if cache.exists(manifest_path):
            return _stale(cache.uri(manifest_path), cache.read_json(manifest_path).get("key") or {}, key)
    return CacheStatus(
        "missing",
        folder.url,
        f"compile cache: missing (nothing at {folder.url}); compiling from scratch (the precompile stage builds it)",
    )


class _Corrupt(Exception):
    """A cache file that does not match its manifest or cannot be read."""


@dataclass(frozen=True)
class _Kernels:
    folder: str
    size: int
    files: int


def _extract_kernels(folder: Storage, manifest: dict[str, Any]) -> _Kernels | None:
    """Verify and extract the manifest's inductor.tar.gz into a fresh folder; None when there is none."""
    sha256 = manifest.get("inductor_sha256")
    if not sha256:
        return None
    return _extract_tarball(folder, KERNELS_FILE, manifest.get("inductor_bytes"), sha256, "inductor")


def _extract_tarball(folder: Storage, name: str, size: int | None, sha256: str | None, kind: str) -> _Kernels:
    """Verify `name` against its manifest, then extract it into a fresh temporary folder; raises _Corrupt."""
    uri = folder.uri(name)
    if not folder.exists(name):
        raise _Corrupt(f"{uri} is missing")
    target = tempfile.mkdtemp(prefix=f"hlat-{kind}-{os.getpid()}-")
    try:
        with tempfile.TemporaryDirectory(prefix=f"hlat-{kind}-get-") as tmp:
            tarball = os.path.join(tmp, name)
            folder.get_file(name, tarball)
            actual_size, actual = os.path.getsize(tarball), _file_sha256(tarball)
            if actual_size != size or actual != sha256:
                raise _Corrupt(
                    f"{uri}: {actual_size} bytes with sha256 {actual[:12]}, the manifest says "
                    f"{size} bytes with sha256 {str(sha256)[:12]}"
                )
            try:
                files = unpack_cache_folder(tarball, target)
            except (tarfile.TarError, ValueError, EOFError, zlib.error, OSError) as exc:
                raise _Corrupt(f"{uri}: {exc}") from exc
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    atexit.register(shutil.rmtree, target, ignore_errors=True)
    return _Kernels(target, actual_size, files)


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stale(uri: str, cached: dict[str, Any], current: dict[str, Any]) -> CacheStatus:
    differences = key_differences(cached, current)
    return CacheStatus(
        "stale",
        uri,
        f"compile cache: stale ({uri} was built for {', '.join(differences)}); not loaded, compiling from scratch "
        "(run the precompile stage again)",
        differences=differences,
    )


def _report(result: CacheStatus, log_status: bool) -> CacheStatus:
    if log_status:
        level = logging.WARNING if result.status in ("stale", "corrupt") else logging.INFO
        seconds = f" in {result.seconds:.2f} s" if result.status == "hit" else ""
        log.log(level, "%s%s", result.message, seconds)
    return result


def localize_neuron_cache(url: str, local_dir: str, workers: int = 16) -> str:
    """Copy the shared Neuron cache to this node's disk; return the local folder.

    HLAT found shared storage a start-up bottleneck. Files present at the same size are kept.
    Each file is written under a temporary name, then renamed.
    """
    source = Storage(url)
    os.makedirs(local_dir, exist_ok=True)
    # One listing with sizes (not a HEAD per file: 64 nodes x thousands of graphs), the same paths as walk_files.
    with storage_errors(source.url):
        found = source.fs.find(source.root, detail=True) if source.fs.exists(source.root) else {}
    prefix = source.root.rstrip("/") + "/"
    sizes = {
        str(path)[len(prefix) :]: int(info["size"])
        for path, info in found.items()
        if info.get("type") != "directory" and str(path).startswith(prefix)
    }
    files = sorted(sizes)

    def copy(rel: str) -> int:
        target = os.path.join(local_dir, *rel.split("/"))
        size = sizes[rel]
        if os.path.exists(target) and os.path.getsize(target) == size:
            return 0
        tmp = f"{target}.tmp-{os.getpid()}"
        source.get_file(rel, tmp)
        os.replace(tmp, target)
        return size

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        copied = list(pool.map(copy, files))
    fresh = sum(1 for n in copied if n)
    if not files:
        log.warning("the Neuron compile cache at %s is empty: graphs compile on this node (run precompile)", url)
    else:
        log.info(
            "Neuron compile cache: %d of %d files (%s) copied from %s to %s in %.1f s",
            fresh, len(files), human_bytes(sum(copied)), url, local_dir, time.perf_counter() - start,
        )  # fmt: skip
    return local_dir


SAGEMAKER_NEURON_CACHE_DIR = "/opt/ml/input/data/hlat-neuron-cache"
"""A SageMaker job's node-local Neuron cache: instance storage that SageMaker never uploads.

See https://docs.aws.amazon.com/sagemaker/latest/dg/model-train-storage-tips-considerations.html
and https://docs.aws.amazon.com/sagemaker/latest/dg/model-train-storage-env-var-summary.html.
"""

NEURON_ENTRY_DONE = "model.done"
"""The file that completes a Neuron cache entry; entries without it are unfinished."""

_LOCALIZED = ".hlat-localized.json"
"""Which job's local ranks the node-local copy was made for."""


@dataclass(frozen=True)
class NodeLocalCache:
    """This node's copy of the shared Neuron cache, and its source."""

    shared: str
    local: str


def node_local_neuron_cache_dir() -> str:
    """This node's copy: HLAT_LOCAL_NEURON_CACHE, else SageMaker's instance storage, else a temp folder."""
    if os.environ.get(LOCAL_NEURON_CACHE_ENV):
        return os.environ[LOCAL_NEURON_CACHE_ENV]
    if in_sagemaker():
        return SAGEMAKER_NEURON_CACHE_DIR
    return os.path.join(tempfile.gettempdir(), "hlat-neuron-cache")


def node_job_token() -> str:
    """What only this job's local ranks on this node share: torchrun's agent and run id."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat") as stat:
            started = stat.read().rsplit(")", 1)[1].split()[19]  # field 22, starttime (proc(5))
    except (OSError, IndexError):
        started = ""
    return f"{parent}:{started}:{os.environ.get('TORCHELASTIC_RUN_ID', '')}"


def use_node_local_neuron_cache() -> NodeLocalCache | None:
    """On trn1, before the process group: copy the shared Neuron cache to this node once; return it or None.

    Local ranks take turns on a file lock; the first copies, the others find its `node_job_token`.
    """
    url = os.environ.get("NEURON_COMPILE_CACHE_URL")
    if not url:
        return None
    local = os.path.abspath(node_local_neuron_cache_dir())
    token = {"job": node_job_token(), "from": url}
    os.makedirs(os.path.dirname(local), exist_ok=True)
    with open(f"{local}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        marker = os.path.join(local, _LOCALIZED)
        try:
            with open(marker) as f:
                done = json.load(f) == token
        except (OSError, ValueError):
            done = False
        if not done:
            localize_neuron_cache(url, local)
            with open(f"{marker}.tmp-{os.getpid()}", "w") as f:
                json.dump(token, f)
            os.replace(f"{marker}.tmp-{os.getpid()}", marker)
    os.environ["NEURON_COMPILE_CACHE_URL"] = local  # read by the Neuron compiler when it first compiles
    return NodeLocalCache(shared=url, local=local)


def sync_new_neuron_graphs(cache: NodeLocalCache) -> int:
    """Upload the complete entries this node compiled that the shared cache lacks; return how many.

    Files are written only if absent (S3's If-None-Match: *, or a hard link); model.done goes last.
    s3fs's multipart uploads skip the condition; for those the listing is the check.
    """
    shared = Storage(cache.shared)
    present = set(shared.walk_files())  # one listing per node
    files = [
        rel
        for rel in Storage(cache.local).walk_files()
        if not rel.endswith((".lock", _LOCALIZED)) and ".tmp-" not in rel
    ]
    entries = [rel[: -len(NEURON_ENTRY_DONE) - 1] for rel in files if rel.endswith(f"/{NEURON_ENTRY_DONE}")]
    uploaded = written = 0
    for entry in entries:
        done = f"{entry}/{NEURON_ENTRY_DONE}"
        if done in present:
            continue
        for rel in [*(f for f in files if f.startswith(f"{entry}/") and f != done), done]:
            if rel not in present:
                written += _put_if_absent(shared, os.path.join(cache.local, *rel.split("/")), rel)
        uploaded += 1
    log.info(
        "Neuron compile cache: %d new graph(s) compiled on this node, %d file(s) written to %s",
        uploaded, written, cache.shared,
    )  # fmt: skip
    return uploaded


SHARE_EVERY_ENV = "HLAT_NEURON_CACHE_SHARE_SECONDS"
"""How often a running trn1 job shares its newly compiled graphs (default 600 s)."""


class NeuronGraphSharing:
    """`with NeuronGraphSharing(cache):` shares a trn1 job's new graphs every `every` seconds and at the end.

    One thread on local rank 0; no sync point added; failures are only logged.
    """

    def __init__(self, cache: NodeLocalCache | None, every: float | None = None) -> None:
        self.cache = cache if cache is not None and os.environ.get("LOCAL_RANK", "0") == "0" else None
        self.every = every if every is not None else float(os.environ.get(SHARE_EVERY_ENV, "600"))
        self.rounds = 0
        """Sharing rounds finished (the periodic ones and the last)."""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> NeuronGraphSharing:
        if self.cache is not None:
            self._thread = threading.Thread(target=self._periodically, name="hlat-neuron-graphs", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cache is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.share()

    def _periodically(self) -> None:
        while not self._stop.wait(self.every):
            self.share()

    def share(self) -> None:
        """One round, now (never two at once)."""
        if self.cache is None:
            return
        with self._lock:
            try:
                sync_new_neuron_graphs(self.cache)
            except (StorageError, OSError) as exc:
                log.warning("Neuron compile cache: new graphs not shared (%s); later jobs compile them again", exc)
            self.rounds += 1


def _put_if_absent(shared: Storage, local_path: str, rel: str) -> bool:
    """Write `local_path` to `rel` atomically unless something is there (then False)."""
    if shared.is_local:
        target = shared.path(rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.tmp-{os.getpid()}"
        shutil.copyfile(local_path, tmp)
        try:
            os.link(tmp, target)  # fails when the target exists: no overwrite, and never a half-written file
        except FileExistsError:
            return False
        finally:
            os.remove(tmp)
        return True
    with storage_errors(shared.uri(rel)):
        try:
            shared.fs.put_file(local_path, shared.path(rel), mode="create")
        except FileExistsError:  # s3fs's answer to S3's 412 on If-None-Match
            return False
    return True


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _shown(value: Any) -> str:
    if value is None:
        return "(none)"
    return value if isinstance(value, str) else json.dumps(value)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")  # not datetime.UTC: Python 3.10


def human_bytes(size: float) -> str:
    """905930 -> '905.9 kB'."""
    if size < 1000:
        return f"{size:.0f} bytes"
    for unit in ("kB", "MB", "GB"):
        size /= 1000
        if size < 1000 or unit == "GB":
            break
    return f"{size:.1f} {unit}"
