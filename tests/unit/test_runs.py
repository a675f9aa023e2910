"""The run layout on local storage: config.json written once, a different config refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hlat.core.run
from hlat.cli import main
from hlat.core.config import ConfigError, HlatConfig
from hlat.core.presets import load_config
from hlat.core.run import (
    CONFIG_FILE,
    STAGE_DIRS,
    Run,
    check_run,
    continued,
    describe_difference,
    open_run,
    run_for,
)
from hlat.core.storage import Storage, StorageNotFound


def test_open_run_writes_config_once_with_run_id(tmp_path: Path) -> None:
    config = load_config("tiny", storage=str(tmp_path))
    assert config.run_id is None
    run = open_run(config)

    assert run.run_id == config.resolved_run_id()
    assert run.run_id.startswith("tiny-")
    assert run.uri == str(tmp_path / run.run_id)
    path = tmp_path / run.run_id / CONFIG_FILE
    stored = json.loads(path.read_text())
    assert stored["run_id"] == run.run_id
    assert stored["training"]["lr"] == config.training.lr
    assert sorted(p.name for p in (tmp_path / run.run_id).iterdir()) == [CONFIG_FILE]

    loaded = run.load_config()
    assert loaded.run_id == run.run_id
    assert loaded.fingerprint() == config.fingerprint()

    # Opening again with the same config is fine and does not rewrite the file.
    mtime = path.stat().st_mtime_ns
    again = open_run(load_config("tiny", storage=str(tmp_path)))
    assert again.run_id == run.run_id
    assert path.stat().st_mtime_ns == mtime
    # Naming the derived run id explicitly is the same run.
    assert open_run(load_config("tiny", run_id=run.run_id, storage=str(tmp_path))).run_id == run.run_id


def test_storage_root_is_not_part_of_the_run(tmp_path: Path) -> None:
    first = open_run(load_config("tiny", run_id="exp", storage=str(tmp_path / "a")))
    # The same run read through another root (a copy, another mount) is the same config.
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "exp").rename(tmp_path / "b" / "exp")
    moved = open_run(load_config("tiny", run_id="exp", storage=str(tmp_path / "b")))
    assert moved.run_id == first.run_id == "exp"


def test_a_different_config_under_the_same_run_id_is_refused(tmp_path: Path) -> None:
    open_run(load_config("tiny", run_id="exp-1", storage=str(tmp_path)))
    before = (tmp_path / "exp-1" / CONFIG_FILE).read_text()

    overrides = {"training.lr": 0.004, "model.n_layers": 3}
    changed = load_config("tiny", overrides, run_id="exp-1", storage=str(tmp_path))
    with pytest.raises(ConfigError) as info:
        open_run(changed)
    message = str(info.value)
    assert "\n" not in message
    assert "'exp-1'" in message
    assert "training.lr: 0.002 -> 0.004" in message
    assert "model.n_layers: 2 -> 3" in message
    assert "use another run id" in message and "--run-id" not in message  # the same words for CLI and UI runs
    assert "schedule_steps" not in message  # not a length change: no hint about extending
    assert (tmp_path / "exp-1" / CONFIG_FILE).read_text() == before


def test_a_run_is_extended_when_its_schedule_stays_and_refused_with_the_fix_when_not(tmp_path: Path) -> None:
    first = load_config("tiny", {"training.max_steps": 40}, run_id="ext", storage=str(tmp_path))
    open_run(first)
    config_file = tmp_path / "ext" / CONFIG_FILE

    # The horizon follows max_steps (schedule_steps unset): a longer run would have trained its first 40 steps on
    # another learning-rate curve. Refused, with the setting that keeps the schedule.
    longer = load_config("tiny", {"training.max_steps": 60}, run_id="ext", storage=str(tmp_path))
    with pytest.raises(ConfigError) as info:
        open_run(longer)
    message = str(info.value)
    assert "training.max_steps: 40 -> 60" in message
    assert "also set training.schedule_steps=40" in message
    assert json.loads(config_file.read_text())["training"]["max_steps"] == 40

    # With the horizon kept, the run is extended: config.json says so, the jobs read the new length.
    kept = load_config(
        "tiny", {"training.max_steps": 60, "training.schedule_steps": 40}, run_id="ext", storage=str(tmp_path)
    )
    assert kept.trajectory_fingerprint() == first.trajectory_fingerprint() != longer.trajectory_fingerprint()
    assert open_run(kept).run_id == "ext"
    stored = json.loads(config_file.read_text())["training"]
    assert (stored["max_steps"], stored["schedule_steps"]) == (60, 40)

    # Once extended, a stage given the run's first length is refused (not silently shortened), saying what to give.
    with pytest.raises(ConfigError) as info:
        open_run(first)
    assert "give every stage of it training.max_steps=60 and training.schedule_steps=40" in str(info.value)
    assert json.loads(config_file.read_text())["training"]["max_steps"] == 60

    # A length change beside any other change is still refused (and no extension hint is given).
    other = load_config(
        "tiny",
        {"training.max_steps": 80, "training.schedule_steps": 40, "training.lr": 0.004},
        run_id="ext",
        storage=str(tmp_path),
    )
    with pytest.raises(ConfigError, match=r"training\.lr: 0\.002 -> 0\.004") as info:
        open_run(other)
    assert "also set" not in str(info.value)


def test_derived_run_id_follows_the_config(tmp_path: Path) -> None:
    base = load_config("tiny", storage=str(tmp_path))
    other = load_config("tiny", {"training.lr": 0.003}, storage=str(tmp_path))
    assert base.resolved_run_id() == load_config("tiny", storage=str(tmp_path)).resolved_run_id()
    assert base.resolved_run_id() != other.resolved_run_id()
    # The storage root does not change the derived id.
    elsewhere = load_config("tiny", storage=str(tmp_path / "elsewhere"))
    assert base.resolved_run_id() == elsewhere.resolved_run_id()
    # Both derived runs open side by side without a conflict.
    assert open_run(base).run_id != open_run(other).run_id
    assert len(list(tmp_path.iterdir())) == 2


def test_describe_difference_limits_the_list() -> None:
    old = load_config("tiny")
    new = load_config(
        "tiny",
        {
            "training.lr": 0.003,
            "training.seed": 1,
            "training.max_steps": 10,
            "training.warmup_steps": 1,
            "training.beta1": 0.8,
            "training.beta2": 0.9,
            "run_id": "ignored",
            "storage.root": "/elsewhere",
        },
    )
    text = describe_difference(old, new, limit=5)
    assert text.count(" -> ") == 5
    assert text.endswith(", and 1 more")
    assert "run_id" not in text and "storage" not in text


def test_stage_folders(tmp_path: Path) -> None:
    run = run_for(load_config("tiny", run_id="exp", storage=str(tmp_path)))
    assert run.stage("data").url == str(tmp_path / "exp" / "data")
    for name in STAGE_DIRS:
        assert run.stage(name).url.endswith(f"/exp/{name}")
    with pytest.raises(ValueError, match="unknown stage folder 'nope'"):
        run.stage("nope")


def test_load_config_of_a_run_never_opened(tmp_path: Path) -> None:
    run = run_for(load_config("tiny", run_id="exp", storage=str(tmp_path)))
    with pytest.raises(StorageNotFound) as info:
        run.load_config()
    assert "\n" not in str(info.value)
    assert "hlat pretrain" in str(info.value)


def test_settings_outside_the_fingerprint_follow_the_latest_flow_run(tmp_path: Path) -> None:
    from hlat.core.presets import load_config
    from hlat.core.run import open_run

    first = open_run(load_config("tiny", storage=str(tmp_path)))
    later = load_config(
        "tiny",
        {"job.budget_usd": 50, "burn_in.continue_on_failure": True, "neuron.exec_timeout": 9000},
        storage=str(tmp_path),
    )
    assert open_run(later).run_id == first.run_id  # the same run: nothing it computes changed
    stored = first.storage.read_json("config.json")
    assert stored["job"]["budget_usd"] == 50 and stored["burn_in"]["continue_on_failure"] is True
    assert stored["neuron"]["exec_timeout"] == 9000  # the next job's environment follows it


def test_a_wsd_run_extends_in_place_until_its_decay_began_and_is_refused_before_any_job_after(tmp_path: Path) -> None:
    from hlat.training.checkpoint import CheckpointManager

    wsd = {"training.schedule": "wsd", "training.warmup_steps": 2, "training.max_steps": 20, "training.decay_steps": 4}
    open_run(load_config("tiny", wsd, run_id="wsd", storage=str(tmp_path)))
    manager = CheckpointManager(Storage(str(tmp_path / "wsd" / "checkpoints")), keep_last=2)

    def committed(step: int) -> None:
        manager.save(step, {"step": step}, {})
        manager.wait()

    committed(10)  # inside the stable phase (the decay begins at step 16): no step taken changes its lr
    longer = open_run(load_config("tiny", {**wsd, "training.max_steps": 30}, run_id="wsd", storage=str(tmp_path)))
    assert longer.config.training.max_steps == 30 and longer.config.training.decay_start == 26
    committed(28)  # now past the decay's start
    refused = (
        r"training.max_steps 30 -> 40: the run cannot be extended in place, its decay began at step 26 and it has "
        r"taken 28 steps; start a new run from its checkpoint"
    )
    with pytest.raises(ConfigError, match=refused):
        open_run(load_config("tiny", {**wsd, "training.max_steps": 40}, run_id="wsd", storage=str(tmp_path)))


# -- config.json validated once per process -------------------------------------------------------------------
@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The run ids of every config.json-shaped validation from now on (a fresh process: nothing validated yet)."""
    seen: list[str] = []
    original = HlatConfig.model_validate.__func__  # type: ignore[attr-defined]

    def counting(cls: type[HlatConfig], data: object, *args: object, **kwargs: object) -> HlatConfig:
        if isinstance(data, dict) and data.get("run_id"):  # a stored config: its run id is filled in
            seen.append(str(data["run_id"]))
        return original(cls, data, *args, **kwargs)

    hlat.core.run._validated.cache_clear()
    monkeypatch.setattr(HlatConfig, "model_validate", classmethod(counting))
    return seen


def test_hlat_status_and_hlat_stop_validate_config_json_once(
    tmp_path: Path, validations: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    run = open_run(load_config("tiny", storage=str(tmp_path)))
    validations.clear()
    hlat.core.run._validated.cache_clear()
    assert main(["status", run.uri]) == 0
    assert validations == [run.run_id]
    hlat.core.run._validated.cache_clear()
    validations.clear()
    assert main(["stop", run.uri]) == 0
    assert validations == [run.run_id]
    assert run.run_id in capsys.readouterr().out


def test_resuming_a_run_validates_config_json_once(tmp_path: Path, validations: list[str]) -> None:
    """What a re-run of `hlat pretrain` does to the run before its stages (the CLI's checks, the flow's start),
    each reading config.json: one validation between them."""
    open_run(load_config("tiny", storage=str(tmp_path)))
    hlat.core.run._validated.cache_clear()
    validations.clear()
    config = continued(load_config("tiny", storage=str(tmp_path)))  # the CLI
    check_run(config)
    config = continued(config)  # the flow's start_run
    check_run(config)
    run = open_run(config)
    assert run.config.training.max_steps == config.training.max_steps
    assert Run.at(run.uri).config.run_id == run.run_id  # a job's, or hlat status's, read of the same file
    assert validations == [run.run_id]
    # A changed file is validated again.
    path = tmp_path / run.run_id / CONFIG_FILE
    path.write_text(path.read_text() + "\n")
    assert Run.at(run.uri).config.run_id == run.run_id
    assert validations == [run.run_id, run.run_id]
