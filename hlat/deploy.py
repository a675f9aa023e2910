"""`hlat deploy` and `hlat worker`: register deployments/prefect.yaml and serve its work pool.

`hlat deploy` is `prefect deploy` plus checks and defaults: the pool exists with the asked type, placeholders are set,
AWS work sits behind a guarded API, and parameter forms are submittable. With a stack it also fills what a user would
hand-edit, and creates the alert automations. docs/deployments.md is the user's guide.
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import boto3
import httpx
import yaml
from botocore.exceptions import BotoCoreError, ClientError

from hlat.core.config import ConfigError
from hlat.core.presets import load_config
from hlat.flows.params import overrides_dict
from hlat.infra.backends.run_roles import BOUNDARY_ENV, PATH_ENV
from hlat.infra.backends.sagemaker_source import EGRESS_ENV
from hlat.pools import DEFAULT_POOL
from hlat.tasks.alerts import alerts_settings, block_document_id, sync_automations

# Prefect is imported in the functions that talk to its API: hlat.tasks, imported above, sets Prefect's environment
# when it loads, and must come before it.

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = PROJECT_ROOT / "deployments" / "prefect.yaml"

IMAGE_CODE_DIR = "/opt/hlat"
"""The worker image's WORKDIR, where container pools find the AWS deployments' code."""
WORKER_DOCKERFILE = PROJECT_ROOT / "deployments" / "worker.Dockerfile"
ROLE_SECRET = "hlat-sagemaker-role"
"""The Prefect Secret block the AWS deployments name in job.role_arn_secret (deployments/prefect.yaml)."""
FLOW_RUN_CPU, FLOW_RUN_MEMORY = 4096, 16384
"""The ECS flow-run task's size; AWS presets train their tokenizer sample in the flow run."""

ENV_HELP = {
    "HLAT_PROJECT_DIR": "the checkout local workers run the flows from",
    "HLAT_S3_ROOT": "the s3://bucket/prefix that holds AWS runs, e.g. HLAT_S3_ROOT=s3://my-bucket/hlat (or --stack)",
    "HLAT_CODE_DIR": f"where the AWS deployments' code is ({IMAGE_CODE_DIR} in the worker image, or a checkout)",
}


def _prefect() -> str:
    """This environment's `prefect` executable, else the one on PATH."""
    beside = Path(sys.executable).with_name("prefect")
    return str(beside) if beside.exists() else (shutil.which("prefect") or "prefect")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def deploy_env(environ: dict[str, str] | None = None, pool_type: str = "process") -> dict[str, str]:
    """The caller's environment plus this checkout's defaults; HLAT_CODE_DIR suits the pool type."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("HLAT_PROJECT_DIR", str(PROJECT_ROOT))
    env.setdefault("HLAT_CODE_DIR", str(PROJECT_ROOT) if pool_type == "process" else IMAGE_CODE_DIR)
    return env


def load_deployments(path: Path = PREFECT_FILE) -> tuple[list[dict[str, Any]], list[Any]]:
    """A prefect.yaml's deployments (anchors and merge keys resolved) and its default pull steps."""
    doc = yaml.safe_load(path.read_text())
    return list(doc.get("deployments") or []), list(doc.get("pull") or [])


def select(deployments: list[dict[str, Any]], patterns: Sequence[str]) -> list[dict[str, Any]]:
    """Deployments whose name matches any glob (all when none), e.g. '*-tiny'."""
    if not patterns:
        return deployments
    names = [p.rsplit("/", 1)[-1] for p in patterns]  # 'flow/deployment' or 'deployment'
    chosen = [d for d in deployments if any(fnmatch.fnmatch(d["name"], p) for p in names)]
    if not chosen:
        known = ", ".join(d["name"] for d in deployments)
        raise ConfigError(f"--name {' '.join(patterns)}: no deployment matches; {PREFECT_FILE.name} has {known}")
    return chosen


# Pull steps that fetch the flow code from somewhere (a git clone, remote storage, a block).
_FETCHING_STEPS = ("git_clone", "pull_from_", "pull_with_")
_IMAGE_DIRS = ("{{ $HLAT_CODE_DIR }}", IMAGE_CODE_DIR)


def code_source(deployment: dict[str, Any], default_pull: list[Any]) -> str:
    """Where a deployment's flow code comes from, by its pull steps: 'remote', 'image' or 'checkout'."""
    steps = [step for step in deployment.get("pull", default_pull) or [] if isinstance(step, dict)]
    names = [str(name).rsplit(".", 1)[-1] for step in steps for name in step]
    if any(n.startswith(_FETCHING_STEPS) for n in names):
        return "remote"
    folders = [
        str((args or {}).get("directory", ""))
        for step in steps
        for name, args in step.items()
        if str(name).endswith("set_working_directory")
    ]
    image_dirs = {d.replace(" ", "") for d in _IMAGE_DIRS}
    return "image" if folders and all(f.replace(" ", "") in image_dirs for f in folders) else "checkout"


def runs_from_checkout(deployment: dict[str, Any], default_pull: list[Any]) -> bool:
    return code_source(deployment, default_pull) == "checkout"


def default_selection(
    deployments: list[dict[str, Any]], default_pull: list[Any], pool_type: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What `hlat deploy` without --name registers on a `pool_type` pool, and what it leaves out.

    Container pools leave out deployments that run from this checkout, whose path means nothing there."""
    if pool_type == "process":
        return deployments, []
    local = [d for d in deployments if runs_from_checkout(d, default_pull)]
    return [d for d in deployments if d not in local], local


def missing_env(deployments: Iterable[dict[str, Any]], default_pull: list[Any], env: dict[str, str]) -> list[str]:
    """Variables named by the deployments' `{{ $VAR }}` placeholders that `env` lacks."""
    from prefect.utilities.templating import PlaceholderType, find_placeholders

    needed = {
        p.name.lstrip("$")
        for dep in deployments
        for p in find_placeholders({**dep, "pull": dep.get("pull", default_pull)})
        if p.type is PlaceholderType.ENV_VAR
    }
    return sorted(v for v in needed if not env.get(v))


class DeployError(RuntimeError):
    """A work pool could not be created, or has another type; one line."""


def api_url() -> str:
    """The Prefect API this process talks to; an ephemeral one would register nothing lasting."""
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
    """Wait until the API at `url` passes its health check (a fresh background server takes ~20 s)."""
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


def api_guarded(url: str) -> bool:
    """Whether the API at `url` refuses an unauthenticated listing (401 or 403); the health check is always open."""
    opener = httpx.Client(trust_env=False, timeout=10)
    try:
        with opener:
            answer = opener.post(f"{url.rstrip('/')}/flows/filter", json={"limit": 1})
    except httpx.HTTPError as exc:
        raise DeployError(f"cannot reach the Prefect API at {url} ({type(exc).__name__}: {exc})") from exc
    if answer.status_code in (401, 403):
        return True
    if answer.is_success:
        return False
    raise DeployError(f"the Prefect API at {url} answered {answer.status_code} to a flow listing: is it Prefect's API?")


def loopback(url: str) -> bool:
    """Whether `url`'s host is this machine's loopback."""
    host = httpx.URL(url).host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def aws_deployments(deployments: Iterable[dict[str, Any]]) -> list[str]:
    """The deployments whose storage is an s3:// root (HLAT_S3_ROOT)."""
    return [d["name"] for d in deployments if "HLAT_S3_ROOT" in str((d.get("parameters") or {}).get("storage", ""))]


def check_api_guarded(url: str, exposed: str | None, pool_type: str, allow_open: bool) -> None:
    """Refuse to put AWS work (`exposed`) behind a Prefect API anyone reaching it may use.

    An open API is a door to the account. A loopback API serving a process pool is exempt. `allow_open` overrides."""
    if exposed is None or allow_open or (pool_type == "process" and loopback(url)):
        return
    if api_guarded(url):
        return
    raise DeployError(
        f"the Prefect API at {url} answers without credentials, and {exposed} would let anyone who reaches it start "
        "SageMaker jobs: turn its authentication on (PREFECT_SERVER_API_AUTH_STRING on the server, "
        'PREFECT_API_AUTH_STRING here; docs/deployments.md, "Deploy to AWS", step 2) or use Prefect Cloud, or pass '
        "--allow-open-server"
    )


def exposed_deployments(deployments: Iterable[dict[str, Any]]) -> str | None:
    """'N AWS deployment(s) (names)' that registering `deployments` exposes, or None."""
    names = aws_deployments(deployments)
    if not names:
        return None
    return f"{len(names)} AWS deployment(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"


def existing_pool_type(name: str) -> str | None:
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
    """The type of the first existing pool of `pools`; None if none, or if the API is unreachable."""
    try:
        return next((t for p in sorted(pools) if (t := existing_pool_type(p))), None)
    except DeployError:
        return None


def ensure_pool(
    name: str, pool_type: str | None, env: dict[str, str], base_job_template: dict[str, Any] | None = None
) -> str:
    """Create the work pool `name` of `pool_type` (None: process) unless it exists; return what was done.

    An existing pool of another type is an error: its worker would run flows elsewhere. `base_job_template`
    replaces the pool's own either way."""
    found = existing_pool_type(name)
    if found is not None and pool_type is not None and found != pool_type:
        raise DeployError(
            f"work pool {name!r} exists with type {found}, not {pool_type}: use --type {found}, or delete it "
            f"(`prefect work-pool delete {name}`) and run this again to create it as {pool_type}"
        )
    if base_job_template is not None:
        return _set_pool_template(name, found or pool_type or "process", base_job_template, create=found is None)
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


def _set_pool_template(name: str, pool_type: str, template: dict[str, Any], create: bool) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import PrefectHTTPStatusError

    try:
        with get_client(sync_client=True) as client:
            if create:
                client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=template))
            else:
                client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))
    except PrefectHTTPStatusError as exc:
        verb = "create" if create else "update"
        raise DeployError(f"could not {verb} work pool {name!r} of type {pool_type}: {exc.response.text}") from exc
    if create:
        return f"created (type {pool_type}), base job template from the stack"
    return f"exists (type {pool_type}), base job template set from the stack"


def deploy(
    patterns: Sequence[str] = (),
    pool_type: str | None = None,
    prefect_file: Path = PREFECT_FILE,
    stack: str | None = None,
    region: str | None = None,
    alerts_block: str | None = None,
    allow_open_server: bool = False,
) -> int:
    """Check, create the pool, then `prefect deploy` the selected deployments of `prefect_file`.

    `pool_type` None: the existing pool's type, else process (ecs with a `stack`). With `stack`, the stack's outputs
    fill HLAT_S3_ROOT, the role secret and the ECS template; its worker image must be pushed. A notification block
    gets the alert automations."""
    api = api_url()
    deployments, default_pull = load_deployments(prefect_file)
    pools = {(d.get("work_pool") or {}).get("name", DEFAULT_POOL) for d in deployments}
    account = read_stack(stack, region) if stack else None
    if account is not None and pool_type is None:
        pool_type = "ecs"
    kind = pool_type or _existing_type(pools) or "process"
    env = deploy_env(pool_type=kind)
    if account is not None:
        env.setdefault("HLAT_S3_ROOT", account.outputs["RunsRoot"])
    skipped: list[dict[str, Any]] = []
    if patterns:
        chosen = select(deployments, patterns)
    else:
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
    alerts = deployment_alerts(chosen, alerts_block or env.get("HLAT_ALERTS_BLOCK") or None)
    template = None
    if account is not None and kind == "ecs":
        image = worker_image(account)
        template = ecs_job_template(account, pinned(image, check_pushed(account, image)), flow_run_secrets(account))
    wait_for_api(api)
    check_api_guarded(api, exposed_deployments(chosen), kind, allow_open_server)
    if alerts is not None:  # a block that is not there fails before anything is registered
        block_document_id(alerts[0])
    chosen_pools = sorted({(d.get("work_pool") or {}).get("name", DEFAULT_POOL) for d in chosen})
    for pool in chosen_pools:
        print(f"hlat: work pool {pool!r}: {ensure_pool(pool, pool_type, env, template)}")
    if template is not None:
        image = template["job_configuration"]["task_definition"]["containerDefinitions"][0]["image"]
        print(f"hlat: flow runs use the worker image {image}")
    if account is not None:
        print(f"hlat: Secret block {ROLE_SECRET!r}: {save_role_secret(account.outputs['SageMakerExecutionRoleArn'])}")
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
        if alerts is not None:
            block, stalled_minutes = alerts
            print(f"hlat: alerts through the notification block {block!r}:")
            for line in sync_automations(block, stalled_minutes):
                print(f"hlat:   automation {line}")
        for pool in chosen_pools:
            print(f"hlat: to run them, start a worker on pool {pool!r} in another terminal: hlat worker --pool {pool}")
    return code


def deployment_alerts(deployments: Iterable[dict[str, Any]], block: str | None) -> tuple[str, float] | None:
    """The alert automations' block and stall window from the deployments' configs and `block`; None: no alerts."""
    configs = {}
    for dep in deployments:
        params = dep.get("parameters") or {}
        try:
            config = load_config(params.get("preset") or "tiny", overrides_dict(params.get("overrides")))
        except (ConfigError, ValueError) as exc:
            raise ConfigError(f"deployment {dep['name']}: its config does not build: {exc}") from exc
        configs[str(dep["name"])] = config.alerts
    return alerts_settings(configs, block)


def run_prefect_deploy(cmd: list[str], env: dict[str, str]) -> int:
    """Run `prefect deploy` less its repeated worker advice; return its exit code."""
    with subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in without_worker_hints(proc.stdout):
            print(line, end="", flush=True)
    return proc.returncode


def without_worker_hints(lines: Iterable[str]) -> Iterator[str]:
    """`prefect deploy`'s output less its advice to start a worker; `deploy` says it once."""
    skipping = False
    for line in lines:
        if line.lstrip().startswith("To execute flow runs from th"):
            skipping = True
        if not skipping:
            yield line
        elif "prefect worker start" in line:
            skipping = False


def form_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A parameter schema without its optional parameters' `"default": null`, which the UI would fill then refuse."""
    properties = {
        name: {k: v for k, v in prop.items() if not (k == "default" and v is None and "type" in prop)}
        for name, prop in schema.get("properties", {}).items()
    }
    return {**schema, "properties": properties}


def submittable_forms(names: Sequence[str]) -> None:
    """Store `form_schema` of each named deployment's registered parameter schema."""
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


# -- the AWS account as code (deployments/account.yaml) ---------------------------------------------------------
STACK_OUTPUTS = (
    "RunsRoot",
    "SageMakerExecutionRoleArn",
    "FlowRunRoleArn",
    "TaskExecutionRoleArn",
    "WorkerRepositoryUri",
    "ClusterName",
    "FlowRunLogGroup",
    "VpcId",
    "SubnetIds",
    "AssignPublicIp",
)
CREATE_STACK = (
    "aws cloudformation deploy --stack-name {stack} --template-file deployments/account.yaml "
    "--capabilities CAPABILITY_NAMED_IAM --parameter-overrides BucketName=<a new bucket name>"
)


_USABLE_STACK_STATUSES = ("CREATE_COMPLETE", "UPDATE_COMPLETE", "UPDATE_ROLLBACK_COMPLETE", "IMPORT_COMPLETE")


@dataclass(frozen=True)
class Stack:
    name: str
    region: str
    outputs: dict[str, str]


def _aws_error(exc: Exception) -> str:
    if isinstance(exc, ClientError):
        return f"{exc.response['Error'].get('Code', '?')}: {exc.response['Error'].get('Message', '')}".rstrip(": ")
    return f"{type(exc).__name__}: {exc}"


def read_stack(name: str, region: str | None = None, session: Any = None) -> Stack:
    """The outputs of the CloudFormation stack `name`, or a one-line error saying why not."""
    session = session or boto3.Session(region_name=region)
    where = session.region_name or "no region"
    if not session.region_name:
        raise DeployError(f"--stack {name}: no AWS region: pass --region or set AWS_DEFAULT_REGION")
    try:
        found = session.client("cloudformation").describe_stacks(StackName=name)["Stacks"][0]
    except ClientError as exc:
        if "does not exist" in str(exc):
            raise DeployError(
                f"--stack {name}: no such stack in {where}: create it with `{CREATE_STACK.format(stack=name)}`"
            ) from exc
        raise DeployError(f"--stack {name}: cannot read it in {where} ({_aws_error(exc)})") from exc
    except BotoCoreError as exc:
        raise DeployError(f"--stack {name}: cannot read it in {where} ({_aws_error(exc)})") from exc
    status = str(found.get("StackStatus", ""))
    if status not in _USABLE_STACK_STATUSES:
        raise DeployError(f"--stack {name}: its status is {status}: fix it (see its events) and run this again")
    outputs = {o["OutputKey"]: o.get("OutputValue", "") for o in found.get("Outputs", [])}
    missing = [k for k in STACK_OUTPUTS if k not in outputs]
    if missing:
        raise DeployError(
            f"--stack {name}: no output {', '.join(missing)}: it is not made from deployments/account.yaml "
            f"(update it with `{CREATE_STACK.format(stack=name)}`)"
        )
    return Stack(name, where, outputs)


def image_tag() -> str:
    """The worker image's tag: HLAT_WORKER_TAG, else the commit, plus `-dirty-<digest>` with tracked changes."""
    if tag := os.environ.get("HLAT_WORKER_TAG"):
        return tag
    commit = _git("rev-parse", "--short=12", "HEAD")
    if commit is None:
        raise DeployError(f"{PROJECT_ROOT} is not a git checkout: set HLAT_WORKER_TAG to the worker image's tag")
    if not _git("status", "--porcelain", "--untracked-files=no"):
        return commit
    changes = _git("diff", "HEAD", "--binary") or ""
    return f"{commit}-dirty-{hashlib.sha256(changes.encode()).hexdigest()[:10]}"


def worker_image(stack: Stack, tag: str | None = None) -> str:
    return f"{stack.outputs['WorkerRepositoryUri']}:{tag or image_tag()}"


def pinned(image: str, digest: str) -> str:
    """`repository:tag` as `repository@digest`, so the pool runs exactly the image checked."""
    return f"{image.rsplit(':', 1)[0]}@{digest}"


def check_pushed(stack: Stack, image: str, session: Any = None) -> str:
    """Refuse a worker image not in ECR; return its digest."""
    repository, tag = image.split("/", 1)[1].rsplit(":", 1)
    ecr = (session or boto3.Session(region_name=stack.region)).client("ecr")
    try:
        found = ecr.describe_images(repositoryName=repository, imageIds=[{"imageTag": tag}])
    except ClientError as exc:
        if exc.response["Error"].get("Code") in ("ImageNotFoundException", "RepositoryNotFoundException"):
            raise DeployError(
                f"the worker image {image} is not in ECR: build and push it first with "
                f"`deployments/push-worker-image.sh --stack {stack.name}` (the flow runs run its code)"
            ) from exc
        raise DeployError(f"cannot check the worker image {image} ({_aws_error(exc)})") from exc
    except BotoCoreError as exc:
        raise DeployError(f"cannot check the worker image {image} ({_aws_error(exc)})") from exc
    return str(found["imageDetails"][0]["imageDigest"])


FIXED_ECS_VARIABLES = (
    "image", "command", "env", "task_role_arn", "execution_role_arn", "task_definition_arn", "aws_credentials",
    "cluster", "vpc_id", "network_configuration", "launch_type", "capacity_provider_strategy", "family",
    "container_name", "configure_cloudwatch_logs", "cloudwatch_logs_options", "cloudwatch_logs_prefix",
    "prefect_api_key_secret_arn", "prefect_api_auth_string_secret_arn", "auto_deregister_task_definition",
)  # fmt: skip
"""What the ECS pool's template fixes, so no run's job variables can change it.

A run may set only cpu, memory, labels, name and task-definition housekeeping."""
FLOW_RUN_COMMAND = "prefect flow-run execute"


SECRET_ENV_PREFIX = "env/"
"""A secret `<stack>/env/<NAME>` becomes the flow runs' variable NAME (HF_TOKEN, WANDB_API_KEY, ...)."""
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def flow_run_secrets(stack: Stack, session: Any = None) -> list[dict[str, str]]:
    """The flow runs' ECS `secrets`, one ARN per secret `<stack>/env/<NAME>`, listed at deploy time."""
    prefix = f"{stack.name}/{SECRET_ENV_PREFIX}"
    client = (session or boto3.Session(region_name=stack.region)).client("secretsmanager")
    found: list[dict[str, str]] = []
    try:
        for page in client.get_paginator("list_secrets").paginate(Filters=[{"Key": "name", "Values": [prefix]}]):
            for secret in page["SecretList"]:
                name = secret["Name"]
                variable = name[len(prefix) :]
                if not name.startswith(prefix) or not _ENV_NAME.fullmatch(variable):
                    continue  # the filter matches prefixes of words too; a name that is no variable is not ours
                found.append({"name": variable, "valueFrom": secret["ARN"]})
    except (BotoCoreError, ClientError) as exc:
        raise DeployError(f"cannot list the flow runs' secrets {prefix}* ({_aws_error(exc)})") from exc
    return sorted(found, key=lambda s: s["name"])


def ecs_job_template(stack: Stack, image: str, secrets: Sequence[dict[str, str]] = ()) -> dict[str, Any]:
    """The ECS pool's base job template: prefect-aws's own, filled from the stack.

    `FIXED_ECS_VARIABLES` are written in and removed from its variables, so no run can set them. Secrets travel as
    ARNs."""
    from prefect_aws.workers.ecs_worker import ECSWorker

    out = stack.outputs
    template: dict[str, Any] = ECSWorker.get_default_base_job_template()
    env = {"AWS_DEFAULT_REGION": stack.region}
    ceilings = (("MaxRunBudgetUsd", "HLAT_MAX_BUDGET_USD"), ("MaxJobInstances", "HLAT_MAX_INSTANCES"))
    run_roles = (("RunRoleBoundaryArn", BOUNDARY_ENV), ("RunRolePath", PATH_ENV))
    for output, variable in (*ceilings, *run_roles):
        if out.get(output):
            env[variable] = out[output]
    if out.get("JobEgress") == "aws-endpoints":
        env[EGRESS_ENV] = "aws-endpoints"
    values: dict[str, Any] = {
        "image": image,
        "command": FLOW_RUN_COMMAND,
        "cluster": out["ClusterName"],
        "task_role_arn": out["FlowRunRoleArn"],
        "execution_role_arn": out["TaskExecutionRoleArn"],
        "cpu": FLOW_RUN_CPU,
        "memory": FLOW_RUN_MEMORY,
        "configure_cloudwatch_logs": True,
        "cloudwatch_logs_options": {"awslogs-group": out["FlowRunLogGroup"], "awslogs-region": stack.region},
        "env": env,
        "launch_type": "FARGATE",
        "container_name": "prefect",  # prefect-aws's default name
        "vpc_id": out["VpcId"] or None,
        "auto_deregister_task_definition": False,  # the worker's policy has no DeregisterTaskDefinition
    }
    if out.get("PrefectApiSecretArn"):
        key = (
            "prefect_api_key_secret_arn"
            if out.get("PrefectAuth") == "api-key"
            else "prefect_api_auth_string_secret_arn"
        )
        values[key] = out["PrefectApiSecretArn"]
    subnets = [s for s in out["SubnetIds"].split(",") if s]
    if out["VpcId"] and subnets:  # else prefect-aws takes every subnet of the VPC
        values["network_configuration"] = {
            "subnets": subnets,
            "assignPublicIp": out["AssignPublicIp"] or "ENABLED",
            "securityGroups": [],
        }
    properties = template["variables"]["properties"]
    for key, value in values.items():
        assert key in properties, f"prefect-aws's ECS template has no variable {key}"
        if key not in FIXED_ECS_VARIABLES:
            properties[key]["default"] = value
    fixed = {key: values.get(key) for key in FIXED_ECS_VARIABLES}
    template["job_configuration"] = _fill(template["job_configuration"], fixed)
    if secrets:
        (container,) = template["job_configuration"]["task_definition"]["containerDefinitions"]
        container["secrets"] = [dict(s) for s in secrets]
    for key in FIXED_ECS_VARIABLES:
        properties.pop(key, None)
    template["variables"]["additionalProperties"] = False
    return template


_UNSET = object()


def _fill(node: Any, fixed: dict[str, Any]) -> Any:
    """`node` with each `{{ key }}` of `fixed` filled in; keys whose value is None are dropped."""
    if isinstance(node, dict):
        filled = {k: _fill(v, fixed) for k, v in node.items()}
        return {k: v for k, v in filled.items() if v is not _UNSET}
    if isinstance(node, list):
        return [v for v in (_fill(item, fixed) for item in node) if v is not _UNSET]
    if isinstance(node, str):
        match = re.fullmatch(r"\{\{\s*(\w+)\s*\}\}", node)
        if match and match.group(1) in fixed:
            value = fixed[match.group(1)]
            return _UNSET if value is None else value
    return node


def save_role_secret(role_arn: str, name: str = ROLE_SECRET) -> str:
    """Save the execution role's ARN in the AWS deployments' Secret block; return what was done."""
    from prefect.blocks.system import Secret

    try:
        found = Secret.load(name)
    except ValueError:  # no such block yet
        found = None
    if isinstance(found, Secret) and found.get() == role_arn:
        return "unchanged"
    Secret(value=role_arn).save(name, overwrite=True)
    return "set to the stack's SageMaker execution role"


WORKER_BASE = "python:3.11-slim"
"""The worker image's base, pinned by digest at build; HLAT_WORKER_BASE=name@sha256:... overrides it."""


def base_digest(docker: str, pull: list[str]) -> str:
    """Pull the base and return it as `name@sha256:...`."""
    name = pull[-1]
    try:
        pulled = subprocess.run(pull, capture_output=True, text=True, check=False)
        if pulled.returncode != 0:
            raise DeployError(f"`{' '.join(pull)}` failed: {(pulled.stderr or pulled.stdout).strip()[-300:]}")
        inspect = [docker, "image", "inspect", "--format", "{{json .RepoDigests}}", name]
        found = subprocess.run(inspect, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise DeployError(f"{docker}: not found: install Docker (with buildx) to build the worker image") from exc
    digests = json.loads(found.stdout or "[]") if found.returncode == 0 else []
    repository = name.split(":", 1)[0]
    for digest in digests:
        if digest.split("@", 1)[0].endswith(repository.rsplit("/", 1)[-1]):
            return str(digest)
    raise DeployError(f"no digest for the base image {name} after pulling it: set HLAT_WORKER_BASE=<name>@sha256:...")


def push_worker_image(
    stack: Stack, tag: str | None = None, dry_run: bool = False, docker: str = "docker", session: Any = None
) -> str:
    """Build the worker image for Fargate, tag it with the commit and push it to the stack's ECR; return it.

    `dry_run` prints the commands. The registry password never appears in output or on a command line."""
    image = worker_image(stack, tag)
    registry = image.split("/", 1)[0]
    version = image.rsplit(":", 1)[1]
    base = os.environ.get("HLAT_WORKER_BASE") or WORKER_BASE
    pull = [docker, "pull", "--platform", "linux/amd64", base]
    if dry_run:
        pinned_base = base if "@sha256:" in base else f"<the digest `{' '.join(pull)}` gives>"
    else:
        pinned_base = base if "@sha256:" in base else base_digest(docker, pull)
    build = [docker, "build", "--platform", "linux/amd64", "-f", str(WORKER_DOCKERFILE.relative_to(PROJECT_ROOT))]
    build += ["--build-arg", f"PYTHON_BASE={pinned_base}", "--build-arg", f"HLAT_CODE_VERSION={version}"]
    build += ["-t", image, "."]
    login = [docker, "login", "--username", "AWS", "--password-stdin", registry]
    steps: list[tuple[list[str], str | None]] = [(build, None), (login, "password"), ([docker, "push", image], None)]
    if dry_run:
        if "@sha256:" not in base:
            print(" ".join(pull))
        for cmd, _ in steps:
            print(" ".join(cmd) + (" < (ECR password)" if "--password-stdin" in cmd else ""))
        return image
    password = None
    for cmd, stdin in steps:
        if stdin == "password":
            if password is None:
                ecr = (session or boto3.Session(region_name=stack.region)).client("ecr")
                try:
                    token = ecr.get_authorization_token()["authorizationData"][0]["authorizationToken"]
                except (BotoCoreError, ClientError) as exc:
                    raise DeployError(f"cannot log in to ECR {registry} ({_aws_error(exc)})") from exc
                password = base64.b64decode(token).decode().split(":", 1)[1]
            stdin = password
        print(f"hlat: {' '.join(cmd[:2])} ...", flush=True)
        try:
            done = subprocess.run(cmd, cwd=PROJECT_ROOT, input=stdin, text=True, check=False)
        except FileNotFoundError as exc:
            raise DeployError(f"{docker}: not found: install Docker (with buildx) to build the worker image") from exc
        if done.returncode != 0:
            raise DeployError(f"`{' '.join(cmd[:2])}` failed with exit code {done.returncode} (its output is above)")
    print(f"hlat: pushed {image}")
    return image


def push_image_main(argv: Sequence[str] | None = None) -> int:
    """deployments/push-worker-image.sh: `--stack NAME [--region R] [--tag T] [--dry-run]`."""
    parser = argparse.ArgumentParser(
        prog="push-worker-image.sh", description="build the worker image from this checkout and push it to ECR"
    )
    parser.add_argument("--stack", required=True, help="the CloudFormation stack of deployments/account.yaml")
    parser.add_argument("--region", help="its region (default: boto3's, e.g. AWS_DEFAULT_REGION)")
    parser.add_argument("--tag", help="the image tag (default: the checkout's commit, -dirty if changed)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    args = parser.parse_args(argv)
    try:
        push_worker_image(read_stack(args.stack, args.region), tag=args.tag, dry_run=args.dry_run)
    except DeployError as exc:
        print(f"push-worker-image.sh: error: {exc}", file=sys.stderr)
        return 1
    return 0


def worker(
    pool: str = DEFAULT_POOL,
    pool_type: str | None = None,
    limit: int | None = None,
    name: str | None = None,
    stack: str | None = None,
    region: str | None = None,
    allow_open_server: bool = False,
) -> NoReturn:
    """Create the pool if missing, then exec `prefect worker start` on it.

    SIGINT is reset first: the worker stops on SIGTERM by sending itself SIGINT, so an inherited SIG_IGN would
    make it ignore SIGTERM. With `stack`, the pool gets `deploy`'s template."""
    template = None
    if stack:  # as `deploy` does: the ECS pool's template from the account stack
        account = read_stack(stack, region)
        pool_type = pool_type or "ecs"
        if pool_type == "ecs":
            image = worker_image(account)
            digest = check_pushed(account, image)
            template = ecs_job_template(account, pinned(image, digest), flow_run_secrets(account))
    wait_for_api(api_url())
    if template is not None:  # the ECS pool's flow runs, which start SageMaker jobs
        check_api_guarded(api_url(), f"the ECS pool {pool!r}", "ecs", allow_open_server)
    env = deploy_env(pool_type=pool_type or "process")
    print(f"hlat: work pool {pool!r}: {ensure_pool(pool, pool_type, env, template)}", flush=True)
    cmd = [_prefect(), "worker", "start", "--pool", pool]  # the worker type follows the pool's own
    if limit is not None:
        cmd += ["--limit", str(limit)]
    if name:
        cmd += ["--name", name]
    os.chdir(PROJECT_ROOT)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.execvpe(cmd[0], cmd, env)
