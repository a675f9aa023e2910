"""tasks/alerts.py without a server: which events the train and evaluate tasks emit and when (each alert once), the
automations `hlat deploy` makes, and the settings it takes from the deployments' configs."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from pydantic import ValidationError

from hlat.core.config import AlertsConfig, ConfigError
from hlat.core.layout import ALERTS_SENT
from hlat.core.presets import load_config
from hlat.core.run import Run
from hlat.infra.supervision.ledger import Attempt
from hlat.infra.supervision.progress import Progress
from hlat.tasks import alerts
from hlat.tasks.alerts import (
    BUDGET_CROSSED,
    EVAL_BELOW_FLOOR,
    PROGRESS,
    RELAUNCHED,
    RELAUNCHES_EXCEEDED,
    SPIKE_SKIPPED,
    TrainAlerts,
    alert_eval_floors,
    alerts_settings,
    automations,
    below_floors,
    crossed_fractions,
    latest_spikes,
)


@pytest.fixture
def emitted(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What the tasks hand to prefect.events.emit_event, in order."""
    import prefect.events

    sent: list[dict[str, Any]] = []

    def emit_event(event: str, **kwargs: Any) -> str:
        sent.append({"event": event, **kwargs})
        return f"event {len(sent)}"  # stands for the Event emitted, which the next one follows

    monkeypatch.setattr(prefect.events, "emit_event", emit_event)
    return sent


def tiny_run(root: Path, run_id: str = "r1", **overrides: Any) -> Run:
    return Run.at(str(root / run_id), load_config("tiny", overrides, run_id=run_id, storage=str(root)))


def names(sent: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in sent]


def test_budget_fractions_are_crossed_once_each_lowest_first() -> None:
    assert crossed_fractions(4.9, 10.0, [0.5, 0.9], []) == []
    assert crossed_fractions(9.5, 10.0, [0.9, 0.5], []) == [0.5, 0.9]
    assert crossed_fractions(9.5, 10.0, [0.5, 0.9], [0.5]) == [0.9]
    assert crossed_fractions(100.0, None, [0.5], []) == []  # no budget: nothing to cross


def test_the_newest_spike_count_is_read_from_the_metrics_tail(tmp_path: Path) -> None:
    run = Run.at(str(tmp_path))
    assert latest_spikes(run) is None
    records = [{"step": 1, "loss": 5.0}, {"step": 2, "spikes_skipped": 1}, {"step": 3, "loss": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert latest_spikes(run) == (1, 2)
    # A long file is read from its tail only; the cut first line is skipped.
    filler = json.dumps({"step": 4, "loss": 4.0, "note": "x" * 200}) + "\n"
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write(filler * 50 + json.dumps({"step": 60, "spikes_skipped": 3}) + "\n")
    assert latest_spikes(run, tail_bytes=4096) == (3, 60)


def test_relaunches_are_announced_once_and_beyond_the_limit_alerted(
    tmp_path: Path, emitted: list[dict[str, Any]]
) -> None:
    run = tiny_run(tmp_path, **{"alerts.max_relaunches": 1})
    first = Attempt(1, "r1-train-1", status="Failed", reason="NaN loss", cause="nan: NonFiniteLoss at step 41")
    first.ended_at = 1.0
    alert = TrainAlerts(run, budget_usd=None)
    alert.attempts([first])
    assert emitted == []  # the first job is no relaunch
    second = Attempt(2, "r1-train-2")
    alert.attempts([first, second])
    alert.attempts([first, second])  # saved again: not a second relaunch
    (relaunch,) = emitted
    assert relaunch["event"] == RELAUNCHED and relaunch["resource"]["prefect.resource.id"] == "hlat.run.r1"
    payload = relaunch["payload"]
    assert payload["attempt"] == 2 and payload["cause"] == "nan: NonFiniteLoss at step 41"
    assert "r1-train-1 ended Failed: NaN loss" in payload["message"] and payload["look"] == f"hlat status {run.uri}"
    # A restarted stage reads what was announced; the third attempt is beyond alerts.max_relaunches=1.
    emitted.clear()
    again = TrainAlerts(run, budget_usd=None)
    again.attempts([first, second])
    assert emitted == []
    again.attempts([first, second, Attempt(3, "r1-train-3")])
    assert names(emitted) == [RELAUNCHED, RELAUNCHES_EXCEEDED]
    assert "more than alerts.max_relaunches=1" in emitted[1]["payload"]["message"]
    assert json.loads((Path(run.uri) / ALERTS_SENT).read_text())["relaunch"] == 3


def test_progress_budget_and_spikes(tmp_path: Path, emitted: list[dict[str, Any]]) -> None:
    run = tiny_run(tmp_path)
    alert = TrainAlerts(run, budget_usd=10.0)
    alert.progress(Progress(1, "j", "InProgress", step=1, target_step=9, cost_usd=1.0))
    alert.progress(Progress(1, "j", "InProgress", step=1, target_step=9, cost_usd=5.0))  # same step: no progress
    assert names(emitted) == [PROGRESS, BUDGET_CROSSED]
    assert emitted[1]["payload"]["fraction"] == 0.5
    # Each event follows the one before it (Prefect's triggers then see them in order).
    assert [e["follows"] for e in emitted] == [None, "event 1"]
    emitted.clear()
    (Path(run.uri) / "metrics.jsonl").write_text(json.dumps({"step": 2, "spikes_skipped": 2}) + "\n")
    alert.progress(Progress(1, "j", "InProgress", step=2, target_step=9, cost_usd=9.5))
    alert.progress(Progress(1, "j", "InProgress", step=3, target_step=9, cost_usd=9.6))
    assert names(emitted) == [PROGRESS, SPIKE_SKIPPED, BUDGET_CROSSED, PROGRESS]
    assert emitted[1]["payload"] == {
        "spikes_skipped": 2, "new": 2, "step": 2, "look": f"hlat status {run.uri}",
        "message": "run r1: 2 loss spike(s) skipped by step 2, 2 in all (training.spike_skip; the job's log names "
        "each step)",
    }  # fmt: skip
    # The spend from the ledger counts too; nothing is announced twice, by this stage or a restarted one.
    emitted.clear()
    TrainAlerts(run, budget_usd=10.0).attempts([Attempt(1, "j", cost_usd=9.9)])
    assert emitted == []


def test_evaluation_floors(tmp_path: Path, emitted: list[dict[str, Any]]) -> None:
    results = {
        "step": 40,
        "perplexity": {"perplexity": 300.0, "bits_per_byte": 2.5},
        "lm_eval": {"tasks": {"hellaswag": {"metrics": {"acc": 0.25, "acc_norm": 0.26}}}},
    }
    floors = {"hellaswag": 0.3, "hellaswag/acc": 0.2, "bits_per_byte": 3.0, "arc_easy": 0.4}
    short, missing = below_floors(results, floors)
    assert [(s.name, s.metric, s.value) for s in short] == [
        ("hellaswag", "hellaswag acc_norm", 0.26),
        ("bits_per_byte", "bits_per_byte", 2.5),
    ]
    assert missing == ["arc_easy"]
    run = tiny_run(tmp_path, **{"alerts.eval_floors": {"hellaswag": 0.3}})
    alert_eval_floors(run, 40, results)
    (event,) = emitted
    assert event["event"] == EVAL_BELOW_FLOOR
    message = "run r1: evaluation of step 40: hellaswag acc_norm 0.26 is below its floor 0.3"
    assert event["payload"]["message"] == message


def test_the_config_refuses_a_block_without_its_type_and_a_window_prefect_would_refuse() -> None:
    assert AlertsConfig(block="custom-webhook/oncall").block == "custom-webhook/oncall"
    for bad in ("oncall", "/oncall", "custom-webhook/", "a/b/c"):
        with pytest.raises(ValidationError, match="TYPE/NAME"):
            AlertsConfig(block=bad)
    assert AlertsConfig(stalled_minutes=1 / 6).stalled_minutes == pytest.approx(1 / 6)
    with pytest.raises(ValidationError):
        AlertsConfig(stalled_minutes=0.1)


def test_deploy_takes_one_block_and_window_from_the_deployments() -> None:
    off, on = AlertsConfig(), AlertsConfig(block="slack-webhook/hlat", stalled_minutes=30)
    assert alerts_settings({"a": off, "b": off}, None) is None
    assert alerts_settings({"a": off, "b": on}, None) == ("slack-webhook/hlat", 30)
    assert alerts_settings({"a": off}, "custom-webhook/oncall") == ("custom-webhook/oncall", 60)
    with pytest.raises(ConfigError, match="name different blocks"):
        alerts_settings({"a": on, "b": AlertsConfig(block="custom-webhook/x", stalled_minutes=30)}, None)
    with pytest.raises(ConfigError, match="different windows"):
        alerts_settings({"a": on, "b": AlertsConfig(block="slack-webhook/hlat")}, None)
    with pytest.raises(ConfigError, match="TYPE/NAME"):
        alerts_settings({"a": off}, "oncall")


def test_the_project_deployments_name_no_block_and_an_override_names_one() -> None:
    from hlat.deploy import deployment_alerts, load_deployments

    deployments, _ = load_deployments()
    assert deployment_alerts(deployments, None) is None
    assert deployment_alerts(deployments, "custom-webhook/oncall") == ("custom-webhook/oncall", 60)
    tiny = next(d for d in deployments if d["name"] == "train-tiny")
    with_block = {**tiny, "parameters": {**tiny["parameters"], "overrides": {"alerts.block": "slack-webhook/hlat"}}}
    assert deployment_alerts([with_block], None) == ("slack-webhook/hlat", 60)


def test_the_automations_and_their_templates() -> None:
    from prefect.server.events.actions import SendNotification as ServerSendNotification

    made = automations(uuid4(), 15)
    assert [a.name for a in made] == [
        "hlat: flow run failed", "hlat: training stalled", "hlat: relaunches", "hlat: budget", "hlat: loss spike",
        "hlat: evaluation floor",
    ]  # fmt: skip
    by_name = {a.name: a for a in made}
    stalled = by_name["hlat: training stalled"].trigger
    assert stalled.posture == "Proactive" and stalled.within == timedelta(minutes=15)  # type: ignore[union-attr]
    assert alerts.ENDED in stalled.expect and alerts.ENDED not in stalled.after  # type: ignore[union-attr]
    failed = by_name["hlat: flow run failed"].trigger
    ended = {"prefect.flow-run.Failed", "prefect.flow-run.Crashed", "prefect.flow-run.TimedOut"}
    assert failed.expect == ended  # type: ignore[union-attr]
    assert "train" in str(failed.match_related) and "hlat" in str(failed.match_related)  # type: ignore[union-attr]
    for automation in made:
        (action,) = automation.actions
        ServerSendNotification.model_validate(action.model_dump())  # the server's check of the Jinja templates


class FakeSupervisor:
    """Stands for the train stage's supervisor: reports one step and one attempt, then ends or fails."""

    def __init__(self, fail: bool, **callbacks: Any) -> None:
        self.fail, self.callbacks = fail, callbacks

    def run_to_completion(self) -> list[Attempt]:
        from hlat.infra.supervision.errors import JobFailed

        attempts = [Attempt(1, "r1-train-1")]
        self.callbacks["on_attempts"](attempts)
        self.callbacks["on_progress"](Progress(1, "r1-train-1", "InProgress", step=3, target_step=9))
        if self.fail:
            raise JobFailed("train stopped: bad data", attempts)
        return attempts

    def spent_usd(self) -> float:
        return 0.0

    def tokens_per_s(self) -> None:
        return None

    def startup_s(self) -> None:
        return None


@pytest.mark.parametrize("fail", [False, True])
def test_the_train_task_emits_start_progress_and_end_around_its_supervisor(
    tmp_path: Path, emitted: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, fail: bool
) -> None:
    from hlat.infra.supervision.errors import JobFailed
    from hlat.tasks import train

    def supervisor_for(run: Run, current_step: Any, **callbacks: Any) -> FakeSupervisor:
        return FakeSupervisor(fail, **callbacks)

    monkeypatch.setattr(train, "supervisor_for", supervisor_for)
    monkeypatch.setattr(train, "create_progress_artifact", lambda *a, **k: uuid4())
    monkeypatch.setattr(train, "create_table_artifact", lambda *a, **k: uuid4())
    run = tiny_run(tmp_path)
    if fail:
        with pytest.raises(JobFailed):
            train.train_model.fn(run, "key")
    else:
        train.train_model.fn(run, "key")
    assert names(emitted) == [alerts.STARTED, PROGRESS, alerts.ENDED]
    assert emitted[-1]["payload"] == {"step": 3, "outcome": "JobFailed" if fail else "done"}
    assert all(e["resource"]["hlat.storage"] == run.uri for e in emitted)


def test_hlat_deploy_takes_the_alerts_block_on_its_command_line() -> None:
    from hlat.cli import build_parser

    assert build_parser().parse_args(["deploy", "--alerts-block", "custom-webhook/oncall"]).alerts_block == (
        "custom-webhook/oncall"
    )
    assert build_parser().parse_args(["deploy"]).alerts_block is None
