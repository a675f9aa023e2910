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

import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from scripts.job_locks import (
    DEPLOYMENTS,
    NEURON,
    PAIRS,
    PIP_TIMEOUT_S,
    JobImage,
    Resolution,
    installed_by_job,
    lock_name,
    normalise,
    pip_resolve,
    requirements_in,
    resolve_pair,
)

pytestmark = pytest.mark.slow

PYPI_PROBE = "https://pypi.org/simple/pip/"


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


def lock_entries(path: Path) -> dict[str, tuple[str, set[str]]]:
    """A lock's releases: name -> (version, the sha256 hashes listed for it)."""
    text = path.read_text().replace("\\\n", " ")
    entries: dict[str, tuple[str, set[str]]] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("--require-hashes"):
            continue
        spec, *options = line.split()
        name, version = spec.split("==")
        entries[normalise(name)] = (version, {o.removeprefix("--hash=sha256:") for o in options})
    return entries


@pytest.mark.parametrize("pair", PAIRS, ids=[p.id for p in PAIRS])
def test_each_job_installs_a_lock_of_exactly_what_pip_resolves_with_the_hashes_of_its_files(
    pair: JobImage, resolutions: dict[str, Future[Resolution]]
) -> None:
    """Issue 51: a job pip-installs its lock (deployments/<file>.lock.txt, scripts/job_locks.py) in hash-checking mode:
    every release pip resolves today beyond the image's own, at that version, listing the hash of the file pip
    chose (and of the release's other files, for another platform's pip)."""
    result = resolutions[pair.id].result(timeout=PIP_TIMEOUT_S + 60)
    assert result.returncode == 0 and result.report is not None
    lock = DEPLOYMENTS / lock_name(pair.requirements)
    assert lock.read_text().splitlines()[3] == "--require-hashes"
    entries = lock_entries(lock)
    wanted = installed_by_job(result, pair)
    assert {n: v for n, (v, _) in entries.items()} == wanted, f"{lock.name} is stale: run `python scripts/job_locks.py`"
    assert all(hashes for _, hashes in entries.values())
    installs = result.report["install"]
    assert isinstance(installs, list)
    for item in installs:
        name = normalise(item["metadata"]["name"])
        info = item.get("download_info", {})
        if name not in entries or str(info.get("url", "")).startswith("file:"):
            continue  # the image's own, or a wheel built here from an sdist (its sdist's hash is listed)
        chosen = info["archive_info"].get("hashes", {}).get("sha256") or info["archive_info"]["hash"].split("=", 1)[1]
        assert chosen in entries[name][1], f"{lock.name}: {name}'s chosen file {info['url']} is not hashed"


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
