"""Alerts end to end: the automations `hlat deploy` makes (tasks/alerts.py), on the test session's Prefect server
(whose ephemeral services include the reactive and proactive triggers and the actions), notify through a
CustomWebhookNotificationBlock to a webhook receiver on 127.0.0.1 that records what it got: a failed hlat flow run,
a stalled training, a budget crossing, a skipped loss spike and an evaluation below its floor each deliver exactly one
notification naming the run; `hlat deploy` makes the automations once.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.infra.supervision.progress import Progress
from hlat.tasks.alerts import ALERTS, AUTOMATION_PREFIX, TrainAlerts, alert_eval_floors, sync_automations
from tests.integration.conftest import free_port

STALLED_MINUTES = 1 / 6  # 10 s: the shortest window a proactive trigger takes
BLOCK = "custom-webhook/hlat-alerts-test"


class Receiver:
    """An HTTP server on 127.0.0.1 recording the JSON bodies posted to it."""

    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []
        received = self.got

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                received.append(json.loads(self.rfile.read(length) or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def about(self, run_id: str) -> list[str]:
        """The notifications (subject and body) that name `run_id`."""
        texts = [f"{m.get('subject')}\n{m.get('body')}" for m in self.got]
        return [t for t in texts if run_id in t]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(prefect_server: None) -> Iterator[Receiver]:
    """The receiver behind the block, and the automations through it (removed afterwards: the server is the
    session's, and its other tests fail hlat flow runs on purpose)."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client

    got = Receiver()
    CustomWebhookNotificationBlock(
        name="hlat alerts test", url=got.url, json_data={"subject": "{{subject}}", "body": "{{body}}"}
    ).save(BLOCK.split("/")[1], overwrite=True)
    try:
        yield got
    finally:
        with get_client(sync_client=True) as client:
            for alert in ALERTS:
                for found in client.read_automations_by_name(AUTOMATION_PREFIX + alert.kind):
                    client.delete_automation(found.id)
        got.close()


PACE_S = 0.3


class PacedAlerts(TrainAlerts):
    """The train task's alerts, one event at a time as a supervisor's polls space them: a burst of events makes the
    triggers service of a SQLite-backed server (the test server) drop one now and then ('database is locked',
    dead-lettered after its retries), e.g. a training's end, which then reads as a stall."""

    def emit(self, event: str, payload: dict[str, Any] | None = None, message: str | None = None) -> None:
        super().emit(event, payload, message)
        time.sleep(PACE_S)


def tiny_run(root: Path, run_id: str, **overrides: Any) -> Run:
    config = load_config("tiny", overrides, run_id=run_id, storage=str(root))
    return Run.at(str(root / run_id), config)


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_failed_run_a_stall_a_budget_crossing_a_skipped_spike_and_a_low_evaluation_each_notify_once(
    receiver: Receiver, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prefect.client.orchestration import get_client

    from hlat.flows.train import train

    caplog.set_level(logging.INFO)
    # `hlat deploy`'s step, three times: the second finds them as wanted, the third updates the one that changed.
    first = sync_automations(BLOCK, 1.0)
    assert all(line.endswith(": created") for line in first) and len(first) == len(ALERTS)
    with get_client(sync_client=True) as client:
        ids = {a.kind: client.read_automations_by_name(AUTOMATION_PREFIX + a.kind)[0].id for a in ALERTS}
    assert all(line.endswith(": unchanged") for line in sync_automations(BLOCK, 1.0))
    again = sync_automations(BLOCK, STALLED_MINUTES)
    assert [line for line in again if not line.endswith(": unchanged")] == ["'hlat: training stalled': updated"]
    with get_client(sync_client=True) as client:
        for alert in ALERTS:
            (only,) = client.read_automations_by_name(AUTOMATION_PREFIX + alert.kind)
            assert only.id == ids[alert.kind]
    tag = uuid.uuid4().hex[:6]

    # A training that started, logged a step and then nothing: no end, no further step.
    stalled = PacedAlerts(tiny_run(tmp_path, f"alerts-stalled-{tag}"), budget_usd=None)
    stalled.started(0, 20)
    stalled.progress(Progress(1, "job-1", "InProgress", step=1, target_step=20))

    # The spend crosses 50% of the budget, then grows without crossing 90%; a restarted stage (a new TrainAlerts
    # on the same run) does not announce the crossing again.
    budget_run = tiny_run(tmp_path, f"alerts-budget-{tag}", **{"job.budget_usd": 10.0})
    spending = PacedAlerts(budget_run, budget_usd=10.0)
    spending.started(0, 20)
    for step, cost in ((1, 2.0), (2, 5.5), (3, 7.0)):
        spending.progress(Progress(1, "job-1", "InProgress", step=step, target_step=20, cost_usd=cost))
    spending.ended("done")
    again = PacedAlerts(budget_run, budget_usd=10.0)
    again.started(3, 20)
    again.progress(Progress(2, "job-2", "InProgress", step=4, target_step=20, cost_usd=8.0))
    again.ended("done")

    # A loss spike skipped: the loop's record at a sync point counts it; the next record counts the same one.
    spike_run = tiny_run(tmp_path, f"alerts-spike-{tag}")
    spikes = PacedAlerts(spike_run, budget_usd=None)
    spikes.started(0, 20)
    metrics = Path(spike_run.uri) / "metrics.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text(json.dumps({"step": 5, "loss": 4.2, "spikes_skipped": 1}) + "\n")
    spikes.progress(Progress(1, "job-1", "InProgress", step=5, target_step=20))
    with metrics.open("a") as fh:
        fh.write(json.dumps({"step": 10, "loss": 4.0, "spikes_skipped": 1}) + "\n")
    spikes.progress(Progress(1, "job-1", "InProgress", step=10, target_step=20))
    spikes.ended("done")

    # An evaluation below its floor (the evaluate task's call, with a results.json as the job writes it).
    eval_run = tiny_run(tmp_path, f"alerts-eval-{tag}", **{"alerts.eval_floors": {"hellaswag": 0.3}})
    results = {"step": 40, "lm_eval": {"tasks": {"hellaswag": {"metrics": {"acc": 0.25, "acc_norm": 0.26}}}}}
    alert_eval_floors(eval_run, 40, results)

    # A failed flow run of an hlat flow: the train stage of a run whose data was never prepared.
    failed = f"alerts-failed-{tag}"
    state = train(preset="tiny", run_id=failed, storage=str(tmp_path), return_state=True)
    assert state.is_failed()

    runs = {
        "failed": failed,
        "stalled": stalled.run_id,
        "budget": budget_run.run_id,
        "spike": spike_run.run_id,
        "eval": eval_run.run_id,
    }
    wait_for(lambda: all(receiver.about(r) for r in runs.values()), 90, "a notification about each run")
    # Past the stalled window and a few proactive evaluations (every 5 s): the ended trainings did not stall, and
    # nothing came twice.
    time.sleep(STALLED_MINUTES * 60 + 12)
    about = {kind: receiver.about(run_id) for kind, run_id in runs.items()}
    assert {kind: len(texts) for kind, texts in about.items()} == dict.fromkeys(runs, 1), about
    (text,) = about["failed"]
    assert f"train/{failed}" in text and "Failed" in text and f"hlat status {failed}" in text
    (text,) = about["stalled"]
    assert "made no progress" in text and "logged no new step" in text and f"hlat status {stalled.uri}" in text
    (text,) = about["budget"]
    assert "spent 50% of its budget" in text and "$5.50, 50% of its budget $10.00" in text
    assert f"hlat status {budget_run.uri}" in text
    (text,) = about["spike"]
    assert "skipped a loss spike" in text and "1 loss spike(s) skipped by step 5" in text
    (text,) = about["eval"]
    assert "evaluated below a floor" in text and "step 40: hellaswag acc_norm 0.26 is below its floor 0.3" in text
    # The webhook's URL (a secret, for a real webhook) is in no log line of the test process.
    assert receiver.url not in caplog.text


def test_hlat_deploy_makes_the_automations_once_and_refuses_a_missing_block(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefect.client.orchestration import get_client

    import hlat.deploy
    from hlat.core.config import ConfigError

    monkeypatch.setattr(hlat.deploy, "ensure_pool", lambda *args: "exists (type process)")  # tested in test_deploy
    monkeypatch.setattr(hlat.deploy, "run_prefect_deploy", lambda cmd, env: 0)  # `prefect deploy`: tests/e2e
    with pytest.raises(ConfigError, match="no such block on this Prefect server: create it first"):
        hlat.deploy.deploy(["train-tiny"], alerts_block="custom-webhook/not-there")
    assert "automation" not in capsys.readouterr().out
    for verb in ("created", "unchanged"):
        assert hlat.deploy.deploy(["train-tiny"], alerts_block=BLOCK) == 0
        out = capsys.readouterr().out
        assert f"alerts through the notification block {BLOCK!r}" in out
        assert all(f"automation '{AUTOMATION_PREFIX}{a.kind}': {verb}" in out for a in ALERTS), out
        assert receiver.url not in out
    with get_client(sync_client=True) as client:
        assert all(len(client.read_automations_by_name(AUTOMATION_PREFIX + a.kind)) == 1 for a in ALERTS)
