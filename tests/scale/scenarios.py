"""Scenarios 1-11 of issue 50 on the simulated SageMaker (tests/scale/sim.py), each in two forms: `fixed=False`, the
control plane as it was (the fix turned off through its config field, or the old rule where there is no switch), and
`fixed=True`, as it is now. Each returns an `Outcome`: what it spent, what of that was wasted, the steps lost, how
the stage ended. test_scenarios.py bounds them; report.py prints them as a table.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hlat.core.config import JobConfig
from hlat.infra.backends.protocol import SubmitError
from tests.scale import model
from tests.scale.sim import Failure, Script, SupervisorKilled, World, world
from tests.scale.sim import record as sim_record


class FixMissing(RuntimeError):
    """The fix a scenario's fixed form needs is not in the tree (yet)."""


@dataclass
class Outcome:
    preset: str
    spent_usd: float
    wasted_usd: float
    steps_lost: int
    submissions: int
    ended: str
    """How the stage ended: 'target' (reached training.max_steps), or the exception's type and first line."""
    newest: int
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def reached(self) -> bool:
        return self.ended == "target"


def has_field(name: str) -> bool:
    return name in JobConfig.model_fields


RESTARTS = 10
"""job.max_restarts of the "before" forms in the tests: enough to show that nothing but the cap stops the stage, at a
tenth of the CPU of the default 100 (report.py runs the default: `restarts=None`)."""


def before(fixed: bool, restarts: int | None, **fields: Any) -> dict[str, Any]:
    """The config overrides of a scenario's form: none when fixed; else the fix's config fields turned off, and
    max_restarts (the rest of the old control plane is `sim.legacy_control_plane`)."""
    if fixed:
        return {}
    return {**off(**fields), **({"job.max_restarts": restarts} if restarts is not None else {})}


def off(**fields: Any) -> dict[str, Any]:
    """Config overrides that turn a fix off, for the fix fields the tree has (job.<name>)."""
    return {f"job.{k}": v for k, v in fields.items() if has_field(k)}


def need(module: str, *names: str) -> Any:
    """A fix's module with the names a scenario calls, or FixMissing."""
    if importlib.util.find_spec(module) is None:
        raise FixMissing(f"{module} is not in the tree")
    mod = importlib.import_module(module)
    for name in names:
        if not hasattr(mod, name):
            raise FixMissing(f"{module}.{name} is not in the tree")
    return mod


def _outcome(
    w: World, actor_error: BaseException | None, start: int, wasted: float | None = None, **notes: Any
) -> Outcome:
    spent = w.backend.billed_usd()
    newest = w.newest()
    ended = "target" if newest >= w.scale.config.training.max_steps else "running"
    if actor_error is not None:
        ended = f"{type(actor_error).__name__}: {str(actor_error).splitlines()[0][:160]}"
    useful = w.scale.ideal_usd(newest - start) if newest > start else 0.0
    return Outcome(
        preset=w.scale.preset,
        spent_usd=spent,
        wasted_usd=max(0.0, spent - useful) if wasted is None else wasted,
        steps_lost=w.backend.steps_lost,
        submissions=w.backend.submissions,
        ended=ended,
        newest=newest,
        notes=notes,
    )


def _supervise(w: World, **changes: Any) -> BaseException | None:
    """Run the train stage's supervisor to its end on the virtual clock; its exception (None: it returned)."""
    sup = w.supervisor(**changes)
    actor = w.sim.spawn("supervisor", sup.run_to_completion)
    w.sim.run()
    return actor.error


def _start(w: World) -> int:
    return w.newest()


# -- 1. a hung job with no live supervisor ---------------------------------------------------------------------------
def scenario_1(mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS) -> Outcome:
    """The job hangs 10 steps after a checkpoint (a storage read with no deadline); its supervisor was SIGKILLed
    a minute before. Before: only MaxRuntimeInSeconds (the budget's time, or 28 days) ends it. Fixed: the in-job
    watchdog ends it at its bound."""
    sc = model.scale(preset, **{"job.poll_seconds": 300})
    hang = sc.config.training.max_steps - 2 * sc.checkpoint_every + sc.checkpoint_every + 10
    watchdog_s, record = None, None
    if fixed:
        wd = need("hlat.training.watchdog", "watchdog_bound_seconds")
        watchdog_s = wd.watchdog_bound_seconds(sc.step_s, sc.save_s)

        def record(step: int, when: float) -> str:  # what the watchdog writes (`write_failure` on the hung rank)
            return sim_record("HangDetected", f"no step for {watchdog_s:.0f} s after step {step}", None, step, 0, 0,
                              when)  # fmt: skip

    script = Script(hang_at_step=hang, watchdog_s=watchdog_s, watchdog_record=record)
    w = world(mp, tmp, preset, fixed=fixed, script=lambda a: script, **{"job.poll_seconds": 300})
    start = _start(w)
    sup = w.supervisor()
    actor = w.sim.spawn("supervisor", sup.run_to_completion)
    hang_at = w.sim.now + sc.starting_s + sc.downloading_s + sc.startup_s + (hang - start) * sc.step_s
    w.sim.at(hang_at - 60, lambda: actor.interrupt(SupervisorKilled("kill -9 of the supervisor")))
    w.sim.run()
    job = next(iter(w.backend.jobs.values()))
    assert job.ended is not None
    return _outcome(w, None, start, wasted=sc.usd(job.ended - hang_at), hung_s=job.ended - hang_at,
                    job_ended=job.secondary, rule_fired=w.backend.rule_fired)  # fmt: skip


# -- 2. platform-class failures never stop by repetition ---------------------------------------------------------------
def scenario_2(
    mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS, reported: str = "peer"
) -> Outcome:
    """A deterministic bug on one rank (host 6) 50 steps after every resume; SageMaker's FailureReason is another
    host's 'connection closed by peer' record ('peer'), or alternates between the two hosts ('alternate')."""
    overrides = {"job.poll_seconds": 300, **before(fixed, restarts, max_attempts_without_progress=10_000)}
    sc = model.scale(preset, **overrides)
    at = sc.config.training.max_steps - 2 * sc.checkpoint_every + 50
    rank = 5 * model.RANKS_PER_HOST + 3

    def script(attempt: int) -> Script:
        host = 6 if reported == "peer" or attempt % 2 == 0 else 5
        bug = Failure("IndexError", "index 4097 is out of bounds for dimension 0 with size 4096", rank, None, host)
        return Script(fail_at_step=at, failure=bug)

    w = world(mp, tmp, preset, fixed=fixed, script=script, **overrides)
    start = _start(w)
    return _outcome(w, _supervise(w), start)


# -- 3. a NaN whose step moves -------------------------------------------------------------------------------------
def scenario_3(mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS) -> Outcome:
    """A NaN before the next checkpoint on every resume, at a step that moves (bf16 stochastic rounding)."""
    overrides = {"job.poll_seconds": 300, **before(fixed, restarts)}
    if not fixed:  # the old rule: a repeat was the same cause, step included; a moving step never repeated
        overrides["job.max_repeats"] = 10**6
    sc = model.scale(preset, **overrides)
    base = sc.config.training.max_steps - 2 * sc.checkpoint_every

    def script(attempt: int) -> Script:
        nan = Failure("NonFiniteLoss", "the loss became NaN or inf", 0, None, None, peers_lost=False)
        return Script(fail_at_step=base + 20 + 7 * (attempt % 9), failure=nan)

    w = world(mp, tmp, preset, fixed=fixed, script=script, **overrides)
    return _outcome(w, _supervise(w), base)


# -- 4. a start-up longer than the hang timeout -------------------------------------------------------------------
def scenario_4(mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS) -> Outcome:
    """Starting 10 min, Downloading 10 min, 50 min of start-up (image, compile cache, process groups): 70 min from
    submission to the first step, against job.hang_timeout_minutes=60 (the default)."""
    overrides = {"job.poll_seconds": 300, **before(fixed, restarts, startup_timeout_minutes=None)}
    w = world(
        mp,
        tmp,
        preset,
        fixed=fixed,
        script=lambda a: Script(starting_s=600, downloading_s=600, startup_s=3000),
        **overrides,
    )
    start = _start(w)
    error = _supervise(w)
    sc = w.scale
    slow_start = sc.usd(600 + 3000 - sc.downloading_s - sc.startup_s)  # what the slow start costs once, not waste
    return _outcome(w, error, start, slow_start_usd=slow_start)


# -- 5. the per-step stop vote -------------------------------------------------------------------------------------
def scenario_5(mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS) -> Outcome:
    """The stop vote as a full-world gloo all-reduce at every step, on a full-mesh group: formed in
    gloo_mesh_init_seconds(P) (past the 30 min timeout at 8,192 ranks: the start-up fails, DistStoreError), then
    2(P-1) hops per step. Fixed: the job's vote schedule and lazily formed group."""
    overrides = {"job.poll_seconds": 300, **before(fixed, restarts, watchdog="off")}
    sc = model.scale(preset, **overrides)
    ranks = sc.ranks
    if fixed:
        # The stop vote through the store (training/stop_vote.py), driven at this world's size: what its step
        # boundaries send (counted on a recording store: nothing, while no stop is asked), and the host-side gloo
        # group formed lazily (init_world's switch): no mesh to form at start-up, no socket before a collective.
        vote_mod = need("hlat.training.stop_vote", "StopVote")
        dist_mod = need("hlat.training.parallel.distributed", "GLOO_LAZY_INIT")
        sent: list[str] = []

        class RecordingStore:
            def __getattr__(self, op: str) -> Any:
                return lambda *args, **kwargs: sent.append(op)

        vote = vote_mod.StopVote(
            rank=ranks - 1, world_size=ranks, max_steps=10**6, passed=0, connect=lambda: RecordingStore()
        )
        boundaries = 1000
        stops = sum(vote.at_boundary(step) for step in range(1, boundaries + 1))
        assert stops == 0 and dist_mod.GLOO_LAZY_INIT == "TORCH_GLOO_LAZY_INIT"
        per_step = len(sent) / boundaries * model.STORE_OP_S
        step_s, startup_s, fail_s = sc.step_s + per_step, sc.startup_s, None
    else:
        init = model.gloo_mesh_init_seconds(ranks)
        step_s, startup_s = sc.step_s + model.gloo_vote_seconds(ranks), sc.startup_s + init
        fail_s = sc.startup_s + model.GLOO_TIMEOUT_S if init > model.GLOO_TIMEOUT_S else None
    timeout = Failure(
        "DistStoreError",
        f"Timed out after {model.GLOO_TIMEOUT_S:.0f} seconds waiting for clients. {ranks // 2}/{ranks} clients joined.",
        0, "torch.distributed", None, peers_lost=False,
    )  # fmt: skip
    script = Script(step_s=step_s, startup_s=startup_s, fail_in_startup_s=fail_s, failure=timeout)
    w = world(mp, tmp, preset, fixed=fixed, script=lambda a: script, **overrides)
    start = _start(w)
    sockets = 0 if fixed else model.gloo_sockets_per_rank(ranks)  # lazy: none to a peer before a collective
    vote_s = per_step if fixed else model.gloo_vote_seconds(ranks)
    return _outcome(w, _supervise(w), start, sockets_per_rank=sockets, vote_s=vote_s)


# -- 6. a stop that does not fit SageMaker's 120 s ----------------------------------------------------------------
def scenario_6(mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS) -> Outcome:
    """`hlat stop` right after an async checkpoint started (its save in flight): the stop's timeline as the job's
    own code computes it (core/stop_timeline.py), before and after the plan changes."""
    tl = need("hlat.core.stop_timeline", "stop_timeline", "PLAN", "OLD_PLAN")
    sc = model.scale(preset, **{"job.poll_seconds": 300})
    timeline = tl.stop_timeline(sc.config, sc.step_s, in_flight=True, plan=tl.PLAN if fixed else tl.OLD_PLAN)
    stop_s = float(timeline.total)
    w = world(mp, tmp, preset, fixed=fixed, script=lambda a: Script(stop_s=stop_s), **{"job.poll_seconds": 300})
    start = _start(w)
    sup = w.supervisor()
    sup_actor = w.sim.spawn("supervisor", sup.run_to_completion)
    from hlat.infra.supervision.status import stop_run

    first = w.sim.now + sc.starting_s + sc.downloading_s + sc.startup_s
    when = first + sc.checkpoint_every * sc.step_s + 1.0  # a second into the step after a checkpoint's
    w.sim.at(when, lambda: w.sim.spawn("hlat stop", lambda: stop_run(w.run, wait_s=0)))
    w.sim.run()
    lost = w.backend.steps_lost
    return _outcome(w, sup_actor.error, start, wasted=sc.usd(lost * sc.step_s), stop_s=stop_s,
                    stops_killed=w.backend.stops_lost)  # fmt: skip


# -- 7. `hlat stop` during a back-off -----------------------------------------------------------------------------
def scenario_7(mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS) -> Outcome:
    """The first job fails for capacity 5 min into Starting; during the back-off the user runs `hlat stop`. What
    is billed after that is waste: the user asked for nothing more."""
    from hlat.infra.supervision.status import stop_run, stop_summary

    def script(attempt: int) -> Script:
        return Script(fail_starting=("CapacityError: Unable to provision requested ML compute capacity.", 300.0)
                      if attempt == 1 else None)  # fmt: skip

    w = world(
        mp, tmp, preset, fixed=fixed, script=script, **{"job.poll_seconds": 300, "job.backoff_seconds": (1800.0,)}
    )
    start = _start(w)
    said: list[str] = []
    stop_at = w.sim.now + 1000  # the job failed at 300 s, seen at the 300 s poll; the back-off lasts to 2,100 s

    def stop() -> None:
        said.append(stop_summary(stop_run(w.run, wait_s=0), w.run.run_id))

    w.sim.at(stop_at, lambda: w.sim.spawn("hlat stop", stop))
    error = _supervise(w)
    after = sum(
        (j.ended or w.sim.now) - max(j.billed_from, stop_at) for j in w.backend.jobs.values() if j.submitted >= stop_at
    )
    return _outcome(w, error, start, wasted=w.scale.usd(max(0.0, after)), said=said)


# -- 8. two supervisors of one run ----------------------------------------------------------------------------------
def scenario_8(mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS) -> Outcome:
    """Supervisor A (a deployment's flow run) runs the job; 20 min later a second one (B, the CLI in another
    terminal) is started on the same run; 40 min in, Ctrl-C in A. Waste: what is billed after the Ctrl-C beyond the
    stop itself."""
    w = world(mp, tmp, preset, fixed=fixed, **{"job.poll_seconds": 300})
    start = _start(w)
    a = w.sim.spawn("A", w.supervisor().run_to_completion)
    b_sup = w.supervisor()
    b = w.sim.spawn("B", b_sup.run_to_completion, at=w.sim.now + 1200)
    ctrl_c = w.sim.now + 2400
    w.sim.at(ctrl_c, lambda: a.interrupt(KeyboardInterrupt()))
    w.sim.run()
    after = sum((j.ended or w.sim.now) - max(j.billed_from, ctrl_c) for j in w.backend.jobs.values()
                if j.submitted > ctrl_c)  # fmt: skip
    return _outcome(w, b.error, start, wasted=w.scale.usd(max(0.0, after)),
                    a=type(a.error).__name__ if a.error else None)  # fmt: skip


# -- 9. a supervisor clock behind the hosts --------------------------------------------------------------------------
def scenario_9(mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS) -> Outcome:
    """The supervisor's machine clock 31 min behind the hosts' and S3's (job.unsupervised_stop_minutes=30)."""
    w = world(mp, tmp, preset, fixed=fixed, skew_s=-31 * 60.0, **{"job.poll_seconds": 300, **before(fixed, restarts)})
    start = _start(w)
    return _outcome(w, _supervise(w), start, rule_fired=len(w.backend.rule_fired))


# -- 10. a failure record cut by FailureReason's 1,024 characters ------------------------------------------------------
def scenario_10(mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS) -> Outcome:
    """Rank 0's commit fails (a storage fault: the other ranks' files did not all land within the commit timeout)
    with a long message naming the missing ranks by host; the fault lasts two attempts."""
    overrides = {"job.poll_seconds": 300, **before(fixed, restarts)}
    sc = model.scale(preset, **overrides)
    at = sc.config.training.max_steps - sc.checkpoint_every
    hosts = ", ".join(f"algo-{h} (ranks {h * 32 - 32}-{h * 32 - 1})" for h in range(2, sc.hosts + 1))
    message = f"not committing s3://hlat-runs/{preset}-sim/checkpoints/step-{at:09d}: missing after 600s: {hosts}"
    storage = Failure("CheckpointError", message, 0, "hlat.core.layout", None)

    def script(attempt: int) -> Script:
        return Script(fail_at_step=at, failure=storage, legacy_record=not fixed) if attempt <= 2 else Script()

    w = world(mp, tmp, preset, fixed=fixed, script=script, **overrides)
    start = _start(w)
    return _outcome(w, _supervise(w), start)


# -- 11. a deadline, a budget's last dollars, a transient quota refusal ------------------------------------------
def scenario_11a(mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS) -> Outcome:
    """The deadline passes during the back-off after a capacity failure: no phantom attempt, `hlat status` true."""
    from datetime import UTC, datetime

    from hlat.infra.supervision.ledger import Ledger
    from hlat.infra.supervision.status import render, run_status

    sc = model.scale(preset)
    deadline = datetime.fromtimestamp(EPOCH_DEADLINE, UTC).isoformat()
    overrides = {"job.poll_seconds": 300, "job.deadline": deadline}

    def script(attempt: int) -> Script:
        return Script(fail_starting=("CapacityError: Unable to provision requested ML compute capacity.", 300.0))

    w = world(mp, tmp, preset, fixed=fixed, script=script, **overrides)
    start = _start(w)
    error = _supervise(w)
    attempts = Ledger(w.run, "train").load()
    status = render(run_status(w.run, clock=w.wall))
    del sc
    return _outcome(w, error, start, phantom=any(not a.ended for a in attempts), status=status)


EPOCH_DEADLINE = 1_800_000_000.0 + 300 + model.FAILURE_SEEN_S + 330.0
"""Inside the back-off after scenario 11a's first job (the clock starts at sim.EPOCH)."""


def scenario_11b(mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS) -> Outcome:
    """The run's earlier jobs spent all but $10 of job.budget_usd: a job of N hosts with a MaxRuntimeInSeconds of
    ~126 s (the $10, plus the stop's grace) would be billed more than that for nothing."""
    from hlat.infra.backends.protocol import job_name
    from hlat.infra.supervision.ledger import Attempt, Ledger

    sc = model.scale(preset)
    earlier = sc.usd(3 * 3600.0)
    overrides = {"job.poll_seconds": 60, "job.budget_usd": earlier + 10.0}
    w = world(mp, tmp, preset, fixed=fixed, **overrides)
    start = _start(w)
    name = job_name(w.run.run_id, 1)
    done = Attempt(1, name, "Failed", "InternalServerError: We encountered an internal error.", "resume",
                   start, start, 3 * 3600.0, sc.hosts, earlier, w.sim.now - 4 * 3600, w.sim.now - 3600)  # fmt: skip
    Ledger(w.run, "train").save([done])
    error = _supervise(w)
    runtimes = [j.spec.max_runtime_s for j in w.backend.jobs.values()]
    return _outcome(w, error, start, wasted=w.backend.billed_usd(), max_runtimes=runtimes)


def scenario_11c(mp: Any, tmp: Any, preset: str, fixed: bool, restarts: int | None = RESTARTS) -> Outcome:
    """CreateTrainingJob refuses the first submission with ResourceLimitExceeded (another job still holds the
    account's trn1 instances), then takes the next."""
    refusal = SubmitError(
        "ResourceLimitExceeded",
        "The account-level service limit 'ml.trn1.32xlarge for training job usage' is 256 Instances, with current "
        "utilization of 64 Instances and a request delta of 256 Instances.",
    )
    w = world(
        mp,
        tmp,
        preset,
        fixed=fixed,
        script=lambda a: Script(refuse=refusal) if a == 1 else Script(),
        **{"job.poll_seconds": 300},
    )
    start = _start(w)
    return _outcome(w, _supervise(w), start)


SCENARIOS: dict[str, Callable[..., Outcome]] = {
    "1": scenario_1,
    "2": scenario_2,
    "3": scenario_3,
    "4": scenario_4,
    "5": scenario_5,
    "6": scenario_6,
    "7": scenario_7,
    "8": scenario_8,
    "9": scenario_9,
    "10": scenario_10,
    "11a": scenario_11a,
    "11b": scenario_11b,
    "11c": scenario_11c,
}
