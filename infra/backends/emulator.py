"""A multi-host SageMaker training job on this machine: the local backend's emulator of SageMaker's side.

It runs the sagemaker backend's own request. Each instance gets its own namespaces, /opt/ml, /tmp and home. Containers
get their job role's credentials, never the caller's. Needs Linux namespaces; one job at a time (docs/multi-host.md).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from hlat.core.config import JobConfig
from hlat.core.layout import SOURCES_DIR
from hlat.core.storage import Storage, storage_errors
from hlat.infra.backends.protocol import JobSpec

LOCAL_BUCKET = "hlat-local"
"""The bucket a local run's folders appear under in an emulated request; its keys are absolute paths."""
MASTER_PORT = 7777
"""SageMaker's master port, fixed by the SDK's drivers (container_drivers/scripts/environment.py, SM_MASTER_PORT)."""
LOCAL_ROLE = "arn:aws:iam::000000000000:role/hlat-local-emulator"
LOCAL_IMAGE = "hlat-local/job-python:latest"
VALIDATED_AS = "ml.m5.xlarge"
"""The SageMaker instance type 'local' stands for when a request is checked against the service model."""
NETWORK_INTERFACE = "lo"
GROUP_NAME = "homogeneousCluster"
HOST_SETUP = Path(__file__).with_name("emulated_host.py")
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
"""The project's source tree, from which the job's Python imports hlat."""
HOST_ENV = "HLAT_LOCAL_HOST"
"""Every process of an emulated instance carries its host name here; tests kill one host's processes by it."""


def request_uri(run_uri: str) -> str:
    """How a run's folder appears in a request: as it is on S3, under LOCAL_BUCKET when local."""
    if "://" in run_uri:
        return run_uri.rstrip("/")
    return f"s3://{LOCAL_BUCKET}{os.path.abspath(run_uri)}"


def storage_of(uri: str) -> Storage:
    prefix = f"s3://{LOCAL_BUCKET}/"
    if uri.startswith(prefix):
        return Storage("/" + uri[len(prefix) :].rstrip("/"))
    return Storage(uri.rstrip("/"))


def _store_all(uploads: dict[str, bytes]) -> None:
    """The SDK's uploads (~150 small files), stored where the request names them, in one concurrent batch on S3."""
    local = {uri: data for uri, data in uploads.items() if storage_of(uri).is_local}
    for uri, data in local.items():
        folder, _, name = uri.rpartition("/")
        storage_of(folder).write_bytes(name, data)
    remote = {storage_of(uri).path(): data for uri, data in uploads.items() if uri not in local}
    if remote:
        any_uri = next(uri for uri in uploads if uri not in local)
        fs = storage_of(any_uri).fs
        with storage_errors(any_uri.rsplit("/", 1)[0]):
            fs.pipe(remote)


def build_request(spec: JobSpec, job: JobConfig, upload: bool = True) -> dict[str, Any]:
    """The CreateTrainingJob request the emulator runs for `spec`, from the sagemaker backend's own builder.

    It is checked whole as SageMaker would. The SDK's uploads go to run storage unless `upload` is off."""
    from hlat.infra.backends.sagemaker_offline import OfflineAWS
    from hlat.infra.backends.sagemaker_request import build_request
    from hlat.infra.backends.sagemaker_validation import validate_request

    emulated = job.model_copy(update={"role_arn": LOCAL_ROLE, "role_arn_secret": None, "image_uri": LOCAL_IMAGE})
    request_spec = replace(spec, run_uri=request_uri(spec.run_uri), image_uri=LOCAL_IMAGE)
    bucket = request_spec.run_uri.split("/")[2]
    uploads: dict[str, bytes] = {}

    def keep(bucket: str, key: str, data: bytes) -> None:
        uploads[f"s3://{bucket}/{key}"] = data

    offline = OfflineAWS(job.region, LOCAL_ROLE, [bucket], store=keep if upload else None)
    request = build_request(request_spec, emulated, offline.session, requirements=None, validated_as=VALIDATED_AS)
    validate_request(request, spec.stage, validated_as=VALIDATED_AS)
    _store_all(uploads)
    return request


@cache
def namespaces_available() -> str | None:
    """None when this machine can run emulated hosts, else why not (with the fix)."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return "emulated hosts need Linux and util-linux's unshare"
    probe = subprocess.run(
        [*_unshare(), "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if probe.returncode != 0:
        return (
            f"emulated hosts need Linux namespaces, and unshare failed here ({probe.stderr.strip()}): run as root, "
            "or enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)"
        )
    return None


def _unshare() -> list[str]:
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--mount", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc"]


def master_port_free() -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", MASTER_PORT))
        except OSError:
            return False
    return True


def host_names(request: Mapping[str, Any]) -> list[str]:
    return [f"algo-{i + 1}" for i in range(int(request["ResourceConfig"]["InstanceCount"]))]


@dataclass
class HostTree:
    name: str
    root: str

    @property
    def ml(self) -> str:
        return os.path.join(self.root, "opt", "ml")

    def path(self, *parts: str) -> str:
        return os.path.join(self.ml, *parts)

    @property
    def private(self) -> str:
        return os.path.join(self.root, "private")


def _write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)


def prepare_host(request: Mapping[str, Any], host: HostTree, hosts: list[str]) -> int:
    """Lay out the instance's /opt/ml as SageMaker does before its container starts; the bytes it received."""
    instance_type = request["ResourceConfig"]["InstanceType"]
    _write_json(
        host.path("input", "config", "resourceconfig.json"),
        {
            "current_host": host.name,
            "current_instance_type": instance_type,
            "current_group_name": GROUP_NAME,
            "hosts": hosts,
            "instance_groups": [{"instance_group_name": GROUP_NAME, "instance_type": instance_type, "hosts": hosts}],
            "network_interface_name": NETWORK_INTERFACE,
        },
    )
    _write_json(host.path("input", "config", "hyperparameters.json"), dict(request.get("HyperParameters") or {}))
    channels = list(request.get("InputDataConfig") or [])
    _write_json(
        host.path("input", "config", "inputdataconfig.json"),
        {
            c["ChannelName"]: {
                "TrainingInputMode": c.get("InputMode", "File"),
                "S3DistributionType": c["DataSource"]["S3DataSource"].get("S3DataDistributionType", "FullyReplicated"),
                "RecordWrapperType": "None",
            }
            for c in channels
        },
    )
    for folder in ("model", "output/data", "output/tensorboard", "input/data"):
        os.makedirs(host.path(*folder.split("/")), exist_ok=True)
    received = 0
    for channel in channels:
        source = storage_of(channel["DataSource"]["S3DataSource"]["S3Uri"])
        target = host.path("input", "data", channel["ChannelName"])
        if channel.get("InputMode") == "FastFile" and source.is_local:
            os.symlink(source.path(), target)  # a mount: nothing is copied before the program reads it
            continue
        received += copy_tree(source, target)
    return received


def copy_tree(source: Storage, target: str) -> int:
    """Copy every file under `source` into the local folder `target`; return the bytes copied.

    From S3 it is one batch of concurrent GETs."""
    os.makedirs(target, exist_ok=True)
    files = source.walk_files()
    paths = [os.path.join(target, rel) for rel in files]
    if source.is_local:
        for rel, path in zip(files, paths, strict=True):
            source.get_file(rel, path)
    elif files:
        with storage_errors(source.url):
            source.fs.get([source.path(rel) for rel in files], paths)
    return sum(os.path.getsize(path) for path in paths)


def hosts_file(job_dir: str, hosts: list[str]) -> str:
    """/etc/hosts of every emulated instance: this machine's, plus each algo-N at the loopback."""
    path = os.path.join(job_dir, "hosts", "etc-hosts")
    try:
        with open("/etc/hosts", encoding="utf-8") as fh:
            base = fh.read()
    except OSError:
        base = "127.0.0.1 localhost\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(base.rstrip("\n") + "\n" + "".join(f"127.0.0.1 {h}\n" for h in hosts))
    return path


def container_command(request: Mapping[str, Any]) -> list[str]:
    algorithm = request["AlgorithmSpecification"]
    return [*(algorithm.get("ContainerEntrypoint") or []), *(algorithm.get("ContainerArguments") or [])]


PASSED_ON = ("AWS_", "HLAT_", "HF_", "OMP_", "MKL_", "TORCH", "GLOO_", "NCCL_", "PJRT_", "XLA_", "NEURON_", "LC_")
"""What of this machine's environment a container gets: AWS endpoints and settings, project switches, threads,
devices.

Nothing else and no credentials: the SDK's environment.py logs every variable, and the job's log reaches the flow's."""
CREDENTIALS = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
)  # fmt: skip
"""Where botocore finds credentials (https://docs.aws.amazon.com/sdkref/latest/guide/settings-reference.html).

The caller's never reach a container, which gets its job's role instead."""
ROLE_SESSION_S = 43_200
"""The longest session STS AssumeRole grants
(https://docs.aws.amazon.com/STS/latest/APIReference/API_AssumeRole.html)."""


def run_on_s3(request: Mapping[str, Any]) -> bool:
    """Whether the request's input channels are on S3, not a local run's folders."""
    uris = [c["DataSource"]["S3DataSource"]["S3Uri"] for c in request.get("InputDataConfig") or []]
    return any(not uri.startswith(f"s3://{LOCAL_BUCKET}/") for uri in uris)


def role_credentials(request: Mapping[str, Any], base: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """The AWS credentials an emulated container gets, and where they come from.

    As on SageMaker, the request's role, never the caller's keys. A local run gets none; an S3 run assumes the
    role through STS, and fails to start if it cannot."""
    if not run_on_s3(request):
        return {}, "none (a local run)"
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    endpoint = base.get("AWS_ENDPOINT_URL_STS") or base.get("AWS_ENDPOINT_URL") or None
    region = base.get("AWS_REGION") or base.get("AWS_DEFAULT_REGION") or "us-east-1"
    duration = min(ROLE_SESSION_S, max(900, int(request["StoppingCondition"]["MaxRuntimeInSeconds"]) + 3600))
    sts = boto3.client("sts", endpoint_url=endpoint, region_name=region)
    role = str(request["RoleArn"])
    session = str(request["TrainingJobName"])[:64]
    try:
        granted = sts.assume_role(RoleArn=role, RoleSessionName=session, DurationSeconds=duration)
    except (ClientError, BotoCoreError) as exc:
        raise RuntimeError(
            f"the emulated job's containers run as its role {role}, never on the caller's credentials, and the "
            f"caller may not assume it ({exc}): let this principal assume it in the role's trust policy, or run "
            "the emulated job on local storage"
        ) from None
    credentials = granted["Credentials"]
    env = {
        "AWS_ACCESS_KEY_ID": credentials["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": credentials["SecretAccessKey"],
        "AWS_SESSION_TOKEN": credentials["SessionToken"],
    }
    return env, f"STS AssumeRole of {role} at {endpoint} (key {credentials['AccessKeyId']})"


def container_environment(
    request: Mapping[str, Any],
    base: Mapping[str, str],
    host: str,
    python: str,
    processes: int,
    credentials: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The container's environment: PASSED_ON, the role's credentials, the request's Environment and SageMaker's own."""
    name = str(request["TrainingJobName"])
    plain = {"PATH", "LANG", "USER", "TZ"}
    env = {k: v for k, v in base.items() if (k in plain or k.startswith(PASSED_ON)) and k not in CREDENTIALS}
    env.update(credentials or {})
    env.update(request.get("Environment") or {})
    region = env.get("AWS_REGION", "us-west-2")
    env.update(
        {
            "TRAINING_JOB_NAME": name,
            "TRAINING_JOB_ARN": f"arn:aws:sagemaker:{region}:000000000000:training-job/{name}",
            HOST_ENV: host,
            "HOME": "/root",
            # The image: the job's Python environment first, so that python3, pip and torchrun are its own.
            "PATH": os.pathsep.join([os.path.dirname(python), env.get("PATH", os.defpath)]),
        }
    )
    if "OMP_NUM_THREADS" not in env:  # N instances share this machine's cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
    return env


def host_command(host: HostTree, hosts_path: str, command: list[str], keep: list[str] | None = None) -> list[str]:
    """The command that starts an emulated instance: new namespaces and private folders, keeping `keep`."""
    private = ["--private", host.private, *(a for path in keep or [] for a in ("--keep", path))]
    return [*_unshare(), sys.executable, str(HOST_SETUP), *private, host.ml, hosts_path, host.name, "--", *command]


def reachable(request: Mapping[str, Any], python: str) -> list[str]:
    """What a container must still reach under its private /tmp and home.

    The job's Python and the project's code, the emulator's interpreter, the local folders the request names under
    LOCAL_BUCKET, and the prepared sources beside such a run (core.layout.SOURCES_DIR)."""
    paths = {PROJECT_ROOT, sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(sys.executable))}
    for interpreter in (python, os.path.realpath(python)):
        paths.add(os.path.dirname(os.path.dirname(os.path.abspath(interpreter))))
    prefix = f"s3://{LOCAL_BUCKET}/"
    for text in _strings(request):
        if text.startswith(prefix):
            path = storage_of(text).path()
            paths.add(path if os.path.exists(path) else os.path.dirname(path))
            beside = next((p / SOURCES_DIR for p in Path(path).parents if (p / SOURCES_DIR).is_dir()), None)
            if beside is not None:
                paths.add(str(beside))
    return sorted(str(p) for p in paths)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def init_pid(launcher_pid: int) -> int | None:
    """The root-namespace pid of an emulated instance's PID 1 (unshare's one child), once it exists."""
    try:
        with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children", encoding="utf-8") as fh:
            children = fh.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None
