"""Run storage: one small interface over local folders and s3:// (fsspec), with one-line errors.

`Storage(url)` is rooted at a folder or prefix; paths are relative to it. Whole-object writes are atomic. S3 faults
users cause become `StorageError`. S3 clients retry and time out (`S3_CLIENT_CONFIG`).
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import posixpath
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import IO, Any, cast

import fsspec


class StorageError(RuntimeError):
    """A storage operation failed for a reason the user can fix; the message is one line."""


class StorageNotFound(StorageError, FileNotFoundError):
    """The object or folder does not exist."""


class TransientStorageError(StorageError):
    """A fault worth retrying (throttling, timeouts, connection resets)."""


_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError", "503"}


def is_transient(exc: BaseException | None) -> bool:
    """Whether a fault anywhere in the exception's chain is worth retrying (throttling, timeouts, resets, 5xx codes)."""
    from botocore import exceptions as bexc

    transient: tuple[type[BaseException], ...] = (
        TransientStorageError,
        ConnectionError,
        TimeoutError,
        bexc.EndpointConnectionError,
        bexc.ConnectionClosedError,
        bexc.ReadTimeoutError,
    )
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, transient):
            return True
        if isinstance(exc, bexc.ClientError) and exc.response.get("Error", {}).get("Code") in _TRANSIENT_API_CODES:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


_TRANSIENT_API_CODES = _TRANSIENT_CODES | {"ServiceUnavailable", "InternalFailure", "RequestLimitExceeded"}


# botocore's config for every S3 Storage unless the caller passes its own. "adaptive" retries back off on throttling,
# 5xx and connection errors, and rate-limit the client after SlowDown
# (https://boto3.amazonaws.com/v1/documentation/api/latest/guide/retries.html). 10 attempts give S3 about a minute to
# scale a prefix. A 512 MiB part takes ~11 s at 50 MB/s, so a 120 s read timeout means a stuck connection.
S3_MAX_POOL_CONNECTIONS = 64
"""Connections one S3 client keeps, and reads a caller sends together (`Storage.parallel_reads`).

botocore's default is 10; 64 lets rank 0 read 8,191 manifests within the stop grace (docs/multi-host.md)."""
S3_CLIENT_CONFIG: dict[str, Any] = {
    "retries": {"mode": "adaptive", "total_max_attempts": 10},
    "connect_timeout": 10,
    "read_timeout": 120,
    "max_pool_connections": S3_MAX_POOL_CONNECTIONS,
}


def _is_s3(url: str) -> bool:
    return url.startswith(("s3://", "s3a://"))


@contextlib.contextmanager
def storage_errors(uri: str) -> Iterator[None]:
    """Turn fsspec/botocore exceptions raised while touching `uri` into StorageErrors."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        translated = translate_error(exc, uri)
        if translated is exc:
            raise  # not a storage fault we know: re-raise as is (not `raise exc from exc`, a cycle)
        raise translated from exc


def translate_error(exc: BaseException, uri: str) -> BaseException:
    """The StorageError explaining `exc`, or `exc` itself when it is not a known storage fault."""
    from botocore import exceptions as bexc

    text = f"{type(exc).__name__}: {exc}"
    bucket = uri.split("/")[2] if _is_s3(uri) else ""
    # Match error codes with the path removed (with and without 's3://'): '.../shard-00503.parquet' is no 503.
    bare = uri.split("://", 1)[-1]
    text = text.replace(uri, "<path>").replace(bare, "<path>") if bare else text
    if (
        isinstance(exc, bexc.NoCredentialsError | bexc.PartialCredentialsError)
        or "Unable to locate credentials" in text
    ):
        return StorageError(
            f"no AWS credentials to reach {uri}: set AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or run with an instance/task role"
        )
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return StorageNotFound(f"bucket {bucket!r} does not exist (from {uri}): create it or fix storage.root")
    if isinstance(exc, PermissionError) or any(
        code in text for code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden")
    ):
        return StorageError(
            f"access denied to {uri}: the AWS credentials in use lack permission for this bucket or prefix "
            "(check the IAM policy, the bucket policy and AWS_PROFILE)"
        )
    if isinstance(exc, FileNotFoundError):
        return StorageNotFound(f"{uri} does not exist")
    if any(code in text for code in _TRANSIENT_CODES) or isinstance(
        exc,
        bexc.EndpointConnectionError | bexc.ConnectionClosedError | bexc.ReadTimeoutError | ConnectionError,
    ):
        return TransientStorageError(f"transient storage fault on {uri}: {text.splitlines()[0]}")
    return exc


class _PartWriter:
    """Feeds an s3fs upload at most one part per write; s3fs buffers each write whole, doubling memory."""

    def __init__(self, upload: Any) -> None:
        self._upload = upload
        self._part = int(upload.blocksize)

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        for start in range(0, view.nbytes, self._part):
            self._upload.write(view[start : start + self._part])
        return view.nbytes

    def flush(self) -> None:
        self._upload.flush()


def _sync_file_range() -> Any:
    """Linux's sync_file_range(2) through libc, or None: start writing a file range back without waiting."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages in the range, do not wait
_WRITEBACK_EVERY = 64 << 20


class _WritebackFile:
    """A local file written whole that starts the disk's writeback every 64 MiB, not all at fsync
    (docs/benchmarks.md)."""

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh
        self._written = 0
        self._started = 0

    def write(self, data: Any) -> int:
        n = self._fh.write(data)
        self._written += n
        if _SYNC_FILE_RANGE is not None and self._written - self._started >= _WRITEBACK_EVERY:
            self._fh.flush()
            # Advisory: a failure here (EINVAL on odd filesystems) just leaves the writeback to fsync.
            _SYNC_FILE_RANGE(self._fh.fileno(), self._started, self._written - self._started, _SYNC_FILE_RANGE_WRITE)
            self._started = self._written
        return n

    def flush(self) -> None:
        self._fh.flush()


class Storage:
    """A folder (local path or s3:// prefix) that stages read and write through relative paths."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        url = str(url)
        if not _is_s3(url) and "://" not in url:
            url = os.path.abspath(os.path.expanduser(url))
        self.url = url.rstrip("/")
        self._options = storage_options
        if _is_s3(url):
            # Fresh instances and no listing cache: credentials and objects may change between calls.
            config = {**S3_CLIENT_CONFIG, **storage_options.get("config_kwargs", {})}
            storage_options = {
                "skip_instance_cache": True,
                "use_listings_cache": False,
                **storage_options,
                "config_kwargs": config,
            }
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **storage_options)
        self.is_local = not _is_s3(url) and self.fs.protocol in ("file", ("file", "local"), "local")

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    @property
    def parallel_reads(self) -> int:
        """Reads a caller should have in flight: an S3 storage's connection pool, else 16."""
        if not _is_s3(self.url):
            return 16
        config = {**S3_CLIENT_CONFIG, **self._options.get("config_kwargs", {})}
        return int(config.get("max_pool_connections") or 10)

    @property
    def block_size(self) -> int | None:
        """The S3 part size this storage's options ask for (default_block_size), or None."""
        value = self._options.get("default_block_size")
        return int(value) if value else None

    def child(self, *parts: str) -> Storage:
        return Storage(self.uri(*parts), **self._options)

    def parent(self) -> Storage:
        return Storage(self.url.rpartition("/")[0] or "/", **self._options)

    def path(self, *parts: str) -> str:
        """Filesystem path of a relative path, as fsspec sees it."""
        return posixpath.join(self.root, *parts) if parts else self.root

    def uri(self, *parts: str) -> str:
        """Full URL of a relative path, as messages show it."""
        return "/".join([self.url, *[p.strip("/") for p in parts if p]])

    # -- reading -----------------------------------------------------------------------------------------
    def exists(self, rel: str = "") -> bool:
        with storage_errors(self.uri(rel)):
            return bool(self.fs.exists(self.path(rel)))

    def require(self, rel: str = "", what: str = "") -> None:
        """Raise StorageNotFound unless the path exists, saying if the whole bucket is missing."""
        if self.exists(rel):
            return
        uri = self.uri(rel)
        prefix = f"{what}: " if what else ""
        if _is_s3(uri):
            bucket = uri.split("/")[2]
            with storage_errors(uri):
                bucket_exists = self.fs.exists(bucket)
            if not bucket_exists:
                raise StorageNotFound(
                    f"{prefix}bucket {bucket!r} does not exist (from {uri}): create it or fix the URI"
                )
        raise StorageNotFound(f"{prefix}{uri} does not exist")

    def read_bytes(self, rel: str, part_size: int | None = None, one_request: bool = False) -> bytes:
        """A whole object; `one_request` skips S3's HEAD for objects known to be small.

        Large S3 objects are read in concurrent ranged GETs of `part_size` (default: the block size)."""
        with storage_errors(self.uri(rel)):
            options: dict[str, Any] = {}
            if _is_s3(self.url):
                options = {"max_concurrency": 1} if one_request else {"chunksize": part_size} if part_size else {}
            data: bytes = self.fs.cat_file(self.path(rel), **options)
            return data

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object, in one ranged GET on S3."""
        with storage_errors(self.uri(rel)):
            data: bytes = self.fs.cat_file(self.path(rel), start=start, end=end)
            return data

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode("utf-8")

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def size(self, rel: str) -> int:
        with storage_errors(self.uri(rel)):
            return int(self.fs.size(self.path(rel)))

    def modified(self, rel: str) -> float:
        """When the object was last written, in epoch seconds by the store's clock: mtime, or S3's LastModified."""
        with storage_errors(self.uri(rel)):
            if self.is_local:
                return os.stat(self.path(rel)).st_mtime
            info = self.fs.info(self.path(rel))
        for key in ("LastModified", "last_modified", "mtime", "updated", "created"):
            value = info.get(key)
            if value is None:
                continue
            if hasattr(value, "timestamp"):
                return float(value.timestamp())
            if isinstance(value, int | float):
                return float(value)
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
        raise StorageError(f"{self.uri(rel)}: the store reports no modification time ({sorted(info)})")

    def list(self, rel: str = "") -> list[str]:
        """Names directly under a folder, sorted; empty when it does not exist."""
        with storage_errors(self.uri(rel)):
            if not self.fs.exists(self.path(rel)):
                return []
            entries = self.fs.ls(self.path(rel), detail=False)
        return sorted(posixpath.basename(str(e).rstrip("/")) for e in entries)

    # `builtins.list`: inside this class body `list` names the method above (mypy: "not valid as a type").
    def walk_files(self, rel: str = "") -> builtins.list[str]:
        base = self.path(rel)
        with storage_errors(self.uri(rel)):
            if not self.fs.exists(base):
                return []
            found = self.fs.find(base)
        prefix = self.root.rstrip("/") + "/"
        return sorted(str(f)[len(prefix) :] if str(f).startswith(prefix) else str(f) for f in found)

    @contextlib.contextmanager
    def open(self, rel: str, mode: str = "rb") -> Iterator[IO[Any]]:
        """Stream a file. Writes through open() are not atomic: prefer write_bytes or atomic_writer."""
        with storage_errors(self.uri(rel)):
            if "w" in mode and self.is_local:
                os.makedirs(os.path.dirname(self.path(rel)), exist_ok=True)
            with self.fs.open(self.path(rel), mode) as fh:
                yield fh

    # -- writing -----------------------------------------------------------------------------------------
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole object atomically."""
        target = self.path(rel)
        with storage_errors(self.uri(rel)):
            if self.is_local:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
                try:
                    with open(tmp, "wb") as fh:
                        fh.write(data)
                        fh.flush()
                        os.fsync(fh.fileno())
                    os.replace(tmp, target)
                except BaseException:
                    # A failed write must leave no stray .tmp file for list() and walk_files() to report.
                    with contextlib.suppress(OSError):
                        os.remove(tmp)
                    raise
            else:
                self.fs.pipe_file(target, data)

    @contextlib.contextmanager
    def atomic_writer(self, rel: str, part_size: int | None = None) -> Iterator[IO[bytes]]:
        """A binary file to stream one object into: whole when the block ends, absent when it raises.

        For objects too big to hold twice. Local: a temporary file, fsynced and renamed. S3: a multipart upload of
        `part_size` parts, visible on close, aborted on error."""
        uri, target = self.uri(rel), self.path(rel)
        if self.is_local:
            with storage_errors(uri):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
                fh = open(tmp, "wb")  # noqa: SIM115 (closed below, before the rename or on error)
            try:
                with storage_errors(uri):
                    yield cast(IO[bytes], _WritebackFile(fh))
                    fh.flush()
                    os.fsync(fh.fileno())
                    fh.close()
                    os.replace(tmp, target)
            except BaseException:
                # As in write_bytes: no stray .tmp file next to the real ones.
                fh.close()
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise
        elif _is_s3(self.url):
            with storage_errors(uri):
                upload = self.fs.open(target, "wb", **({"block_size": part_size} if part_size else {}))
            try:
                with storage_errors(uri):
                    yield cast(IO[bytes], _PartWriter(upload))
                    upload.close()  # completes the upload: the object appears now, whole
            except BaseException:
                # Not close(), which would publish the partial object: discard() aborts the upload, and marking the
                # file closed keeps __del__ from publishing it later.
                with contextlib.suppress(Exception):
                    upload.discard()
                upload.closed = True
                raise
        else:
            buffer = io.BytesIO()
            yield buffer
            self.write_bytes(rel, buffer.getvalue())

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode("utf-8"))

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_text(rel, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")

    def put_file(self, local_path: str, rel: str) -> None:
        """Upload or copy a local file to a relative path, atomically for local targets."""
        with storage_errors(self.uri(rel)):
            if self.is_local:
                with open(local_path, "rb") as fh:
                    self.write_bytes(rel, fh.read())
            else:
                self.fs.put_file(local_path, self.path(rel))

    def get_file(self, rel: str, local_path: str) -> None:
        with storage_errors(self.uri(rel)):
            os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
            self.fs.get_file(self.path(rel), local_path)

    def remove(self, rel: str, recursive: bool = False) -> None:
        """Delete a file, or a folder with recursive=True; missing paths are ignored."""
        with storage_errors(self.uri(rel)):
            if self.fs.exists(self.path(rel)):
                self.fs.rm(self.path(rel), recursive=recursive)

    def abort_incomplete_uploads(self, rel: str = "") -> int:
        """Abort what killed writers left under a folder; return how many.

        S3: incomplete multipart uploads, hidden from listings but billed
        (https://docs.aws.amazon.com/AmazonS3/latest/userguide/mpu-abort-incomplete-mpu-lifecycle-config.html).
        Local: stray `.tmp-*` files. Call it only when no writer is at work there."""
        uri = self.uri(rel)
        if self.is_local:
            removed = 0
            base = self.path(rel)
            for folder, _, names in os.walk(base):
                for name in names:
                    if ".tmp-" in name:
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(os.path.join(folder, name))
                            removed += 1
            return removed
        if not _is_s3(self.url):
            return 0
        bucket, _, key = self.path(rel).partition("/")
        prefix = key.rstrip("/") + "/" if key else ""
        aborted = 0
        with storage_errors(uri):
            for upload in self._list_uploads(bucket, prefix):
                # NoSuchUpload: completed or aborted meanwhile (another job's clean-up): nothing left to do.
                with contextlib.suppress(FileNotFoundError):
                    self.fs.call_s3(
                        "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    aborted += 1
        return aborted

    def _list_uploads(self, bucket: str, prefix: str) -> builtins.list[dict[str, Any]]:
        uploads: builtins.list[dict[str, Any]] = []
        markers: dict[str, str] = {}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            uploads += page.get("Uploads", [])
            if not page.get("IsTruncated"):
                return uploads
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def check_writable(self) -> None:
        """Fail early, in one line, when the root cannot be written."""
        probe = f".hlat-write-probe-{uuid.uuid4().hex[:8]}"
        self.write_bytes(probe, b"ok")
        self.remove(probe)


class StorageClock:
    """One clock for a job's hosts and its supervisor: the store's.

    `now()` writes and reads back a tiny probe. Only differences of store times mean anything."""

    def __init__(self, storage: Storage, probe: str = ".hlat-clock-probe") -> None:
        self.storage, self.probe = storage, probe

    def modified(self, rel: str) -> float | None:
        """When `rel` was last written (None: it does not exist)."""
        try:
            return self.storage.modified(rel)
        except StorageNotFound:
            return None

    def now(self) -> float:
        """The probe's modification time right after writing it."""
        self.storage.write_bytes(self.probe, b"")
        return self.storage.modified(self.probe)

    def age(self, rel: str) -> float | None:
        """Seconds, by the store's clock, since `rel` was written (None: it does not exist)."""
        written = self.modified(rel)
        return None if written is None else max(0.0, self.now() - written)
