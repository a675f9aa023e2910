"""The project's modules as pyproject.toml's package-dir mapping lays them out (hlat.core is core/, ...), for the
tests that read the source: the layer rules and the packaging checks."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_files() -> dict[str, Path]:
    """'hlat/core/config.py' (a module's path in the package, as the wheel holds it) -> its file in the checkout, for
    every module of the package, subpackages included."""
    return {
        f"{package.replace('.', '/')}/{path.relative_to(ROOT / folder).as_posix()}": path
        for package, folder in SETUPTOOLS["package-dir"].items()
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def project_modules() -> dict[str, Path]:
    """'hlat.core.config' (or 'hlat.core' for its __init__) -> its file, for every module of the package."""
    return {name.removesuffix(".py").removesuffix("/__init__").replace("/", "."): path
            for name, path in package_files().items()}  # fmt: skip
