"""`hlat status` and `hlat stop` from another process after the terminal of the command that started the run closed,
on two emulated SageMaker hosts (tests/integration/test_status_stop.py has the same on the local backend; this test
is apart so that only it joins the emulator's files, which one worker runs in a row)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from hlat.infra.backends.emulator import namespaces_available
from tests.integration.test_status_stop import TWO_HOSTS, dead_cli_then_status_and_stop, new_run

pytestmark = pytest.mark.slow


@pytest.mark.usefixtures("one_multi_host_job_at_a_time")
@pytest.mark.skipif(bool(namespaces_available()), reason=str(namespaces_available()))
def test_status_and_stop_of_a_job_on_the_sagemaker_emulator_after_its_terminal_closed(
    prepared: Path, tmp_path: Path
) -> None:
    """The same on two emulated SageMaker hosts, the command's terminal closed (SIGHUP to its session's group): the
    stop reaches every host's ranks, which checkpoint."""
    run = new_run(prepared, tmp_path, "hosts", **TWO_HOSTS)
    dead_cli_then_status_and_stop(tmp_path, run, "hosts", signal.SIGHUP, **TWO_HOSTS)
