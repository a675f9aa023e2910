"""`hlat deploy` and `hlat worker`: register deployments/prefect.yaml and serve its work pool.

`hlat deploy` is `prefect deploy` on the project's file, from the project root, with three things added: the
work pool is created when missing (so the deployments are runnable at once), the `{{ $VAR }}` placeholders of
the deployments being registered are checked against the environment first (a missing one is named with what
it is for, instead of a literal '{{ $HLAT_S3_ROOT }}' landing in a deployment's parameters), and
HLAT_PROJECT_DIR, HLAT_GIT_REPOSITORY and HLAT_GIT_BRANCH default to this checkout.

`hlat worker` creates the pool when missing and then becomes `prefect worker start` (same process id, so a
supervisor or a test stops it with one signal).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

from training.config import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = PROJECT_ROOT / "deployments" / "prefect.yaml"
DEFAULT_POOL = "hlat"
POOL_TYPES = ("process", "ecs", "kubernetes")

ENV_HELP = {
    "HLAT_PROJECT_DIR": "the checkout local workers run the flows from",
    "HLAT_S3_ROOT": "the s3://bucket/prefix that holds AWS runs, e.g. HLAT_S3_ROOT=s3://my-bucket/hlat",
    "HLAT_GIT_REPOSITORY": "the git URL production workers clone (no 'origin' remote to default to)",
    "HLAT_GIT_BRANCH": "the branch production workers clone",
}


def _prefect() -> str:
    """The `prefect` executable of this environment (next to this Python), else the one on PATH."""
    beside = Path(sys.executable).with_name("prefect")
    return str(beside) if beside.exists() else (shutil.which("prefect") or "prefect")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def deploy_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment `prefect deploy` runs in: the caller's, with this checkout's defaults filled in."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("HLAT_PROJECT_DIR", str(PROJECT_ROOT))
    git_defaults = {
        "HLAT_GIT_REPOSITORY": ("remote", "get-url", "origin"),
        "HLAT_GIT_BRANCH": ("branch", "--show-current"),
    }
    for var, args in git_defaults.items():
        if var not in env and (value := _git(*args)):
            env[var] = value
    return env


def load_deployments(path: Path = PREFECT_FILE) -> tuple[list[dict[str, Any]], list[Any]]:
    """The deployments of a prefect.yaml (YAML anchors and merge keys resolved) and its default pull steps."""
    doc = yaml.safe_load(path.read_text())
    return list(doc.get("deployments") or []), list(doc.get("pull") or [])


def select(deployments: list[dict[str, Any]], patterns: Sequence[str]) -> list[dict[str, Any]]:
    """Deployments whose name matches any glob pattern, e.g. '*-tiny' or 'hlat/pretrain-*' (all when none)."""
    if not patterns:
        return deployments
    names = [p.rsplit("/", 1)[-1] for p in patterns]  # 'flow/deployment' or 'deployment'
    chosen = [d for d in deployments if any(fnmatch.fnmatch(d["name"], p) for p in names)]
    if not chosen:
        known = ", ".join(d["name"] for d in deployments)
        raise ConfigError(f"--name {' '.join(patterns)}: no deployment matches; {PREFECT_FILE.name} has {known}")
    return chosen


def missing_env(deployments: Iterable[dict[str, Any]], default_pull: list[Any], env: dict[str, str]) -> list[str]:
    """Environment variables that the deployments' `{{ $VAR }}` placeholders name and `env` lacks."""
    from prefect.utilities.templating import PlaceholderType, find_placeholders

    needed = {
        p.name.lstrip("$")
        for dep in deployments
        for p in find_placeholders({**dep, "pull": dep.get("pull", default_pull)})
        if p.type is PlaceholderType.ENV_VAR
    }
    return sorted(v for v in needed if not env.get(v))


class DeployError(RuntimeError):
    """A work pool could not be created (the message says why); the CLI prints it as one line."""


def api_url() -> str:
    """The Prefect API this process talks to; deploying to an ephemeral one would register nothing lasting."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ConfigError(
            "PREFECT_API_URL is not set: start a server (`prefect server start`) and run "
            "`prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api`, or `prefect cloud login`"
        )
    return str(url)


def ensure_pool(name: str, pool_type: str, env: dict[str, str]) -> str:
    """Create the work pool `name` of `pool_type` unless it exists; returns what was done."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            found = client.read_work_pool(name).type
        except ObjectNotFound:
            found = None
    if found is not None:
        note = "" if found == pool_type else f"; asked for {pool_type}, kept as it is"
        return f"exists (type {found}{note})"
    # The CLI fills in the worker type's default base job template.
    create = subprocess.run(
        [_prefect(), "--no-prompt", "work-pool", "create", name, "--type", pool_type],
        env=env,
        capture_output=True,
        text=True,
    )
    if create.returncode != 0:
        detail = (create.stderr or create.stdout).strip().splitlines()[-1:] or ["no output"]
        hint = " (the kubernetes type needs `pip install prefect-kubernetes`)" if pool_type == "kubernetes" else ""
        raise DeployError(f"could not create work pool {name!r} of type {pool_type}{hint}: {detail[0]}")
    return f"created (type {pool_type})"


def deploy(patterns: Sequence[str] = (), pool_type: str = "process", prefect_file: Path = PREFECT_FILE) -> int:
    """Check, create the pool, then `prefect deploy` the selected deployments of `prefect_file`."""
    api = api_url()
    env = deploy_env()
    deployments, default_pull = load_deployments(prefect_file)
    chosen = select(deployments, patterns)
    missing = missing_env(chosen, default_pull, env)
    if missing:
        lines = "; ".join(f"{v}: {ENV_HELP.get(v, 'named by a {{ $' + v + ' }} placeholder')}" for v in missing)
        hint = " (or deploy the local ones only: hlat deploy --name '*-tiny')" if "HLAT_S3_ROOT" in missing else ""
        raise ConfigError(f"set {', '.join(missing)} before deploying {len(chosen)} deployment(s): {lines}{hint}")
    for pool in sorted({(d.get("work_pool") or {}).get("name", DEFAULT_POOL) for d in chosen}):
        print(f"hlat: work pool {pool!r}: {ensure_pool(pool, pool_type, env)}")
    cmd = [_prefect(), "--no-prompt", "deploy", "--prefect-file", str(prefect_file)]
    cmd += ["--all"] if not patterns else [a for d in chosen for a in ("--name", d["name"])]
    print(f"hlat: deploying {len(chosen)} deployment(s) to {api}", flush=True)
    return subprocess.run(cmd, cwd=PROJECT_ROOT, env=env).returncode


def worker(
    pool: str = DEFAULT_POOL, pool_type: str = "process", limit: int | None = None, name: str | None = None
) -> NoReturn:
    """Create the pool if missing, then replace this process with `prefect worker start` on it."""
    api_url()
    env = deploy_env()
    print(f"hlat: work pool {pool!r}: {ensure_pool(pool, pool_type, env)}", flush=True)
    cmd = [_prefect(), "worker", "start", "--pool", pool]  # the worker type follows the pool's own
    if limit is not None:
        cmd += ["--limit", str(limit)]
    if name:
        cmd += ["--name", name]
    os.chdir(PROJECT_ROOT)
    os.execvpe(cmd[0], cmd, env)
