"""The project's modules as pyproject.toml's package-dir mapping lays them out (hlat.core is core/, ...), for the
tests that read the source: the layer rules and the packaging checks."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def project_modules() -> dict[str, Path]:
    """'hlat.<layer>.<module>' (or 'hlat.<module>' for hlat/'s own files) -> path, for every module of the package,
    subpackages included."""
    found = {}
    for package, folder in SETUPTOOLS["package-dir"].items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                parts = path.relative_to(ROOT / folder).with_suffix("").parts
                found[".".join([package, *(p for p in parts if p != "__init__")])] = path
    return found
