"""Document validation with great-expectations 1.x, batch by batch.

Row-level expectations (non-null text, length bounds, valid UTF-8, exact duplicates, and any row-level
expectation users add in config) flag rows by index; each flagged row gets one reason, the first in
`REASON_ORDER`, so counts reconcile: rows read = rows kept + rows quarantined, and the reasons add up to
the quarantined rows. Data-set-level checks (column present, not empty, duplicate rate, enough rows) run
once at the end and fail the stage under either policy.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from training.config import ConfigError, DataValidationConfig

log = logging.getLogger("hlat.data")

DUPLICATE_COLUMN = "_hlat_duplicate"
REASON_ORDER = ("null", "invalid_utf8", "too_short", "too_long", "duplicate")


class DataValidationError(RuntimeError):
    """The data set breaks a rule that the policy does not allow to quarantine; not worth retrying."""


@dataclass
class BatchOutcome:
    kept: list[str]
    quarantined: list[tuple[str | None, str]]


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
    """Validates DataFrames of documents with one great-expectations suite, keeping duplicate state across batches."""

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

        result = self._source_batch.get_batch(batch_parameters={"dataframe": frame}).validate(
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
        texts = [_as_text(v) for v in frame[self.column].tolist()]
        frame = pd.DataFrame(
            {
                self.column: pd.Series(texts, dtype=object),
                DUPLICATE_COLUMN: [self._is_duplicate(t) for t in texts],
            }
        )
        result = self._validation.run(
            batch_parameters={"dataframe": frame}, result_format={"result_format": "COMPLETE"}
        )
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
        outcome = BatchOutcome(
            kept=[t for i, t in enumerate(texts) if i not in row_reason and t is not None],
            quarantined=[(texts[i], r) for i, r in sorted(row_reason.items())],
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

    def _is_duplicate(self, text: str | None) -> bool:
        if text is None:
            return False
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if digest in self._seen:
            return True
        self._seen.add(digest)
        return False

    def finish(self) -> None:
        """Data-set-level checks, after every batch."""
        t, cfg = self.tally, self.cfg
        if t.rows_read == 0:
            raise DataValidationError(
                "data.source: the data set is empty (0 rows read); check data.source and data.split"
            )
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
    """Coerce a cell to str: bytes are decoded with replacement (so bad bytes show up as invalid_utf8)."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, str):
        # Lone surrogates (e.g. from JSON "\udc80" escapes) cannot be encoded as UTF-8: mark them like bad bytes.
        return value if not _SURROGATE.search(value) else _SURROGATE.sub("\ufffd", value)
    return str(value)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _describe(counts: Counter[str]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"
