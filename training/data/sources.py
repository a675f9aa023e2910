"""Corpus sources for prepare-data: what a source is, its fingerprint, and opening a hub data set.

A source is a hub data set name, an s3:// URI, a local file or folder (jsonl/json, parquet, txt),
or `builtin:python-stdlib`, an offline corpus built from the installed standard library.
Rules:
- files are cut into units and streamed by training.data.reader; hub data sets open here via `datasets`.
- the hub endpoint is probed once first: if silent, the load goes offline at once instead of retrying for minutes.
- offline without a cached copy fails at once with a SourceError saying what to do.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import re
import sys
import sysconfig
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hlat.core.config import ConfigError, DataConfig
from hlat.core.storage import Storage

log = logging.getLogger("hlat.data")

BUILTIN_STDLIB = "builtin:python-stdlib"
_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_FORMAT_BUILDER = {"jsonl": "json", "parquet": "parquet", "txt": "text"}
# How long the probe of the Hugging Face hub waits for an answer before the hub counts as unreachable.
HUB_PROBE_SECONDS = 5.0
# Folders of the standard library that are tests, vendored wheels or third-party installs, not its own text.
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "_bundled"}


class SourceError(RuntimeError):
    """The corpus source cannot be read; the message says what to change."""


@dataclass(frozen=True)
class Source:
    kind: str  # "builtin" | "files" | "hub"
    builder: str | None  # datasets builder for files: json | parquet | text
    data_files: list[str]
    name: str


def cache_dir() -> Path:
    """Where hlat keeps rebuildable inputs (the builtin corpus); HLAT_CACHE_DIR overrides."""
    return Path(os.environ.get("HLAT_CACHE_DIR", Path.home() / ".cache" / "hlat"))


# -- the offline corpus -----------------------------------------------------------------------------------
def stdlib_documents() -> Iterator[dict[str, str]]:
    """Standard-library documents in a fixed order: per module its docstrings, then its source."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _STDLIB_SKIP.intersection(p.relative_to(root).parts[:-1]))
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = path.relative_to(root).as_posix()
        docs = _docstrings(source)
        if docs:
            yield {"text": docs, "origin": f"{rel}#docstrings"}
        if source.strip():
            yield {"text": source, "origin": rel}


def _docstrings(source: str) -> str:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    nodes = [
        tree,
        *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)),
    ]
    texts = [d for n in nodes if (d := ast.get_docstring(n))]
    return "\n\n".join(texts)


def build_stdlib_corpus() -> Path:
    """Write the builtin corpus once per Python version; return its path."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    target = cache_dir() / "corpus" / f"python-stdlib-{version}.jsonl"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as fh:
        for doc in stdlib_documents():
            fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
    os.replace(tmp, target)
    log.info("built the offline corpus %s (%d bytes)", target, target.stat().st_size)
    return target


# -- resolving a source -----------------------------------------------------------------------------------
# An S3 bucket name (https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html) and a Hugging
# Face repository id (`namespace/name` or a bare name: letters, digits, '-', '_', '.'; no '--' or '..').
_S3_URI = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def source_kind(src: str) -> str:
    """'builtin', 's3', 'local' or 'hub', from data.source's shape alone."""
    if src.startswith("builtin:"):
        return "builtin"
    if src.startswith("s3://"):
        return "s3"
    local = Path(os.path.expanduser(src))
    if local.exists() or src.startswith((".", "/", "~")) or (os.sep in src and not _looks_like_hub_name(src)):
        return "local"
    return "hub"


def check_source(cfg: DataConfig) -> None:
    """Check what can be known of data.source without reading it; ConfigError names the fix."""
    src = cfg.source
    kind = source_kind(src)
    if kind == "builtin" and src != BUILTIN_STDLIB:
        raise ConfigError(f"data.source: unknown builtin corpus {src!r}; the builtin corpus is {BUILTIN_STDLIB!r}")
    if kind == "local" and not Path(os.path.expanduser(src)).exists():
        raise ConfigError(
            f"data.source: the local path {os.path.expanduser(src)!r} does not exist; give an existing file or "
            "folder (jsonl, json, parquet, txt), an s3:// URI, a Hugging Face dataset name or " + BUILTIN_STDLIB
        )
    if kind == "s3" and not _S3_URI.match(src):
        raise ConfigError(f"data.source: {src!r} is not an S3 URI; use s3://bucket/prefix (a bucket's naming rules)")
    if kind == "hub" and (not _HUB_ID.match(src) or "--" in src or ".." in src):
        raise ConfigError(
            f"data.source: {src!r} is neither an existing local path nor a Hugging Face dataset name "
            "(namespace/name: letters, digits, '-', '_', '.')"
        )


def resolve_source(cfg: DataConfig) -> Source:
    """Decide how to read data.source; missing paths and buckets fail here."""
    src = cfg.source
    kind = source_kind(src)
    if src == BUILTIN_STDLIB:
        return Source("builtin", "json", [str(build_stdlib_corpus())], src)
    if kind == "builtin":
        check_source(cfg)  # raises: an unknown builtin corpus
    if kind == "local" and not Path(os.path.expanduser(src)).exists():
        raise SourceError(f"data.source: local path {os.path.expanduser(src)!r} does not exist")
    if kind in ("s3", "local"):
        files = _list_data_files(src)
        builder = _builder_for(cfg, files)
        return Source("files", builder, files, src)
    return Source("hub", None, [], src)


def _looks_like_hub_name(src: str) -> bool:
    parts = src.split("/")
    return len(parts) == 2 and all(parts) and not src.startswith((".", "/", "~"))


def _list_data_files(src: str) -> list[str]:
    store = Storage(src)
    if src.startswith("s3://"):
        store.require(what="data.source")
        is_dir = store.fs.isdir(store.root)
    else:
        is_dir = os.path.isdir(store.root)
    if not is_dir:
        return [store.url]
    files = [store.uri(rel) for rel in store.walk_files() if Path(rel).suffix in _EXTENSIONS]
    if not files:
        raise SourceError(f"data.source: {src} holds no {', '.join(sorted(_EXTENSIONS))} files")
    return files


def _builder_for(cfg: DataConfig, files: list[str]) -> str:
    if cfg.file_format != "auto":
        return _FORMAT_BUILDER[cfg.file_format]
    kinds = {_EXTENSIONS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ConfigError(
            f"data.file_format: cannot tell the format of {cfg.source} from its file names "
            f"({sorted(Path(f).suffix or '(none)' for f in files)[:5]}); set data.file_format to jsonl, parquet or txt"
        )
    return kinds.pop()  # type: ignore[return-value]


def source_fingerprint(cfg: DataConfig) -> str:
    """The source's content, cheaply: file sizes and times (or ETags), or hub name and revision."""
    spec = resolve_source(cfg)
    parts: list[Any] = [spec.kind, spec.name, cfg.hf_config, cfg.split, cfg.revision]
    if spec.kind == "builtin":
        parts.append(sys.version)  # the builtin corpus is a function of the Python installation alone
    elif spec.kind == "files":
        for f in spec.data_files:
            store = Storage(f)
            info = store.fs.info(store.root)
            parts.append([f, info.get("size"), info.get("ETag") or info.get("mtime")])
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


# -- reading a hub data set (files are read by training.data.reader) -------------------------------------------
def _guarded(batches: Iterator[dict[str, list[Any]]], name: str) -> Iterator[dict[str, list[Any]]]:
    """Non-transient reading errors become one clear SourceError."""
    try:
        yield from batches
    except (ConnectionError, TimeoutError, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise SourceError(f"data.source: {name}: {_first_line(exc)}") from exc
        raise
    except Exception as exc:
        raise SourceError(f"data.source: cannot read {name}: {_first_line(exc)}") from exc


def _open_hub(cfg: DataConfig, datasets: Any) -> Any:
    from datasets.exceptions import DatasetNotFoundError

    unreachable = None
    # Not for a local folder (datasets reads it directly), nor in offline mode, nor behind an ALL_PROXY (a SOCKS
    # proxy, usually), which httpx follows and urllib does not.
    probe = not (datasets.config.HF_HUB_OFFLINE or os.path.isdir(cfg.source) or _env_any("ALL_PROXY", "all_proxy"))
    if probe:
        unreachable = hub_unreachable(datasets.config.HF_ENDPOINT)
    try:
        if unreachable is None:
            return datasets.load_dataset(
                cfg.source, cfg.hf_config, split=cfg.split, streaming=cfg.streaming, revision=cfg.revision
            )
        with _offline(datasets):
            dataset = datasets.load_dataset(
                cfg.source, cfg.hf_config, split=cfg.split, streaming=cfg.streaming, revision=cfg.revision
            )
        log.warning("the Hugging Face hub does not answer (%s): %s read from its cached copy", unreachable, cfg.source)
        return dataset
    except DatasetNotFoundError as exc:
        if unreachable:  # offline mode, no cached copy
            raise _unreachable(cfg, unreachable) from exc
        raise SourceError(
            f"data.source: Hugging Face dataset {cfg.source!r} was not found (or is gated): {_first_line(exc)}"
        ) from exc
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        if unreachable or any(
            k in text for k in ("Connect", "connect", "Offline", "offline", "resolve", "Timeout", "timed out")
        ):
            raise _unreachable(cfg, unreachable or _first_line(exc)) from exc
        raise SourceError(f"data.source: cannot load {cfg.source!r}: {_first_line(exc)}") from exc


def _unreachable(cfg: DataConfig, why: str) -> SourceError:
    return SourceError(
        f"data.source: cannot reach the Hugging Face hub for {cfg.source!r} ({why}); "
        "check the network or HF_ENDPOINT, or copy the data set to s3:// or a local folder and point "
        "data.source there"
    )


def _env_any(*names: str) -> bool:
    return any(os.environ.get(n) for n in names)


def hub_unreachable(endpoint: str, timeout: float = HUB_PROBE_SECONDS) -> str | None:
    """Why `endpoint` gives no HTTP answer within about `timeout` seconds, or None (any status answers).

    One HEAD request on a daemon thread, since name resolution has no timeout.
    """
    import ssl
    import urllib.error
    import urllib.request

    outcome: list[str | None] = []

    def probe() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout):
                outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)  # it answered
        except (urllib.error.URLError, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            answered = isinstance(reason, ssl.SSLError)
            outcome.append(None if answered else f"{endpoint}: {type(reason).__name__}: {reason}"[:300])
        except Exception:  # an endpoint urllib cannot even parse: let the hub's own client report it
            outcome.append(None)

    thread = threading.Thread(target=probe, name="hlat-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    return outcome[0] if outcome else f"{endpoint}: no answer in {timeout:.0f} s"


@contextmanager
def _offline(datasets: Any) -> Iterator[None]:
    """Hugging Face offline mode for one load: a cached copy or an error, at once."""
    from huggingface_hub import constants

    before = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = before


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
