"""`hlat deploy` and `hlat worker`: register deployments/prefect.yaml and serve its work pool.

`hlat deploy` is `prefect deploy` on the project's file, from the project root, with these things added: the
work pool is created when missing (so the deployments are runnable at once) and an existing pool of another
type than --type is an error (not silently kept); the `{{ $VAR }}` placeholders of the deployments being
registered are checked against the environment first (a missing one is named with what it is for, instead of a
literal '{{ $HLAT_S3_ROOT }}' landing in a deployment's parameters); HLAT_PROJECT_DIR, HLAT_GIT_REPOSITORY and
HLAT_GIT_BRANCH default to this checkout; and with --type ecs or kubernetes and no --name, the deployments that
run from this checkout (no git clone in their pull steps), which such a worker cannot reach, are left out.
Last, the registered deployments' parameter forms are made submittable as they open: an optional parameter
(`run_id`, `storage`, `step`) is drawn as its type alone, and its `"default": null` is taken out of the stored
schema, since the UI would fill the field with that null and then refuse it as not a string (or integer).

`hlat worker` creates the pool when missing (or refuses one of another type) and then becomes `prefect worker
start` (same process id, so a supervisor or a test stops it with one signal: SIGINT or SIGTERM, which Prefect
turns into SIGINT; SIGINT is reset to its default first, since a worker started in the background by a
non-interactive shell inherits it ignored and would then ignore SIGTERM as well).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import httpx
import yaml

from hlat.core.config import ConfigError

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


# Pull steps that fetch the flow code from somewhere (a git clone, remote storage, a block): a deployment with
# none of them runs from the checkout its `set_working_directory` step names, on the worker's own machine.
_FETCHING_STEPS = ("git_clone", "pull_from_", "pull_with_")


def runs_from_checkout(deployment: dict[str, Any], default_pull: list[Any]) -> bool:
    """Whether a deployment's pull steps (its own, else the file's) only point at a local folder."""
    steps = deployment.get("pull", default_pull) or []
    names = [str(name).rsplit(".", 1)[-1] for step in steps if isinstance(step, dict) for name in step]
    return not any(n.startswith(_FETCHING_STEPS) for n in names)


def default_selection(
    deployments: list[dict[str, Any]], default_pull: list[Any], pool_type: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What `hlat deploy` without --name registers on a pool of `pool_type`, and what it leaves out.

    A process pool gets every deployment. An ecs or kubernetes pool runs each flow run in a fresh container,
    where a local checkout's path means nothing: the deployments that run from it are left out.
    """
    if pool_type == "process":
        return deployments, []
    local = [d for d in deployments if runs_from_checkout(d, default_pull)]
    return [d for d in deployments if d not in local], local


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
    """A work pool could not be created, or is of another type (the message says why); the CLI prints it as one
    line."""


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


API_WAIT_SECONDS = 90.0


def wait_for_api(url: str, timeout: float = API_WAIT_SECONDS) -> None:
    """Wait until the Prefect API at `url` answers its health check: a server started a moment ago with
    `prefect server start --background` takes some 20 s to answer on 2 cores."""
    import time
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            with opener.open(f"{url.rstrip('/')}/health", timeout=5):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise DeployError(
                    f"cannot reach the Prefect API at {url} ({exc}): start the server, or set PREFECT_API_URL to "
                    "the one you use"
                ) from exc
        if not said:
            print(f"hlat: waiting for the Prefect API at {url} (up to {timeout:.0f} s)", flush=True)
            said = True
        time.sleep(1)


def existing_pool_type(name: str) -> str | None:
    """The type of the work pool `name`, or None when there is no such pool."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            return str(client.read_work_pool(name).type)
    except ObjectNotFound:
        return None
    except (OSError, httpx.TransportError) as exc:
        raise DeployError(
            f"cannot reach the Prefect API at {api_url()} ({type(exc).__name__}: {exc}): start the server, or set "
            "PREFECT_API_URL to the one you use"
        ) from exc


def _existing_type(pools: Iterable[str]) -> str | None:
    """The type of the first of `pools` that exists; None if none does or the API is not reached (the checks that
    follow say what is wrong more usefully)."""
    try:
        return next((t for p in sorted(pools) if (t := existing_pool_type(p))), None)
    except DeployError:
        return None


def ensure_pool(name: str, pool_type: str | None, env: dict[str, str]) -> str:
    """Create the work pool `name` of `pool_type` (None: process) unless it exists; returns what was done.

    An existing pool of another type than the one asked for is an error: its worker would run the flows elsewhere
    than asked (a process pool asked for as ecs runs them on the worker's host, from paths a container would not
    have). With no type asked for, an existing pool is taken as it is.
    """
    found = existing_pool_type(name)
    if found is not None and pool_type is not None and found != pool_type:
        raise DeployError(
            f"work pool {name!r} exists with type {found}, not {pool_type}: use --type {found}, or delete it "
            f"(`prefect work-pool delete {name}`) and run this again to create it as {pool_type}"
        )
    if found is not None:
        return f"exists (type {found})"
    pool_type = pool_type or "process"
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


def deploy(patterns: Sequence[str] = (), pool_type: str | None = None, prefect_file: Path = PREFECT_FILE) -> int:
    """Check, create the pool, then `prefect deploy` the selected deployments of `prefect_file`. `pool_type`
    None: the existing pool's type, or process for a new pool."""
    api = api_url()
    env = deploy_env()
    deployments, default_pull = load_deployments(prefect_file)
    skipped: list[dict[str, Any]] = []
    if patterns:
        chosen = select(deployments, patterns)
    else:
        pools = {(d.get("work_pool") or {}).get("name", DEFAULT_POOL) for d in deployments}
        kind = pool_type or _existing_type(pools) or "process"
        chosen, skipped = default_selection(deployments, default_pull, kind)
        if not chosen:
            raise ConfigError(
                f"every deployment of {prefect_file.name} runs from this checkout, which {kind} workers "
                "cannot reach: name the ones to deploy anyway with --name, or deploy them with --type process"
            )
    missing = missing_env(chosen, default_pull, env)
    if missing:
        lines = "; ".join(f"{v}: {ENV_HELP.get(v, 'named by a {{ $' + v + ' }} placeholder')}" for v in missing)
        hint = " (or deploy the local ones only: hlat deploy --name '*-tiny')" if "HLAT_S3_ROOT" in missing else ""
        raise ConfigError(f"set {', '.join(missing)} before deploying {len(chosen)} deployment(s): {lines}{hint}")
    wait_for_api(api)
    chosen_pools = sorted({(d.get("work_pool") or {}).get("name", DEFAULT_POOL) for d in chosen})
    for pool in chosen_pools:
        print(f"hlat: work pool {pool!r}: {ensure_pool(pool, pool_type, env)}")
    cmd = [_prefect(), "--no-prompt", "deploy", "--prefect-file", str(prefect_file)]
    if skipped:
        names = ", ".join(d["name"] for d in skipped)
        print(
            f"hlat: skipping {len(skipped)} deployment(s) that run from this checkout, which {kind} workers "
            f"cannot reach: {names} (deploy them anyway with --name, e.g. --name '*-tiny')"
        )
    everything = not patterns and not skipped
    cmd += ["--all"] if everything else [a for d in chosen for a in ("--name", d["name"])]
    print(f"hlat: deploying {len(chosen)} deployment(s) to {api}", flush=True)
    code = run_prefect_deploy(cmd, env)
    if code == 0:
        submittable_forms([d["name"] for d in chosen])
        for pool in chosen_pools:
            print(f"hlat: to run them, start a worker on pool {pool!r} in another terminal: hlat worker --pool {pool}")
    return code


def run_prefect_deploy(cmd: list[str], env: dict[str, str]) -> int:
    """Run `prefect deploy`, its output shown as it comes less the repeated worker advice; its exit code."""
    with subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in without_worker_hints(proc.stdout):
            print(line, end="", flush=True)
    return proc.returncode


def without_worker_hints(lines: Iterable[str]) -> Iterator[str]:
    """`prefect deploy`'s output less its advice to start a worker, which it repeats after every deployment (with
    Prefect's command, where `hlat worker` is the one to use here): said once, by `deploy`, at the end."""
    skipping = False
    for line in lines:
        if line.lstrip().startswith("To execute flow runs from th"):
            skipping = True
        if not skipping:
            yield line
        elif "prefect worker start" in line:
            skipping = False


def form_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A deployment's parameter schema without the `"default": null` of its optional typed parameters (see the
    module's docstring); what a field left empty means is said in its description."""
    properties = {
        name: {k: v for k, v in prop.items() if not (k == "default" and v is None and "type" in prop)}
        for name, prop in schema.get("properties", {}).items()
    }
    return {**schema, "properties": properties}


def submittable_forms(names: Sequence[str]) -> None:
    """Store `form_schema` of each named deployment's parameter schema (as `prefect deploy` registered it)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with get_client(sync_client=True) as client:
        found = client.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=list(names))))
        for deployment in found:
            schema = deployment.parameter_openapi_schema or {}
            fixed = form_schema(schema)
            if fixed != schema:
                client.update_deployment(deployment.id, DeploymentUpdate(parameter_openapi_schema=fixed))


def worker(
    pool: str = DEFAULT_POOL, pool_type: str | None = None, limit: int | None = None, name: str | None = None
) -> NoReturn:
    """Create the pool if missing, then replace this process with `prefect worker start` on it.

    SIGINT is reset to its default before the exec (a handled signal would be reset by the exec anyway; an
    ignored one would stay ignored): Prefect's worker stops on SIGTERM by sending itself SIGINT, so an inherited
    SIG_IGN, as `hlat worker &` in a script or a supervisor's shell gives, would make it ignore SIGTERM too.
    """
    wait_for_api(api_url())
    env = deploy_env()
    print(f"hlat: work pool {pool!r}: {ensure_pool(pool, pool_type, env)}", flush=True)
    cmd = [_prefect(), "worker", "start", "--pool", pool]  # the worker type follows the pool's own
    if limit is not None:
        cmd += ["--limit", str(limit)]
    if name:
        cmd += ["--name", name]
    os.chdir(PROJECT_ROOT)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.execvpe(cmd[0], cmd, env)
