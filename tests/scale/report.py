"""The table of docs/multi-host.md ("A simulated SageMaker at full scale"): every scenario of tests/scale at both
presets, before and after its fix, with the default job.max_restarts (100): dollars billed, dollars wasted, steps
lost, jobs submitted and how the stage ended. `python -m tests.scale.report` (about a minute of CPU: the "before"
forms relaunch 101 jobs)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import pytest

from tests.scale import model, scenarios

WHAT = {
    "1": "hung job, supervisor dead",
    "2": "deterministic bug reported as a lost peer",
    "3": "NaN at a moving step",
    "4": "start-up of 70 min",
    "5": "full-world gloo stop vote",
    "6": "stop with a save in flight",
    "7": "`hlat stop` in a back-off",
    "8": "two supervisors, Ctrl-C in one",
    "9": "supervisor clock 31 min behind",
    "10": "failure record cut at 1,024",
    "11a": "deadline passes in a back-off",
    "11b": "$10 of budget left",
    "11c": "transient ResourceLimitExceeded",
}


def ending(text: str) -> str:
    return text.split(":", 1)[0]


def main() -> None:
    logging.disable(logging.CRITICAL)
    rows = [
        "| scenario | preset | before: billed / wasted | steps lost | jobs | ended "
        "| after: billed / wasted | steps lost | jobs | ended |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in scenarios.SCENARIOS.items():
            for preset in model.PRESETS:
                cells = []
                for fixed in (False, True):
                    mp = pytest.MonkeyPatch()
                    try:
                        o = run(mp, Path(tmp) / f"{name}-{preset}-{fixed}", preset, fixed, restarts=None)
                    finally:
                        mp.undo()
                    cells += [
                        f"${o.spent_usd:,.0f} / ${o.wasted_usd:,.0f}",
                        f"{o.steps_lost:,}",
                        str(o.submissions),
                        ending(o.ended),
                    ]
                rows.append(f"| {name}: {WHAT[name]} | {preset} | " + " | ".join(cells) + " |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
