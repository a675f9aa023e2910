"""HLAT's online tokenize-and-pack loader: a run's prepared sources -> fixed-length (inputs, targets) batches.

Rules:
- documents are tokenized while training runs; no tokenized corpus is written.
- each source's order depends on (seed, source, epoch) only; document g goes to rank g % data_degree.
- each document comes from the source with the largest token deficit `w_i * T - t_i`; no RNG.
- over W tokens a source's share is off its weight by at most about (S + 2) L / W (L: longest document).
- rows are exactly `seq_len` tokens, overlapping by one: no padding.
- `Batch.state` resumes exactly; other data, tokenizer, seed, split or DP size is refused.
docs/data.md ("The loader mixes by tokens") explains it.
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
import torch

from hlat.core.shards import DataManifest, MixtureManifest, ShardInfo, read_mixture
from hlat.core.storage import Storage
from hlat.training.data.tokenizer import Tokenizer

STATE_VERSION = 2
SEED_STRIDE = 1_000_003
"""Epoch e of seed s draws from random.Random(s * SEED_STRIDE + e)."""
SOURCE_STRIDE = 1_000_000_007
"""Source i of seed s orders as seed s + i * SOURCE_STRIDE would; source 0 as the seed itself."""
ENCODE_DOCS = 64
ENCODE_CHARS = 1 << 18
"""Characters encoded per group: big enough to batch, small enough to re-encode on resume."""
_POLL_S = 0.1
"""How often a blocked producer or consumer checks the other side is still there."""
_RENAMED = {"dp_rank": "data_rank", "dp_size": "data_degree"}
"""State keys of earlier releases, read under today's names."""
_RESUME_KEYS = ("sources", "current", "mix", "carry", "batches", "data_rank", "data_degree", "seed", "split")
_POSITION = ("epoch", "shard", "row", "offset", "tokens")


@dataclass(frozen=True)
class Batch:
    """One micro-batch of packed rows and the loader state right after it."""

    inputs: torch.Tensor
    """LongTensor (micro_batch_size, seq_len): token ids."""
    targets: torch.Tensor
    """LongTensor (micro_batch_size, seq_len): next-token labels."""
    doc_ids: torch.Tensor | None
    """With document_masking: LongTensor (micro_batch_size, seq_len), +1 after each EOS; else None."""
    state: dict[str, Any]
    """The loader state after this batch (JSON-able)."""
    source_tokens: list[int]
    """Targets of this batch from each source, in manifest order."""


def data_fingerprint(manifest: DataManifest, split: str) -> str:
    """What a saved position refers to: the split's shards with their rows and checksums."""
    shards = [[s.path, s.rows, s.sha256] for s in manifest.shards if s.split == split]
    body = json.dumps({"format": manifest.format, "text_column": manifest.text_column, "shards": shards})
    return hashlib.sha256(body.encode()).hexdigest()


def mixture_fingerprint(sources: Sequence[tuple[str, str]]) -> str:
    """The sources a saved position refers to: (name, data_fingerprint) of each, in order."""
    return hashlib.sha256(json.dumps([list(s) for s in sources]).encode()).hexdigest()


def source_seed(seed: int, index: int) -> int:
    return seed + index * SOURCE_STRIDE


def epoch_plan(seed: int, epoch: int, n_shards: int) -> tuple[list[int], list[int]]:
    """The epoch's shard order and each position's row-shuffle seed."""
    rng = random.Random(seed * SEED_STRIDE + epoch)
    order = list(range(n_shards))
    rng.shuffle(order)
    return order, [rng.getrandbits(64) for _ in range(n_shards)]


def row_order(rows: int, row_seed: int) -> list[int]:
    """A shard's rows in the order an epoch reads them."""
    perm = list(range(rows))
    random.Random(row_seed).shuffle(perm)
    return perm


def pick_source(weights: Sequence[float], drawn: Sequence[int]) -> int:
    """The source with the largest deficit weight * total - drawn (ties: lowest index); weight 0: never."""
    total = sum(drawn)
    best, best_deficit = -1, 0.0
    for i, (w, t) in enumerate(zip(weights, drawn, strict=True)):
        if w > 0 and (best < 0 or w * total - t > best_deficit):
            best, best_deficit = i, w * total - t
    if best < 0:
        raise ValueError("no source of the mixture has a positive weight")
    return best


def initial_state(
    *,
    sources: Sequence[tuple[str, str]],
    data_rank: int,
    data_degree: int,
    seq_len: int,
    micro_batch_size: int,
    seed: int,
    split: str,
    tokenizer_sha256: str,
) -> dict[str, Any]:
    """The state before the first batch; `sources`: (name, fingerprint) of each."""
    return {
        "version": STATE_VERSION,
        "sources": [
            {"name": name, "fingerprint": fp, "epoch": 0, "shard": 0, "row": 0, "offset": 0, "tokens": 0}
            for name, fp in sources
        ],
        "current": None,
        "mix": {"weights": [], "drawn": [0] * len(sources)},
        "carry": [],
        "batches": 0,
        "data_rank": data_rank,
        "data_degree": data_degree,
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "seed": seed,
        "split": split,
        "data_fingerprint": mixture_fingerprint(sources),
        "tokenizer_sha256": tokenizer_sha256,
    }


@dataclass(frozen=True)
class _Source:
    """One source's split, as its stream reads it."""

    name: str
    data: Storage
    shards: list[ShardInfo]
    fmt: str
    text_column: str
    seed: int
    """Its order seed: source_seed(seed, index)."""


@dataclass(frozen=True)
class _Plan:
    """Everything the producer thread needs, but not the loader, so the loader can be collected."""

    sources: list[_Source]
    mixture: MixtureManifest
    split: str
    micro_batches_per_step: int
    tokenizer: Tokenizer
    eos_id: int
    seq_len: int
    micro_batch_size: int
    data_rank: int
    data_degree: int
    document_masking: bool
    encode_threads: int

    def step_of(self, batches: int) -> int:
        """The optimizer step whose weights batch number `batches` follows (0 for validation)."""
        return batches // self.micro_batches_per_step if self.split == "train" else 0

    def weights(self, step: int) -> list[float]:
        """The sources' weights at `step`; sources without documents in the split get 0."""
        raw = [w if s.shards else 0.0 for w, s in zip(self.mixture.weights_at(step), self.sources, strict=True)]
        total = sum(raw)
        if total <= 0:
            raise ValueError(f"no source with {self.split!r} documents has a positive weight at step {step}")
        return [w / total for w in raw]


class _Failure:
    """An exception raised in the producer, on its way to the consumer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _ShardReader:
    """Reads one source's shards, checksum-verified, with the next one downloading."""

    def __init__(self, source: _Source, stop: threading.Event) -> None:
        self.source, self.stop = source, stop
        self.pending: dict[int, tuple[threading.Thread, list[Any]]] = {}

    def _read(self, index: int) -> bytes:
        info = self.source.shards[index]
        payload = self.source.data.read_bytes(info.path)
        if hashlib.sha256(payload).hexdigest() != info.sha256:
            raise ValueError(
                f"{self.source.data.uri(info.path)} does not match its checksum in the manifest; re-run prepare-data"
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
        info = self.source.shards[index]
        payload = self.get(index)
        where = self.source.data.uri(info.path)
        if self.source.fmt == "parquet":
            column = pq.read_table(io.BytesIO(payload), columns=[self.source.text_column]).column(0)
            found = len(column)
            picked = column.take(pa.array(rows, pa.int64())).to_pylist() if found == info.rows else []
        else:
            # Split on "\n" only: json escapes it inside strings, but not U+2028 and the like, where
            # str.splitlines() would cut a document in two.
            lines = payload.split(b"\n")
            if lines and not lines[-1]:
                lines.pop()
            found = len(lines)
            picked = [json.loads(lines[r])[self.source.text_column] for r in rows] if found == info.rows else []
        if found != info.rows:
            raise ValueError(f"{where} has {found} rows but the manifest says {info.rows}; re-run prepare-data")
        for text in picked:
            if not isinstance(text, str):
                raise ValueError(f"{where}: column {self.source.text_column!r} holds {type(text).__name__}, not text")
        return picked


class _Stopped(Exception):
    """The loader was closed while the producer waited."""


def _documents(
    plan: _Plan, source: _Source, epoch: int, shard: int, row: int, reader: _ShardReader
) -> Iterator[tuple[int, int, int, int, np.ndarray]]:
    """This rank's documents of one source from a position on, forever."""
    n = len(source.shards)
    while True:
        order, row_seeds = epoch_plan(source.seed, epoch, n)
        base = sum(source.shards[i].rows for i in order[:shard])
        for pos in range(shard, n):
            index = order[pos]
            rows = source.shards[index].rows
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
            reader.prefetch(order[pos + 1] if pos + 1 < n else epoch_plan(source.seed, epoch + 1, n)[0][0])
            i = 0
            while i < len(texts):
                j, chars = i, 0
                while j < len(texts) and j - i < ENCODE_DOCS and (j == i or chars + len(texts[j]) <= ENCODE_CHARS):
                    chars += len(texts[j])
                    j += 1
                encoded = plan.tokenizer.encode_batch(texts[i:j], add_eos=True, threads=plan.encode_threads)
                for k, ids in zip(ks[i:j], encoded, strict=True):
                    yield epoch, pos, k, rows, ids
                i = j
            row = 0
        epoch, shard, row = epoch + 1, 0, 0


def _make_batch(plan: _Plan, window: np.ndarray, state: dict[str, Any], source_tokens: list[int]) -> Batch:
    b, n = plan.micro_batch_size, plan.seq_len
    inputs = torch.from_numpy(window[:-1].reshape(b, n).copy())
    targets = torch.from_numpy(window[1:].reshape(b, n).copy())
    doc_ids = None
    if plan.document_masking:
        # A new document starts right after each EOS; the EOS itself belongs to the document it ends.
        eos = (inputs == plan.eos_id).long()
        doc_ids = eos.cumsum(1) - eos
    return Batch(inputs=inputs, targets=targets, doc_ids=doc_ids, state=state, source_tokens=source_tokens)


def _put(out: queue.Queue[Any], stop: threading.Event, item: Any) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(plan: _Plan, state: dict[str, Any], out: queue.Queue[Any], stop: threading.Event) -> None:
    """The producer thread: documents -> token stream -> batches, each with its state."""
    try:
        _pack(plan, state, out, stop)
    except _Stopped:
        pass
    except BaseException as exc:
        _put(out, stop, _Failure(exc))


class _Streams:
    """Each source's document stream, opened at its saved position on first use."""

    def __init__(self, plan: _Plan, positions: list[dict[str, Any]], stop: threading.Event) -> None:
        self.plan, self.stop = plan, stop
        self.positions = [dict(p) for p in positions]
        self.open: dict[int, Iterator[tuple[int, int, int, int, np.ndarray]]] = {}

    def next_document(self, i: int) -> tuple[np.ndarray, int]:
        """Source i's next document and its tokens already in the stream (first time only)."""
        position = self.positions[i]
        if i not in self.open:
            source = self.plan.sources[i]
            start = (position["epoch"], position["shard"], position["row"])
            self.open[i] = _documents(self.plan, source, *start, _ShardReader(source, self.stop))
        epoch, shard, row, rows, ids = next(self.open[i])
        offset, position["offset"] = int(position["offset"]), 0
        if offset and (epoch, shard, row) != (position["epoch"], position["shard"], position["row"]):
            where = (position["epoch"], position["shard"], position["row"])
            raise ValueError(f"loader state points {offset} tokens into document {where}, which is not this rank's")
        if offset > len(ids):
            raise ValueError(f"loader state offset {offset} lies past the end of a {len(ids)}-token document")
        # Where the source's next document comes from.
        if row + 1 < rows:
            position.update(epoch=epoch, shard=shard, row=row + 1)
        elif shard + 1 < len(self.plan.sources[i].shards):
            position.update(epoch=epoch, shard=shard + 1, row=0)
        else:
            position.update(epoch=epoch + 1, shard=0, row=0)
        position["at"] = (epoch, shard, row)
        return ids, offset


def _pack(plan: _Plan, state: dict[str, Any], out: queue.Queue[Any], stop: threading.Event) -> None:
    need = plan.micro_batch_size * plan.seq_len + 1
    window = np.empty(need, dtype=np.int64)
    carry = list(state["carry"])
    fill = len(carry)
    window[:fill] = carry
    batches = int(state["batches"])
    streams = _Streams(plan, state["sources"], stop)
    tokens = [int(p["tokens"]) for p in state["sources"]]
    mix_weights, drawn = list(state["mix"]["weights"]), [int(t) for t in state["mix"]["drawn"]]
    in_batch = [0] * len(plan.sources)
    current: int | None = state["current"]
    step: int | None = None
    weights: list[float] = []
    while not stop.is_set():
        if current is None:
            if plan.step_of(batches) != step:
                step = plan.step_of(batches)
                weights = plan.weights(step)
            if weights != mix_weights:  # a new phase of the schedule (or the start): count from here
                mix_weights, drawn = weights, [0] * len(plan.sources)
            current = pick_source(weights, drawn)
            ids, used = streams.next_document(current)
            drawn[current] += len(ids)
        else:  # resuming inside a document: it was drawn (and counted) before the state was saved
            ids, used = streams.next_document(current)
        while used < len(ids):
            take = min(len(ids) - used, need - fill)
            window[fill : fill + take] = ids[used : used + take]
            in_batch[current] += take - (1 if fill == 0 else 0)  # the stream's very first token is no target
            fill += take
            used += take
            if fill < need:
                continue
            batches += 1
            tokens = [t + n for t, n in zip(tokens, in_batch, strict=True)]
            inside = current if used < len(ids) else None
            positions = []
            for i, (saved, now) in enumerate(zip(state["sources"], streams.positions, strict=True)):
                where = {k: now[k] for k in ("epoch", "shard", "row")}
                if i == inside:
                    where = dict(zip(("epoch", "shard", "row"), now["at"], strict=True))
                positions.append(
                    {"name": saved["name"], "fingerprint": saved["fingerprint"], **where,
                     "offset": used if i == inside else 0, "tokens": tokens[i]}
                )  # fmt: skip
            after = {
                **state,
                "sources": positions,
                "current": inside,
                "mix": {"weights": mix_weights, "drawn": list(drawn)},
                "carry": [int(window[-1])],
                "batches": batches,
                "seq_len": plan.seq_len,
                "micro_batch_size": plan.micro_batch_size,
            }
            if not _put(out, stop, _make_batch(plan, window, after, in_batch)):
                return
            in_batch = [0] * len(plan.sources)
            window[0] = window[-1]
            fill = 1
        current = None


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
    """Endless iterator of packed `Batch`es for one data-parallel rank."""

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
        micro_batches_per_step: int = 1,
    ) -> None:
        """`data`: the run's prepared-data folder; `tokenizer_model`: its tokenizer folder or file.

        `prefetch`: batches built ahead. `encode_threads`: tokenizer threads.
        `micro_batches_per_step`: gradient accumulation, which maps batches to schedule steps.
        """
        if seq_len < 1 or micro_batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and micro_batch_size ({micro_batch_size}) must be positive")
        if data_degree < 1 or not 0 <= data_rank < data_degree:
            raise ValueError(
                f"data_rank must be in [0, data_degree); got data_rank={data_rank}, data_degree={data_degree}"
            )
        if prefetch < 1 or encode_threads < 1 or micro_batches_per_step < 1:
            raise ValueError(
                f"prefetch ({prefetch}), encode_threads ({encode_threads}) and micro_batches_per_step "
                f"({micro_batches_per_step}) must be positive"
            )
        mixture, prepared = read_mixture(data)
        sources, too_few = [], []
        for index, p in enumerate(prepared):
            shards = [s for s in p.manifest.shards if s.split == split]
            rows = sum(s.rows for s in shards)
            if split == "train" and 0 < rows <= data_rank:
                raise ValueError(
                    f"the 'train' split of source {p.name!r} has {rows} documents, too few for {data_degree} "
                    f"data-parallel ranks: rank {data_rank} would get none"
                )
            if split != "train" and 0 < rows < data_degree:
                # Evaluation leaves such a source out on every rank alike, so that the ranks mix the same sources.
                too_few.append(f"source {p.name!r} has {rows}")
                rows = 0
            sources.append(
                _Source(
                    name=p.name, data=p.data, shards=shards if rows else [], fmt=p.manifest.format,
                    text_column=p.manifest.text_column, seed=source_seed(seed, index),
                )
            )  # fmt: skip
        if not any(s.shards for s in sources):
            if too_few:
                raise ValueError(
                    f"the {split!r} split is too small: {', '.join(too_few)} documents, too few for {data_degree} "
                    "data-parallel ranks (some ranks would get none)"
                )
            raise ValueError(f"{data.uri()} has no {split!r} documents; re-run prepare-data or pick another split")
        tokenizer = Tokenizer.load(tokenizer_model)
        self._plan = _Plan(
            sources=sources,
            mixture=mixture,
            split=split,
            micro_batches_per_step=micro_batches_per_step,
            tokenizer=tokenizer,
            eos_id=tokenizer.eos_id,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            data_rank=data_rank,
            data_degree=data_degree,
            document_masking=document_masking,
            encode_threads=encode_threads,
        )
        if split == "train":
            self._check_weights()
        self.prefetch = prefetch
        self.data = data
        self._state = initial_state(
            sources=[(p.name, data_fingerprint(p.manifest, split)) for p in prepared],
            data_rank=data_rank,
            data_degree=data_degree,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            seed=seed,
            split=split,
            tokenizer_sha256=tokenizer.sha256,
        )
        self._closed = False
        self._worker: tuple[threading.Thread, queue.Queue[Any], threading.Event, weakref.finalize[Any, Any]] | None
        self._worker = None

    def _check_weights(self) -> None:
        """A source with weight at any step of the schedule must have training documents."""
        plan = self._plan
        steps = {0, *(int(e["step"]) for e in plan.mixture.schedule)}
        for step in sorted(steps):
            for source, weight in zip(plan.sources, plan.mixture.weights_at(step), strict=True):
                if weight > 0 and not source.shards:
                    raise ValueError(
                        f"source {source.name!r} has weight {weight:.3g} at step {step} but no 'train' documents; "
                        "re-run prepare-data or give it weight 0"
                    )

    @property
    def source_names(self) -> list[str]:
        """The sources' names, in the order of `Batch.source_tokens`."""
        return [s.name for s in self._plan.sources]

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
            args=(self._plan, json.loads(json.dumps(self._state)), out, stop),
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
        """The state after the last yielded batch: JSON-able, per rank."""
        return json.loads(json.dumps(self._state))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue right after the batch `state` was saved with, exactly as an uninterrupted run would.

        Refuses other data, tokenizer, seed, split, rank or DP size.
        """
        if isinstance(state, dict) and state.get("version") == 1:
            state = self._from_version_1(state)
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a PackedLoader state of version {STATE_VERSION} or 1 (got version {got!r})")
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
            theirs = [s.get("name") for s in state["sources"]] if isinstance(state["sources"], list) else "?"
            raise ValueError(
                f"the loader state was saved on different data (its {state['split']!r} split of sources {theirs} "
                f"differs from that of {self.source_names} in {self.data.uri()}); resume on the prepared data the "
                "checkpoint was trained on"
            )
        if state["tokenizer_sha256"] != mine["tokenizer_sha256"]:
            raise ValueError(
                "the loader state was saved with a different tokenizer (tokenizer.model or tokenizer.json); resume "
                "with the same one"
            )
        for key in ("seed", "split"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"the loader state was saved with {key}={state[key]!r} but this loader has {key}={mine[key]!r}"
                )
        self._check_positions(state)
        self._stop()
        # seq_len and micro_batch_size stay this loader's: the stream position does not depend on them.
        fresh = {**state, "seq_len": mine["seq_len"], "micro_batch_size": mine["micro_batch_size"]}
        self._state = json.loads(json.dumps(fresh))

    def _check_positions(self, state: dict[str, Any]) -> None:
        """Refuse a state whose positions cannot be this loader's."""
        n = len(self._plan.sources)
        sources, current, mix = state["sources"], state["current"], state["mix"]
        bad = not isinstance(sources, list) or len(sources) != n or not isinstance(mix, dict)
        bad = bad or not (current is None or (isinstance(current, int) and 0 <= current < n))
        bad = bad or not isinstance(state["carry"], list) or len(state["carry"]) > 1
        bad = bad or not isinstance(state["batches"], int) or state["batches"] < 0
        if not bad:
            for i, (position, source) in enumerate(zip(sources, self._plan.sources, strict=True)):
                values = [position.get(k) if isinstance(position, dict) else None for k in _POSITION]
                bad = bad or any(not isinstance(v, int) or v < 0 for v in values)
                bad = bad or (values[1] or 0) >= max(len(source.shards), 1)
                bad = bad or (i != current and values[3] != 0)
            drawn = mix.get("drawn")
            bad = bad or not isinstance(mix.get("weights"), list) or not isinstance(drawn, list) or len(drawn) != n
        if bad:
            shown = {k: state[k] for k in ("sources", "current", "mix", "carry", "batches")}
            raise ValueError(f"malformed loader state: {shown}")

    def _from_version_1(self, state: dict[str, Any]) -> dict[str, Any]:
        """A pre-mixture state in today's form, for a one-source loader of the same data."""
        old = {_RENAMED.get(key, key): value for key, value in state.items()}
        mine = self._state
        (source,) = mine["sources"] if len(mine["sources"]) == 1 else (None,)
        if source is None or old.get("data_fingerprint") != source["fingerprint"]:
            raise ValueError(
                "the loader state (version 1, from before mixtures) was saved on different data: it resumes only a "
                f"one-source run on the same prepared shards, not the sources {self.source_names} in "
                f"{self.data.uri()}"
            )
        position = {k: old.get(k) for k in ("epoch", "shard", "row", "offset")}
        batches = old.get("batches")
        targets = old.get("seq_len", 0) * old.get("micro_batch_size", 0) if isinstance(batches, int) else 0
        tokens = batches * targets if isinstance(batches, int) and isinstance(targets, int) else 0
        return {
            **{k: v for k, v in old.items() if k not in (*position, "data_fingerprint")},
            "version": STATE_VERSION,
            "sources": [{"name": source["name"], "fingerprint": source["fingerprint"], **position, "tokens": tokens}],
            "current": 0 if position["offset"] else None,
            "mix": {"weights": [], "drawn": [0]},
            "data_fingerprint": mine["data_fingerprint"],
        }
