"""`Storage` and `open_run` against real moto S3 servers over HTTP (see conftest.py)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from hlat.core.config import ConfigError
from hlat.core.presets import load_config
from hlat.core.run import CONFIG_FILE, open_run
from hlat.core.storage import Storage, StorageError, StorageNotFound, TransientStorageError

# Fixture types (tests/integration is not a package, so conftest's classes are not imported by name).
S3Env = Any
IamS3 = Any


def assert_one_line(exc: BaseException) -> str:
    message = str(exc)
    assert message
    assert "\n" not in message, message
    assert "Traceback" not in message, message
    return message


def object_keys(env: S3Env) -> list[str]:
    listed = env.client().list_objects_v2(Bucket=env.bucket)
    return sorted(obj["Key"] for obj in listed.get("Contents", []))


# -- round trips ---------------------------------------------------------------------------------------------
def test_bytes_text_json_round_trip(s3_env: S3Env) -> None:
    store = Storage(s3_env.url)
    store.write_bytes("a/blob.bin", b"\x00\x01binary\xff")
    store.write_text("a/note.txt", "héllo\n")
    store.write_json("meta.json", {"b": [1, 2], "a": "x"})

    assert store.read_bytes("a/blob.bin") == b"\x00\x01binary\xff"
    assert store.read_text("a/note.txt") == "héllo\n"
    assert store.read_json("meta.json") == {"a": "x", "b": [1, 2]}
    # The objects really are on the server, under the prefix.
    assert object_keys(s3_env) == ["prefix/a/blob.bin", "prefix/a/note.txt", "prefix/meta.json"]
    body = s3_env.client().get_object(Bucket=s3_env.bucket, Key="prefix/a/note.txt")["Body"].read()
    assert body == "héllo\n".encode()

    store.write_text("a/note.txt", "overwritten")
    assert store.read_text("a/note.txt") == "overwritten"


def test_exists_list_walk_size(s3_env: S3Env) -> None:
    store = Storage(s3_env.url)
    store.write_bytes("data/shard-0.parquet", b"12345")
    store.write_bytes("data/sub/deep.txt", b"xy")
    store.write_bytes("top.txt", b"")
    # Written behind Storage's back: visible at once (no listing cache).
    s3_env.client().put_object(Bucket=s3_env.bucket, Key="prefix/data/external.bin", Body=b"abc")

    assert store.exists("top.txt")
    assert store.exists("data")
    assert store.exists("data/external.bin")
    assert not store.exists("missing.txt")
    assert store.list() == ["data", "top.txt"]
    assert store.list("data") == ["external.bin", "shard-0.parquet", "sub"]
    assert store.list("no-such-folder") == []
    assert store.walk_files() == ["data/external.bin", "data/shard-0.parquet", "data/sub/deep.txt", "top.txt"]
    assert store.walk_files("data/sub") == ["data/sub/deep.txt"]
    assert store.walk_files("nothing-here") == []
    assert store.size("data/shard-0.parquet") == 5
    assert store.size("top.txt") == 0


def test_open_streams_reads_and_writes(s3_env: S3Env) -> None:
    store = Storage(s3_env.url)
    payload = b"".join(f"line {i}\n".encode() for i in range(20_000))  # ~200 KB, several reads
    with store.open("stream/log.txt", "wb") as fh:
        for start in range(0, len(payload), 4096):
            fh.write(payload[start : start + 4096])
    assert store.size("stream/log.txt") == len(payload)

    with store.open("stream/log.txt", "rb") as fh:
        head = fh.read(7)
        fh.seek(len(payload) - 11)
        tail = fh.read()
    assert head == b"line 0\n"
    assert tail == b"line 19999\n"

    with store.open("stream/text.txt", "w") as fh:
        fh.write("text mode\n")
    with store.open("stream/text.txt", "r") as fh:
        assert fh.read() == "text mode\n"


def test_put_file_and_get_file(s3_env: S3Env, tmp_path: Path) -> None:
    store = Storage(s3_env.url)
    source = tmp_path / "model.bin"
    source.write_bytes(b"weights" * 1000)
    store.put_file(str(source), "ckpt/model.bin")
    assert store.size("ckpt/model.bin") == 7000

    target = tmp_path / "down" / "nested" / "model.bin"
    store.get_file("ckpt/model.bin", str(target))
    assert target.read_bytes() == source.read_bytes()

    with pytest.raises(StorageNotFound) as info:
        store.get_file("ckpt/missing.bin", str(tmp_path / "x.bin"))
    assert "ckpt/missing.bin" in assert_one_line(info.value)


def test_remove_file_folder_and_missing(s3_env: S3Env) -> None:
    store = Storage(s3_env.url)
    store.write_bytes("keep.txt", b"k")
    store.write_bytes("gone.txt", b"g")
    store.write_bytes("folder/a.txt", b"a")
    store.write_bytes("folder/sub/b.txt", b"b")

    store.remove("gone.txt")
    assert not store.exists("gone.txt")
    store.remove("folder", recursive=True)
    assert not store.exists("folder/a.txt")
    assert store.walk_files() == ["keep.txt"]
    store.remove("never-existed.txt")  # ignored
    assert object_keys(s3_env) == ["prefix/keep.txt"]


def test_missing_object_is_not_found(s3_env: S3Env) -> None:
    store = Storage(s3_env.url)
    for call in (lambda: store.read_bytes("nope.txt"), lambda: store.size("nope.txt")):
        with pytest.raises(StorageNotFound) as info:
            call()
        message = assert_one_line(info.value)
        assert f"s3://{s3_env.bucket}/prefix/nope.txt" in message
        assert isinstance(info.value, FileNotFoundError)


def test_child_is_rooted_at_sub_prefix(s3_env: S3Env) -> None:
    store = Storage(s3_env.url)
    child = store.child("run-1", "data")
    assert child.url == f"s3://{s3_env.bucket}/prefix/run-1/data"
    assert child.uri("x.json") == f"s3://{s3_env.bucket}/prefix/run-1/data/x.json"
    child.write_json("x.json", {"ok": True})
    assert store.read_json("run-1/data/x.json") == {"ok": True}
    assert child.list() == ["x.json"]
    assert child.walk_files() == ["x.json"]
    assert store.walk_files() == ["run-1/data/x.json"]


def test_check_writable_leaves_nothing_behind(s3_env: S3Env) -> None:
    store = Storage(s3_env.url)
    store.check_writable()
    assert object_keys(s3_env) == []
    # The bucket root itself works as a storage root too.
    Storage(f"s3://{s3_env.bucket}").check_writable()
    assert object_keys(s3_env) == []


# -- runs on S3 ----------------------------------------------------------------------------------------------
def test_open_run_writes_config_once_and_refuses_a_different_one(s3_env: S3Env) -> None:
    config = load_config("tiny", run_id="exp-1", storage=s3_env.url)
    run = open_run(config)
    assert run.run_id == "exp-1"
    assert run.uri == f"{s3_env.url}/exp-1"
    assert object_keys(s3_env) == [f"prefix/exp-1/{CONFIG_FILE}"]
    stored = run.storage.read_json(CONFIG_FILE)
    assert stored["run_id"] == "exp-1"
    assert stored["training"]["lr"] == config.training.lr
    assert run.load_config().fingerprint() == config.fingerprint()

    # Same config again: accepted, config.json untouched.
    before = s3_env.client().head_object(Bucket=s3_env.bucket, Key=f"prefix/exp-1/{CONFIG_FILE}")["ETag"]
    assert open_run(load_config("tiny", run_id="exp-1", storage=s3_env.url)).run_id == "exp-1"
    after = s3_env.client().head_object(Bucket=s3_env.bucket, Key=f"prefix/exp-1/{CONFIG_FILE}")["ETag"]
    assert before == after

    new_lr = config.training.lr * 2
    changed = load_config("tiny", {"training.lr": new_lr}, run_id="exp-1", storage=s3_env.url)
    with pytest.raises(ConfigError) as info:
        open_run(changed)
    message = assert_one_line(info.value)
    assert "training.lr" in message
    assert f"training.lr: {config.training.lr} -> {new_lr}" in message
    assert "use another run id" in message and "--run-id" not in message  # the same words for CLI and UI runs
    assert run.storage.read_json(CONFIG_FILE)["training"]["lr"] == config.training.lr


# -- the errors users cause ----------------------------------------------------------------------------------
def test_missing_bucket_is_not_found_naming_the_bucket(s3_env: S3Env) -> None:
    bucket = f"hlat-missing-{uuid.uuid4().hex[:8]}"
    store = Storage(f"s3://{bucket}/runs")
    for call in (store.check_writable, lambda: store.read_bytes("config.json")):
        with pytest.raises(StorageNotFound) as info:
            call()
        message = assert_one_line(info.value)
        assert repr(bucket) in message
        assert "does not exist" in message
    with pytest.raises(StorageNotFound):
        open_run(load_config("tiny", storage=f"s3://{bucket}/runs"))


def test_no_credentials_says_so(s3_no_credentials: S3Env) -> None:
    store = Storage(s3_no_credentials.url)
    for call in (store.check_writable, lambda: store.read_bytes("x.txt"), lambda: store.exists("x.txt")):
        with pytest.raises(StorageError) as info:
            call()
        assert not isinstance(info.value, StorageNotFound | TransientStorageError)
        message = assert_one_line(info.value)
        assert "credentials" in message
        assert s3_no_credentials.url in message


def test_access_denied_by_iam_policy(s3_denied: IamS3) -> None:
    # The key is valid: the bucket its policy allows can be written.
    allowed = Storage(f"s3://{s3_denied.allowed_bucket}/runs")
    allowed.check_writable()
    allowed.write_text("ok.txt", "fine")
    assert allowed.read_text("ok.txt") == "fine"

    denied = Storage(f"s3://{s3_denied.denied_bucket}/runs")
    for call in (
        denied.check_writable,
        lambda: denied.read_bytes("config.json"),
        lambda: denied.write_text("a.txt", "b"),
    ):
        with pytest.raises(StorageError) as info:
            call()
        assert not isinstance(info.value, StorageNotFound | TransientStorageError)
        message = assert_one_line(info.value)
        assert "access denied" in message
        assert s3_denied.denied_bucket in message


def test_unknown_access_key_is_access_denied(s3_denied: IamS3, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    with pytest.raises(StorageError) as info:
        Storage(f"s3://{s3_denied.allowed_bucket}/runs").check_writable()
    assert "access denied" in assert_one_line(info.value)
