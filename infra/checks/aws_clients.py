"""How the preflight's AWS checks make their clients and read AWS's errors.

Clients come from boto3's default chain, as the job backends build theirs, with few retries and short timeouts. A
refusal is one of `DENIED`; `unexpected` turns any other answer into one finding line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import boto3
from botocore.config import Config

from hlat.infra.checks.findings import Finding

DENIED = ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "UnrecognizedClientException")
"""The error codes of a refusal: the check is denied to the caller, not failed by the account."""


def client_config(attempts: int = 2) -> Any:
    """botocore settings of every preflight client: `attempts` tries, short timeouts."""
    return Config(
        retries={"mode": "standard", "max_attempts": attempts},
        connect_timeout=5,
        read_timeout=15,
        user_agent_extra="hlat",
    )


def boto_session(region: str | None) -> Any:
    """A session of boto3's default chain, in `region` where given."""
    return boto3.Session(region_name=region) if region else boto3.Session()


def error_code(exc: Any) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__))


def error_message(exc: Any) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Message", exc))[:200]


ClientFactory = Callable[[str], Any]
"""A service's client by its name ('s3', 'iam', ...), made once per preflight."""


def unexpected(check: str, exc: Exception) -> Finding:
    """An unexpected answer, in one line. A refusal fails the check. No usable answer fails the caller's side, but
    leaves quotas and plans unverified."""
    status = int(getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    answered = hasattr(exc, "response") and status < 500
    if answered:
        return Finding(check, False, f"{error_code(exc)}: {error_message(exc)}")
    soft = check in ("quota", "training-plan")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    why = f"{type(exc).__name__}: {text}"[:160]
    return Finding(check, soft, f"no answer ({why})" + (", not checked" if soft else ""), checked=not soft)
