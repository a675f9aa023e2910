"""`Storage` on a local folder: the same interface the S3 integration tests exercise."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from botocore.exceptions import ClientError, NoCredentialsError

from hlat.core.storage import Storage, StorageError, StorageNotFound, TransientStorageError, translate_error


def assert_one_line(exc: BaseException) -> str:
    message = str(exc)
    assert message
    assert "\n" not in message, message
    assert "Traceback" not in message, message
    return message


def files_on_disk(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_paths_are_absolute_and_relative_to_the_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = Storage("runs/")
    assert store.is_local
    assert store.url == str(tmp_path / "runs")
    assert store.uri("a", "b.json") == str(tmp_path / "runs" / "a" / "b.json")
    assert store.child("x").url == str(tmp_path / "runs" / "x")


def test_write_is_atomic_and_overwrites(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    store.write_bytes("deep/nested/blob.bin", b"first")
    store.write_bytes("deep/nested/blob.bin", b"second, longer")
    store.write_text("note.txt", "héllo")
    store.write_json("meta.json", {"b": 1, "a": [1, 2]})

    assert store.read_bytes("deep/nested/blob.bin") == b"second, longer"
    assert store.read_text("note.txt") == "héllo"
    assert store.read_json("meta.json") == {"a": [1, 2], "b": 1}
    assert (tmp_path / "meta.json").read_text().endswith("\n")
    # No temporary files left behind.
    assert files_on_disk(tmp_path) == ["deep/nested/blob.bin", "meta.json", "note.txt"]


def test_failed_write_keeps_the_old_file_and_no_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Storage(str(tmp_path))
    store.write_bytes("config.json", b"old")

    def disk_full(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left"):
        store.write_bytes("config.json", b"new")
    monkeypatch.undo()

    assert store.read_bytes("config.json") == b"old"
    assert files_on_disk(tmp_path) == ["config.json"]
    assert store.list() == ["config.json"]


def test_missing_file_is_not_found_in_one_line(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    for call in (
        lambda: store.read_bytes("nope.txt"),
        lambda: store.read_json("nope.txt"),
        lambda: store.size("nope.txt"),
        lambda: store.get_file("nope.txt", str(tmp_path / "copy.txt")),
    ):
        with pytest.raises(StorageNotFound) as info:
            call()
        assert isinstance(info.value, FileNotFoundError)
        assert assert_one_line(info.value) == f"{tmp_path / 'nope.txt'} does not exist"
    with pytest.raises(StorageNotFound), store.open("nope.txt") as fh:
        fh.read()


def test_exists_list_and_walk_files(tmp_path: Path) -> None:
    store = Storage(str(tmp_path / "root"))
    assert store.list() == []  # the root itself does not exist yet
    assert store.walk_files() == []
    assert not store.exists()

    store.write_bytes("data/shard-1.parquet", b"1")
    store.write_bytes("data/shard-0.parquet", b"0")
    store.write_bytes("data/sub/deep.txt", b"d")
    store.write_bytes("top.txt", b"top")

    assert store.exists() and store.exists("data") and store.exists("data/sub/deep.txt")
    assert not store.exists("data/missing")
    assert store.list() == ["data", "top.txt"]
    assert store.list("data") == ["shard-0.parquet", "shard-1.parquet", "sub"]
    assert store.list("missing-folder") == []
    everything = ["data/shard-0.parquet", "data/shard-1.parquet", "data/sub/deep.txt", "top.txt"]
    assert store.walk_files() == everything
    # Paths stay relative to the storage root, not to the folder walked.
    assert store.walk_files("data/sub") == ["data/sub/deep.txt"]
    assert store.walk_files("missing-folder") == []
    assert store.size("top.txt") == 3
    assert store.child("data").walk_files() == ["shard-0.parquet", "shard-1.parquet", "sub/deep.txt"]


def test_open_streams_and_creates_folders(tmp_path: Path) -> None:
    store = Storage(str(tmp_path))
    with store.open("logs/run/metrics.jsonl", "w") as fh:
        for i in range(3):
            fh.write(f'{{"step": {i}}}\n')
    with store.open("logs/run/metrics.jsonl", "r") as fh:
        assert fh.read().splitlines() == ['{"step": 0}', '{"step": 1}', '{"step": 2}']
    with store.open("logs/run/metrics.jsonl") as fh:
        assert fh.read(10) == b'{"step": 0'


def test_put_get_remove_and_check_writable(tmp_path: Path) -> None:
    store = Storage(str(tmp_path / "store"))
    source = tmp_path / "src.bin"
    source.write_bytes(b"payload" * 100)
    store.put_file(str(source), "ckpt/step-1/model.bin")
    assert store.read_bytes("ckpt/step-1/model.bin") == source.read_bytes()
    store.get_file("ckpt/step-1/model.bin", str(tmp_path / "down" / "model.bin"))
    assert (tmp_path / "down" / "model.bin").read_bytes() == source.read_bytes()

    store.write_bytes("ckpt/step-2/model.bin", b"2")
    store.remove("ckpt/step-1", recursive=True)
    store.remove("does-not-exist")  # ignored
    assert store.walk_files() == ["ckpt/step-2/model.bin"]
    store.remove("ckpt/step-2/model.bin")
    assert store.walk_files() == []

    store.check_writable()
    assert files_on_disk(tmp_path / "store") == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores file permissions")
def test_read_only_folder_is_access_denied(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(StorageError) as info:
            Storage(str(locked)).check_writable()
        assert "access denied" in assert_one_line(info.value)
    finally:
        locked.chmod(0o700)


def test_a_path_that_looks_like_an_error_code_is_not_a_fault(tmp_path: Path) -> None:
    # '503' in a shard name once made "Is a directory" a transient (retried) fault.
    store = Storage(str(tmp_path))
    (tmp_path / "shard-00503.parquet").mkdir()
    with pytest.raises(IsADirectoryError) as info:
        store.read_bytes("shard-00503.parquet")
    assert not isinstance(info.value, StorageError)
    assert info.value.__cause__ is not info.value


def _client_error(code: str, message: str = "boom") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}}, "GetObject")


@pytest.mark.parametrize(
    ("exc", "kind", "words"),
    [
        (NoCredentialsError(), StorageError, "no AWS credentials"),
        (_client_error("NoSuchBucket", "The specified bucket does not exist"), StorageNotFound, "'bkt'"),
        (_client_error("AccessDenied", "Access Denied"), StorageError, "access denied"),
        (PermissionError("Forbidden"), StorageError, "access denied"),
        (FileNotFoundError("bkt/runs/x"), StorageNotFound, "s3://bkt/runs/x does not exist"),
        (_client_error("SlowDown", "Reduce your request rate.\nmore"), TransientStorageError, "SlowDown"),
        (ConnectionResetError("reset by peer"), TransientStorageError, "transient"),
    ],
)
def test_translate_error(exc: BaseException, kind: type, words: str) -> None:
    translated = translate_error(exc, "s3://bkt/runs/x")
    assert type(translated) is kind
    assert words in assert_one_line(translated)


def test_translate_error_keeps_unknown_errors() -> None:
    error = ValueError("not a storage problem")
    assert translate_error(error, "s3://bkt/runs/x") is error
    path_error = IsADirectoryError(21, "Is a directory", "bkt/runs/InternalError-503")
    assert translate_error(path_error, "s3://bkt/runs/InternalError-503") is path_error


def test_a_large_atomic_write_starts_its_writeback_as_it_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from hlat.core import storage

    if sys.platform.startswith("linux"):
        assert storage._SYNC_FILE_RANGE is not None  # libc's sync_file_range was found
    calls: list[tuple[int, int]] = []

    def record(fd: int, offset: int, nbytes: int, flags: int) -> int:
        assert flags == storage._SYNC_FILE_RANGE_WRITE
        calls.append((offset, nbytes))
        return 0

    monkeypatch.setattr(storage, "_SYNC_FILE_RANGE", record)
    monkeypatch.setattr(storage, "_WRITEBACK_EVERY", 1000)
    chunk = bytes(range(256)) * 3  # 768 bytes a write
    with Storage(str(tmp_path)).atomic_writer("big.bin") as out:
        for _ in range(10):
            out.write(chunk)
    assert (tmp_path / "big.bin").read_bytes() == chunk * 10
    # every ~1000 bytes the range written since the last call, in order, without gaps
    assert calls[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(calls))
    assert len(calls) == 5 and sum(n for _, n in calls) == 7680
