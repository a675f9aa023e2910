"""The run: `Run` (its id, storage and config) and opening a run with its config.json.

A run is one folder under the storage root; docs/stages.md draws its tree, core/layout.py names its files.
Flows, tasks and jobs all take a `Run`. config.json is validated once per process (per content).
A different config under the same run id is refused; a longer schedule-preserving run is extended.
"""

from __future__ import annotations

import functools
import json
import logging

from hlat.core.config import ConfigError, HlatConfig, validate_config
from hlat.core.layout import CHECKPOINTS_DIR, CONFIG_FILE, STAGE_DIRS, CheckpointIndex
from hlat.core.storage import Storage, StorageNotFound

log = logging.getLogger("hlat.runs")


class Run:
    """One run: its id, its storage and its config. The one value a stage's tasks and a job's code are given.

    `config` is config.json's, read and validated on first use and kept (one validation per process).
    Each reader takes the config section it uses (`run.config.job`...).
    """

    __slots__ = ("_config", "run_id", "storage")

    def __init__(self, run_id: str, storage: Storage, config: HlatConfig | None = None) -> None:
        self.run_id = run_id
        self.storage = storage
        self._config = config

    @classmethod
    def at(cls, uri: str, config: HlatConfig | None = None, run_id: str | None = None) -> Run:
        """The run stored at `uri` (a folder or s3:// prefix; its id, unless given, is the URI's last part).
        Without `config`, config.json is read when first asked for."""
        return cls.of(Storage(uri), config, run_id)

    @classmethod
    def of(cls, storage: Storage, config: HlatConfig | None = None, run_id: str | None = None) -> Run:
        """The run stored in the folder `storage` (its id, unless given, is the folder's name)."""
        run_id = run_id or storage.url.rstrip("/").rsplit("/", 1)[-1]
        if config is not None:
            config = config.model_copy(update={"run_id": run_id})
        return cls(run_id=run_id, storage=storage, config=config)

    @property
    def config(self) -> HlatConfig:
        if self._config is None:
            self._config = load_stored_config(self.storage)
        return self._config

    def with_config(self, config: HlatConfig) -> Run:
        """The same run holding `config` (its run_id filled in)."""
        return Run(self.run_id, self.storage, config.model_copy(update={"run_id": self.run_id}))

    @property
    def uri(self) -> str:
        return self.storage.url

    @property
    def root(self) -> Storage:
        """The storage root: the folder that holds this run, and the prepared sources beside it."""
        return self.storage.parent()

    def stage(self, name: str) -> Storage:
        """Storage rooted at one stage's folder (e.g. 'data', 'tokenizer')."""
        if name not in STAGE_DIRS:
            raise ValueError(f"unknown stage folder {name!r}; known: {', '.join(STAGE_DIRS)}")
        return self.storage.child(name)

    def load_config(self) -> HlatConfig:
        """The config stored in config.json now, read again (as written by open_run)."""
        return load_stored_config(self.storage)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Run) and (self.run_id, self.storage.url) == (other.run_id, other.storage.url)

    def __hash__(self) -> int:
        return hash((self.run_id, self.storage.url))

    def __repr__(self) -> str:
        return f"Run({self.run_id!r}, {self.storage.url!r})"


def load_stored_config(folder: Storage) -> HlatConfig:
    """A run folder's config.json, validated; StorageNotFound naming the fix when the run was never started."""
    try:
        text = folder.read_text(CONFIG_FILE)
    except StorageNotFound:
        raise StorageNotFound(
            f"{folder.uri(CONFIG_FILE)} does not exist: run 'hlat pretrain' or a stage first"
        ) from None
    return _validated(text).model_copy(deep=True)


@functools.lru_cache(maxsize=8)
def _validated(text: str) -> HlatConfig:
    """config.json's text, validated once per process (a changed file is new text). Callers get a deep copy."""
    return validate_config(json.loads(text))


def run_for(config: HlatConfig) -> Run:
    """The run of a config (no I/O)."""
    run_id = config.resolved_run_id()
    return Run(
        run_id=run_id,
        storage=Storage(config.storage.root).child(run_id),
        config=config.model_copy(update={"run_id": run_id}),
    )


def open_run(config: HlatConfig) -> Run:
    """Write the resolved config to <run>/config.json; refuse a different config under the same run id, except a
    longer training.max_steps under the same cosine schedule (the run is extended). `check_run` says, reading
    only, what this will do; call `continued(config)` first to take over the length of a default run that was
    extended in place.

    What determines the run's outputs (its fingerprint) is written once. Settings outside it (the job's budget and
    limits, precompile, burn-in, evaluation) may change between flow runs: config.json is updated to them, so the
    jobs launched next read what the user asked for now.

    The stored config has `run_id` filled in, so the training job reading it needs nothing else. The
    storage root is not compared: a run may be moved or read through another mount.
    """
    run = run_for(config)
    resolved = config.model_copy(update={"run_id": run.run_id})
    text = resolved.model_dump_json(indent=2) + "\n"
    existing = _stored(run)
    if existing is None:
        run.storage.write_text(CONFIG_FILE, text)
        return run
    _refuse_unless_compatible(run, existing, resolved, derived=config.run_id is None)
    if existing.fingerprint() != resolved.fingerprint():
        # Only the length changed, under the same schedule: the steps trained so far stay valid.
        t = resolved.training
        kept = (f"the decay moves to the new horizon's end, from step {t.decay_start}" if t.schedule == "wsd"
                else f"the cosine horizon stays {t.schedule_horizon} steps")  # fmt: skip
        log.info("run %s: training.max_steps %d -> %d (%s)", run.run_id, existing.training.max_steps, t.max_steps,
                 kept)  # fmt: skip
        run.storage.write_text(CONFIG_FILE, text)
    elif existing.model_dump(exclude={"storage"}) != resolved.model_dump(exclude={"storage"}):
        # Only settings outside the fingerprint changed (job budget and limits, precompile, burn-in,
        # evaluation): the jobs started from now on read the new ones.
        log.info("run %s: updating settings outside its fingerprint (%s)", run.run_id,
                 describe_difference(existing, resolved))  # fmt: skip
        run.storage.write_text(CONFIG_FILE, text)
    return run


def _stored(run: Run) -> HlatConfig | None:
    if not run.storage.exists(CONFIG_FILE):
        return None
    return load_stored_config(run.storage)


def _extended_in_place(existing: HlatConfig, resolved: HlatConfig) -> bool:
    """`existing` is `resolved` run longer on the same schedule (`--set training.max_steps=800 --set
    training.schedule_steps=600` given to the run `resolved` started)."""
    return (
        existing.training.max_steps > resolved.training.max_steps
        and existing.trajectory_fingerprint() == resolved.trajectory_fingerprint()
    )


def continued(config: HlatConfig) -> HlatConfig:
    """The config a run goes on with. A run whose id is derived from its config (no run id given) that was extended
    in place under that id (`--run-id <preset>-<hash> --set training.max_steps=...`) is that extended run: a plain
    re-run continues it, with its stored length and schedule and its id pinned (the longer length would derive
    another id). Anything else is `config` itself. Reads config.json (nothing is written)."""
    if config.run_id is not None:
        return config
    run = run_for(config)
    existing = _stored(run)
    resolved = config.model_copy(update={"run_id": run.run_id})
    if existing is None or existing.fingerprint() == resolved.fingerprint():
        return config
    if not _extended_in_place(existing, resolved):
        return config  # refused by check_run / open_run, with the reason
    length = {"max_steps": existing.training.max_steps, "schedule_steps": existing.training.schedule_steps}
    log.info(
        "run %s was extended in place to %d steps: continuing it (give another run id for a %d-step run)",
        run.run_id, existing.training.max_steps, config.training.max_steps,
    )  # fmt: skip
    return config.model_copy(update={"run_id": run.run_id, "training": config.training.model_copy(update=length)})


def check_run(config: HlatConfig) -> Run:
    """What open_run would refuse, found by reading only: raise ConfigError (the same message) before anything
    starts; return the run otherwise."""
    run = run_for(config)
    existing = _stored(run)
    if existing is not None:
        resolved = config.model_copy(update={"run_id": run.run_id})
        _refuse_unless_compatible(run, existing, resolved, derived=config.run_id is None)
    return run


def _refuse_unless_compatible(run: Run, existing: HlatConfig, resolved: HlatConfig, derived: bool) -> None:
    if existing.fingerprint() == resolved.fingerprint():
        return
    longer = resolved.training.max_steps > existing.training.max_steps
    if longer and existing.trajectory_fingerprint() == resolved.trajectory_fingerprint():
        # A WSD run extended after its decay began would change the learning rate of steps already taken: refused
        # here, before any job (whose resume would refuse it too, once per relaunch).
        taken = CheckpointIndex(run.storage.child(CHECKPOINTS_DIR)).latest_step() or 0
        if (problem := existing.training.extension_problem(resolved.training, taken)) is not None:
            raise ConfigError(f"run {run.run_id!r} at {run.uri}: {problem}")
        return
    difference = describe_difference(existing, resolved)
    if derived:
        # The id derived from this config names a run another config took with an explicit --run-id.
        raise ConfigError(
            f"run {run.run_id!r} at {run.uri}, the id derived from this config, holds a run started with a different "
            f"config under that id ({difference}){_extension_hint(existing, resolved)}; or give this config "
            "another run id"
        )
    raise ConfigError(
        f"run {run.run_id!r} at {run.uri} was started with a different config "
        f"({difference}){_extension_hint(existing, resolved)}; use another "
        "run id for this config, or none so that one is derived from the config"
    )


def _extension_hint(old: HlatConfig, new: HlatConfig) -> str:
    """How to extend the run when a new training.max_steps (or length-related field) is all that differs."""

    def without_length(config: HlatConfig) -> str:
        length = {"max_steps": 1, "schedule_steps": None}
        return config.model_copy(update={"training": config.training.model_copy(update=length)}).fingerprint()

    if without_length(old) != without_length(new):
        return ""
    horizon = old.training.schedule_horizon
    if new.training.max_steps < old.training.max_steps:
        return (
            f"; the run trains to {old.training.max_steps} steps (it may have been extended): give every stage of it "
            f"training.max_steps={old.training.max_steps}"
            + (f" and training.schedule_steps={horizon}" if old.training.schedule_steps else "")
        )
    return (
        f"; training.max_steps sets the cosine schedule's horizon unless training.schedule_steps is set, so the "
        f"steps already trained followed another schedule: to extend the run on its own schedule, also set "
        f"training.schedule_steps={horizon}"
    )


def describe_difference(old: HlatConfig, new: HlatConfig, limit: int = 5) -> str:
    """'training.lr: 0.001 -> 0.002, ...' for the first few differing leaves."""

    def leaves(obj: object, prefix: str = "") -> dict[str, object]:
        if isinstance(obj, dict):
            out: dict[str, object] = {}
            for k, v in obj.items():
                out.update(leaves(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: obj}

    skip = {"run_id", "storage"}
    a = leaves({k: v for k, v in old.model_dump(mode="json").items() if k not in skip})
    b = leaves({k: v for k, v in new.model_dump(mode="json").items() if k not in skip})
    diffs = [
        f"{k}: {json.dumps(a.get(k))} -> {json.dumps(b.get(k))}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]
    more = f", and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return ", ".join(diffs[:limit]) + more
