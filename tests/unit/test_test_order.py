"""How the suite keeps to its time: the main suite's order on two workers, and each tier's budget (scripts/test.sh)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.conftest import EMULATOR_FILES, EMULATOR_UNIT, LONGEST_FILES, EmulatorFilesTogether

ROOT = Path(__file__).resolve().parents[2]


def files_taking_the_emulator_lock() -> set[str]:
    found = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        if path != Path(__file__).resolve() and "one_multi_host_job_at_a_time" in path.read_text():
            found.add(path.relative_to(ROOT).as_posix())
    return found


def test_emulator_files_name_every_file_that_takes_the_emulators_lock() -> None:
    assert set(EMULATOR_FILES) == files_taking_the_emulator_lock()


def test_the_emulators_files_are_one_work_unit_and_other_files_their_own() -> None:
    scheduler = object.__new__(EmulatorFilesTogether)  # _split_scope reads nothing of the scheduler's state
    scopes = {scheduler._split_scope(f"{path}::test_x[a::b]") for path in EMULATOR_FILES}
    assert scopes == {EMULATOR_UNIT}
    assert scheduler._split_scope("tests/e2e/test_readme.py::test_y") == "tests/e2e/test_readme.py"


def test_the_ordering_table_names_existing_files_once_the_emulators_first() -> None:
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)
    assert [path for path in LONGEST_FILES if not (ROOT / path).is_file()] == []
    assert LONGEST_FILES[: len(EMULATOR_FILES)] == EMULATOR_FILES


def run_tier(name: str, command: str, scale: str) -> subprocess.CompletedProcess[str]:
    """scripts/test.sh's budgets and its `tier` function, run on `command` alone."""
    script = (ROOT / "scripts" / "test.sh").read_text()
    start, end = script.index("declare -A BUDGET_S="), script.index("\n}\n", script.index("\ntier() {")) + 3
    program = f"set -u\n{script[start:end]}\ntier '{name}' {command}\n"
    env = {**os.environ, "HLAT_BUDGET_SCALE": scale}
    return subprocess.run(["bash", "-c", program], capture_output=True, text=True, env=env, check=False)


def budget_of(name: str) -> int:
    found = re.search(rf'\["{re.escape(name)}"\]=(\d+)', (ROOT / "scripts" / "test.sh").read_text())
    assert found, name
    return int(found.group(1))


def test_a_tier_over_its_budget_fails_naming_the_tier_its_time_and_budget() -> None:
    one_second = str(1 / budget_of("main suite"))
    over = run_tier("main suite", "sleep 2.2", scale=one_second)  # SECONDS counts whole seconds
    assert over.returncode == 1
    assert "OVER BUDGET: the main suite took" in over.stderr and "over its budget of 1 s" in over.stderr
    within = run_tier("NxD tier (2.24.1)", "true", scale="1")
    assert within.returncode == 0
    assert f"the NxD tier (2.24.1) took 0 s (budget: {budget_of('NxD tier (2.24.1)')} s" in within.stdout
    failing = run_tier("XLA tier (2.28.0)", "false", scale="1")
    assert failing.returncode == 1 and "OVER BUDGET" not in failing.stderr
