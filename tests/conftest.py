"""Test-session environment: nothing reaches the network or the user's home, and one Prefect test server."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Set before anything imports prefect, datasets or huggingface_hub: they read these at import time.
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="hlat-tests-"))
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_TO_API_BATCH_INTERVAL"] = "0.3"
os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"  # as hlat.tasks sets it, before prefect loads
os.environ.pop("PREFECT_API_URL", None)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = str(_SESSION_DIR / "hf")
os.environ["HF_DATASETS_CACHE"] = str(_SESSION_DIR / "hf" / "datasets")
os.environ.setdefault("HLAT_CACHE_DIR", str(_SESSION_DIR / "hlat-cache"))
os.environ["TOKENIZERS_PARALLELISM"] = "false"

# Prefect's console log handler keeps the stream it is built with. Build it now, on the session's stderr: built
# lazily inside a test that uses capsys (the first CLI call imports Prefect), it would write to that test's
# captured stream after it is closed, failing every later Prefect flow of the session.
from prefect.logging.configuration import setup_logging  # noqa: E402

setup_logging()

# tests/xla and tests/nxd are the XLA and NxD tiers: they run in .venv-xla and .venv-xla-2.28 (scripts/test.sh),
# without this conftest (--confcutdir).
collect_ignore = ["xla", "nxd"]

from tests.sizes import SMALL_DATA, SMALL_RUN  # noqa: E402  (re-exported: tests import them from here)

# The longest test files first (by a timed serial run on 2 cores): scripts/test.sh hands files to its two
# pytest-xdist workers in collection order (`--dist loadfile --no-loadscope-reorder`), so a long file started last
# would keep one worker busy while the other idles.
LONGEST_FILES = (
    "tests/e2e/test_readme.py",
    "tests/integration/test_emulator.py",
    "tests/chaos/test_emulator_chaos.py",
    "tests/integration/test_job_requirements.py",
    "tests/integration/test_emulator_hosts.py",
    "tests/e2e/test_deployments.py",
    "tests/chaos/test_stop_grace.py",
    "tests/integration/test_cli.py",
    "tests/integration/test_emulator_storage_faults.py",
    "tests/unit/test_benchmarks.py",
    "tests/chaos/test_failure_causes.py",
    "tests/integration/test_flows.py",
    "tests/integration/test_training.py",
    "tests/chaos/test_train_stage.py",
    "tests/integration/test_evaluate.py",
    "tests/integration/test_local_jobs.py",
    "tests/integration/test_compile_cache.py",
    "tests/integration/test_stages.py",
    "tests/integration/test_xla_rehearsal.py",
    "tests/integration/test_fsdp.py",
    "tests/integration/test_prepare_job.py",
    "tests/chaos/test_kill_resume.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of LONGEST_FILES first, in that order; the rest as collected (a stable sort: the same order on
    every xdist worker, as xdist requires)."""
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture
def one_multi_host_job_at_a_time() -> Iterator[None]:
    """Hold the machine's SageMaker-emulator lock for one test: one multi-host job runs on a machine at a time (the
    SDK fixes its master port, 7777), and scripts/test.sh runs test files on two pytest-xdist workers at once."""
    import fcntl

    with open(Path(tempfile.gettempdir()) / "hlat-tests-sagemaker-emulator.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    """One temporary Prefect server (SQLite) for the whole session (~10 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with prepared data and a trained tokenizer, shared by the training tests."""
    from hlat.core.presets import load_config
    from hlat.infra.runs import open_run
    from hlat.infra.tokenizer import build_tokenizer
    from hlat.training.data.units import prepare_dataset

    root = tmp_path_factory.mktemp("prepared")
    cfg = load_config("tiny", SMALL_DATA, run_id="base", storage=str(root))
    run = open_run(cfg)
    prepare_dataset(cfg.data, run.stage("data"), fingerprint="training-tests")
    build_tokenizer(
        run.stage("data"), run.stage("tokenizer"), cfg.model.vocab_size, cfg.model.max_seq_len, cfg.tokenizer
    )
    return root / "base"


@pytest.fixture
def small_run() -> dict[str, object]:
    return dict(SMALL_RUN)
