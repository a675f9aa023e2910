"""The package layout: the top-level layer folders mapped into the one `hlat` package by pyproject.toml's
package-dir (no links), a wheel that holds each module once, and every package folder listed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.layout import ROOT, SETUPTOOLS, package_files


def test_every_package_folder_is_listed_and_every_layer_mapped() -> None:
    folders = {
        f"{package}.{'.'.join(init.parent.relative_to(ROOT / folder).parts)}".rstrip(".")
        for package, folder in SETUPTOOLS["package-dir"].items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert set(SETUPTOOLS["packages"]) == folders
    assert set(SETUPTOOLS["package-dir"]) == {"hlat", "hlat.core", "hlat.infra", "hlat.tasks", "hlat.flows",
                                              "hlat.training"}  # fmt: skip


def test_no_link_in_the_repository() -> None:
    listed = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert not [line for line in listed.splitlines() if line.startswith("120000")]


def test_the_wheel_holds_each_module_once(tmp_path: Path) -> None:
    source = tmp_path / "source"
    for name in ("pyproject.toml", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    for folder in SETUPTOOLS["package-dir"].values():
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    build = subprocess.run([*command, str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("hlat-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = [n for n in names if n.endswith(".py")]
    assert len(modules) == len(set(modules))
    assert set(modules) == set(package_files())
    assert {"hlat/infra/cost/measured.json", "hlat/infra/reports/baselines.json"} <= set(names)  # package data


def test_a_layer_has_one_identity() -> None:
    """`import core` from the checkout (its folder is on sys.path there) refuses: the module is hlat.core."""
    out = subprocess.run([sys.executable, "-c", "import core"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "import this folder as hlat.core" in out.stderr
