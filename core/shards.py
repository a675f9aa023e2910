"""Prepared-data shards and their manifest: the contract between prepare-data and every later stage.

Shards are parquet (or jsonl) files with one column, `text`, written under `data/<shard_dir>/`. The
manifest (`data/manifest.json`) is written last and lists every shard with its rows, bytes and sha256; a
reader trusts only shards the manifest names, so a failed re-run never mixes with a good earlier output.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from hlat.core.layout import MANIFEST_FILE
from hlat.core.storage import Storage

Split = Literal["train", "validation"]


class ShardInfo(BaseModel):
    path: str
    """Path relative to the data/ folder."""
    split: Split
    rows: int
    bytes: int
    sha256: str


class DataManifest(BaseModel):
    """What prepare-data produced; `fingerprint` is the cache key of the stage run that wrote it."""

    fingerprint: str
    format: Literal["parquet", "jsonl"]
    text_column: str = "text"
    shards: list[ShardInfo]

    def rows(self, split: Split) -> int:
        return sum(s.rows for s in self.shards if s.split == split)

    def bytes(self, split: Split) -> int:
        return sum(s.bytes for s in self.shards if s.split == split)

    @property
    def checksum(self) -> str:
        """One hash over every shard's checksum: what later stages key their caches on."""
        return hashlib.sha256("".join(s.sha256 for s in self.shards).encode()).hexdigest()


MIXTURE_VERSION: Literal[2] = 2


class MixtureSource(BaseModel):
    """One prepared source of a run's mixture: where it lives and what it holds."""

    name: str
    weight: float
    """Its weight before any schedule entry (as configured; the loader normalises)."""
    max_epochs: float | None
    """The most passes over its training tokens the run may make; None: no limit."""
    folder: str
    """Absolute URI of the prepared source (its own manifest.json, shards, report.json): shared by every run under
    the storage root that prepares the same source with the same settings."""
    fingerprint: str
    """The source's cache key (its reader, validation, curation and shard settings and its content)."""
    checksum: str
    """Its manifest's checksum."""
    train_rows: int
    validation_rows: int
    train_bytes: int
    validation_bytes: int


class MixtureManifest(BaseModel):
    """A run's `data/manifest.json`: the prepared sources it trains on, their weights and the weight schedule."""

    version: Literal[2] = MIXTURE_VERSION
    fingerprint: str
    """The prepare-data stage's cache key that wrote it."""
    sources: list[MixtureSource]
    schedule: list[dict[str, Any]] = []
    """[{"step": s, "weights": {name: w}}, ...] as data.schedule gives it."""

    @property
    def checksum(self) -> str:
        """One hash over the sources (names, weights, shard checksums) and the schedule."""
        body = [[s.name, s.weight, s.checksum] for s in self.sources]
        return hashlib.sha256(json.dumps([body, self.schedule], sort_keys=True).encode()).hexdigest()

    def weights_at(self, step: int) -> list[float]:
        """The sources' weights at optimizer step `step`, in source order, normalised to sum 1."""
        raw = {s.name: s.weight for s in self.sources}
        for entry in self.schedule:
            if int(entry["step"]) <= step:
                raw = {name: float(entry["weights"].get(name, 0.0)) for name in raw}
        total = sum(raw.values())
        return [raw[s.name] / total for s in self.sources]


@dataclass(frozen=True)
class PreparedSource:
    """A source of a mixture, opened: its entry, its folder and its own manifest."""

    entry: MixtureSource
    data: Storage
    manifest: DataManifest

    @property
    def name(self) -> str:
        return self.entry.name


def read_mixture(data: Storage) -> tuple[MixtureManifest, list[PreparedSource]]:
    """A run's prepared data: its mixture manifest and each source opened. A data folder of a release before
    mixtures (one DataManifest) reads as a mixture of that one source, named 'data'."""
    if not data.exists(MANIFEST_FILE):
        read_manifest(data)  # raises the clear error
    body = data.read_json(MANIFEST_FILE)
    if body.get("version") != MIXTURE_VERSION:
        manifest = DataManifest.model_validate(body)
        entry = MixtureSource(
            name="data", weight=1.0, max_epochs=None, folder=data.uri(), fingerprint=manifest.fingerprint,
            checksum=manifest.checksum, train_rows=manifest.rows("train"), validation_rows=manifest.rows("validation"),
            train_bytes=manifest.bytes("train"), validation_bytes=manifest.bytes("validation"),
        )  # fmt: skip
        mixture = MixtureManifest(fingerprint=manifest.fingerprint, sources=[entry])
        return mixture, [PreparedSource(entry, data, manifest)]
    mixture = MixtureManifest.model_validate(body)
    opened = []
    for entry in mixture.sources:
        folder = Storage(entry.folder)
        manifest = read_manifest(folder)
        if manifest.checksum != entry.checksum:
            raise ValueError(
                f"{folder.uri(MANIFEST_FILE)} no longer holds the shards {data.uri(MANIFEST_FILE)} was made from "
                f"(source {entry.name!r}); re-run prepare-data"
            )
        opened.append(PreparedSource(entry, folder, manifest))
    return mixture, opened


def mixture_rows(sources: list[PreparedSource], split: Split) -> int:
    return sum(s.manifest.rows(split) for s in sources)


def mixture_documents(sources: list[PreparedSource], weights: list[float], split: Split) -> Iterator[str]:
    """The documents of one split of every source, interleaved so that each source's share of the text (in
    characters) follows its weight: before each document the source furthest below its share gives the next one
    (ties: the first). A source runs out after its last document; the others go on. What the tokenizer trains on
    and evaluation scores, streamed shard by shard."""
    streams = [
        (i, iter_documents(s.data, s.manifest, split))
        for i, s in enumerate(sources)
        if weights[i] > 0 and s.manifest.rows(split)
    ]
    taken = [0] * len(sources)
    while streams:
        total = sum(taken) + 1
        at = max(range(len(streams)), key=lambda k: (weights[streams[k][0]] * total - taken[streams[k][0]], -k))
        i, stream = streams[at]
        text = next(stream, None)
        if text is None:
            del streams[at]
            continue
        taken[i] += len(text)
        yield text


def data_checksum_of(data: Storage) -> str:
    """The checksum of a run's prepared data (a mixture's, or a single manifest's): what later stages key on."""
    body = data.read_json(MANIFEST_FILE) if data.exists(MANIFEST_FILE) else None
    if body is not None and body.get("version") == MIXTURE_VERSION:
        return MixtureManifest.model_validate(body).checksum
    return read_manifest(data).checksum


def encode_shard(texts: list[str], fmt: Literal["parquet", "jsonl"]) -> bytes:
    if fmt == "parquet":
        buf = io.BytesIO()
        pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), buf, compression="zstd")
        return buf.getvalue()
    return "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts).encode("utf-8")


def write_shard(data: Storage, rel: str, split: Split, texts: list[str], fmt: Literal["parquet", "jsonl"]) -> ShardInfo:
    """Write one shard of `texts` at `rel` (under the data folder) and describe it for the manifest."""
    payload = encode_shard(texts, fmt)
    data.write_bytes(rel, payload)
    return ShardInfo(
        path=rel, split=split, rows=len(texts), bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest()
    )


class ShardWriter:
    """Buffers documents per split and writes a shard every `shard_rows` documents."""

    def __init__(self, data: Storage, shard_dir: str, fmt: Literal["parquet", "jsonl"], shard_rows: int):
        self.data, self.shard_dir, self.fmt, self.shard_rows = data, shard_dir, fmt, shard_rows
        self.buffers: dict[Split, list[str]] = {"train": [], "validation": []}
        self.shards: list[ShardInfo] = []

    def add(self, text: str, split: Split) -> None:
        buf = self.buffers[split]
        buf.append(text)
        if len(buf) >= self.shard_rows:
            self._flush(split)

    def _flush(self, split: Split) -> None:
        texts = self.buffers[split]
        if not texts:
            return
        index = sum(1 for s in self.shards if s.split == split)
        rel = f"{self.shard_dir}/{split}-{index:05d}.{self.fmt}"
        self.shards.append(write_shard(self.data, rel, split, texts, self.fmt))
        self.buffers[split] = []

    def close(self) -> list[ShardInfo]:
        splits: tuple[Split, ...] = ("train", "validation")
        for split in splits:
            self._flush(split)
        return self.shards


def read_manifest(data: Storage) -> DataManifest:
    """The manifest of a prepared data folder; a clear error when prepare-data has not completed there."""
    if not data.exists(MANIFEST_FILE):
        from hlat.core.storage import StorageNotFound

        raise StorageNotFound(
            f"{data.uri(MANIFEST_FILE)} does not exist: run the prepare-data stage for this run first"
        )
    return DataManifest.model_validate(data.read_json(MANIFEST_FILE))


def iter_documents(data: Storage, manifest: DataManifest, split: Split, verify: bool = True) -> Iterator[str]:
    """Stream documents of one split, shard by shard (never the whole corpus in memory).

    With verify=True each shard's sha256 is checked against the manifest before its rows are used.
    """
    for shard in manifest.shards:
        if shard.split == split:
            yield from shard_texts(data, shard, manifest.format, verify)


def shard_texts(
    data: Storage, shard: ShardInfo, fmt: Literal["parquet", "jsonl"], verify: bool = True
) -> Iterator[str]:
    """The documents of one shard, its sha256 checked first (verify=True)."""
    payload = data.read_bytes(shard.path)
    if verify and hashlib.sha256(payload).hexdigest() != shard.sha256:
        raise ValueError(f"{data.uri(shard.path)} does not match its checksum in the manifest; re-run prepare-data")
    if fmt == "parquet":
        yield from pq.read_table(io.BytesIO(payload), columns=["text"]).column("text").to_pylist()
    else:
        # Only "\n" ends a record: str.splitlines() would also cut at U+2028, U+0085, ... inside the text.
        for line in payload.decode("utf-8").split("\n"):
            if line:
                yield json.loads(line)["text"]
