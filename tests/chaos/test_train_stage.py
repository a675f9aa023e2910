"""Chaos for the train stage on the local job backend: jobs killed by injected faults, a flow process killed and
restarted, a dollar budget. Real processes throughout: the flow (in-process or `hlat run train`), the local
backend's job supervisor, and the training processes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.run import Run
from hlat.infra.backends.local import LocalBackend
from hlat.infra.supervision.ledger import Ledger
from tests.conftest import SMALL_DATA
from tests.jobs import default_sigint, final_weights, make_run, metrics, processes_mentioning, wait_for

pytestmark = pytest.mark.slow

STEPS = 40
RUN = {"max_steps": STEPS, "checkpoint_every": 4, "keep_checkpoints": 2, "eval_every": 0, "warmup_steps": 5}
ROOT = Path(__file__).resolve().parents[2]


def overrides(**training: Any) -> dict[str, Any]:
    return {**SMALL_DATA, **{f"training.{k}": v for k, v in {**RUN, **training}.items()}}


def history(run: Path) -> list[tuple[int, float, int]]:
    return [(r["step"], r["loss"], r["samples_crc32"]) for r in metrics(run) if "samples_crc32" in r]


def cli(tmp_path: Path, run_id: str, sets: dict[str, Any]) -> list[str]:
    args = [sys.executable, "-m", "hlat.cli", "run", "train", "--run-id", run_id, "--storage", str(tmp_path)]
    for key, value in sets.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    return args


def cli_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "OMP_NUM_THREADS": "1"}


def test_job_killed_five_times_completes_bitwise_equal(
    prepared: Path, tmp_path: Path, prefect_server: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hlat.flows.train import train

    reference = make_run(prepared, tmp_path, "reference", **RUN)
    train(preset="tiny", overrides=overrides(), run_id="reference", storage=str(tmp_path))

    chaos = make_run(prepared, tmp_path, "chaos", **RUN)
    rng = random.Random(20261122)
    kill_at, step = [], 1
    for _ in range(5):  # each attempt gets past at least one checkpoint before it is killed
        step += rng.randint(5, 7)
        kill_at.append(step)
    assert kill_at[-1] < STEPS
    faults = {str(i + 1): {"kill_at_step": s} for i, s in enumerate(kill_at)}
    monkeypatch.setenv("HLAT_LOCAL_FAULTS", json.dumps(faults))
    summary = train(preset="tiny", overrides=overrides(), run_id="chaos", storage=str(tmp_path))

    assert summary["final_step"] == STEPS and summary["jobs"] == 6
    attempts = Ledger(Run.at(str(chaos)), "train").load()
    assert [a.action for a in attempts] == ["resume"] * 5 + ["done"]
    assert all("SIGKILL" in (a.reason or "") for a in attempts[:5])
    assert history(chaos) == history(reference)  # same samples, same order, same losses
    ours, theirs = final_weights(chaos), final_weights(reference)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert processes_mentioning(str(chaos)) == []


def test_flow_process_killed_and_restarted_reattaches_to_the_same_job(
    prepared: Path, tmp_path: Path, prefect_server: None
) -> None:
    run = make_run(prepared, tmp_path, "reattach", **{**RUN, "max_steps": 150, "log_every": 1})
    command = cli(tmp_path, "reattach", overrides(max_steps=150, log_every=1))
    flow = subprocess.Popen(command, cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    backend = LocalBackend(str(run / "jobs"))
    ledger = Ledger(Run.at(str(run)), "train")
    try:
        wait_for(lambda: any(a.status == "InProgress" for a in ledger.load()), 120, "the job to start")
        name = ledger.load()[0].job_name
        lines = lambda: backend.logs(name)[0]  # noqa: E731
        wait_for(lambda: any(" step 8 loss" in line for line in lines()), 120, "the job to train a few steps")
    finally:
        flow.kill()  # the flow process dies without a chance to clean up
        flow.wait()
    state = backend.describe(name)
    assert state is not None and state.status == "InProgress"  # the job outlives its flow process

    again = subprocess.run(command, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    attempts = ledger.load()
    assert [(a.job_name, a.status) for a in attempts] == [(name, "Completed")]
    assert sorted(p.name for p in (run / "jobs").iterdir() if p.is_dir()) == [name]
    assert max(r["step"] for r in metrics(run)) == 150
    assert processes_mentioning(str(run)) == []


def test_dollar_budget_stops_the_run_with_a_clear_message(prepared: Path, tmp_path: Path, prefect_server: None) -> None:
    run = make_run(prepared, tmp_path, "budget", **{**RUN, "max_steps": 5000})
    # $1 per second of job: a $6 budget is spent a few seconds into the job.
    sets = {**overrides(max_steps=5000), "job.price_per_hour_usd": 3600, "job.budget_usd": 6}
    out = subprocess.run(cli(tmp_path, "budget", sets), cwd=ROOT, env=cli_env(), capture_output=True, text=True)
    assert out.returncode == 1, out.stderr[-3000:]
    (error,) = [line for line in out.stderr.splitlines() if line.startswith("hlat: error:")]  # then the log's path
    assert error.startswith("hlat: error: train stopped") and "job.budget_usd" in error and "is spent" in error
    (attempt,) = Ledger(Run.at(str(run)), "train").load()
    # Whichever comes first: the supervisor stops the job once $6 is billed, or the job stops itself job.stop_grace
    # _seconds (20 s: more than the budget) before (training/stop_rule.py). Either way no relaunch.
    if attempt.stop_requested == "budget":
        assert attempt.status == "Stopped" and "job.budget_usd=$6.00 is spent" in error and attempt.cost_usd >= 6
    else:
        assert (attempt.status, attempt.category) == ("Completed", "budget"), attempt
        assert "raise job.budget_usd to go on" in error
    assert processes_mentioning(str(run)) == []


def test_sigint_to_the_flow_stops_its_job(prepared: Path, tmp_path: Path, prefect_server: None) -> None:
    """Ctrl-C on `hlat run train`: the job is stopped (SIGTERM, it checkpoints), nothing is left running."""
    run = make_run(prepared, tmp_path, "interrupt", **{**RUN, "max_steps": 5000, "log_every": 1})
    # Its output goes to a file: an unread pipe fills up with the job's forwarded log lines and blocks the flow.
    output = (tmp_path / "flow.log").open("wb")
    flow = subprocess.Popen(
        cli(tmp_path, "interrupt", overrides(max_steps=5000, log_every=1)),
        cwd=ROOT,
        env=cli_env(),
        stdout=output,
        stderr=subprocess.STDOUT,
        preexec_fn=default_sigint,
    )
    ledger = Ledger(Run.at(str(run)), "train")
    backend = LocalBackend(str(run / "jobs"))
    wait_for(lambda: any(a.status == "InProgress" for a in ledger.load()), 120, "the job to start")
    name = ledger.load()[0].job_name
    wait_for(lambda: any(" step 5 loss" in line for line in backend.logs(name)[0]), 120, "a few steps")
    flow.send_signal(signal.SIGINT)
    flow.wait(timeout=120)
    output.close()
    wait_for(lambda: (s := backend.describe(name)) is not None and s.terminal, 60, "the job to stop")
    state = backend.describe(name)
    assert state is not None and state.status == "Stopped"
    assert ledger.load()[0].stop_requested == "cancelled"
    assert processes_mentioning(str(run)) == []


def ephemeral_env(tmp_path: Path) -> dict[str, str]:
    """The terminal of a user without a Prefect server: no PREFECT_API_URL (Prefect's temporary server), a Prefect
    home of the test's own (its database, and a way to find the server it starts)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return {**env, "PREFECT_HOME": str(tmp_path / "prefect-home"), "OMP_NUM_THREADS": "1"}


def temporary_servers(prefect_home: Path) -> list[int]:
    """Live Prefect API servers started with this Prefect home."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if b"prefect.server.api.server:create_app" not in (entry / "cmdline").read_bytes():
                continue
            if f"PREFECT_HOME={prefect_home}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def started_train(prepared: Path, tmp_path: Path, run_id: str) -> tuple[subprocess.Popen[bytes], Path, str]:
    """`hlat run train` on a prepared run, in a process group of its own as a terminal starts it, once its job has
    trained a few steps."""
    run = make_run(prepared, tmp_path, run_id, **{**RUN, "max_steps": 5000, "log_every": 1})
    output = (tmp_path / f"{run_id}.log").open("wb")
    flow = subprocess.Popen(
        cli(tmp_path, run_id, overrides(max_steps=5000, log_every=1)),
        cwd=ROOT,
        env=ephemeral_env(tmp_path),
        stdout=output,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: (default_sigint(), os.setpgrp()),  # type: ignore[func-returns-value]
    )
    ledger = Ledger(Run.at(str(run)), "train")
    wait_for(lambda: any(a.status == "InProgress" for a in ledger.load()), 180, "the job to start")
    name = ledger.load()[0].job_name
    backend = LocalBackend(str(run / "jobs"))
    wait_for(lambda: any(" step 5 loss" in line for line in backend.logs(name)[0]), 120, "a few steps")
    return flow, run, name


def test_ctrl_c_in_the_terminal_stops_the_job_at_a_checkpoint_and_exits_130_leaving_nothing(
    prepared: Path, tmp_path: Path
) -> None:
    """SIGINT to the whole process group of `hlat run train` (Ctrl-C), Prefect's temporary server included: the
    server is out of that group, so the flow reports the interruption and stops its job, and the command exits in
    seconds with where the run stands."""
    flow, run, name = started_train(prepared, tmp_path, "ctrl-c")
    assert temporary_servers(tmp_path / "prefect-home")  # the temporary server, not the session's
    sent = time.monotonic()
    os.killpg(flow.pid, signal.SIGINT)
    code = flow.wait(timeout=120)
    took = time.monotonic() - sent
    out = (tmp_path / "ctrl-c.log").read_text()
    assert code == 130 and took < 10, (code, took, out[-3000:])
    state = LocalBackend(str(run / "jobs")).describe(name)
    assert state is not None and state.status == "Stopped"
    from hlat.tasks.train import latest_checkpoint

    step = latest_checkpoint(Run.at(str(run)))  # the checkpoint the stopped job wrote on its SIGTERM
    assert step is not None and step >= 5
    (line,) = [line for line in out.splitlines() if line.startswith("hlat: interrupted")]
    assert line == (
        f"hlat: interrupted: the run's newest checkpoint is step {step}; run the same command to resume "
        "(finished stages are cached)"
    )
    assert "Connection refused" not in out and "Error logging to API" not in out
    assert processes_mentioning(str(run)) == [] and temporary_servers(tmp_path / "prefect-home") == []


def test_a_killed_command_leaves_no_temporary_server_behind(prepared: Path, tmp_path: Path) -> None:
    """SIGKILL of `hlat run train`: its job goes on (a re-run re-attaches to it), its temporary server does not."""
    flow, run, name = started_train(prepared, tmp_path, "sigkill")
    flow.kill()
    flow.wait()
    wait_for(lambda: temporary_servers(tmp_path / "prefect-home") == [], 20, "the server to be stopped")
    backend = LocalBackend(str(run / "jobs"))
    state = backend.describe(name)
    assert state is not None and not state.terminal  # the job trains on alone, by design
    backend.stop(name)
    wait_for(lambda: (s := backend.describe(name)) is not None and s.terminal, 60, "the job to stop")
    assert processes_mentioning(str(run)) == []
