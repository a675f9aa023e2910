"""HLAT's online tokenize-and-pack data loader: prepared shards -> fixed-length (inputs, targets) batches.

Documents are tokenized while training runs (no pre-tokenized copy of the corpus is ever written), joined into
one token stream per data-parallel rank and cut into rows of exactly `seq_len` tokens: no padding, ever.

Order. Every epoch orders the documents of the split afresh, deterministically from (seed, epoch):
`random.Random(seed * 1_000_003 + epoch)` shuffles the order of the shards, then draws one 64-bit seed per
shard position from which that shard's rows are shuffled. Documents are numbered 0, 1, ... in this order
(across shards) and document g goes to rank g % data_degree, so the ranks see disjoint documents that together
cover the epoch. Only the shard being read (and the next one, read ahead) is in memory, and only this rank's
rows of it are decoded; the plan itself costs O(shards) plus O(rows of one shard). Every rank reads every
shard (the tokenizing, not the reading, is what the ranks divide).

Packing. Each document is encoded with sentencepiece (no BOS) and followed by EOS; the documents form one
stream t0 t1 t2 .... A row is a window of seq_len + 1 stream tokens: inputs are its first seq_len, targets its
last seq_len, and the next row starts at the last token of this one. Consecutive rows thus overlap by one
token, so every stream token but the very first is a target exactly once and nothing is thrown away at row
boundaries. What a batch leaves over is carried into the next one, across shards and epochs: a document may
start in one row and end in the next, and epochs roll over forever (training decides when to stop).

State. `Batch.state` (and `state_dict()`) is a plain JSON-able dict that says where the stream stands after
that batch. A long document may span many batches, so the position is a token offset inside the document
being consumed rather than a copy of its remaining tokens; on resume that one document is re-tokenized
(sentencepiece is deterministic) and `carry` holds the single overlap token:

    version            1
    epoch              epoch of the next token to read
    shard              position in that epoch's shard order
    row                position in that shard's shuffled row order (the document being, or next to be, read)
    offset             tokens of document `row` (its EOS included) already in the stream
    carry              the overlap token: the last target of this batch, the first input of the next ([] at start)
    batches            batches this rank has yielded since the start of training
    data_rank, data_degree, seq_len, micro_batch_size, seed, split
    data_fingerprint   sha256 over the split's shards (path, rows, sha256) and the manifest format
    tokenizer_sha256   sha256 of tokenizer.model

Each rank saves its own state (the checkpoint code stores one per rank) and loads it back into a loader built
with the same rank. Resuming refuses other data, another tokenizer, another seed or split, and another
data-parallel size: resharding on a changed DP degree is not supported; resume with the same number of
data-parallel ranks. seq_len and micro_batch_size may change on resume: the stream simply continues, cut to
the new shape.

Overlap with compute: a daemon thread reads, tokenizes and packs ahead into a queue of `prefetch` batches
(sentencepiece and shard reads release the GIL), and attaches to every batch the state it had when it finished
building that batch, so the state matches the batch whatever the prefetch depth. An exception in that thread
is re-raised in the consumer; the next `next()` then retries from the last yielded batch. `close()`, leaving a
`with` block, or garbage collection stops the thread.
"""

from __future__ import annotations

import hashlib
import io
import json
import queue
import random
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import sentencepiece as spm
import torch

from hlat.core.shards import DataManifest, ShardInfo, read_manifest
from hlat.core.storage import Storage

STATE_VERSION = 1
SEED_STRIDE = 1_000_003
"""Epoch e of seed s draws from random.Random(s * SEED_STRIDE + e): distinct seeds give distinct orders for
the first million epochs."""
ENCODE_DOCS = 64
ENCODE_CHARS = 1 << 18
"""Documents are encoded in groups of at most this many documents / characters: large enough for
sentencepiece's batch call to pay off, small enough that a resume re-encodes little."""
_POLL_S = 0.1
"""How often a blocked producer or consumer looks whether the other side has gone away."""
_RENAMED = {"dp_rank": "data_rank", "dp_size": "data_degree"}
"""State keys of earlier releases, read under today's names."""
_RESUME_KEYS = ("epoch", "shard", "row", "offset", "carry", "batches", "data_rank", "data_degree", "seed", "split")


@dataclass(frozen=True)
class Batch:
    """One micro-batch of packed rows and the loader state right after it."""

    inputs: torch.Tensor
    """LongTensor (micro_batch_size, seq_len): token ids."""
    targets: torch.Tensor
    """LongTensor (micro_batch_size, seq_len): inputs shifted left by one (next-token labels)."""
    doc_ids: torch.Tensor | None
    """With document_masking: LongTensor (micro_batch_size, seq_len), 0 at the row start and +1 after each EOS,
    so equal ids mark one document's tokens (for block-diagonal attention masks); otherwise None."""
    state: dict[str, Any]
    """The loader state after this batch (JSON-able; `load_state_dict` resumes right after this batch)."""


def data_fingerprint(manifest: DataManifest, split: str) -> str:
    """What a saved position refers to: the split's shards, in manifest order, with their rows and checksums."""
    shards = [[s.path, s.rows, s.sha256] for s in manifest.shards if s.split == split]
    body = json.dumps({"format": manifest.format, "text_column": manifest.text_column, "shards": shards})
    return hashlib.sha256(body.encode()).hexdigest()


def epoch_plan(seed: int, epoch: int, n_shards: int) -> tuple[list[int], list[int]]:
    """The epoch's shard order (indices into the split's shards) and the row-shuffle seed of each position."""
    rng = random.Random(seed * SEED_STRIDE + epoch)
    order = list(range(n_shards))
    rng.shuffle(order)
    return order, [rng.getrandbits(64) for _ in range(n_shards)]


def row_order(rows: int, row_seed: int) -> list[int]:
    """A shard's rows in the order an epoch reads them."""
    perm = list(range(rows))
    random.Random(row_seed).shuffle(perm)
    return perm


def initial_state(
    *,
    data_rank: int,
    data_degree: int,
    seq_len: int,
    micro_batch_size: int,
    seed: int,
    split: str,
    data_fingerprint: str,
    tokenizer_sha256: str,
) -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "epoch": 0,
        "shard": 0,
        "row": 0,
        "offset": 0,
        "carry": [],
        "batches": 0,
        "data_rank": data_rank,
        "data_degree": data_degree,
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "seed": seed,
        "split": split,
        "data_fingerprint": data_fingerprint,
        "tokenizer_sha256": tokenizer_sha256,
    }


@dataclass(frozen=True)
class _Plan:
    """Everything the producer thread needs; deliberately not the loader, so the loader can be collected."""

    data: Storage
    shards: list[ShardInfo]
    fmt: str
    text_column: str
    model_proto: bytes
    eos_id: int
    seq_len: int
    micro_batch_size: int
    data_rank: int
    data_degree: int
    seed: int
    document_masking: bool
    encode_threads: int


class _Failure:
    """An exception raised in the producer, on its way to the consumer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _ShardReader:
    """Reads shards (checksum-verified) and keeps the next one downloading in the background."""

    def __init__(self, plan: _Plan, stop: threading.Event) -> None:
        self.plan, self.stop = plan, stop
        self.pending: dict[int, tuple[threading.Thread, list[Any]]] = {}

    def _read(self, index: int) -> bytes:
        info = self.plan.shards[index]
        payload = self.plan.data.read_bytes(info.path)
        if hashlib.sha256(payload).hexdigest() != info.sha256:
            raise ValueError(
                f"{self.plan.data.uri(info.path)} does not match its checksum in the manifest; re-run prepare-data"
            )
        return payload

    def prefetch(self, index: int) -> None:
        if index in self.pending:
            return
        box: list[Any] = []

        def work() -> None:
            try:
                box.append(self._read(index))
            except BaseException as exc:  # handed to get(), which raises it in the producer
                box.append(_Failure(exc))

        thread = threading.Thread(target=work, name=f"hlat-shard-read-{index}", daemon=True)
        thread.start()
        self.pending[index] = (thread, box)

    def get(self, index: int) -> bytes:
        self.prefetch(index)
        thread, box = self.pending.pop(index)
        while thread.is_alive() and not self.stop.is_set():
            thread.join(_POLL_S)
        if not box:
            raise _Stopped
        result = box[0]
        if isinstance(result, _Failure):
            raise result.exc
        payload: bytes = result
        return payload

    def texts(self, index: int, rows: Sequence[int]) -> list[str]:
        """The texts of the given rows of a shard, in the given order."""
        info = self.plan.shards[index]
        payload = self.get(index)
        where = self.plan.data.uri(info.path)
        if self.plan.fmt == "parquet":
            column = pq.read_table(io.BytesIO(payload), columns=[self.plan.text_column]).column(0)
            found = len(column)
            picked = column.take(pa.array(rows, pa.int64())).to_pylist() if found == info.rows else []
        else:
            # Split on "\n" only: json escapes it inside strings, but not U+2028 and the like, where
            # str.splitlines() would cut a document in two.
            lines = payload.split(b"\n")
            if lines and not lines[-1]:
                lines.pop()
            found = len(lines)
            picked = [json.loads(lines[r])[self.plan.text_column] for r in rows] if found == info.rows else []
        if found != info.rows:
            raise ValueError(f"{where} has {found} rows but the manifest says {info.rows}; re-run prepare-data")
        for text in picked:
            if not isinstance(text, str):
                raise ValueError(f"{where}: column {self.plan.text_column!r} holds {type(text).__name__}, not text")
        return picked


class _Stopped(Exception):
    """The loader was closed while the producer waited."""


def _documents(
    plan: _Plan, epoch: int, shard: int, row: int, reader: _ShardReader
) -> Iterator[tuple[int, int, int, int, np.ndarray]]:
    """This rank's documents from a position on, forever: (epoch, shard position, row position, rows of the
    shard, token ids with EOS appended)."""
    processor = spm.SentencePieceProcessor(model_proto=plan.model_proto)
    n = len(plan.shards)
    while True:
        order, row_seeds = epoch_plan(plan.seed, epoch, n)
        base = sum(plan.shards[i].rows for i in order[:shard])
        for pos in range(shard, n):
            index = order[pos]
            rows = plan.shards[index].rows
            first = (plan.data_rank - base) % plan.data_degree  # first row position whose global number is ours
            start = row + (first - row) % plan.data_degree
            base += rows
            ks = range(start, rows, plan.data_degree)
            if not ks:
                reader.pending.pop(index, None)  # read ahead for nothing: this rank has no row in it
                row = 0
                continue
            perm = row_order(rows, row_seeds[pos])
            texts = reader.texts(index, [perm[k] for k in ks])
            # Read the next shard while this one is tokenized.
            reader.prefetch(order[pos + 1] if pos + 1 < n else epoch_plan(plan.seed, epoch + 1, n)[0][0])
            i = 0
            while i < len(texts):
                j, chars = i, 0
                while j < len(texts) and j - i < ENCODE_DOCS and (j == i or chars + len(texts[j]) <= ENCODE_CHARS):
                    chars += len(texts[j])
                    j += 1
                encoded = processor.encode(
                    texts[i:j], add_bos=False, add_eos=True, return_type="numpy", num_threads=plan.encode_threads
                )
                for k, ids in zip(ks[i:j], encoded, strict=True):
                    yield epoch, pos, k, rows, ids
                i = j
            row = 0
        epoch, shard, row = epoch + 1, 0, 0


def _make_batch(plan: _Plan, window: np.ndarray, state: dict[str, Any]) -> Batch:
    b, n = plan.micro_batch_size, plan.seq_len
    inputs = torch.from_numpy(window[:-1].reshape(b, n).copy())
    targets = torch.from_numpy(window[1:].reshape(b, n).copy())
    doc_ids = None
    if plan.document_masking:
        # A new document starts right after each EOS; the EOS itself belongs to the document it ends.
        eos = (inputs == plan.eos_id).long()
        doc_ids = eos.cumsum(1) - eos
    return Batch(inputs=inputs, targets=targets, doc_ids=doc_ids, state=state)


def _put(out: queue.Queue[Any], stop: threading.Event, item: Any) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(plan: _Plan, state: dict[str, Any], out: queue.Queue[Any], stop: threading.Event) -> None:
    """The producer thread: documents -> token stream -> batches, each with the state right after it."""
    try:
        _pack(plan, state, out, stop)
    except _Stopped:
        pass
    except BaseException as exc:
        _put(out, stop, _Failure(exc))


def _pack(plan: _Plan, state: dict[str, Any], out: queue.Queue[Any], stop: threading.Event) -> None:
    need = plan.micro_batch_size * plan.seq_len + 1
    window = np.empty(need, dtype=np.int64)
    carry = list(state["carry"])
    fill = len(carry)
    window[:fill] = carry
    offset, batches = int(state["offset"]), int(state["batches"])
    start = (int(state["epoch"]), int(state["shard"]), int(state["row"]))
    reader = _ShardReader(plan, stop)
    n_shards = len(plan.shards)
    for epoch, shard, row, rows, ids in _documents(plan, *start, reader):
        if stop.is_set():
            return
        if offset and (epoch, shard, row) != start:
            raise ValueError(f"loader state points {offset} tokens into document {start}, which is not this rank's")
        used, offset = offset, 0
        if used > len(ids):
            raise ValueError(f"loader state offset {used} lies past the end of document {start} ({len(ids)} tokens)")
        while used < len(ids):
            take = min(len(ids) - used, need - fill)
            window[fill : fill + take] = ids[used : used + take]
            fill += take
            used += take
            if fill < need:
                continue
            batches += 1
            # Where the next token comes from: further into this document, or the start of the next one.
            if used < len(ids):
                at = (epoch, shard, row, used)
            elif row + 1 < rows:
                at = (epoch, shard, row + 1, 0)
            elif shard + 1 < n_shards:
                at = (epoch, shard + 1, 0, 0)
            else:
                at = (epoch + 1, 0, 0, 0)
            after = {
                **state,
                "epoch": at[0],
                "shard": at[1],
                "row": at[2],
                "offset": at[3],
                "carry": [int(window[-1])],
                "batches": batches,
                "seq_len": plan.seq_len,
                "micro_batch_size": plan.micro_batch_size,
            }
            if not _put(out, stop, _make_batch(plan, window, after)):
                return
            window[0] = window[-1]
            fill = 1


def _shutdown(stop: threading.Event, out: queue.Queue[Any], thread: threading.Thread | None) -> None:
    stop.set()
    # Empty the queue so a producer blocked on put() notices the stop at once.
    while True:
        try:
            out.get_nowait()
        except queue.Empty:
            break
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=30)


class PackedLoader:
    """Endless iterator of packed `Batch`es for one data-parallel rank (see the module docstring)."""

    def __init__(
        self,
        data: Storage,
        tokenizer_model: str,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        data_rank: int = 0,
        data_degree: int = 1,
        split: str = "train",
        document_masking: bool = False,
        prefetch: int = 4,
        encode_threads: int = 1,
    ) -> None:
        """`data`: the prepared-data folder (with manifest.json); `tokenizer_model`: local path of the run's
        tokenizer.model; `prefetch`: batches built ahead; `encode_threads`: sentencepiece threads (1 keeps
        the many ranks of a node from oversubscribing its cores)."""
        if seq_len < 1 or micro_batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and micro_batch_size ({micro_batch_size}) must be positive")
        if data_degree < 1 or not 0 <= data_rank < data_degree:
            raise ValueError(
                f"data_rank must be in [0, data_degree); got data_rank={data_rank}, data_degree={data_degree}"
            )
        if prefetch < 1 or encode_threads < 1:
            raise ValueError(f"prefetch ({prefetch}) and encode_threads ({encode_threads}) must be positive")
        manifest = read_manifest(data)
        shards = [s for s in manifest.shards if s.split == split]
        rows = sum(s.rows for s in shards)
        if rows == 0:
            raise ValueError(f"{data.uri()} has no {split!r} documents; re-run prepare-data or pick another split")
        if rows <= data_rank:
            raise ValueError(
                f"the {split!r} split has {rows} documents, too few for {data_degree} data-parallel ranks: "
                f"rank {data_rank} would get none"
            )
        with open(tokenizer_model, "rb") as fh:
            model_proto = fh.read()
        processor = spm.SentencePieceProcessor(model_proto=model_proto)
        eos_id = processor.eos_id()
        if eos_id < 0:
            raise ValueError(f"{tokenizer_model} has no EOS piece; packed documents need one between them")
        self._plan = _Plan(
            data=data,
            shards=shards,
            fmt=manifest.format,
            text_column=manifest.text_column,
            model_proto=model_proto,
            eos_id=eos_id,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            data_rank=data_rank,
            data_degree=data_degree,
            seed=seed,
            document_masking=document_masking,
            encode_threads=encode_threads,
        )
        self.prefetch = prefetch
        self._state = initial_state(
            data_rank=data_rank,
            data_degree=data_degree,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            seed=seed,
            split=split,
            data_fingerprint=data_fingerprint(manifest, split),
            tokenizer_sha256=hashlib.sha256(model_proto).hexdigest(),
        )
        self._closed = False
        self._worker: tuple[threading.Thread, queue.Queue[Any], threading.Event, weakref.finalize[Any, Any]] | None
        self._worker = None

    # -- iteration ---------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise RuntimeError("this PackedLoader is closed; build a new one (and load_state_dict) to go on")
        if self._worker is None:
            self._start()
        assert self._worker is not None
        thread, out, _, _ = self._worker
        while True:
            try:
                item = out.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not thread.is_alive() and out.empty():
                    self._stop()
                    raise RuntimeError("the data loader's producer thread ended without a batch or an error") from None
        if isinstance(item, _Failure):
            # The producer is done; a later next() starts a fresh one from the last yielded batch.
            self._stop()
            raise item.exc
        batch: Batch = item
        self._state = batch.state
        return batch

    def _start(self) -> None:
        out: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        thread = threading.Thread(
            target=_produce,
            args=(self._plan, dict(self._state), out, stop),
            name=f"hlat-packed-loader-rank{self._plan.data_rank}",
            daemon=True,
        )
        thread.start()
        # Runs on close(), on garbage collection of the loader, or at interpreter exit: the thread holds no
        # reference to the loader, so dropping the loader is enough to stop it.
        finalizer = weakref.finalize(self, _shutdown, stop, out, thread)
        self._worker = (thread, out, stop, finalizer)

    def _stop(self) -> None:
        if self._worker is not None:
            self._worker[3]()
            self._worker = None

    def close(self) -> None:
        """Stop the producer thread (waits for it) and drop the batches built ahead."""
        self._stop()
        self._closed = True

    def __enter__(self) -> PackedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state after the last yielded batch (the initial state before the first): JSON-able, per rank."""
        return json.loads(json.dumps(self._state))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue right after the batch `state` was saved with: the next batches are exactly those an
        uninterrupted run would have yielded. Refuses states of other data, tokenizer, seed, split, rank or
        data-parallel size."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a PackedLoader state of version {STATE_VERSION} (got version {got!r})")
        # Checkpoints written before the parallel degrees had one name each call them dp_rank and dp_size.
        state = {_RENAMED.get(key, key): value for key, value in state.items()}
        missing = [k for k in (*_RESUME_KEYS, "data_fingerprint", "tokenizer_sha256") if k not in state]
        if missing:
            raise ValueError(f"loader state lacks {', '.join(missing)}; it was not saved by PackedLoader.state_dict")
        mine = self._state
        if state["data_degree"] != mine["data_degree"]:
            raise ValueError(
                f"the loader state was saved with data-parallel size {state['data_degree']} but this run has "
                f"{mine['data_degree']}: resharding on a changed DP degree is not supported; resume with the same "
                f"number of data-parallel ranks ({state['data_degree']})"
            )
        if state["data_rank"] != mine["data_rank"]:
            raise ValueError(
                f"the loader state belongs to data-parallel rank {state['data_rank']}, not {mine['data_rank']}: "
                "each rank must load the state it saved"
            )
        if state["data_fingerprint"] != mine["data_fingerprint"]:
            raise ValueError(
                f"the loader state was saved on different data (its {state['split']!r} shards differ from those in "
                f"{self._plan.data.uri()}); resume on the prepared data the checkpoint was trained on"
            )
        if state["tokenizer_sha256"] != mine["tokenizer_sha256"]:
            raise ValueError("the loader state was saved with a different tokenizer.model; resume with the same one")
        for key in ("seed", "split"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"the loader state was saved with {key}={state[key]!r} but this loader has {key}={mine[key]!r}"
                )
        ints = ("epoch", "shard", "row", "offset", "batches")
        bad = any(not isinstance(state[k], int) or state[k] < 0 for k in ints)
        bad = bad or state["shard"] >= len(self._plan.shards)
        if bad or not isinstance(state["carry"], list) or len(state["carry"]) > 1:
            shown = {k: state[k] for k in (*ints, "carry")}
            raise ValueError(f"malformed loader state: {shown}")
        self._stop()
        # seq_len and micro_batch_size stay this loader's: the stream position does not depend on them.
        fresh = {**state, "seq_len": mine["seq_len"], "micro_batch_size": mine["micro_batch_size"]}
        self._state = json.loads(json.dumps(fresh))
