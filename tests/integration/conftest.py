"""Real S3 for integration tests: moto servers on 127.0.0.1, reached over HTTP by boto3 and s3fs.

- `s3_server` (session): a `ThreadedMotoServer` in this process, IAM not enforced.
- `s3_env` (function): fake credentials and AWS_ENDPOINT_URL pointing at `s3_server`, plus a fresh bucket.
- `iam_s3_server` (session): a second moto server in a *subprocess* that enforces IAM. moto reads
  `settings.INITIAL_NO_AUTH_ACTION_COUNT` from the environment at import time and keeps it (and the request
  counter) process-global, so enforcing IAM in-process would also affect `s3_server`; a separate process keeps
  the two apart. Its first few unauthenticated actions create a bucket, a user whose policy allows only
  another bucket, and that user's access key.
- `s3_denied` (function): the environment of that restricted user.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

REGION = "us-east-1"
FAKE_KEY = "testing"

# Every variable through which botocore/aiobotocore could find credentials or a profile other than ours.
AWS_CREDENTIAL_VARS = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_ENDPOINT_URL_S3",
    "AWS_S3_ENDPOINT",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_up(endpoint: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll a moto server's /moto-api/ (which does not count as an action for IAM) until it answers."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"moto server at {endpoint} exited with code {proc.returncode}")
        try:
            with opener.open(f"{endpoint}/moto-api/", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            last = exc
            time.sleep(0.05)
    raise RuntimeError(f"moto server at {endpoint} did not answer within {timeout:.0f}s: {last}")


def s3_client(endpoint: str, key: str = FAKE_KEY, secret: str = FAKE_KEY, service: str = "s3") -> Any:
    """A boto3 client for a moto server, with explicit endpoint and credentials (not the environment's)."""
    return boto3.client(
        service,
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
    )


def clear_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in AWS_CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)


def set_aws_env(monkeypatch: pytest.MonkeyPatch, endpoint: str, key: str, secret: str) -> None:
    clear_aws_env(monkeypatch)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    # Never wait on an instance-metadata service that is not there.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@dataclass(frozen=True)
class S3Env:
    endpoint: str
    bucket: str
    url: str

    def client(self, service: str = "s3") -> Any:
        return s3_client(self.endpoint, service=service)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A real moto S3 server on 127.0.0.1 (IAM not enforced); yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(endpoint)
        yield endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> S3Env:
    """Fake credentials and AWS_ENDPOINT_URL for `s3_server`, and a fresh, uniquely named bucket."""
    set_aws_env(monkeypatch, s3_server, FAKE_KEY, FAKE_KEY)
    bucket = f"hlat-test-{uuid.uuid4().hex[:12]}"
    s3_client(s3_server).create_bucket(Bucket=bucket)
    return S3Env(endpoint=s3_server, bucket=bucket, url=f"s3://{bucket}/prefix")


@pytest.fixture
def s3_no_credentials(s3_env: S3Env, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3Env:
    """The `s3_env` bucket with no credentials anywhere botocore looks, and no metadata service to wait on."""
    clear_aws_env(monkeypatch)
    empty_credentials = tmp_path / "aws-credentials"
    empty_config = tmp_path / "aws-config"
    empty_credentials.write_text("")
    empty_config.write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty_credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty_config))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint)
    return s3_env


@pytest.fixture(scope="session")
def make_s3_client() -> Any:
    """`make_s3_client(endpoint, key=..., secret=..., service="s3")`: a boto3 client for a moto server."""
    return s3_client


@dataclass(frozen=True)
class IamS3:
    endpoint: str
    denied_bucket: str
    allowed_bucket: str
    key: str
    secret: str


# Unauthenticated actions the IAM server grants before it enforces IAM: create_bucket, create_user,
# put_user_policy, create_access_key (see `iam_s3_server`). Every later request must be signed by a known key
# and allowed by its policies.
_SETUP_ACTIONS = 4


@contextlib.contextmanager
def moto_process(folder: Path, **env: str) -> Iterator[str]:
    """A moto server of its own on a free port (its log in `folder`, shown if the block fails), with `env` added to
    its environment (the caller's AWS_* variables left out); yields its endpoint, stopped afterwards."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    script = Path(sys.executable).with_name("moto_server")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "moto.server"]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | env
    log_path = folder / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)], env=environment, stdout=log, stderr=log)
    try:
        wait_until_up(endpoint, proc=proc)
        yield endpoint
    except Exception:
        sys.stderr.write(log_path.read_text(errors="replace")[-4000:])
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            shutil.rmtree(folder)


@pytest.fixture(scope="session")
def iam_s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IamS3]:
    folder = tmp_path_factory.mktemp("iam-moto")
    with moto_process(folder, INITIAL_NO_AUTH_ACTION_COUNT=str(_SETUP_ACTIONS)) as endpoint:
        denied = f"hlat-denied-{uuid.uuid4().hex[:8]}"
        allowed = f"hlat-allowed-{uuid.uuid4().hex[:8]}"
        user = "hlat-restricted"
        # The four unauthenticated actions.
        s3_client(endpoint).create_bucket(Bucket=denied)
        iam = s3_client(endpoint, service="iam")
        iam.create_user(UserName=user)
        policy = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Action": "s3:*",
                    "Resource": [f"arn:aws:s3:::{allowed}", f"arn:aws:s3:::{allowed}/*"],
                }
            ],
        }
        iam.put_user_policy(UserName=user, PolicyName="only-allowed", PolicyDocument=json.dumps(policy))
        access = iam.create_access_key(UserName=user)["AccessKey"]
        key, secret = access["AccessKeyId"], access["SecretAccessKey"]
        # From here on IAM is enforced: the user's own key creates the bucket its policy allows.
        s3_client(endpoint, key, secret).create_bucket(Bucket=allowed)
        yield IamS3(endpoint=endpoint, denied_bucket=denied, allowed_bucket=allowed, key=key, secret=secret)


@pytest.fixture
def s3_denied(iam_s3_server: IamS3, monkeypatch: pytest.MonkeyPatch) -> IamS3:
    """The environment of a user allowed `allowed_bucket` and nothing else, on the IAM-enforcing server."""
    set_aws_env(monkeypatch, iam_s3_server.endpoint, iam_s3_server.key, iam_s3_server.secret)
    return iam_s3_server


@pytest.fixture
def guarded_prefect_server() -> Iterator[str]:
    """A temporary Prefect server with its authentication on (PREFECT_SERVER_API_AUTH_STRING), and this process's
    Prefect settings pointing at it with the matching PREFECT_API_AUTH_STRING; yields the auth string. Per test
    (~10 s): it stands beside the session's open server, whose settings come back when it stops."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_SERVER_API_AUTH_STRING, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    auth = f"hlat:{uuid.uuid4().hex}"
    with (
        temporary_settings({PREFECT_SERVER_API_AUTH_STRING: auth, PREFECT_API_AUTH_STRING: auth}),
        prefect_test_harness(server_startup_timeout=120),
    ):
        yield auth
