"""What a SageMaker job pip-installs must not replace a package its image pins.

Training, precompile and burn-in jobs pip-install deployments/job-requirements-<SDK>.txt on the Neuron training image
of their Neuron SDK (deployments/neuron-image-2.24.1.txt, Python 3.10; neuron-image-2.28.0.txt, Python 3.12);
evaluation jobs install deployments/eval-requirements.txt on
the PyTorch GPU image (deployments/gpu-image-2.10.txt, Python 3.13), and prepare-data jobs
deployments/data-requirements.txt on the CPU image of the same PyTorch release (checked against the same pin
list). A requirement that moved one of the image's pins would break the image under the job: a newer protobuf
breaks neuronx-cc, a newer fsspec the image's datasets.

For each pair, pip's own resolver runs as that install would, but for the image's Python and platform (Ubuntu
22.04: glibc 2.35, x86_64) instead of this machine's: `pip install --dry-run --report` into an empty --target (so
nothing installed here counts), wheels only (pip allows nothing else for another Python version), with the
image's file both as requirements (it is installed) and as constraints (it may not move). The report names the
version pip chose for every package; the tests check the image's pins kept theirs and the job got its own. Two
cheap negative cases show the check can fail: the tensorboard 2.21 that job-requirements-2.24.1.txt used to pin is
refused, directly (the image pins tensorboard 2.6.0) and through its protobuf>=6.31.

Needs PyPI (pip's cache helps: a warm run takes about a minute). Skipped when PyPI cannot be reached, unless
HLAT_REQUIRE_PYPI=1 (CI), where that fails instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from hlat.core.environment import NEURON_SDKS

pytestmark = pytest.mark.slow

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"
PYPI_PROBE = "https://pypi.org/simple/pip/"
PIP_TIMEOUT_S = 900
"""pip resolves for minutes under the suite's load (botocore has over a thousand releases to weigh)."""


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
class Refused:
    """A requirement the Neuron image's pins must refuse, and the package pip's conflict message must name."""

    name: str
    requirement: str
    without_pin: str | None
    """An image pin left out of the constraints, so the refusal must come through a dependency instead."""
    culprit: str


NEGATIVES = [
    Refused("tensorboard-2.21-direct", "tensorboard==2.21.0", None, "tensorboard"),
    Refused("tensorboard-2.21-via-protobuf", "tensorboard==2.21.0", "tensorboard", "protobuf"),
]


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


def resolve_refused(case: Refused, work: Path) -> Resolution:
    constraints = DEPLOYMENTS / NEURON.image
    if case.without_pin is not None:
        kept = [line for line in constraints.read_text().splitlines() if not line.startswith(f"{case.without_pin}=")]
        constraints = work / "constraints.txt"
        constraints.write_text("\n".join(kept) + "\n")
    return pip_resolve(work, [case.requirement, "-c", str(constraints)], NEURON.python, NEURON.glibc)


def pypi_unreachable() -> str | None:
    """Why PyPI cannot be reached, or None when it answers."""
    try:
        with urllib.request.urlopen(urllib.request.Request(PYPI_PROBE, method="HEAD"), timeout=5):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as exc:
        return f"{PYPI_PROBE}: {getattr(exc, 'reason', exc)}"


@pytest.fixture(scope="module")
def pypi() -> None:
    problem = pypi_unreachable()
    if problem is None:
        return
    if os.environ.get("HLAT_REQUIRE_PYPI") == "1":
        pytest.fail(f"PyPI cannot be reached ({problem}) and HLAT_REQUIRE_PYPI=1 requires it", pytrace=False)
    pytest.skip(f"PyPI cannot be reached ({problem}): no resolution possible (HLAT_REQUIRE_PYPI=1 fails instead)")


@pytest.fixture(scope="module")
def resolutions(pypi: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Resolution]]]:
    """Every resolution of the module, started at once (pip mostly waits on the network): id -> its future."""
    with ThreadPoolExecutor(max_workers=len(PAIRS) + len(NEGATIVES)) as pool:
        futures = {p.id: pool.submit(resolve_pair, p, tmp_path_factory.mktemp("resolve")) for p in PAIRS}
        for case in NEGATIVES:
            futures[case.name] = pool.submit(resolve_refused, case, tmp_path_factory.mktemp("refuse"))
        yield futures


@pytest.mark.parametrize("pair", PAIRS, ids=[p.id for p in PAIRS])
def test_job_requirements_leave_the_image_pins_alone(
    pair: JobImage, resolutions: dict[str, Future[Resolution]]
) -> None:
    result = resolutions[pair.id].result(timeout=PIP_TIMEOUT_S + 60)
    assert result.returncode == 0, (
        f"pip cannot install {pair.requirements} on the image's pins ({pair.image}, Python {pair.python}):\n"
        f"{result.output[-4000:]}"
    )
    chosen = result.versions()
    misfits = result.needing_another_python(pair.python)
    assert not misfits, f"pip chose releases that cannot run on the image's Python {pair.python}: {misfits}"

    def got(req: Requirement) -> str:
        return chosen.get(normalise(req.name), "not installed")

    image_pins = requirements_in(DEPLOYMENTS / pair.image)
    moved = [f"{req} -> {got(req)}" for req in image_pins if not req.specifier.contains(got(req), prereleases=True)]
    assert not moved, f"{pair.requirements} would move these pins of {pair.image}: {moved}"

    own = requirements_in(DEPLOYMENTS / pair.requirements)
    loose = [str(req) for req in own if len(req.specifier) != 1 or next(iter(req.specifier)).operator != "=="]
    assert not loose, f"{pair.requirements}: pin each requirement exactly (name==version): {loose}"
    wrong = [f"{req} -> {got(req)}" for req in own if got(req) != next(iter(req.specifier)).version]
    assert not wrong, f"{pair.requirements}: these would not install at their own pins: {wrong}"


@pytest.mark.parametrize("case", NEGATIVES, ids=[c.name for c in NEGATIVES])
def test_a_requirement_that_moves_an_image_pin_is_refused(
    case: Refused, resolutions: dict[str, Future[Resolution]]
) -> None:
    result = resolutions[case.name].result(timeout=PIP_TIMEOUT_S + 60)
    assert result.returncode != 0, f"{case.requirement} resolved against {NEURON.image}: {result.versions()}"
    assert "ResolutionImpossible" in result.output, f"pip failed for another reason:\n{result.output[-4000:]}"
    conflict = result.output.split("The conflict is caused by:", 1)[-1].split("To fix this", 1)[0]
    assert case.culprit in conflict, f"the conflict should name {case.culprit}:\n{result.output[-4000:]}"


def test_a_release_for_a_newer_python_than_the_images_is_named() -> None:
    """The Requires-Python check on a report as pip 23.2 wrote it for the 2.24.1 image (Python 3.10)."""
    chosen = [("networkx", "3.6.1", "!=3.14.1,>=3.11"), ("Markdown", "3.11", ">=3.11"), ("numpy", "1.26.4", ">=3.9")]
    report = {"install": [{"metadata": {"name": n, "version": v, "requires_python": r}} for n, v, r in chosen]}
    resolution = Resolution(0, "", report)
    assert resolution.needing_another_python("3.10") == [
        "networkx 3.6.1 (Requires-Python !=3.14.1,>=3.11)",
        "Markdown 3.11 (Requires-Python >=3.11)",
    ]
    assert resolution.needing_another_python("3.12") == []
