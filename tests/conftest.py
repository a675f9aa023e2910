"""Test-session environment: nothing reaches the network or the user's home, and one Prefect test server."""

from __future__ import annotations

import logging
import os
import resource
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling

# Set before anything imports prefect, datasets or huggingface_hub: they read these at import time.
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="hlat-tests-"))
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_TO_API_BATCH_INTERVAL"] = "0.3"
os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"  # as hlat.tasks sets it, before prefect loads
# Test fault injection (HLAT_FAULT_*, HLAT_PREPARE_FAULTS, HLAT_LOCAL_FAULTS) reaches jobs only through these hook
# modules (training/hooks.py, infra/backends/local_daemon.py): set before anything reads them; every job, daemon and
# host
# inherits them.
os.environ.setdefault("HLAT_JOB_HOOKS", "hlat.training.faults")
os.environ.setdefault("HLAT_BACKEND_HOOKS", "hlat.infra.backends.local_faults")
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

# The files whose tests hold the SageMaker emulator's machine-wide lock (`one_multi_host_job_at_a_time`). Under
# `--dist loadfile` they form one work unit (EmulatorFilesTogether): one worker runs them in a row. Spread over both
# workers, one would wait for the other's lock (CI, 2026-12-06: 398 s, 76 s and 73 s of set-up spent waiting).
# tests/unit/test_test_order.py checks that this list names every file that takes the lock.
EMULATOR_FILES = (
    "tests/chaos/test_emulator_chaos.py",
    "tests/integration/test_emulator.py",
    "tests/integration/test_emulator_hosts.py",
    "tests/chaos/test_stop_grace.py",
    "tests/chaos/test_failure_causes.py",
    "tests/integration/test_emulator_storage_faults.py",
    "tests/integration/test_status_stop_emulator.py",
    "tests/integration/test_emulator_watchdog.py",
)
EMULATOR_UNIT = "tests: the SageMaker emulator's files"

# The longest work units first (docs/testing.md has the times): scripts/test.sh hands units to its pytest-xdist
# workers in collection order (`--dist loadfile --no-loadscope-reorder`). The emulator's files come first, as one
# unit; the e2e blocks then start on the other workers; a long unit started last would keep one worker busy while
# the others idle.
LONGEST_FILES = (
    *EMULATOR_FILES,
    "tests/e2e/test_readme.py",
    "tests/e2e/test_deployments.py",
    "tests/integration/test_job_requirements.py",
    "tests/integration/test_cli.py",
    "tests/integration/test_status_stop.py",
    "tests/unit/test_benchmarks.py",
    "tests/integration/test_flows.py",
    "tests/integration/test_training.py",
    "tests/chaos/test_train_stage.py",
    "tests/integration/test_evaluate.py",
    "tests/integration/test_local_jobs.py",
    "tests/integration/test_compile_cache.py",
    "tests/integration/test_stages.py",
    "tests/integration/test_xla_rehearsal.py",
    "tests/integration/test_mixture_run.py",
    "tests/integration/test_fsdp.py",
    "tests/integration/test_prepare_job.py",
    "tests/chaos/test_kill_resume.py",
)


class EmulatorFilesTogether(LoadFileScheduling):
    """`--dist loadfile`, with the files of EMULATOR_FILES as one work unit, run in a row by one worker."""

    def _split_scope(self, nodeid: str) -> str:
        path = super()._split_scope(nodeid)
        return EMULATOR_UNIT if path in EMULATOR_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadFileScheduling | None:
    """The scheduler of `--dist loadfile` (scripts/test.sh's); the other modes keep xdist's own."""
    return EmulatorFilesTogether(config, log) if config.getvalue("dist") == "loadfile" else None


# The fast tier's rule (scripts/test.sh --fast, which passes --test-budget): a test whose body takes more than a few
# seconds on an idle machine is marked `slow`, and the tier fails when a test not so marked overran the budget, so a
# new slow test cannot silently make the inner loop slow. The budget stretches with the load average over the cores
# (other work on a shared machine slows every test alike); the set-ups and teardowns of fixtures get three budgets,
# as a session fixture (the Prefect test server, ~10 s) is built inside the first test that uses it on each worker.
FIXTURE_BUDGETS = 3
_overruns: list[tuple[str, str, float, float]] = []  # (test, phase, seconds, budget)
_config: pytest.Config | None = None


@pytest.fixture(autouse=True)
def _no_capture_handler_left_on_named_loggers() -> Iterator[None]:
    """Take pytest's own log handlers off every named logger after each test.

    Prefect's logging set-up (a flow run in a test) gives its extra loggers ("hlat", PREFECT_LOGGING_EXTRA_LOGGERS)
    the root logger's handlers of that moment, pytest's capture handlers among them. pytest reuses one capture
    handler per session, so a later test's `caplog` would see each "hlat.*" record twice: once from the root, once
    from "hlat"."""
    yield
    for logger in logging.Logger.manager.loggerDict.values():
        if isinstance(logger, logging.Logger):
            for handler in [h for h in logger.handlers if type(h).__module__ == "_pytest.logging"]:
                logger.removeHandler(handler)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--test-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail the run when the body of a test not marked slow took over SECONDS (a fixture's set-up or "
        f"teardown: {FIXTURE_BUDGETS}x), times the load average per core when that is over 1",
    )
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=0,
        metavar="N",
        help="show the N test phases that took the most CPU time (the test process's and its reaped children's)",
    )


def phase_budget(budget: float, phase: str) -> float:
    """The budget of one phase of a test (`setup`, `call` or `teardown`) on this machine now."""
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return budget * (1 if phase == "call" else FIXTURE_BUDGETS) * max(1.0, per_core)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Note a phase of a test not marked slow that overran --test-budget (in the process that reports the run:
    under pytest-xdist, the controller, which receives its workers' reports)."""
    config = _config
    cpu = dict(report.user_properties).get("cpu_s")
    if cpu is not None and config is not None and not hasattr(config, "workerinput"):
        _cpu.append((float(cpu), report.duration, report.when, report.nodeid))
    budget = config.getoption("test_budget") if config is not None else None
    if budget is None or hasattr(config, "workerinput") or "slow" in report.keywords:
        return
    allowed = phase_budget(budget, report.when)
    if report.duration > allowed:
        _overruns.append((report.nodeid, report.when, report.duration, allowed))


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


# --cpu-durations=N: the N phases that took the most CPU (this process's and its children's, as the kernel counts
# them when a child is reaped): on a machine whose cores are shared by several streams, wall time says how long a
# test waited; CPU time says what it costs the others.
_cpu: list[tuple[float, float, str, str]] = []  # (cpu seconds, wall seconds, phase, test)


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item._hlat_cpu_started = _cpu_seconds()  # type: ignore[attr-defined]
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Each phase's CPU: from its start (set-up's, or the report of the phase before, which it follows at once)."""
    outcome = yield
    started = getattr(item, "_hlat_cpu_started", None)
    if started is not None:
        now = _cpu_seconds()
        outcome.get_result().user_properties.append(("cpu_s", now - started))
        item._hlat_cpu_started = now  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A run with an overrun fails (exit code 1), even when every test passed."""
    if _overruns and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    shown = terminalreporter.config.getoption("cpu_durations")
    if shown and _cpu:
        terminalreporter.section(f"the {shown} phases that took the most CPU (the process's and its children's)")
        terminalreporter.line(f"in all: {sum(c for c, *_ in _cpu):.0f} s of CPU in {len(_cpu)} phases")
        for cpu, wall, phase, nodeid in sorted(_cpu, reverse=True)[:shown]:
            terminalreporter.line(f"{cpu:8.1f}s cpu {wall:8.1f}s wall  {phase:8s} {nodeid}")
    if not _overruns:
        return
    terminalreporter.section("tests over the fast tier's budget: mark them @pytest.mark.slow", red=True)
    for nodeid, phase, seconds, allowed in _overruns:
        terminalreporter.line(f"{nodeid} ({phase}): {seconds:.1f} s, budget {allowed:.1f} s")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of LONGEST_FILES first, in that order; the rest as collected (a stable sort: the same order on
    every xdist worker, as xdist requires)."""
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture
def one_multi_host_job_at_a_time() -> Iterator[None]:
    """Hold the machine's SageMaker-emulator lock for one test: one multi-host job runs on a machine at a time (the
    SDK fixes its master port, 7777), and scripts/test.sh runs test files on several pytest-xdist workers at once."""
    import fcntl

    from hlat.infra.backends.emulator import master_port_free

    def port_released(timeout: float) -> bool:
        """The master port free: the ranks of the job before (this test's, or another worker's) have exited; an
        ended job's hosts may take seconds to go, and a torchrun that starts meanwhile fails with EADDRINUSE."""
        deadline = time.monotonic() + timeout
        while not master_port_free():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    with open(Path(tempfile.gettempdir()) / "hlat-tests-sagemaker-emulator.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        assert port_released(120), "port 7777 stayed in use for 120 s: a multi-host job outlived its test"
        yield
        port_released(60)  # the next holder waits too; a job left running fails that one, by name


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
    from hlat.core.run import open_run
    from hlat.infra.inputs.tokenizer import build_tokenizer
    from hlat.training.data.units import prepare_dataset

    root = tmp_path_factory.mktemp("prepared")
    cfg = load_config("tiny", SMALL_DATA, run_id="base", storage=str(root))
    run = open_run(cfg)
    prepare_dataset(cfg.data, run.stage("data"), fingerprint="training-tests")
    build_tokenizer(
        run.stage("data"), run.stage("tokenizer"), cfg.model.vocab_size, cfg.model.max_seq_len, cfg.tokenizer
    )
    return root / "base"


def prose_corpus(path: Path, docs: int) -> str:
    """A jsonl source of English-like prose, deterministic: the second source of the mixture fixture."""
    import json
    import random

    rng = random.Random(7)
    words = [
        "the",
        "a",
        "model",
        "data",
        "token",
        "learns",
        "from",
        "each",
        "of",
        "many",
        "short",
        "long",
        "sentences",
        "and",
        "stream",
        "mixes",
        "weight",
    ]
    lines = []
    for i in range(docs):
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + "."
                     for _ in range(rng.randint(3, 12))]  # fmt: skip
        lines.append(json.dumps({"text": f"Note {i}. " + " ".join(sentences)}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def prepared_mixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder whose prepared data is a mixture of two sources (the stdlib corpus 0.7, prose 0.3), each in its
    folder beside the runs, and a tokenizer trained on the mixture."""
    from hlat.core.layout import source_folder
    from hlat.core.presets import load_config
    from hlat.core.run import open_run
    from hlat.infra.inputs.tokenizer import build_tokenizer
    from hlat.training.data.units import prepare_dataset, write_mixture

    root = tmp_path_factory.mktemp("prepared-mixture")
    prose = prose_corpus(root / "prose.jsonl", 200)
    sources = [
        {"name": "stdlib", "source": "builtin:python-stdlib", "max_documents": 300, "weight": 0.7},
        {"name": "prose", "source": prose, "weight": 0.3},
    ]
    cfg = load_config("tiny", {**SMALL_DATA, "data.sources": sources}, run_id="base-mix", storage=str(root))
    run = open_run(cfg)
    folders = []
    for source in cfg.data.mixture:
        folder = source_folder(run.storage, source.resolved_name, f"fixture-{source.resolved_name}")
        prepare_dataset(cfg.data.source_data_config(source), folder, fingerprint=source.resolved_name)
        folders.append((source, folder))
    write_mixture(cfg.data, run.stage("data"), folders, "training-tests-mixture")
    build_tokenizer(
        run.stage("data"), run.stage("tokenizer"), cfg.model.vocab_size, cfg.model.max_seq_len, cfg.tokenizer
    )
    return root / "base-mix"


@pytest.fixture
def small_run() -> dict[str, object]:
    return dict(SMALL_RUN)
