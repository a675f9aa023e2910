"""Resolve `model.init_from` once per run, before any job: where its weights are, which ones exactly, and a folder
every job of the run can read them from (core/init_from.py's record, `init/import.json`).

- An s3:// prefix is read in place: each rank reads its own tensors with ranged GETs (never a whole shard file).
- A local folder is read in place when the run is local too; for a run on S3 (a SageMaker job cannot read this
  machine's disk) it is uploaded once to `<storage root>/imports/<sha256>/`, which later runs reuse.
- A hub name `org/name[@revision]` is downloaded through huggingface_hub's cache (only config.json and the
  safetensors; from the cache alone with HF_HUB_OFFLINE), then treated as a local folder.

Identity: each file's sha256 (the hub cache names an LFS file's blob by its sha256, so hub downloads are not read
twice; other local files are hashed while read), or on S3 its ETag (reading a 140 GB checkpoint only to hash it
would take longer than the import); the record's `sha256` hashes that list, so two runs that started from the same
bytes say so. Only safetensors are read (https://huggingface.co/docs/safetensors): a checkpoint of pickled
`pytorch_model.bin` files is refused with the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from hlat.core.config import HlatConfig
from hlat.core.init_from import model_fields
from hlat.core.layout import (
    CONFIG_FILE,  # a run's config.json; a HF checkpoint's has the same name
    IMPORT_RECORD,
    import_folder,
)
from hlat.core.models import family_of
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.infra.inputs.tokenizer import hub_snapshot

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
COMPLETE = "COMPLETE"
HUB_PATTERNS = [CONFIG_FILE, "*.safetensors", INDEX_FILE]
FIX = (
    "point model.init_from at a local folder, an s3:// prefix or a Hugging Face hub name (org/name[@revision]) "
    f"holding a LlamaForCausalLM or GPTNeoXForCausalLM checkpoint ({CONFIG_FILE} and safetensors), or remove it to "
    "start from a random initialisation"
)
_LOCAL = ("/", "./", "../", "~", "file://")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 22


def locate(source: str) -> tuple[Storage, dict[str, Any]]:
    """The folder holding `source`'s files, and where they came from: {"from": "s3" | "local" | "hub", "revision"
    (hub: the commit)}."""
    if source.startswith("s3://"):
        return Storage(source), {"from": "s3", "revision": None}
    if os.path.isdir(os.path.expanduser(source)) or source.startswith(_LOCAL):
        folder = os.path.abspath(os.path.expanduser(source.removeprefix("file://")))
        if not os.path.isdir(folder):
            raise ValueError(f"model.init_from={source!r}: no such folder; {FIX}")
        return Storage(folder), {"from": "local", "revision": None}
    snapshot = hub_snapshot(source, HUB_PATTERNS, "model.init_from", FIX)
    return Storage(snapshot), {"from": "hub", "revision": os.path.basename(os.path.normpath(snapshot))}


def weight_files(folder: Storage, source: str) -> list[str]:
    """config.json and the safetensors files a checkpoint folder holds: the index and the shards its weight_map
    names, or the single model.safetensors. ValueError naming model.init_from and the fix otherwise."""
    present = set(folder.list()) if folder.exists() else set()
    if CONFIG_FILE not in present:
        raise ValueError(f"model.init_from={source!r}: {folder.uri()} has no {CONFIG_FILE}; {FIX}")
    if INDEX_FILE in present:
        shards = sorted(set(folder.read_json(INDEX_FILE)["weight_map"].values()))
        missing = [name for name in shards if name not in present]
        if missing:
            raise ValueError(
                f"model.init_from={source!r}: {INDEX_FILE} names {len(missing)} shard file(s) the folder lacks "
                f"({', '.join(missing[:3])}); copy the whole checkpoint"
            )
        return [CONFIG_FILE, INDEX_FILE, *shards]
    if SINGLE_FILE in present:
        return [CONFIG_FILE, SINGLE_FILE]
    pickled = sorted(name for name in present if name.endswith(".bin"))
    what = f"only pickled weights ({', '.join(pickled[:2])}): convert them to safetensors" if pickled else FIX
    raise ValueError(f"model.init_from={source!r}: no {SINGLE_FILE} or {INDEX_FILE} in {folder.uri()}; {what}")


def file_identity(folder: Storage, name: str) -> dict[str, Any]:
    """{"name", "bytes", and "sha256" (local) or "etag" (S3)} of one file (the module docstring)."""
    if not folder.is_local:
        info = folder.fs.info(folder.path(name))
        return {"name": name, "bytes": int(info["size"]), "etag": str(info.get("ETag", "")).strip('"')}
    path = folder.path(name)
    blob = os.path.basename(os.path.realpath(path))
    if os.path.islink(path) and _SHA256.fullmatch(blob):  # the hub cache's LFS blob: named by its sha256
        return {"name": name, "bytes": os.path.getsize(path), "sha256": blob}
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return {"name": name, "bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def files_sha256(files: list[dict[str, Any]]) -> str:
    """One hash over the files' identities (name, size, sha256 or ETag), in name order."""
    lines = json.dumps(sorted(files, key=lambda f: f["name"]), sort_keys=True)
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def readable_location(folder: Storage, names: list[str], run: Run, sha256: str) -> str:
    """Where the jobs read the weights: the folder itself, unless the run is on S3 and the folder on this machine's
    disk; then the copy under `<storage root>/imports/<sha256>/` (uploaded once, COMPLETE written last, so a copy
    that an earlier attempt left half-done is written again)."""
    if run.storage.is_local or not folder.is_local:
        return folder.url
    target = import_folder(run.root, sha256)
    if not target.exists(COMPLETE):
        for name in names:
            target.put_file(folder.path(name), name)
        target.write_json(COMPLETE, {"sha256": sha256, "files": names})
    return target.url


def import_checkpoint(config: HlatConfig, run: Run) -> dict[str, Any]:
    """Resolve config.model.init_from, check that hlat's model can hold it (its config.json, `model_fields`), and
    write the run's record (`IMPORT_RECORD`); returns the record. A record for the same source already in the run
    is kept (a re-run of the stage, a relaunch): the run started from those weights."""
    source = config.model.init_from
    if source is None:
        raise ValueError("import_checkpoint: model.init_from is not set")
    if run.storage.exists(IMPORT_RECORD):
        record: dict[str, Any] = run.storage.read_json(IMPORT_RECORD)
        if record.get("source") == source:
            return record
    folder, origin = locate(source)
    names = weight_files(folder, source)
    hf_config = folder.read_json(CONFIG_FILE)
    model_fields(hf_config, source)  # refuses what hlat's model cannot hold, before anything is copied
    files = [file_identity(folder, name) for name in names]
    sha256 = files_sha256(files)
    record = {
        "source": source,
        **origin,
        "location": readable_location(folder, names, run, sha256),
        "config": hf_config,
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
        "sha256": sha256,
    }
    run.storage.write_json(IMPORT_RECORD, record)
    return record


def model_notes(config: HlatConfig) -> list[str]:
    """For the dry run and the plan, which price the model before any stage ran: where the jobs' model comes from
    when it is not all in the config (model.init_from's config.json, tokenizer.pretrained's vocabulary)."""
    from hlat.infra.inputs.tokenizer import vocabulary_note

    notes = []
    if (source := config.model.init_from) is not None:
        m = config.model
        family = family_of(m).name
        notes.append(
            f"weights: from model.init_from={source}; its config.json decides the model's family and shape once the "
            f"import has run (the train stage says what changed); these figures assume the config's {family} "
            f"({m.n_layers} layers, d_model {m.d_model}): set them to the checkpoint's for exact ones"
        )
    if (vocabulary := vocabulary_note(config)) is not None:
        notes.append(vocabulary)
    return notes


def peek(source: str) -> str:
    """What preflight says of model.init_from, reading only the small files: its config.json checked against hlat's
    families (`model_fields`) and, for a folder or prefix, its safetensors listed (`weight_files`); a hub name's
    config.json and index come through the hub cache, its weights not. ValueError (HubUnreachable for a hub that
    does not answer) as `import_checkpoint` would raise."""
    if source.startswith("s3://") or os.path.isdir(os.path.expanduser(source)) or source.startswith(_LOCAL):
        folder, origin = locate(source)
        names = weight_files(folder, source)
    else:
        folder = Storage(hub_snapshot(source, [CONFIG_FILE, INDEX_FILE], "model.init_from", FIX))
        origin = {"revision": os.path.basename(os.path.normpath(folder.url))}
        # Only what was asked for counts (a cache may hold more): the index's shards, when the model is sharded.
        names = sorted(set(folder.read_json(INDEX_FILE)["weight_map"].values())) if folder.exists(INDEX_FILE) else []
    fields = model_fields(folder.read_json(CONFIG_FILE), source)
    revision = f" at {origin['revision'][:12]}" if origin.get("revision") else ""
    shards = len([n for n in names if n.endswith(".safetensors")])
    files = f", {shards} safetensors file(s)" if shards else ""
    return f"{source}{revision}: {fields['arch']}, {fields['n_layers']} layers, d_model {fields['d_model']}{files}"
