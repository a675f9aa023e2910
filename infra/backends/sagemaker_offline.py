"""A boto3 session that sends nothing: what a dry run and the local backend's emulator build requests with.

Every AWS call made through it is recorded and answered here. Reads get plausible answers; writes are only
recorded (and uploads, optionally, kept).
"""

from __future__ import annotations

import copy
import json
import logging
import urllib.parse
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import boto3
from botocore.awsrequest import AWSResponse

log = logging.getLogger("hlat.sagemaker")

_READ_OPERATIONS = ("Get", "List", "Describe", "Head", "Simulate", "Search")
"""Operation name prefixes of calls that change nothing; dry_run reports the others."""


class OfflineAWS:
    """A boto3 session that sends nothing: every API call it makes is recorded and answered here.

    Handlers on botocore's event system do it: 'before-parameter-build' sees each call's API parameters (after the
    caller built them, before validation against the service model), and a 'before-call' handler that returns a
    (response, parsed) pair makes botocore skip the HTTP request. Reads the SageMaker SDK makes while building a
    request get plausible answers (the caller's identity, the role and its trust policy, the run's bucket, an
    allowed policy simulation); writes (S3 uploads, CreateTrainingJob) are only recorded. Clients must be created
    from `session` after construction: each client copies the session's handlers when it is created.

    `store(bucket, key, data)`, when given, receives the bytes of every upload (PutObject, or a multipart upload
    once completed): how the local backend's SageMaker emulator gets the source and driver channels a request names.
    """

    def __init__(
        self,
        region: str,
        role_arn: str,
        buckets: list[str],
        store: Callable[[str, str, bytes], None] | None = None,
    ) -> None:
        self.region = region
        self.store = store
        self._parts: dict[str, dict[int, bytes]] = {}
        self.role_arn = role_arn
        arn = role_arn.split(":")  # arn:aws:iam::<account>:role/<name>
        self.account = arn[4] if len(arn) > 5 and arn[4] else "123456789012"
        self.buckets = buckets
        self.calls: list[dict[str, Any]] = []
        # Static made-up credentials: nothing is signed, and no credential provider (SSO, instance metadata)
        # is ever consulted.
        self.session = boto3.Session(
            aws_access_key_id="hlat-dry-run", aws_secret_access_key="hlat-dry-run", region_name=region
        )
        self.session.events.register("before-parameter-build", self._record)
        self.session.events.register("before-call", self._answer)

    def requests(self) -> list[dict[str, Any]]:
        """The calls that would have changed something, in the order they were made."""
        return [c for c in self.calls if not c["operation"].startswith(_READ_OPERATIONS)]

    def _record(self, params: dict[str, Any], model: Any, context: dict[str, Any], **_: Any) -> None:
        # The request context travels from this event to 'before-call': it carries the parameters to _answer
        # (uploads run on several threads, so "the last call recorded" would not do).
        context["hlat_params"] = params
        recorded = {k: v for k, v in params.items() if k != "Body"}
        if "Body" in params:
            # Uploads are summarised: their bodies are the project's files, not worth repeating.
            recorded["Size"] = _body_size(params["Body"])
            if self.store is not None:
                self._keep(model.name, params)
        elif self.store is not None and model.name == "CompleteMultipartUpload":
            parts = self._parts.pop(str(params["UploadId"]), {})
            self.store(str(params["Bucket"]), str(params["Key"]), b"".join(parts[n] for n in sorted(parts)))
        self.calls.append(
            {
                "service": model.service_model.service_name,
                "operation": model.name,
                "params": copy.deepcopy(recorded),
            }
        )

    def _keep(self, operation: str, params: dict[str, Any]) -> None:
        assert self.store is not None
        body = params["Body"]
        data = bytes(body) if isinstance(body, bytes | bytearray) else body.read()
        if hasattr(body, "seek"):
            body.seek(0)
        if operation == "PutObject":
            self.store(str(params["Bucket"]), str(params["Key"]), data)
        elif operation == "UploadPart":
            self._parts.setdefault(str(params["UploadId"]), {})[int(params["PartNumber"])] = data

    def _answer(self, model: Any, context: dict[str, Any], **_: Any) -> tuple[AWSResponse, dict[str, Any]]:
        answer = self._canned(model.service_model.service_name, model.name, context.get("hlat_params", {}))
        return AWSResponse("https://hlat-dry-run.invalid", 200, {}, None), answer

    def _canned(self, service: str, operation: str, params: dict[str, Any]) -> dict[str, Any]:
        if operation == "GetCallerIdentity":
            return {
                "Account": self.account,
                "Arn": f"arn:aws:sts::{self.account}:assumed-role/hlat-dry-run/hlat",
                "UserId": "AROAHLATDRYRUN:hlat",
            }
        if operation == "GetRole":
            trust = {
                "Version": "2012-10-17",
                "Statement": [
                    {"Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"}, "Action": "sts:AssumeRole"}
                ],
            }
            name = params.get("RoleName", "hlat")
            arn = self.role_arn if self.role_arn.endswith(f"/{name}") else f"arn:aws:iam::{self.account}:role/{name}"
            return {
                "Role": {
                    "Path": "/",
                    "RoleName": name,
                    "RoleId": "AROAHLATDRYRUN",
                    "Arn": arn,
                    "CreateDate": datetime(2024, 1, 1, tzinfo=UTC),
                    # IAM returns the trust policy URL-encoded.
                    "AssumeRolePolicyDocument": urllib.parse.quote(json.dumps(trust)),
                }
            }
        if operation == "SimulatePrincipalPolicy":
            return {
                "EvaluationResults": [
                    {"EvalActionName": action, "EvalResourceName": "*", "EvalDecision": "allowed"}
                    for action in params.get("ActionNames", [])
                ],
                "IsTruncated": False,
            }
        if operation == "ListBuckets":
            created = datetime(2024, 1, 1, tzinfo=UTC)
            return {"Buckets": [{"Name": b, "CreationDate": created} for b in self.buckets], "Owner": {"ID": "hlat"}}
        if operation == "ListObjectsV2":
            return {"IsTruncated": False, "KeyCount": 0, "Name": params.get("Bucket", "")}
        if operation in ("PutObject", "UploadPart", "CompleteMultipartUpload"):
            return {"ETag": '"hlat-dry-run"'}
        if operation == "CreateMultipartUpload":
            # One id per object: s3transfer uploads several files at once, each in its own threads.
            upload_id = f"hlat-dry-run/{params.get('Bucket')}/{params.get('Key')}"
            return {"Bucket": params.get("Bucket"), "Key": params.get("Key"), "UploadId": upload_id}
        if operation == "CreateTrainingJob":
            name = params.get("TrainingJobName", "")
            return {"TrainingJobArn": f"arn:aws:sagemaker:{self.region}:{self.account}:training-job/{name}"}
        log.debug("dry run: no canned answer for %s %s; answering with an empty response", service, operation)
        return {}


def _body_size(body: Any) -> int | None:
    """Bytes in an upload's body: bytes, s3transfer's ReadFileChunk (both have a length) or a seekable file."""
    try:
        return len(body)
    except TypeError:
        pass
    try:
        here = body.tell()
        body.seek(0, 2)
        end = int(body.tell())
        body.seek(here)
        return end - int(here)
    except (AttributeError, OSError, ValueError):
        return None
