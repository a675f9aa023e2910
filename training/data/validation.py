"""Document validation with great-expectations 1.x, batch by batch.

Rules:
- each flagged row gets one reason, the first in `REASON_ORDER`, so counts reconcile.
- data-set-level checks run once at the end and fail the stage under either policy.
- each batch runs the suite once, on pyarrow strings, asking only for unexpected indices.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from hlat.core.config import ConfigError, DataValidationConfig

log = logging.getLogger("hlat.data")

DUPLICATE_COLUMN = "_hlat_duplicate"
REASON_ORDER = ("null", "invalid_utf8", "too_short", "too_long", "duplicate")
# Only unexpected_index_list is used: the values themselves and their most common ones (a Counter over whole
# documents) are not asked for.
_RESULT_FORMAT = {"result_format": "COMPLETE", "partial_unexpected_count": 0, "exclude_unexpected_values": True}
_TEXT_DTYPE = pd.StringDtype("pyarrow", na_value=np.nan)


class DataValidationError(RuntimeError):
    """The data break a rule the policy cannot quarantine; not worth retrying."""


@dataclass
class BatchOutcome:
    kept: list[str]
    quarantined: list[tuple[str | None, str]]
    """(text, reason) of each row set aside, in row order."""
    quarantined_index: list[int] = field(default_factory=list)
    """For each quarantined row: its position in the validated frame."""
    kept_digests: list[bytes] = field(default_factory=list)
    """Each kept text's sha256, reused as duplicate key and split hash."""


@dataclass
class ValidationTally:
    """Running counts across batches; what the report shows."""

    rows_read: int = 0
    rows_kept: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    expectation_failures: Counter[str] = field(default_factory=Counter)
    non_null_rows: int = 0

    @property
    def rows_quarantined(self) -> int:
        return sum(self.by_reason.values())

    @property
    def duplicate_rate(self) -> float:
        return self.by_reason["duplicate"] / self.non_null_rows if self.non_null_rows else 0.0


def _expectation_class(type_name: str) -> Any:
    import great_expectations as gx

    class_name = "".join(part.capitalize() for part in type_name.split("_"))
    cls = getattr(gx.expectations, class_name, None)
    if cls is None:
        raise ConfigError(
            f"data.validation.expectations: {type_name!r} is not a great-expectations expectation "
            f"(looked for gx.expectations.{class_name})"
        )
    return cls


class DocumentValidator:
    """Validates document DataFrames with one suite, keeping duplicate state across batches."""

    def __init__(self, cfg: DataValidationConfig, text_column: str) -> None:
        import great_expectations as gx
        from great_expectations.data_context.types.base import ProgressBarsConfig

        self.cfg, self.column = cfg, text_column
        self.tally = ValidationTally()
        self._seen: set[bytes] = set()
        self._context = gx.get_context(mode="ephemeral")
        self._context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
        source = self._context.data_sources.add_pandas("hlat")
        batch = source.add_dataframe_asset("documents").add_batch_definition_whole_dataframe("batch")
        self._source_batch = source.add_dataframe_asset("source").add_batch_definition_whole_dataframe("first")
        col = text_column
        builtin: list[tuple[str, Any]] = [
            ("null", gx.expectations.ExpectColumnValuesToNotBeNull(column=col)),
            ("invalid_utf8", gx.expectations.ExpectColumnValuesToNotMatchRegex(column=col, regex="\ufffd")),
            (
                "length",
                gx.expectations.ExpectColumnValueLengthsToBeBetween(
                    column=col, min_value=cfg.min_chars, max_value=cfg.max_chars
                ),
            ),
            (
                "duplicate",
                gx.expectations.ExpectColumnValuesToBeInSet(column=DUPLICATE_COLUMN, value_set=[False]),
            ),
        ]
        custom = [
            (spec["type"], _expectation_class(spec["type"])(**spec.get("kwargs", {}))) for spec in cfg.expectations
        ]
        suite = gx.ExpectationSuite(name="hlat-documents")
        for reason, expectation in [*builtin, *custom]:
            expectation.meta = {**(expectation.meta or {}), "hlat_reason": reason}
            suite.add_expectation(expectation)
        suite = self._context.suites.add(suite)
        self._validation = self._context.validation_definitions.add(
            gx.ValidationDefinition(name="hlat-documents", data=batch, suite=suite)
        )

    def check_columns(self, frame: pd.DataFrame) -> None:
        """Column presence, checked on the first batch with great-expectations itself."""
        import great_expectations as gx

        # The columns are all it needs: not the rows, which great-expectations would fingerprint (hash) whole.
        result = self._source_batch.get_batch(batch_parameters={"dataframe": frame.iloc[:0]}).validate(
            gx.expectations.ExpectColumnToExist(column=self.column)
        )
        if not result.success:
            raise DataValidationError(
                f"data.text_column: column {self.column!r} is not in the source; its columns are "
                f"{list(frame.columns)}; set data.text_column to the one holding the text"
            )

    def validate(self, frame: pd.DataFrame) -> BatchOutcome:
        if self.tally.rows_read == 0:
            self.check_columns(frame)
        texts, array, duplicate, keys = self._texts(frame[self.column])
        # The text as pyarrow-backed strings: what great-expectations' regex and length metrics convert the column to
        # anyway (astype(str)), and hashed several times faster than Python objects for the batch fingerprint it takes.
        frame = pd.DataFrame(
            {
                self.column: pd.array(array, dtype=_TEXT_DTYPE),
                DUPLICATE_COLUMN: duplicate,
            }
        )
        result = self._validation.run(batch_parameters={"dataframe": frame}, result_format=_RESULT_FORMAT)
        flagged: dict[str, set[int]] = {}
        for res in result.results:
            config = res.expectation_config
            assert config is not None, "great-expectations results carry their expectation"
            reason = (config.meta or {}).get("hlat_reason", config.type)
            indices = res.result.get("unexpected_index_list")
            if res.success:
                continue
            if indices is None:
                raise ConfigError(
                    f"data.validation.expectations: {config.type} is not a row-level "
                    "expectation (it flags no rows), so it cannot quarantine; use a column-values expectation"
                )
            self.tally.expectation_failures[reason] += len(indices)
            if reason == "length":
                short = {int(i) for i in indices if len(texts[i] or "") < self.cfg.min_chars}
                flagged.setdefault("too_short", set()).update(short)
                flagged.setdefault("too_long", set()).update(int(i) for i in indices if int(i) not in short)
            else:
                flagged.setdefault(reason, set()).update(int(i) for i in indices)
        order = [*REASON_ORDER, *(r for r in flagged if r not in REASON_ORDER)]
        row_reason: dict[int, str] = {}
        for reason in order:
            for i in flagged.get(reason, ()):
                row_reason.setdefault(i, reason)
        kept: list[str] = []
        kept_digests: list[bytes] = []
        for i, text in enumerate(texts):
            if text is not None and i not in row_reason:
                kept.append(text)
                kept_digests.append(keys[i])
        quarantined = sorted(row_reason.items())
        outcome = BatchOutcome(
            kept=kept,
            quarantined=[(texts[i], r) for i, r in quarantined],
            quarantined_index=[i for i, _ in quarantined],
            kept_digests=kept_digests,
        )
        self.tally.rows_read += len(texts)
        self.tally.rows_kept += len(outcome.kept)
        self.tally.non_null_rows += sum(t is not None for t in texts)
        self.tally.by_reason.update(r for _, r in outcome.quarantined)
        if self.cfg.policy == "fail" and outcome.quarantined:
            counts = Counter(r for _, r in outcome.quarantined)
            raise DataValidationError(
                f"data.validation.policy='fail' and {len(outcome.quarantined)} rows break the rules "
                f"({_describe(counts)}) in rows {self.tally.rows_read - len(texts)}-{self.tally.rows_read - 1}; "
                "fix the source or set data.validation.policy=quarantine"
            )
        return outcome

    def _texts(self, column: pd.Series) -> tuple[list[str | None], pa.Array, np.ndarray, list[bytes]]:
        """The column as text and pyarrow array, which rows repeat, and each text's sha256 (from one encode)."""
        values = column.tolist()
        try:
            array = pa.array(values, pa.large_string())
        except (pa.ArrowException, UnicodeEncodeError):
            array = None
        if array is None or not all(v is None or type(v) is str for v in values):
            # Bytes, NaN, numbers, lone surrogates: the slow way.
            values = [v if v is None or type(v) is str else _as_text(v) for v in values]
            try:
                array = pa.array(values, pa.large_string())
            except UnicodeEncodeError:
                values = [_as_text(v) for v in values]
                array = pa.array(values, pa.large_string())
        offsets = np.frombuffer(array.buffers()[1], dtype=np.int64).tolist()
        data = memoryview(array.buffers()[2] or b"")
        duplicate = np.zeros(len(values), dtype=bool)
        keys: list[bytes] = [b""] * len(values)
        # sha256: the hash assign_split takes of a text (so callers can reuse it), and faster than blake2b on CPUs with
        # SHA instructions; its first 16 bytes are the duplicate key.
        seen, sha256 = self._seen, hashlib.sha256
        for i, value in enumerate(values):
            if value is None:
                continue
            keys[i] = digest = sha256(data[offsets[i] : offsets[i + 1]]).digest()
            key = digest[:16]
            if key in seen:
                duplicate[i] = True
            else:
                seen.add(key)
        return values, array, duplicate, keys

    def finish(self) -> None:
        """Data-set-level checks, after every batch."""
        check_totals(self.tally, self.cfg)


def check_totals(tally: ValidationTally, cfg: DataValidationConfig) -> None:
    """Data-set-level checks on a whole data set's counts."""
    t = tally
    if t.rows_read == 0:
        raise DataValidationError("data.source: the data set is empty (0 rows read); check data.source and data.split")
    if t.duplicate_rate > cfg.max_duplicate_rate:
        raise DataValidationError(
            f"duplicate rate {t.duplicate_rate:.1%} exceeds data.validation.max_duplicate_rate="
            f"{cfg.max_duplicate_rate:.1%} ({t.by_reason['duplicate']} of {t.non_null_rows} non-null rows are "
            "exact duplicates); deduplicate the source or raise the threshold"
        )
    if t.rows_kept < cfg.min_rows:
        raise DataValidationError(
            f"only {t.rows_kept} rows kept of {t.rows_read} read ({_describe(t.by_reason)} quarantined), fewer "
            f"than data.validation.min_rows={cfg.min_rows}"
        )


def _as_text(value: Any) -> str | None:
    """A cell as str: bytes decoded with replacement, so bad bytes show as invalid_utf8."""
    if value is None or value is pd.NA or (isinstance(value, float) and value != value):
        return None
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, str):
        # Lone surrogates (e.g. from JSON "\udc80" escapes) cannot be encoded as UTF-8: mark them like bad bytes.
        return value if value.isascii() or not _SURROGATE.search(value) else _SURROGATE.sub("\ufffd", value)
    return str(value)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _describe(counts: Counter[str]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"
