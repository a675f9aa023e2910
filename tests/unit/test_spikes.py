"""Loss-spike skipping (training.spike_skip): the device-side detector's rule (a full window first, a spike left out
of it, the gradient norm too, NaN left to nan_policy, a resumed state judging as the uninterrupted one), the training
loop skipping an injected spike's update and stopping on too many in a row (EXIT_LOSS_SPIKES, its failure record),
and the supervisor not relaunching that stop."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hlat.core.config import HlatConfig, validate_config
from hlat.core.contract import EXIT_LOSS_SPIKES, parse_failure_record
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.infra.backends import local_daemon
from hlat.infra.backends.protocol import Action, FailureClass, classify_reason
from hlat.infra.supervision.errors import JobFailed
from hlat.infra.supervision.judgement import loss_spikes_stop
from hlat.training import hooks as job_hooks
from hlat.training.checkpoint import CheckpointManager
from hlat.training.loop import Trainer
from hlat.training.parallel.distributed import init_world
from hlat.training.spikes import SpikeDetector, describe_spike, spikes_reason
from tests import spike_hooks
from tests.jobs import make_run, metrics
from tests.unit.test_supervisor import Play, ScriptedBackend, record_reason, supervisor

WINDOW = 8


def detector(max_consecutive: int = 3, zscore: float = 6.0) -> SpikeDetector:
    return SpikeDetector(WINDOW, zscore, max_consecutive, torch.device("cpu"))


def feed(d: SpikeDetector, step: int, loss: float, norm: float | None = 1.0, nxd: bool = False) -> bool:
    """One step through the detector as the loop drives it (`nxd`: judged on the loss, the norm recorded after)."""
    loss_t, norm_t = torch.tensor(loss), torch.tensor(norm if norm is not None else 1.0)
    verdict = d.judge(loss_t, None if nxd else norm_t)
    d.record(torch.tensor(step, dtype=torch.int32), verdict, norm_t if nxd else None)
    return bool(verdict.spike)


def normal(step: int) -> float:
    """A loss that wanders a little around 3."""
    return 3.0 + 0.05 * ((step * 7) % 5 - 2)


def test_no_step_is_judged_before_the_window_is_full() -> None:
    d = detector()
    assert not any(feed(d, s, 100.0 if s == 3 else normal(s)) for s in range(1, WINDOW + 1))
    assert int(d.filled) == WINDOW and int(d.skipped) == 0
    assert float(d.history[0].max()) == 100.0  # an outlier while the window fills is part of the window


def test_a_spike_is_skipped_and_left_out_of_the_window_normal_steps_are_not() -> None:
    d = detector()
    for s in range(1, WINDOW + 1):
        assert not feed(d, s, normal(s))
    history = d.history.clone()
    assert feed(d, 9, 30.0)
    assert torch.equal(d.history, history) and int(d.filled) == WINDOW  # the spike did not enter the window
    assert not any(feed(d, s, normal(s)) for s in range(10, 40))
    assert int(d.skipped) == 1 and int(d.newest_step) == 9 and int(d.consecutive) == 0
    seen = d.tensors()
    assert describe_spike(seen, d.zscore).startswith("loss spike skipped (loss 30 vs window mean 3")


def test_a_gradient_norm_spike_is_skipped_and_under_nxd_the_loss_alone_decides() -> None:
    d = detector()
    for s in range(1, WINDOW + 1):
        feed(d, s, normal(s), norm=1.0 + 0.01 * (s % 3))
    assert feed(d, 9, normal(9), norm=50.0)
    assert describe_spike(d.tensors(), d.zscore).startswith("grad-norm spike skipped (grad norm 50 vs window mean 1")
    nxd = detector()
    for s in range(1, WINDOW + 1):
        feed(nxd, s, normal(s), norm=1.0 + 0.01 * (s % 3), nxd=True)
    assert not feed(nxd, 9, normal(9), norm=50.0, nxd=True)  # the norm is known after the update only
    assert float(nxd.history[1].max()) == 50.0  # ... and still enters the window
    assert feed(nxd, 10, 30.0, nxd=True)


def test_a_non_finite_step_is_no_spike_and_stays_out_of_the_window() -> None:
    d = detector()
    for s in range(1, WINDOW + 1):
        feed(d, s, normal(s))
    history = d.history.clone()
    assert not feed(d, 9, float("nan"))
    assert not feed(d, 10, normal(10), norm=float("inf"))
    assert torch.equal(d.history, history) and int(d.skipped) == 0


def test_max_consecutive_spikes_trip_and_name_their_steps() -> None:
    d = detector(max_consecutive=3)
    for s in range(1, WINDOW + 1):
        feed(d, s, normal(s))
    assert feed(d, 9, 30.0) and not feed(d, 10, normal(10))  # a run of one: the count starts again
    assert [feed(d, s, 30.0) for s in (11, 12)] == [True, True] and int(d.tripped_at) == 0
    assert feed(d, 13, 30.0)
    assert (int(d.tripped_from), int(d.tripped_at), int(d.skipped)) == (11, 13, 4)
    reason = spikes_reason(d.tensors(), 3, 6.0)
    assert reason.startswith("LossSpikes: steps 11-13 spiked 3 in a row (training.spike_max_consecutive=3")


def test_a_restored_state_judges_every_later_step_as_the_uninterrupted_detector() -> None:
    losses = [normal(s) for s in range(1, 30)]
    losses[12], losses[20] = 30.0, 25.0
    straight, first = detector(), detector()
    for s, loss in enumerate(losses[:15], 1):
        feed(straight, s, loss)
        feed(first, s, loss)
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in first.state_dict().items()}
    resumed = detector()
    resumed.load_state_dict(saved)
    for s, loss in enumerate(losses[15:], 16):
        assert feed(straight, s, loss) == feed(resumed, s, loss)
    for name, value in straight.state_dict().items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(resumed.state_dict()[name])), name
    assert int(resumed.skipped) == 2
    other = SpikeDetector(WINDOW * 2, 6.0, 3, torch.device("cpu"))
    other.load_state_dict(saved)  # another window size: the window starts empty, the counters go on
    assert int(other.filled) == 0 and int(other.skipped) == 1


# -- the training loop ---------------------------------------------------------------------------------------
@pytest.fixture
def spike_hooks_installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(job_hooks.HOOKS_ENV, spike_hooks.MODULE)
    job_hooks.hooks.cache_clear()
    yield
    job_hooks.hooks.cache_clear()


def build(run: Path) -> Trainer:
    cfg: HlatConfig = validate_config(Storage(str(run)).read_json("config.json"))
    return Trainer(
        cfg=cfg,
        run=Run.at(str(run)),
        checkpoints=Storage(str(run / "checkpoints")),
        world=init_world("cpu", cfg),
        tokenizer_model=str(run / "tokenizer" / "tokenizer.model"),
    )


def weights_after_each_step(trainer: Trainer) -> tuple[int, list[dict[str, torch.Tensor]]]:
    """fit()'s exit code, and the model's weights after each step (index k - 1: after step k)."""
    after: list[dict[str, torch.Tensor]] = []
    step = trainer.train_step

    def train_step(batches: Any) -> dict[str, Any]:
        out = step(batches)
        after.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
        return out

    trainer.train_step = train_step  # type: ignore[method-assign]
    return trainer.fit(), after


SPIKY = {"max_steps": 14, "checkpoint_every": 7, "eval_every": 0, "log_every": 1, "spike_skip": True,
         "spike_window": WINDOW}  # fmt: skip


def test_an_injected_spike_is_skipped_on_the_device_and_normal_steps_are_not(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spike_hooks_installed: None,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.WARNING, logger="hlat")
    monkeypatch.setenv(spike_hooks.SPIKE_STEPS, "11")
    run = make_run(prepared, tmp_path, "spike", **SPIKY)
    code, after = weights_after_each_step(build(run))
    assert code == 0
    for name, before in after[9].items():  # the weights after step 11 are those after step 10
        assert torch.equal(after[10][name], before), name
    assert any(not torch.equal(after[11][n], after[10][n]) for n in after[10])  # step 12 learns again
    steps = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in steps if r.get("skipped")] == [11]
    assert [r["spikes_skipped"] for r in steps] == [0] * 10 + [1] * 4
    assert "step 11: loss spike skipped (loss" in caplog.text and "1 skipped so far" in caplog.text


def test_too_many_spikes_in_a_row_stop_the_job_with_a_failure_record_and_no_checkpoint_of_them(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spike_hooks_installed: None
) -> None:
    failure = tmp_path / "failure"
    monkeypatch.setenv("HLAT_FAILURE_FILE", str(failure))
    monkeypatch.setenv(spike_hooks.SPIKE_STEPS, "10,11,12")
    run = make_run(prepared, tmp_path, "diverged", **{**SPIKY, "checkpoint_every": 4, "spike_max_consecutive": 3})
    trainer = build(run)
    assert trainer.fit() == EXIT_LOSS_SPIKES
    assert trainer.step == 12  # found at step 12's sync point, before its checkpoint
    manager = CheckpointManager(Storage(str(run / "checkpoints")), keep_last=5)
    assert manager.latest_step() == 8
    record = parse_failure_record(failure.read_text())
    assert record is not None and record.type == "LossSpikes"
    assert record.message.startswith("steps 10-12 spiked 3 in a row (training.spike_max_consecutive=3")
    assert "loss spike skipped (loss" in record.message


# -- the control plane ---------------------------------------------------------------------------------------
def test_the_local_backend_names_the_exit_and_the_supervisor_does_not_relaunch_it(tmp_path: Path) -> None:
    bare = local_daemon.failure_reason(EXIT_LOSS_SPIKES, None, ["last words"])
    assert bare.startswith("AlgorithmError: LossSpikes: ") and f"exit code {EXIT_LOSS_SPIKES}" in bare
    decision = loss_spikes_stop(classify_reason(bare))
    assert (decision.action, decision.failure_class, decision.category) == (
        Action.FATAL, FailureClass.FATAL, "loss-spikes"
    )  # fmt: skip
    nan = classify_reason("AlgorithmError: NonFiniteLoss: loss is nan at step 31")
    assert loss_spikes_stop(nan) is nan

    clock = [0.0]
    reason = record_reason("LossSpikes", "steps 41-48 spiked 8 in a row (training.spike_max_consecutive=8)", 48)
    backend = ScriptedBackend([Play([("Failed", reason)], reaches=40), Play()], clock)
    with pytest.raises(JobFailed) as info:
        supervisor(tmp_path, backend, clock, max_repeats=3).run_to_completion()
    assert len(backend.submitted) == 1  # not relaunched, whatever job.max_repeats says
    message = str(info.value)
    assert "\n" not in message and "the run diverged, not relaunched" in message and "steps 41-48" in message
    assert info.value.attempts[-1].action == "fatal" and info.value.attempts[-1].category == "loss-spikes"
