"""What a SageMaker job pip-installs, resolved for its image, and locked with hashes.

Each job installs a requirements file on top of an AWS image (deployments/): training, precompile and burn-in jobs
deployments/job-requirements-<SDK>.txt on their Neuron SDK's training image (the image's pins:
neuron-image-<SDK>.txt), evaluation jobs eval-requirements.txt and prepare-data jobs data-requirements.txt on the
PyTorch GPU and CPU images of one release (gpu-image-2.10.txt). pip's own resolver runs as that install would, but for
the image's Python and platform instead of this machine's (`pip install --dry-run --report`, wheels only), with the
image's file both as requirements (it is installed) and as constraints (it may not move).

`python scripts/job_locks.py` writes, beside each file, `<file>.lock.txt`: every release the job installs that the
image does not already hold at that version, pinned, with the sha256 of each of that release's files on PyPI (pip's
hash-checking mode: a file whose hash is not listed is refused, so a release replaced on the index, or a package
the lock does not name, fails the job at start instead of running). This is what the jobs install
(infra/backends/sagemaker_source.py: requirements_of); tests/integration/test_job_requirements.py checks that each
lock is what the resolution gives today. Needs PyPI.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from hlat.core.environment import NEURON_SDKS

DEPLOYMENTS = Path(__file__).resolve().parents[1] / "deployments"
PIP_TIMEOUT_S = 900
"""pip resolves for minutes under the suite's load (botocore has over a thousand releases to weigh)."""
PYPI_JSON = "https://pypi.org/pypi/{name}/json"


@dataclass(frozen=True)
class JobImage:
    """A job's requirements file and the image it is installed on (files under deployments/)."""

    requirements: str
    image: str
    python: str
    """The image's Python, major.minor."""
    glibc: tuple[int, int] = (2, 35)
    """The image's C library (Ubuntu 22.04's by default): wheels needing a newer one could not install."""
    sdist_only: tuple[str, ...] = ()
    """Dependencies PyPI has only as source: the image builds them at install time; here they are built first
    (pure Python, so the wheel built here is the one the image would build) and offered through --find-links,
    since pip resolves for another Python version from wheels only."""

    @property
    def id(self) -> str:
        return f"{self.requirements}@{self.image}"


UBUNTU_GLIBC = {"22.04": (2, 35), "24.04": (2, 39)}
PAIRS = [
    # Each Neuron SDK's training image and what its jobs install (core.environment.NEURON_SDKS)
    *(
        JobImage(sdk.job_requirements, sdk.image_pins, sdk.python, glibc=UBUNTU_GLIBC[sdk.ubuntu])
        for sdk in NEURON_SDKS.values()
    ),
    JobImage(
        "eval-requirements.txt",
        "gpu-image-2.10.txt",
        "3.13",
        sdist_only=("sqlitedict", "rouge-score", "word2number"),  # lm_eval's
    ),
    JobImage("data-requirements.txt", "gpu-image-2.10.txt", "3.13"),
]
NEURON = PAIRS[0]


@dataclass(frozen=True)
class Resolution:
    returncode: int
    output: str
    """pip's stdout and stderr."""
    report: dict[str, object] | None

    def chosen(self) -> list[dict[str, str]]:
        """The core metadata of every release pip chose (the report's install entries)."""
        assert self.report is not None
        installs = self.report["install"]
        assert isinstance(installs, list)
        return [i["metadata"] for i in installs]

    def versions(self) -> dict[str, str]:
        """Chosen version of every package, by normalised name."""
        return {normalise(m["name"]): m["version"] for m in self.chosen()}

    def needing_another_python(self, python: str) -> list[str]:
        """The chosen releases whose Requires-Python excludes `python` (pip's own check, as the image's pip does it).
        A release found on an index that does not state Requires-Python (a local --find-links folder, a file:// index)
        is only known to need a newer Python once its metadata is read: pip 23.2 took networkx 3.6.1 and Markdown 3.11
        (both Python >= 3.11) for the 2.24.1 image's Python 3.10 that way."""
        return [
            f"{m['name']} {m['version']} (Requires-Python {m['requires_python']})"
            for m in self.chosen()
            if m.get("requires_python") and not SpecifierSet(m["requires_python"]).contains(python, prereleases=True)
        ]


def normalise(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements_in(path: Path) -> list[Requirement]:
    """The requirement lines of a requirements file (comments and blank lines skipped)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def manylinux_platforms(glibc: tuple[int, int], arch: str = "x86_64") -> list[str]:
    """Every manylinux platform tag a system with this glibc accepts, newest first (pip takes them as given)."""
    major, minor = glibc
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
    return [*tags, f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]


def pip_resolve(
    work: Path,
    args: list[str],
    python: str,
    glibc: tuple[int, int],
    find_links: Path | None = None,
) -> Resolution:
    """`pip install --dry-run --report` of `args` for another Python and platform, installing nothing."""
    report = work / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"]
    cmd += ["--target", str(work / "target"), "--report", str(report)]
    cmd += ["--python-version", python, "--implementation", "cp", "--only-binary=:all:"]
    for platform in manylinux_platforms(glibc):
        cmd += ["--platform", platform]
    if find_links is not None:
        cmd += ["--find-links", str(find_links)]
    cmd += ["--disable-pip-version-check", "--no-input", "--progress-bar", "off", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    loaded = json.loads(report.read_text()) if proc.returncode == 0 and report.is_file() else None
    return Resolution(proc.returncode, proc.stdout + proc.stderr, loaded)


def build_sdist_only(work: Path, names: tuple[str, ...]) -> Path:
    """Wheels of source-only dependencies, built here (pip's wheel cache makes this quick after the first run)."""
    wheels = work / "wheels"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "--no-input"]
    cmd += ["--wheel-dir", str(wheels), *names]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"could not build wheels of {', '.join(names)}:\n{proc.stdout}{proc.stderr}")
    return wheels


def resolve_pair(pair: JobImage, work: Path) -> Resolution:
    image = DEPLOYMENTS / pair.image
    find_links = build_sdist_only(work, pair.sdist_only) if pair.sdist_only else None
    args = ["-r", str(DEPLOYMENTS / pair.requirements), "-r", str(image), "-c", str(image)]
    return pip_resolve(work, args, pair.python, pair.glibc, find_links)


def lock_name(requirements: str) -> str:
    """The lock beside a requirements file: job-requirements-2.28.0.txt -> job-requirements-2.28.0.lock.txt."""
    return requirements.removesuffix(".txt") + ".lock.txt"


def installed_by_job(resolution: Resolution, pair: JobImage) -> dict[str, str]:
    """name -> version of every release the job's own requirements bring beyond the image: its requirements and,
    through their dependencies (markers evaluated for the image's Python and platform, extras followed), every
    release they need that the image's pins do not hold. A pinned package is the image's, and so are its own
    dependencies: the walk stops there (torch's CUDA wheels, say, are not the job's to install)."""
    from packaging.markers import default_environment

    image = {normalise(r.name) for r in requirements_in(DEPLOYMENTS / pair.image)}
    chosen = {normalise(m["name"]): m for m in resolution.chosen()}
    environment = {
        **default_environment(),
        "python_version": pair.python,
        "python_full_version": f"{pair.python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    found: dict[str, str] = {}
    missing: dict[str, dict[str, Any]] = {}
    need: dict[str, SpecifierSet] = {}
    todo = [(normalise(r.name), frozenset(r.extras)) for r in requirements_in(DEPLOYMENTS / pair.requirements)]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name in image:
            continue
        seen.add((name, extras))
        meta = (
            chosen.get(name)
            or missing.get(name)
            or missing.setdefault(name, newest_release(name, pair.python, need[name]))
        )
        found[name] = meta["version"]
        for line in meta.get("requires_dist") or []:
            dep = Requirement(line)
            wanted = dep.marker is None or any(
                dep.marker.evaluate({**environment, "extra": extra}) for extra in (extras or {""})
            )
            if wanted:
                todo.append((normalise(dep.name), frozenset(dep.extras)))
                need[normalise(dep.name)] = need.get(normalise(dep.name), SpecifierSet()) & dep.specifier
    return found


def newest_release(name: str, python: str, specifier: SpecifierSet) -> dict[str, Any]:
    """The core metadata of `name`'s newest release for `python`, from PyPI: for a dependency whose marker holds on
    the image's Python but not on this one (pip's --python-version does not change how it evaluates markers, so its
    resolution leaves such a dependency out: aiohttp's async-timeout on Python 3.10)."""
    from packaging.version import Version

    with urllib.request.urlopen(PYPI_JSON.format(name=name), timeout=60) as answer:
        project = json.load(answer)
    fits = [
        Version(version)
        for version, files in project["releases"].items()
        if files
        and not Version(version).is_prerelease
        and specifier.contains(version)
        and not all(f.get("yanked") for f in files)
        and all(not f.get("requires_python") or SpecifierSet(f["requires_python"]).contains(python) for f in files)
    ]
    version = str(max(fits))
    info = project["info"]
    requires = info.get("requires_dist") if info.get("version") == version else []
    return {"name": name, "version": version, "requires_dist": requires or []}


def release_hashes(name: str, version: str) -> list[str]:
    """The sha256 of every file of a release on PyPI (wheels for every platform, and the sdist)."""
    with urllib.request.urlopen(PYPI_JSON.format(name=name), timeout=60) as answer:
        files = json.load(answer)["releases"].get(version, [])
    hashes = sorted({f["digests"]["sha256"] for f in files})
    if not hashes:
        raise RuntimeError(f"PyPI lists no files for {name} {version}")
    return hashes


def lock_text(pair: JobImage, releases: dict[str, str], hashes: dict[str, list[str]]) -> str:
    lines = [
        f"# Generated by scripts/job_locks.py from {pair.requirements} on {pair.image} (Python {pair.python}): every",
        "# release the job installs beyond the image's own, with the sha256 of each of its files on PyPI. pip installs",
        "# it in hash-checking mode. Do not edit: change the requirements file and run the script again.",
        "--require-hashes",
    ]
    for name in sorted(releases):
        pins = " \\\n".join(f"    --hash=sha256:{h}" for h in hashes[name])
        lines.append(f"{name}=={releases[name]} \\\n{pins}")
    return "\n".join(lines) + "\n"


def write_locks(work: Path) -> list[Path]:
    """Resolve every pair and write its lock; returns the files written."""
    written = []
    for pair in PAIRS:
        folder = work / pair.requirements
        folder.mkdir(parents=True)
        resolution = resolve_pair(pair, folder)
        if resolution.returncode != 0 or resolution.report is None:
            raise RuntimeError(f"pip cannot resolve {pair.id}:\n{resolution.output[-3000:]}")
        releases = installed_by_job(resolution, pair)
        hashes = {name: release_hashes(name, version) for name, version in releases.items()}
        path = DEPLOYMENTS / lock_name(pair.requirements)
        path.write_text(lock_text(pair, releases, hashes))
        written.append(path)
        print(f"{path.name}: {len(releases)} release(s)", flush=True)
    return written


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hlat-locks-") as tmp:
        write_locks(Path(tmp))
    sys.exit(0)
