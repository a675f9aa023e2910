"""The step-line contract (`core/contract.py`): the loop's progress line, as the supervisor reads it."""

from __future__ import annotations

import math
import re

import pytest

from hlat.core.contract import STEP_LINE_METRICS, StepLine, format_step_line, parse_step_line


def test_a_formatted_step_line_parses_back_to_its_values() -> None:
    line = format_step_line(120, 5.43214, 0.8123, 1.987e-3, 45000.4)
    assert line == "step 120 loss 5.4321 grad_norm 0.812 lr 1.99e-03 45000 tok/s"
    assert parse_step_line(f"[1,0]<stdout>: 2026-12-07 INFO hlat.train {line}") == StepLine(
        step=120, loss=5.4321, grad_norm=0.812, lr=1.99e-3, tokens_per_s=45000.0
    )


def test_a_non_finite_value_parses_as_none_and_other_lines_as_nothing() -> None:
    parsed = parse_step_line(format_step_line(7, math.nan, math.inf, 1e-4, 900.0))
    assert parsed is not None and parsed.step == 7 and parsed.loss is None and parsed.grad_norm is None
    assert parsed.tokens_per_s == 900.0
    assert parse_step_line("step 7 val_loss 2.1000") is None
    assert parse_step_line("stop at step 7: checkpointing") is None
    assert parse_step_line(format_step_line(7, 2.0, 0.3, 1e-4, math.nan)) is None  # no throughput, no progress


@pytest.mark.parametrize(("name", "expected"), [("loss", "2.1000"), ("grad_norm", "0.300"), ("tokens_per_s", "1234")])
def test_sagemakers_metric_definitions_read_the_formatted_line(name: str, expected: str) -> None:
    line = format_step_line(40, 2.1, 0.3, 1.5e-4, 1234.0)
    match = re.search(STEP_LINE_METRICS[name], line)
    assert match is not None and match.group(1) == expected
