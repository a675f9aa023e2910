"""The run layout: one prefix per run id under the storage root, and the config written there once.

```
<storage_root>/<run_id>/
  config.json      the resolved config, written once
  data/            shards, manifest.json, report.json, quarantine/
  tokenizer/       tokenizer.model, HF tokenizer files, report.json
  compile-cache/  burn-in/  checkpoints/  eval/
```
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from hlat.core.config import ConfigError, HlatConfig, validate_config
from hlat.core.layout import CONFIG_FILE, STAGE_DIRS
from hlat.core.storage import Storage, StorageNotFound

log = logging.getLogger("hlat.runs")


@dataclass(frozen=True)
class Run:
    """Where one run's outputs live."""

    run_id: str
    storage: Storage

    @property
    def uri(self) -> str:
        return self.storage.url

    def stage(self, name: str) -> Storage:
        """Storage rooted at one stage's folder (e.g. 'data', 'tokenizer')."""
        if name not in STAGE_DIRS:
            raise ValueError(f"unknown stage folder {name!r}; known: {', '.join(STAGE_DIRS)}")
        return self.storage.child(name)

    def load_config(self) -> HlatConfig:
        try:
            return validate_config(self.storage.read_json(CONFIG_FILE))
        except StorageNotFound:
            raise StorageNotFound(
                f"{self.storage.uri(CONFIG_FILE)} does not exist: run 'hlat pretrain' or a stage first"
            ) from None


def run_for(config: HlatConfig) -> Run:
    """The run of a config (no I/O)."""
    run_id = config.resolved_run_id()
    return Run(run_id=run_id, storage=Storage(config.storage.root).child(run_id))


def open_run(config: HlatConfig) -> Run:
    """Write the resolved config to <run>/config.json; refuse a different config under the same run id, except a
    longer training.max_steps under the same cosine schedule (the run is extended).

    What determines the run's outputs (its fingerprint) is written once. Settings outside it (the job's budget and
    limits, precompile, burn-in, evaluation) may change between flow runs: config.json is updated to them, so the
    jobs launched next read what the user asked for now.

    The stored config has `run_id` filled in, so the training job reading it needs nothing else. The
    storage root is not compared: a run may be moved or read through another mount.
    """
    run = run_for(config)
    resolved = config.model_copy(update={"run_id": run.run_id})
    text = resolved.model_dump_json(indent=2) + "\n"
    if run.storage.exists(CONFIG_FILE):
        existing = validate_config(run.storage.read_json(CONFIG_FILE))
        if existing.fingerprint() != resolved.fingerprint():
            longer = resolved.training.max_steps > existing.training.max_steps
            if not longer or existing.trajectory_fingerprint() != resolved.trajectory_fingerprint():
                raise ConfigError(
                    f"run {run.run_id!r} at {run.uri} was started with a different config "
                    f"({describe_difference(existing, resolved)}){_extension_hint(existing, resolved)}; use another "
                    "run id for this config, or none so that one is derived from the config"
                )
            # Only the length changed, under the same schedule: the steps trained so far stay valid.
            log.info("run %s: training.max_steps %d -> %d (the cosine horizon stays %d steps)", run.run_id,
                     existing.training.max_steps, resolved.training.max_steps,
                     resolved.training.schedule_horizon)  # fmt: skip
            run.storage.write_text(CONFIG_FILE, text)
            return run
        if existing.model_dump(exclude={"storage"}) != resolved.model_dump(exclude={"storage"}):
            # Only settings outside the fingerprint changed (job budget and limits, precompile, burn-in,
            # evaluation): the jobs started from now on read the new ones.
            log.info("run %s: updating settings outside its fingerprint (%s)", run.run_id,
                     describe_difference(existing, resolved))  # fmt: skip
            run.storage.write_text(CONFIG_FILE, text)
        return run
    run.storage.write_text(CONFIG_FILE, text)
    return run


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
