"""Alerts: the Prefect events a run's training and evaluation emit, and the automations that notify a person.

Events carry the run (`hlat.run.<run_id>`) and a one-line message. `alerts/sent.json` keeps what was announced, so
restarts do not repeat it. Emitting never stops a stage. docs/deployments.md lists the automations.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

from hlat.core.config import AlertsConfig, ConfigError
from hlat.core.layout import ALERTS_SENT, METRICS_FILE
from hlat.core.run import Run
from hlat.core.stages import stage_names

if TYPE_CHECKING:
    from prefect.events.schemas.automations import AutomationCore

    from hlat.core.run import Run
    from hlat.infra.supervision.ledger import Attempt
    from hlat.infra.supervision.progress import Progress

log = logging.getLogger("hlat.alerts")

# The events (https://docs.prefect.io/v3/concepts/events).
STARTED = "hlat.train.started"
PROGRESS = "hlat.train.progress"
RELAUNCHED = "hlat.train.relaunched"
RELAUNCHES_EXCEEDED = "hlat.train.relaunches-exceeded"
ENDED = "hlat.train.ended"
BUDGET_CROSSED = "hlat.budget.crossed"
SPIKE_SKIPPED = "hlat.train.spike-skipped"
EVAL_BELOW_FLOOR = "hlat.eval.below-floor"

RUN_ID_LABEL = "hlat.run-id"
STORAGE_LABEL = "hlat.storage"


def flow_names() -> list[str]:
    """The hlat flows (the parent DAG and each stage's): a failed or crashed run of any is an alert."""
    return ["hlat", *stage_names()]


def run_resource(run_id: str, uri: str) -> dict[str, str]:
    """The run as an event's resource: `hlat.run.<run_id>`, labelled with its id and storage."""
    return {
        "prefect.resource.id": f"hlat.run.{run_id}",
        "prefect.resource.name": run_id,
        RUN_ID_LABEL: run_id,
        STORAGE_LABEL: uri,
    }


def flow_run_related() -> list[dict[str, str]]:
    """The calling flow run as an event's related resource (empty outside one).

    Passed explicitly, since events from other threads have no run context for Prefect to read."""
    from prefect.context import FlowRunContext, TaskRunContext

    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    flow_run = getattr(flow_ctx, "flow_run", None)
    flow_run_id = getattr(flow_run, "id", None) or getattr(getattr(task_ctx, "task_run", None), "flow_run_id", None)
    if flow_run_id is None:
        return []
    related = {"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"}
    if name := getattr(flow_run, "name", None):
        related["prefect.resource.name"] = str(name)
    return [related]


def look_command(uri: str) -> str:
    return f"hlat status {uri}"


class RunEvents:
    """Emits a run's events, each carrying the run, its flow run, the message and how to look.

    Each event `follows` the previous one so triggers see them in order; an end before the last step would leave
    the stall window open. `emit` never raises."""

    def __init__(self, run_id: str, uri: str) -> None:
        self.run_id, self.uri = run_id, uri
        self.resource = run_resource(run_id, uri)
        self.related = flow_run_related()
        self.last: Any = None
        """The last event emitted, which the next one follows."""

    def emit(self, event: str, payload: dict[str, Any] | None = None, message: str | None = None) -> None:
        from prefect.events import emit_event

        body = dict(payload or {})
        if message is not None:
            body.update(message=message, look=look_command(self.uri))
        try:
            sent = emit_event(
                event, resource=self.resource, related=list(self.related), payload=body, follows=self.last
            )
        except Exception as exc:  # an alert that cannot be sent must not stop the stage
            log.warning("could not emit the event %s: %s", event, exc)
        else:
            self.last = sent or self.last


def crossed_fractions(
    spent: float, budget: float | None, fractions: Iterable[float], done: Iterable[float]
) -> list[float]:
    """The fractions of `budget` that `spent` has reached and `done` lacks, lowest first."""
    if not budget or budget <= 0:
        return []
    announced = set(done)
    return sorted(f for f in set(fractions) if f not in announced and spent >= f * budget)


def latest_spikes(run: Run, tail_bytes: int = 1 << 16) -> tuple[int, int | None] | None:
    """(spikes_skipped, step) of the newest metrics record counting skipped spikes, from the tail of metrics.jsonl.

    None when no record counts them (spike skipping off, or no sync point yet)."""
    if not run.storage.exists(METRICS_FILE):
        return None
    size = run.storage.size(METRICS_FILE)
    with run.storage.open(METRICS_FILE, "rb") as fh:
        fh.seek(max(0, size - tail_bytes))
        lines = fh.read().decode("utf-8", errors="replace").splitlines()
    for line in reversed(lines[1:] if size > tail_bytes else lines):  # the first line may be cut
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("spikes_skipped") is not None:
            step = record.get("step")
            return int(record["spikes_skipped"]), int(step) if step is not None else None
    return None


class TrainAlerts(RunEvents):
    """The train stage's events, fed by the supervisor's callbacks between `started` and `ended`.

    Budget fractions and skipped spikes are announced once per run, relaunches once per attempt."""

    def __init__(self, run: Run, budget_usd: float | None) -> None:
        super().__init__(run.run_id, run.uri)
        self.run, self.storage, self.config = run, run.storage, run.config.alerts
        self.budget_usd = budget_usd
        self.step: int | None = None
        self.sent = self._load_sent()

    def _load_sent(self) -> dict[str, Any]:
        try:
            sent = self.storage.read_json(ALERTS_SENT) if self.storage.exists(ALERTS_SENT) else {}
        except Exception as exc:
            log.warning("could not read %s: %s", self.storage.uri(ALERTS_SENT), exc)
            sent = {}
        return {"budget_fractions": [], "spikes_skipped": 0, "relaunch": 1, **(sent if isinstance(sent, dict) else {})}

    def _save_sent(self) -> None:
        try:
            self.storage.write_json(ALERTS_SENT, self.sent)
        except Exception as exc:  # at worst the same alert is sent again by a later stage
            log.warning("could not write %s: %s", self.storage.uri(ALERTS_SENT), exc)

    def started(self, step: int | None, target_step: int) -> None:
        self.emit(STARTED, {"step": step, "target_step": target_step})

    def ended(self, outcome: str) -> None:
        """The stage stopped watching (`outcome`: 'done' or the exception's class); no stall alert after this."""
        self.emit(ENDED, {"step": self.step, "outcome": outcome})

    def progress(self, p: Progress) -> None:
        """Each poll: a progress event on a new step (then the spike count), and the budget."""
        if p.step is not None and p.step != self.step:
            self.step = p.step
            payload = {"step": p.step, "target_step": p.target_step, "attempt": p.attempt, "loss": p.loss}
            self.emit(PROGRESS, payload)
            self._check_spikes()
        self._check_budget(p.cost_usd)

    def attempts(self, attempts: list[Attempt]) -> None:
        """Each ledger save: a relaunch is any attempt after the first; and the spend so far."""
        if attempts and attempts[-1].attempt > int(self.sent["relaunch"]):
            new = attempts[-1]
            before = next((a for a in attempts if a.attempt == new.attempt - 1), None)
            self._relaunched(new.attempt, before)
        self._check_budget(sum(a.cost_usd for a in attempts))

    def _relaunched(self, attempt: int, before: Attempt | None) -> None:
        relaunches, limit = attempt - 1, self.config.max_relaunches
        cause = (before.cause or before.category or before.reason) if before is not None else None
        ending = f" after {before.job_name} ended {before.ending}" if before is not None else ""
        message = f"run {self.run_id}: training relaunched (attempt {attempt}, relaunch {relaunches}){ending}"
        payload = {"attempt": attempt, "relaunches": relaunches, "cause": cause, "max_relaunches": limit}
        self.emit(RELAUNCHED, payload, message)
        if relaunches > limit:
            self.emit(RELAUNCHES_EXCEEDED, payload, f"{message}: more than alerts.max_relaunches={limit} relaunches")
        self.sent["relaunch"] = attempt
        self._save_sent()

    def _check_budget(self, spent: float) -> None:
        new = crossed_fractions(spent, self.budget_usd, self.config.budget_fractions, self.sent["budget_fractions"])
        if not new:
            return
        assert self.budget_usd is not None
        for fraction in new:
            message = (
                f"run {self.run_id}: training spent ${spent:,.2f}, {fraction:.0%} of its budget "
                f"${self.budget_usd:,.2f} (job.budget_usd; at 100% the stage stops)"
            )
            payload = {"fraction": fraction, "spent_usd": round(spent, 2), "budget_usd": self.budget_usd}
            self.emit(BUDGET_CROSSED, payload, message)
        self.sent["budget_fractions"] = sorted({*self.sent["budget_fractions"], *new})
        self._save_sent()

    def _check_spikes(self) -> None:
        try:
            found = latest_spikes(self.run)
        except Exception as exc:  # a metrics file being rewritten: the next step reads it again
            log.debug("could not read the spike count: %s", exc)
            return
        if found is None or found[0] <= int(self.sent["spikes_skipped"]):
            return
        count, step = found
        new = count - int(self.sent["spikes_skipped"])
        at = f" by step {step}" if step is not None else ""
        message = (
            f"run {self.run_id}: {new} loss spike(s) skipped{at}, {count} in all (training.spike_skip; "
            "the job's log names each step)"
        )
        self.emit(SPIKE_SKIPPED, {"spikes_skipped": count, "new": new, "step": step}, message)
        self.sent["spikes_skipped"] = count
        self._save_sent()


@dataclass(frozen=True)
class Shortfall:
    name: str
    metric: str
    """What was compared: '<task> <metric>' or a perplexity figure."""
    value: float
    floor: float


def below_floors(results: dict[str, Any], floors: dict[str, float]) -> tuple[list[Shortfall], list[str]]:
    """The metrics of an evaluation's results.json below their floor, and the floors no result names.

    A floor's key is an lm-eval task (its main metric), '<task>/<metric>', or a perplexity field."""
    from hlat.infra.reports.eval_report import choose_metric

    tasks = (results.get("lm_eval") or {}).get("tasks") or {}
    perplexity = results.get("perplexity") or {}
    short, missing = [], []
    for key, floor in floors.items():
        task, _, wanted = key.partition("/")
        metrics = (tasks.get(task) or {}).get("metrics") or {}
        metric = wanted or (choose_metric(metrics) if metrics else None)
        if metric is not None and isinstance(metrics.get(metric), int | float):
            found: tuple[str, float] | None = (f"{task} {metric}", float(metrics[metric]))
        elif not wanted and isinstance(perplexity.get(key), int | float):
            found = (key, float(perplexity[key]))
        else:
            found = None
        if found is None:
            missing.append(key)
        elif found[1] < floor:
            short.append(Shortfall(key, found[0], found[1], floor))
    return short, missing


def alert_eval_floors(run: Run, step: int | None, results: dict[str, Any], events: RunEvents | None = None) -> None:
    """Emit one event per metric of `results` below its alerts.eval_floors floor.

    A floor no result names is a warning, since a misspelt task would otherwise never alert."""
    floors = run.config.alerts.eval_floors
    if not floors:
        return
    short, missing = below_floors(results, floors)
    if missing:
        log.warning("alerts.eval_floors: no evaluation result for %s (its keys are lm-eval tasks, "
                    "'<task>/<metric>' or perplexity fields)", ", ".join(missing))  # fmt: skip
    events = events or RunEvents(run.run_id, run.uri)
    at = f"step {step}" if step is not None else "its checkpoint"
    for s in short:
        message = f"run {run.run_id}: evaluation of {at}: {s.metric} {s.value:.4g} is below its floor {s.floor:g}"
        payload = {"step": step, "metric": s.metric, "value": s.value, "floor": s.floor}
        events.emit(EVAL_BELOW_FLOOR, payload, message)


# -- the automations (hlat deploy) -------------------------------------------------------------------------------------
AUTOMATION_PREFIX = "hlat: "

_RUN = "{{ event.resource['" + RUN_ID_LABEL + "'] }}"
_UI_URL = "{% set url = flow_run|ui_url %}{% if url %} {{ url }}{% endif %}"
_FLOW_RUN_LINK = "{% if flow_run %}\nFlow run: {{ flow_run.name }}" + _UI_URL + "{% endif %}"
_EVENT_BODY = (
    "{{ event.payload.message }}\n"
    "Run: " + _RUN + " ({{ event.resource['" + STORAGE_LABEL + "'] }})\n"
    "To look: {{ event.payload.look }}" + _FLOW_RUN_LINK
)
_STALLED_BODY = (
    "run " + _RUN + ": its training logged no new step for {{ automation.trigger.within }} "
    "(last: {{ event.event }} at {{ event.occurred }}, step {{ event.payload.step }}); the job may be hung or "
    "waiting for capacity, or its supervisor gone.\n"
    "Run: " + _RUN + " ({{ event.resource['" + STORAGE_LABEL + "'] }})\n"
    "To look: hlat status {{ event.resource['" + STORAGE_LABEL + "'] }}" + _FLOW_RUN_LINK
)
_FAILED_BODY = (
    "hlat flow run {{ flow_run.name }} ended {{ flow_run.state.name }}: {{ flow_run.state.message }}\n"
    "Run: {{ flow_run.parameters.run_id or flow_run.name }} (preset {{ flow_run.parameters.preset }}, storage "
    "{{ flow_run.parameters.storage }})\n"
    "To look: hlat status {{ flow_run.parameters.run_id or '' }}"
    "{% if flow_run.parameters.storage %} --storage {{ flow_run.parameters.storage }}{% endif %}"
    "; the flow run's logs" + _UI_URL
)


@dataclass(frozen=True)
class AlertKind:
    """One automation: its name after 'hlat: ', what it watches, and its notification's subject."""

    kind: str
    description: str
    subject: str


ALERTS = (
    AlertKind("flow run failed", "An hlat flow run ended Failed, Crashed or TimedOut.",
              "hlat: flow run {{ flow_run.name }} {{ flow_run.state.name }}"),
    AlertKind("training stalled", "A training logged no new step for alerts.stalled_minutes.",
              "hlat: run " + _RUN + " made no progress"),
    AlertKind("relaunches", "A training relaunched more than alerts.max_relaunches times.",
              "hlat: run " + _RUN + " relaunched {{ event.payload.relaunches }} times"),
    AlertKind("budget", "A training's spend crossed a fraction of its budget (alerts.budget_fractions).",
              "hlat: run " + _RUN + " spent {{ (event.payload.fraction * 100) | round | int }}% of its budget"),
    AlertKind("loss spike", "A training skipped a loss spike (training.spike_skip).",
              "hlat: run " + _RUN + " skipped a loss spike"),
    AlertKind("evaluation floor", "An evaluation metric came out below its floor (alerts.eval_floors).",
              "hlat: run " + _RUN + " evaluated below a floor"),
)  # fmt: skip


def _trigger(kind: str, stalled: timedelta) -> Any:
    from prefect.events.schemas.automations import EventTrigger, Posture

    each = {"prefect.resource.id"}
    if kind == "flow run failed":
        return EventTrigger(
            expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed", "prefect.flow-run.TimedOut"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": flow_names()},
            for_each=each, posture=Posture.Reactive, threshold=1, within=timedelta(0),
        )  # fmt: skip
    if kind == "training stalled":
        # Each start, step or relaunch opens a window of `stalled`; a step, relaunch or end within it closes it
        # quietly (a step or a relaunch opens the next); a window that closes empty fires.
        return EventTrigger(
            after={STARTED, PROGRESS, RELAUNCHED}, expect={PROGRESS, RELAUNCHED, ENDED},
            match={"prefect.resource.id": "hlat.run.*"}, for_each=each, posture=Posture.Proactive, threshold=1,
            within=stalled,
        )  # fmt: skip
    event = {"relaunches": RELAUNCHES_EXCEEDED, "budget": BUDGET_CROSSED, "loss spike": SPIKE_SKIPPED,
             "evaluation floor": EVAL_BELOW_FLOOR}[kind]  # fmt: skip
    return EventTrigger(
        expect={event}, match={"prefect.resource.id": "hlat.run.*"}, for_each=each, posture=Posture.Reactive,
        threshold=1, within=timedelta(0),
    )  # fmt: skip


def automations(block_document_id: UUID, stalled_minutes: float) -> list[AutomationCore]:
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore

    stalled = timedelta(minutes=stalled_minutes)
    made = []
    for alert in ALERTS:
        body = {"flow run failed": _FAILED_BODY, "training stalled": _STALLED_BODY}.get(alert.kind, _EVENT_BODY)
        action = SendNotification(block_document_id=block_document_id, subject=alert.subject, body=body)
        made.append(
            AutomationCore(
                name=AUTOMATION_PREFIX + alert.kind,
                description=alert.description,
                trigger=_trigger(alert.kind, stalled),
                actions=[action],
            )
        )
    return made


def parse_block(ref: str) -> tuple[str, str]:
    """'TYPE/NAME' -> (block type slug, block document name)."""
    kind, _, name = ref.partition("/")
    if not kind or not name or "/" in name:
        raise ConfigError(f"alerts.block={ref!r}: give a notification block as TYPE/NAME, e.g. custom-webhook/oncall")
    return kind, name


def block_document_id(ref: str) -> UUID:
    """The id of the notification block 'TYPE/NAME' on the Prefect API; a ConfigError says how to create it."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    kind, name = parse_block(ref)
    try:
        with get_client(sync_client=True) as client:
            document = client.read_block_document_by_name(name, kind, include_secrets=False)
    except ObjectNotFound as exc:
        raise ConfigError(
            f"alerts.block={ref!r}: no such block on this Prefect server: create it first (in the UI's Blocks page, "
            f"or `prefect block create {kind}`), holding the webhook"
        ) from exc
    capabilities = set(getattr(document.block_schema, "capabilities", None) or [])
    if document.block_schema is not None and "notify" not in capabilities:
        raise ConfigError(f"alerts.block={ref!r}: a {kind} block cannot send notifications; name a notification block")
    return document.id


def sync_automations(block: str, stalled_minutes: float) -> list[str]:
    """Create the automations, or update same-named ones in place (extra copies are deleted); one line each.

    One already as wanted is left alone: an update would reset its trigger's open windows."""
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    wanted = automations(block_document_id(block), stalled_minutes)
    done = []
    with get_client(sync_client=True) as client:
        for automation in wanted:
            found = client.read_automations_by_name(automation.name)
            for extra in found[1:]:
                client.delete_automation(extra.id)
            if not found:
                client.create_automation(automation)
                done.append(f"{automation.name!r}: created")
            elif AutomationCore.model_validate(found[0].model_dump(exclude={"id"})) == automation:
                done.append(f"{automation.name!r}: unchanged")
            else:
                client.update_automation(found[0].id, automation)
                done.append(f"{automation.name!r}: updated")
    return done


def alerts_settings(configs: dict[str, AlertsConfig], block: str | None) -> tuple[str, float] | None:
    """The automations' block and stall window from the deployments' alerts configs; None without a block.

    `block` (a flag or HLAT_ALERTS_BLOCK) wins. The automations watch every hlat run, so differing settings are
    refused."""
    naming = {name: c for name, c in configs.items() if c.block}
    blocks = {c.block for c in naming.values()}
    if block is None and len(blocks) > 1:
        listed = "; ".join(f"{n}: {c.block}" for n, c in sorted(naming.items()))
        raise ConfigError(
            f"alerts.block: the deployments name different blocks ({listed}): the automations are the server's, one "
            "set for every hlat run; name one block in all of them, or pass HLAT_ALERTS_BLOCK"
        )
    chosen = block or next(iter(blocks), None)
    if chosen is None:
        return None
    parse_block(chosen)
    windows = {c.stalled_minutes for c in (naming or configs).values()}
    if len(windows) > 1:
        raise ConfigError(
            f"alerts.stalled_minutes: the deployments give different windows ({', '.join(map(str, sorted(windows)))}):"
            " the stalled-training automation is one for every hlat run; give the same in all of them"
        )
    return chosen, next(iter(windows), AlertsConfig().stalled_minutes)
