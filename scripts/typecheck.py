"""mypy over the `hlat` package as pyproject.toml lays it out (hlat.core is core/, ...), and benchmarks/.

mypy finds a module by its folder and follows neither setuptools' package-dir mapping nor the editable install's
import hook (https://github.com/python/mypy/issues/13392), so this names every file with its module, as the wheel
holds it: one identity per module. The options are pyproject.toml's [tool.mypy].

Usage: .venv/bin/python scripts/typecheck.py
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parents[1]


def sources() -> list[BuildSource]:
    """Every module of the package (through the mapping) and of benchmarks/, with its module name."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = []
    for package, folder in {**mapping, "benchmarks": "benchmarks"}.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            module = ".".join([package, *(p for p in parts if p != "__init__")])
            found.append(BuildSource(str(path.relative_to(ROOT)), module))
    return found


def main() -> int:
    os.chdir(ROOT)
    _, options = process_options(["--config-file", "pyproject.toml"], require_targets=False)
    files = sources()
    try:
        messages = build.build(files, options).errors
    except CompileError as exc:
        messages = exc.messages
    for line in messages:
        print(line)
    errors = sum(": error:" in line for line in messages)
    print(f"Found {errors} errors (checked {len(files)} source files)" if errors else
          f"Success: no issues found in {len(files)} source files")  # fmt: skip
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
