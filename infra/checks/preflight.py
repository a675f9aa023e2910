"""The live preflight of a run: what AWS and the data source answer, asked before anything is spent.

`source_findings` checks, for every run, that the corpus, tokenizer and init weights can be read. `aws_findings` checks
a SageMaker run's identity, role, PassRole, storage, images, quotas and plan. Each check is one `Finding` line; a
failure names its fix. A check this account cannot make is "not verified" (`checked=False`), never a failure. Clients
come from boto3's default chain in `job.region`, as the job backends build theirs. No Prefect here. docs/deployments.md
("Preflight") lists every check."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from hlat.core.config import ConfigError, DataConfig, HlatConfig
from hlat.core.stages import job_stages, setting, training_stage
from hlat.core.stages import stages as stage_rows

SAGEMAKER_SERVICE = "sagemaker.amazonaws.com"
PROBE_NAME = ".hlat-preflight-"
"""Name prefix of the probe object written (and removed) under the run's prefix."""
QUOTA_NAME = "{instance_type} for training job usage"
"""Service Quotas' name of one instance type's SageMaker training-job quota (its code is read from the listing)."""
PASSED_TTL_S = 600.0
"""Seconds a passed check is not repeated in one process (the CLI and the flow it starts share it)."""

_IMAGE = re.compile(
    r"^(?P<account>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?/"
    r"(?P<repo>[^:@]+)(?::(?P<tag>[^@]+)|@(?P<digest>sha256:[0-9a-f]+))?$"
)
_DENIED = ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "UnrecognizedClientException")


@dataclass(frozen=True)
class Finding:
    """One check's outcome: `ok` False stops the run; `checked` False means it could not be verified here."""

    check: str
    ok: bool
    message: str
    checked: bool = True

    def line(self) -> str:
        mark = "ok" if self.ok and self.checked else "??" if self.ok else "FAIL"
        return f"preflight {mark:<4} {self.check}: {self.message}"


@dataclass
class PreflightResult:
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if not f.ok]

    def lines(self) -> list[str]:
        return [f.line() for f in self.findings]


class PreflightFailed(ConfigError):
    """The preflight found problems; the message is one line per failure."""

    def __init__(self, failures: list[Finding]) -> None:
        self.failures = failures
        # A source failure reads as the source checks' errors always have ("data.source: ..."); the others name
        # the preflight's check.
        super().__init__(
            "\n".join(f.message if f.check == "source" else f"preflight: {f.check}: {f.message}" for f in failures)
        )


# -- what passed recently (one answer for the CLI and the flow it starts) ----------------------------------------
_passed: dict[str, float] = {}


def _recently_passed(key: str) -> bool:
    at = _passed.get(key)
    return at is not None and time.monotonic() - at < PASSED_TTL_S


def _source_key(config: HlatConfig) -> str:
    readers = [[s.source, s.hf_config, s.revision] for s in config.data.mixture]
    return json.dumps(["source", readers, config.tokenizer.pretrained, os.environ.get("HF_HUB_OFFLINE")])


def _aws_key(config: HlatConfig) -> str:
    body = config.model_dump(mode="json", include={"job", "storage", "data", "evaluation", "precompile", "burn_in"})
    return json.dumps(["aws", config.resolved_run_id(), body], sort_keys=True, default=str)


# -- the data source --------------------------------------------------------------------------------------------
SourceShape = Callable[[DataConfig], str]
"""Checks data.source's shape without reading it and returns its kind: 'builtin', 'local', 's3' or 'hub'. The flows hand
in training/data/sources.py's functions, which this layer cannot import."""


def source_findings(config: HlatConfig, shape: SourceShape) -> list[Finding]:
    """Whether each corpus source can be read; a data.sources entry's findings name it."""
    findings = []
    for source in config.data.mixture:
        found = _one_source(config.data.source_data_config(source), shape, config.job.backend)
        if config.data.sources:
            named = f"data.sources[{source.resolved_name}]"
            found = Finding(found.check, found.ok, found.message.replace("data.source:", f"{named}:"), found.checked)
        findings.append(found)
    if config.tokenizer.pretrained is not None:
        findings.append(tokenizer_finding(config.tokenizer.pretrained, config.job.backend))
    if config.model.init_from is not None:
        findings.append(init_from_finding(config.model.init_from, config.job.backend))
    return findings


def _fetched(check: str, source: str, backend: str, describe: Callable[[], str]) -> Finding:
    """The finding of a check that fetches `source`; `describe` gives the success line. For SageMaker runs an
    unreachable hub is unchecked, not failed; a missing name fails."""
    from hlat.core.storage import StorageError
    from hlat.infra.inputs.tokenizer import HubUnreachable

    try:
        return Finding(check, True, describe())
    except HubUnreachable as exc:
        if backend == "sagemaker":
            return Finding(check, True, f"{source}: the hub does not answer from here", checked=False)
        return Finding(check, False, str(exc))
    except (ValueError, StorageError) as exc:
        return Finding(check, False, str(exc))


def tokenizer_finding(source: str, backend: str = "local") -> Finding:
    """Whether tokenizer.pretrained can be fetched: its files are copied as the tokenizer stage will copy them."""
    import tempfile

    from hlat.infra.inputs.tokenizer import fetch_pretrained

    def describe() -> str:
        with tempfile.TemporaryDirectory(prefix="hlat-preflight-tokenizer-") as tmp:
            info = fetch_pretrained(source, tmp)
        revision = f" at {info['revision']}" if info["revision"] else ""
        return f"{source}{revision}: {', '.join(info['names'])}"

    return _fetched("tokenizer", source, backend, describe)


def init_from_finding(source: str, backend: str = "local") -> Finding:
    """Whether model.init_from can be imported, judged from its small files (infra/inputs/init_from.py `peek`)."""
    from hlat.infra.inputs.init_from import peek

    return _fetched("init_from", source, backend, lambda: peek(source))


def _one_source(data: DataConfig, shape: SourceShape, backend: str) -> Finding:
    src = data.source
    try:
        kind = shape(data)  # its shape; a local path's existence
    except ConfigError as exc:
        return Finding("source", False, str(exc))
    if kind == "s3":
        return _s3_source(src)
    if kind == "hub":
        return _hub_source(data, backend)
    return Finding("source", True, f"{src} ({kind})")


def _s3_source(uri: str) -> Finding:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, _, key = uri[len("s3://") :].partition("/")
    s3 = _session(None).client("s3", config=_client_config())
    try:
        if key and not key.endswith("/"):
            try:
                s3.head_object(Bucket=bucket, Key=key)
                return Finding("source", True, f"{uri} (an object)")
            except ClientError as exc:
                if _code(exc) not in ("404", "NoSuchKey", "NotFound"):
                    raise
        prefix = key.rstrip("/") + "/" if key else ""
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
        if listed.get("KeyCount", 0):
            return Finding("source", True, f"{uri} (a prefix)")
        return Finding(
            "source", False, f"data.source: nothing at or under {uri}; give an s3:// URI that holds the corpus"
        )
    except NoCredentialsError:
        return Finding(
            "source",
            False,
            f"data.source: {uri} cannot be read: no AWS credentials; configure a profile or "
            "environment keys (or job.aws_credentials_block) that may read it",
        )
    except ClientError as exc:
        code = _code(exc)
        if code == "NoSuchBucket":
            return Finding("source", False, f"data.source: bucket {bucket!r} does not exist; check the s3:// URI")
        if code in (*_DENIED, "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return Finding(
                "source",
                False,
                f"data.source: {uri} cannot be read ({code}); the caller needs s3:GetObject and "
                f"s3:ListBucket on arn:aws:s3:::{bucket}",
            )
        return Finding("source", False, f"data.source: {uri} cannot be read: {code}: {_message(exc)}")
    except BotoCoreError as exc:
        return Finding("source", False, f"data.source: {uri} cannot be read: {type(exc).__name__}: {exc}")


def hub_cached(name: str) -> Path | None:
    """A local copy of hub dataset `name` (the datasets cache's or the hub cache's), or None."""
    from huggingface_hub import constants

    datasets_cache = Path(
        os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets"
    )  # datasets' own default
    candidates = [
        datasets_cache / name.replace("/", "___"),
        Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}",
    ]
    return next((p for p in candidates if p.is_dir()), None)


def _hub_source(d: DataConfig, backend: str) -> Finding:
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    name, cached = d.source, hub_cached(d.source)
    if constants.HF_HUB_OFFLINE:
        if cached is not None:
            return Finding("source", True, f"{name}: offline (HF_HUB_OFFLINE=1), its cached copy at {cached}")
        return Finding(
            "source",
            False,
            f"data.source: {name!r} cannot be resolved offline (HF_HUB_OFFLINE=1) and has no cached "
            "copy; unset HF_HUB_OFFLINE to reach the hub, or copy the data set to s3:// or a local folder",
        )
    try:
        HfApi(endpoint=constants.ENDPOINT).dataset_info(name, revision=d.revision, timeout=10)
        return Finding("source", True, f"{name} (the Hugging Face hub knows it)")
    except GatedRepoError:
        return Finding(
            "source",
            False,
            f"data.source: {name!r} is gated on the Hugging Face hub; accept its terms on the hub and set HF_TOKEN",
        )
    except RevisionNotFoundError:
        return Finding("source", False, f"data.revision: {d.revision!r} is not a revision of {name!r}; fix or unset it")
    except RepositoryNotFoundError:
        return Finding(
            "source",
            False,
            f"data.source: no Hugging Face dataset named {name!r} (or it is private: set HF_TOKEN); "
            "check the name (namespace/name)",
        )
    except Exception as exc:  # no answer: the network, a proxy, the endpoint
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:200]
        if cached is not None:
            return Finding("source", True, f"{name}: the hub does not answer ({why}); its cached copy at {cached}")
        if backend == "sagemaker":  # the job reaches the hub from AWS, not from here
            return Finding("source", True, f"{name}: the hub does not answer from here ({why})", checked=False)
        return Finding(
            "source",
            False,
            f"data.source: cannot reach the Hugging Face hub for {name!r} ({why}) and no cached copy; "
            "check the network or HF_ENDPOINT, or copy the data set to s3:// or a local folder",
        )


# -- AWS --------------------------------------------------------------------------------------------------------
def _client_config(attempts: int = 2) -> Any:
    from botocore.config import Config

    return Config(
        retries={"mode": "standard", "max_attempts": attempts},
        connect_timeout=5,
        read_timeout=15,
        user_agent_extra="hlat",
    )


def _session(region: str | None) -> Any:
    import boto3

    return boto3.Session(region_name=region) if region else boto3.Session()


def _code(exc: Any) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__))


def _message(exc: Any) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Message", exc))[:200]


ClientFactory = Callable[[str], Any]


def aws_findings(config: HlatConfig, clients: Mapping[str, Any] | None = None) -> list[Finding]:
    """The AWS checks of a SageMaker run. `clients` replaces a service's boto3 client by name (for tests)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
    from botocore.parsers import ResponseParserError

    session = _session(config.job.region)
    made: dict[str, Any] = dict(clients or {})

    def client(service: str) -> Any:
        if service not in made:
            # IAM's few reads are not retried: a simulator that is not there (moto) answers 500 at once.
            attempts = 1 if service == "iam" else 2
            made[service] = session.client(service, region_name=config.job.region, config=_client_config(attempts))
        return made[service]

    try:
        identity = client("sts").get_caller_identity()
    except NoCredentialsError:
        return [
            Finding(
                "caller",
                False,
                "no AWS credentials: configure a profile (aws configure; AWS_PROFILE), environment "
                "keys, or job.aws_credentials_block",
            )
        ]
    except (ClientError, BotoCoreError) as exc:
        return [
            Finding(
                "caller", False, f"STS GetCallerIdentity failed ({_code(exc)}: {_message(exc)}); fix the credentials"
            )
        ]
    caller, account = str(identity["Arn"]), str(identity["Account"])
    findings = [Finding("caller", True, f"{caller} (account {account}, region {config.job.region})")]

    def assume(role_arn: str) -> Any:
        import boto3

        session_name = f"{PROBE_SESSION}{uuid.uuid4().hex[:12]}"
        answer = client("sts").assume_role(
            RoleArn=role_arn, RoleSessionName=session_name, DurationSeconds=PROBE_SESSION_S
        )
        credentials = answer["Credentials"]
        role_session = boto3.Session(
            aws_access_key_id=credentials["AccessKeyId"],
            aws_secret_access_key=credentials["SecretAccessKey"],
            aws_session_token=credentials["SessionToken"],
            region_name=config.job.region,
        )
        return role_session.client("s3", config=_client_config())

    checks: list[tuple[str, Callable[[], list[Finding]]]] = [
        ("role", lambda: _role(client, config, caller, account)),
        ("storage", lambda: _storage(client, config, caller, assume)),
        ("image", lambda: _images(client, config, account)),
        ("quota", lambda: _quotas(client, config)),
        ("training-plan", lambda: _training_plan(client, config)),
    ]
    for name, check in checks:
        try:
            findings += check()
        except (ClientError, BotoCoreError, ResponseParserError) as exc:
            findings.append(_unexpected(name, exc))
    return findings


def _unexpected(check: str, exc: Exception) -> Finding:
    """An unexpected answer, in one line. A refusal fails the check. No usable answer fails the caller's side, but
    leaves quotas and plans unverified."""
    status = int(getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    answered = hasattr(exc, "response") and status < 500
    if answered:
        return Finding(check, False, f"{_code(exc)}: {_message(exc)}")
    soft = check in ("quota", "training-plan")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    why = f"{type(exc).__name__}: {text}"[:160]
    return Finding(check, soft, f"no answer ({why})" + (", not checked" if soft else ""), checked=not soft)


# -- the execution role -----------------------------------------------------------------------------------------
def _role(client: ClientFactory, config: HlatConfig, caller: str, account: str) -> list[Finding]:
    from botocore.exceptions import ClientError

    role_arn = config.job.role_arn
    if not role_arn:
        return [
            Finding(
                "role",
                False,
                "job.role_arn is not set: set it to the IAM role SageMaker assumes "
                "(arn:aws:iam::<account>:role/<name>), or job.role_arn_secret",
            )
        ]
    role_account = role_arn.split(":")[4] if role_arn.count(":") >= 5 else ""
    name = role_arn.rsplit("/", 1)[-1]
    iam = client("iam")
    if role_account != account:
        return [
            Finding(
                "role",
                True,
                f"{role_arn} is in account {role_account}, the caller in {account}: its trust and "
                "PassRole are not checked from here",
                checked=False,
            )
        ]
    try:
        role = iam.get_role(RoleName=name)["Role"]
    except ClientError as exc:
        if _code(exc) == "NoSuchEntity":
            return [
                Finding(
                    "role",
                    False,
                    f"job.role_arn: no role {name!r} in account {account}; create it (trusting "
                    f"{SAGEMAKER_SERVICE}) or fix the ARN",
                )
            ]
        if _code(exc) in _DENIED:
            return [Finding("role", True, f"{role_arn}: iam:GetRole denied to the caller, not checked", checked=False)]
        raise
    findings = []
    trusted = _trusts_sagemaker(role.get("AssumeRolePolicyDocument"), sagemaker_request_context(config, account))
    if role.get("Arn") and role["Arn"] != role_arn:
        findings.append(Finding("role", False, f"job.role_arn: {role_arn} is not the role's ARN; use {role['Arn']}"))
    elif trusted:
        findings.append(Finding("role", True, f"{role_arn} exists and trusts {SAGEMAKER_SERVICE}"))
    elif trusted is None:
        findings.append(
            Finding(
                "role",
                True,
                f"{role_arn} trusts {SAGEMAKER_SERVICE} under a condition only IAM evaluates; not checked",
                checked=False,
            )
        )
    else:
        findings.append(
            Finding(
                "role",
                False,
                f"{role_arn} does not trust {SAGEMAKER_SERVICE}: add to its trust policy a statement "
                f'{{"Effect": "Allow", "Principal": {{"Service": "{SAGEMAKER_SERVICE}"}}, "Action": "sts:AssumeRole"}}',
            )
        )
    findings.append(_pass_role(iam, caller, account, role_arn))
    return findings


def _document(value: Any) -> dict[str, Any]:
    """A policy document as IAM returns it: a dict (boto3 decodes it) or URL-encoded JSON text."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str) and value.strip():
        text = value if value.lstrip().startswith("{") else unquote(value)
        loaded = json.loads(text)
        return loaded if isinstance(loaded, dict) else {}
    return {}


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [] if value is None else [value]


def sagemaker_request_context(config: HlatConfig, account: str) -> dict[str, str]:
    """The condition keys of SageMaker's AssumeRole for a run's job (aws:SourceAccount, aws:SourceArn), lower-cased. See
    https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-roles.html (confused-deputy guard)."""
    from hlat.infra.backends.protocol import job_name

    partition = config.job.role_arn.split(":")[1] if config.job.role_arn and ":" in config.job.role_arn else "aws"
    name = job_name(config.resolved_run_id(), 1)
    job = f"arn:{partition}:sagemaker:{config.job.region}:{account}:training-job/{name}"
    return {"aws:sourceaccount": account, "aws:sourcearn": job}


def _trusts_sagemaker(document: Any, context: Mapping[str, str] | None = None) -> bool | None:
    """Whether a trust policy lets SageMaker assume the role given `context`; None when a condition is not evaluated."""
    answer: bool | None = False
    for statement in _listed(_document(document).get("Statement")):
        if statement.get("Effect") != "Allow":
            continue
        actions = [str(a).lower() for a in _listed(statement.get("Action"))]
        if not any(fnmatch.fnmatchcase("sts:assumerole", a) for a in actions):
            continue
        principal = statement.get("Principal")
        services = _listed(principal.get("Service")) if isinstance(principal, Mapping) else []
        if SAGEMAKER_SERVICE not in services and principal != "*":
            continue
        holds = _trust_condition_holds(statement.get("Condition"), context or {})
        if holds:
            return True
        if holds is None:
            answer = None
    return answer


def _trust_condition_holds(condition: Any, context: Mapping[str, str]) -> bool | None:
    """Whether a trust Condition holds for `context` (string and ARN tests); None for other keys or operators."""
    if not condition:
        return True
    for operator, tests in dict(condition).items():
        op = operator.split(":")[-1].removesuffix("IfExists")
        for key, values in dict(tests).items():
            got = context.get(key.lower())
            if got is None or op not in ("StringEquals", "StringLike", "ArnEquals", "ArnLike"):
                return None
            wanted = [str(v) for v in _listed(values)]
            ok = any(fnmatch.fnmatchcase(got, w) for w in wanted) if op.endswith("Like") else got in wanted
            if not ok:
                return False
    return True


def caller_principal(caller: str, iam: Any) -> str | None:
    """The IAM principal whose policies decide the caller's rights: a user as is, an assumed role's role. None for the
    root and for principals IAM cannot simulate."""
    from botocore.exceptions import ClientError

    parts = caller.split(":", 5)
    if len(parts) < 6:
        return None
    resource = parts[5]
    if resource.startswith("user/"):
        return caller.replace(":sts::", ":iam::", 1)  # moto and some SDKs write a user's ARN under sts
    if resource.startswith("assumed-role/"):
        name = resource.split("/")[1]
        try:
            return str(iam.get_role(RoleName=name)["Role"]["Arn"])
        except ClientError:
            return f"arn:{parts[1]}:iam::{parts[4]}:role/{name}"
    return None


PASS_ROLE_STATEMENT = (
    '{{"Effect": "Allow", "Action": "iam:PassRole", "Resource": "{role}", '
    '"Condition": {{"StringEquals": {{"iam:PassedToService": "' + SAGEMAKER_SERVICE + '"}}}}}}'
)


def _pass_role(iam: Any, caller: str, account: str, role_arn: str) -> Finding:
    """Whether the caller may pass the role to SageMaker. IAM's simulator decides; where it is unavailable, the
    principal's policies are evaluated here."""
    from botocore.exceptions import BotoCoreError, ClientError
    from botocore.parsers import ResponseParserError

    if caller.endswith(":root"):
        return Finding("passrole", True, "the account root may pass any role")
    principal = caller_principal(caller, iam)
    if principal is None:
        return Finding("passrole", True, f"{caller}: a principal IAM cannot simulate; not checked", checked=False)
    fix = f"add to {principal}'s policy {PASS_ROLE_STATEMENT.format(role=role_arn)}"
    try:
        results = iam.simulate_principal_policy(
            PolicySourceArn=principal,
            ActionNames=["iam:PassRole"],
            ResourceArns=[role_arn],
            ContextEntries=[
                {
                    "ContextKeyName": "iam:PassedToService",
                    "ContextKeyValues": [SAGEMAKER_SERVICE],
                    "ContextKeyType": "string",
                }
            ],
        )["EvaluationResults"]
        decision = str(results[0]["EvalDecision"]) if results else "implicitDeny"
        if decision == "allowed":
            return Finding("passrole", True, f"{principal} may pass {role_arn} to SageMaker (IAM policy simulator)")
        return Finding("passrole", False, f"{principal} may not iam:PassRole {role_arn} ({decision}); {fix}")
    except (ClientError, BotoCoreError, ResponseParserError) as exc:  # denied, or moto's 500: not implemented
        simulated = _code(exc)
    try:
        allowed = passrole_decision(_principal_policies(iam, principal), role_arn)
    except (ClientError, BotoCoreError) as exc:
        return Finding(
            "passrole",
            True,
            f"not checked: the policy simulator answered {simulated} and the caller's policies "
            f"cannot be read ({_code(exc)}); allow iam:SimulatePrincipalPolicy to verify",
            checked=False,
        )
    if allowed is None:
        return Finding(
            "passrole",
            True,
            f"not checked: {principal}'s policies hold conditions evaluated only by IAM",
            checked=False,
        )
    if allowed:
        return Finding("passrole", True, f"{principal} may pass {role_arn} to SageMaker (its policies, read here)")
    return Finding("passrole", False, f"{principal} may not iam:PassRole {role_arn} (its policies); {fix}")


def _principal_policies(iam: Any, principal: str) -> list[dict[str, Any]]:
    """The identity policies of a user (its own, its groups') or a role: inline and attached, as documents."""
    kind, _, name = principal.split(":", 5)[5].partition("/")
    name = name.rsplit("/", 1)[-1]
    docs: list[Any] = []

    def attached(arns: Iterable[str]) -> None:
        for arn in arns:
            version = iam.get_policy(PolicyArn=arn)["Policy"]["DefaultVersionId"]
            docs.append(iam.get_policy_version(PolicyArn=arn, VersionId=version)["PolicyVersion"]["Document"])

    if kind == "user":
        for policy in iam.list_user_policies(UserName=name)["PolicyNames"]:
            docs.append(iam.get_user_policy(UserName=name, PolicyName=policy)["PolicyDocument"])
        attached(p["PolicyArn"] for p in iam.list_attached_user_policies(UserName=name)["AttachedPolicies"])
        for group in iam.list_groups_for_user(UserName=name)["Groups"]:
            g = group["GroupName"]
            for policy in iam.list_group_policies(GroupName=g)["PolicyNames"]:
                docs.append(iam.get_group_policy(GroupName=g, PolicyName=policy)["PolicyDocument"])
            attached(p["PolicyArn"] for p in iam.list_attached_group_policies(GroupName=g)["AttachedPolicies"])
    else:
        for policy in iam.list_role_policies(RoleName=name)["PolicyNames"]:
            docs.append(iam.get_role_policy(RoleName=name, PolicyName=policy)["PolicyDocument"])
        attached(p["PolicyArn"] for p in iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"])
    return [_document(d) for d in docs]


def passrole_decision(documents: Iterable[Mapping[str, Any]], role_arn: str) -> bool | None:
    """Whether identity policies allow iam:PassRole of `role_arn` to SageMaker: False, True, or None if unsure.
    Wildcards match as in IAM; boundaries, SCPs and session policies are not seen."""

    def matches(patterns: Any, value: str, case: bool) -> bool:
        return any(
            fnmatch.fnmatchcase(value if case else value.lower(), str(p) if case else str(p).lower())
            for p in _listed(patterns)
        )

    def applies(statement: Mapping[str, Any]) -> bool | None:
        if "Action" in statement and not matches(statement["Action"], "iam:PassRole", case=False):
            return False
        if "NotAction" in statement and matches(statement["NotAction"], "iam:PassRole", case=False):
            return False
        if "Resource" in statement and not matches(statement["Resource"], role_arn, case=True):
            return False
        if "NotResource" in statement and matches(statement["NotResource"], role_arn, case=True):
            return False
        return _condition_holds(statement.get("Condition"))

    allowed: bool | None = False
    for document in documents:
        for statement in _listed(document.get("Statement")):
            hit = applies(statement)
            if statement.get("Effect") == "Deny" and hit:
                return False
            if statement.get("Effect") == "Allow":
                if hit:
                    allowed = True
                elif hit is None and allowed is False:
                    allowed = None
    return allowed


def _condition_holds(condition: Any) -> bool | None:
    """A statement's Condition for a PassRole to SageMaker: True/False for iam:PassedToService tests, None for any
    other key (unknown here)."""
    if not condition:
        return True
    for operator, tests in dict(condition).items():
        for key, values in dict(tests).items():
            if key.lower() != "iam:passedtoservice":
                return None
            wanted = [str(v) for v in _listed(values)]
            op = operator.split(":")[-1].replace("IfExists", "")
            if op == "StringEquals":
                ok = SAGEMAKER_SERVICE in wanted
            elif op == "StringLike":
                ok = any(fnmatch.fnmatchcase(SAGEMAKER_SERVICE, w) for w in wanted)
            elif op == "StringNotEquals":
                ok = SAGEMAKER_SERVICE not in wanted
            elif op == "StringNotLike":
                ok = not any(fnmatch.fnmatchcase(SAGEMAKER_SERVICE, w) for w in wanted)
            else:
                return None
            if not ok:
                return False
    return True


# -- the storage prefix -----------------------------------------------------------------------------------------
PROBE_SESSION = "hlat-preflight-"
"""Session-name prefix of the probe's AssumeRole; deployments/account.yaml allows only sessions so named."""
PROBE_SESSION_S = 900
"""The assumed session's lifetime: STS's minimum (the probe takes seconds)."""
RoleAssumer = Callable[[str], Any]
"""Assumes a role (its ARN) and returns an S3 client with its credentials; raises ClientError when STS refuses."""


def _storage(client: ClientFactory, config: HlatConfig, caller: str, assume: RoleAssumer) -> list[Finding]:
    """Probe the run prefix as the caller and as the job's role (assumed where the caller may)."""
    from botocore.exceptions import ClientError

    root = config.storage.root.rstrip("/")
    if not root.startswith("s3://"):
        return [Finding("storage", False, f"storage.root: SageMaker needs s3://bucket/prefix, not {root!r}")]
    bucket, _, prefix = root[len("s3://") :].partition("/")
    run_prefix = "/".join(p for p in (prefix, config.resolved_run_id()) if p)
    s3 = client("s3")
    findings: list[Finding] = []
    try:
        location = s3.get_bucket_location(Bucket=bucket).get("LocationConstraint") or "us-east-1"
        if location != config.job.region:
            findings.append(
                Finding(
                    "storage",
                    False,
                    f"bucket {bucket!r} is in {location}, job.region is {config.job.region}: "
                    f"SageMaker reads and writes buckets of its own region; use a bucket in {config.job.region} "
                    f"or set job.region={location}",
                )
            )
    except ClientError as exc:
        if _code(exc) == "NoSuchBucket":
            return [
                Finding(
                    "storage",
                    False,
                    f"storage.root: bucket {bucket!r} does not exist; create it "
                    f"(aws s3 mb s3://{bucket} --region {config.job.region}) or fix the URI",
                )
            ]
        if _code(exc) not in _DENIED:
            raise
    from botocore.exceptions import BotoCoreError
    from botocore.parsers import ResponseParserError

    findings.append(_probe(s3, bucket, run_prefix, "the caller", cleanup=s3))
    try:  # an unexpected answer to the job's role's probe keeps the caller's finding
        findings.append(_probe_as_job_role(s3, bucket, run_prefix, config, caller, assume))
    except (ClientError, BotoCoreError, ResponseParserError) as exc:
        findings.append(_unexpected("storage", exc))
    return findings


def _probe(s3: Any, bucket: str, run_prefix: str, who: str, cleanup: Any) -> Finding:
    """The four S3 calls every stage makes under the run prefix, as `who`; `cleanup` removes a stray probe."""
    from botocore.exceptions import ClientError

    key = f"{run_prefix}/{PROBE_NAME}{uuid.uuid4().hex[:12]}"
    where = f"s3://{bucket}/{key}"
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("s3:PutObject", lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"hlat preflight probe\n")),
        ("s3:GetObject", lambda: s3.get_object(Bucket=bucket, Key=key)["Body"].read()),
        ("s3:ListBucket", lambda: s3.list_objects_v2(Bucket=bucket, Prefix=key).get("Contents", [])),
        ("s3:DeleteObject", lambda: s3.delete_object(Bucket=bucket, Key=key)),
    ]
    for action, step in steps:
        try:
            answer = step()
        except ClientError as exc:
            left = ""
            if action != "s3:PutObject":
                removed = _remove_quietly(cleanup, bucket, key)
                left = "" if removed else f"; the probe {where} is left: remove it by hand"
            resource = f"arn:aws:s3:::{bucket}" + ("" if action == "s3:ListBucket" else f"/{run_prefix}/*")
            return Finding(
                "storage",
                False,
                f"{action} denied on s3://{bucket}/{run_prefix}/ ({_code(exc)}); allow {action} on {resource} "
                f"to {who}{left}",
            )
        if action == "s3:ListBucket" and key not in [o["Key"] for o in answer]:
            _remove_quietly(cleanup, bucket, key)
            return Finding("storage", False, f"the probe {where} was written by {who} but is not listed")
    return Finding("storage", True, f"write, read, list and delete under s3://{bucket}/{run_prefix}/ as {who}")


def _probe_as_job_role(
    caller_s3: Any, bucket: str, run_prefix: str, config: HlatConfig, caller: str, assume: RoleAssumer
) -> Finding:
    """The probe as job.role_arn, whose rights the jobs use; not verified where the caller may not assume it."""
    from botocore.exceptions import BotoCoreError, ClientError
    from botocore.parsers import ResponseParserError

    role_arn = config.job.role_arn

    def as_caller(why: str) -> Finding:
        return Finding("storage", True, f"checked as the caller, not as the job's role: {why}", checked=False)

    if not role_arn:
        return as_caller("job.role_arn is not set")
    name = role_arn.rsplit("/", 1)[-1]
    parts = caller.split(":", 5)
    if len(parts) == 6 and parts[5].startswith(f"assumed-role/{name}/") and parts[4] == role_arn.split(":")[4]:
        return _probe(caller_s3, bucket, run_prefix, f"the job's role {role_arn} (the caller)", cleanup=caller_s3)
    try:
        role_s3 = assume(role_arn)
    except ClientError as exc:
        code = _code(exc)
        fix = (
            f"to check as the job's role, allow the caller sts:AssumeRole on it in sessions named "
            f"{PROBE_SESSION}* and trust the caller's account in the role's trust policy (deployments/account.yaml: "
            "PreflightAssumesExecutionRole)"
        )
        if code in _DENIED:
            return as_caller(f"sts:AssumeRole of {role_arn} denied ({code}); {fix}")
        return as_caller(f"sts:AssumeRole of {role_arn}: {code}: {_message(exc)}; {fix}")
    except (BotoCoreError, ResponseParserError) as exc:  # no usable answer from STS
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return as_caller(f"sts:AssumeRole of {role_arn}: no answer ({type(exc).__name__}: {text[:160]})")
    return _probe(role_s3, bucket, run_prefix, f"the job's role {role_arn}", cleanup=caller_s3)


def _remove_quietly(s3: Any, bucket: str, key: str) -> bool:
    """Delete the probe; whether that was allowed."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        s3.delete_object(Bucket=bucket, Key=key)
        return True
    except (ClientError, BotoCoreError):
        return False


# -- images -----------------------------------------------------------------------------------------------------
def stage_images(config: HlatConfig) -> dict[str, list[str]]:
    """The image each SageMaker stage job runs, as the backend resolves it: {image URI: [what runs it]}."""
    from hlat.infra.stage_jobs import job_image

    job = config.job
    train = job.image_uri
    if train is None:
        from hlat.infra.backends.sagemaker_images import neuron_training_image

        train = neuron_training_image(job.region, config.neuron.sdk)
        if train is None:
            raise ConfigError(
                f"job.region={job.region!r}: AWS publishes no Neuron PyTorch training image there; set job.image_uri "
                "to a training image in that region"
            )
    images: dict[str, list[str]] = {}
    places = list(dict.fromkeys(row.runs_on for row in stage_rows() if row.runs_on is not None))
    for where in places:
        images.setdefault(job_image(config, where) or train, []).append(where.named_for)
    return images


def _images(client: ClientFactory, config: HlatConfig, account: str) -> list[Finding]:
    from botocore.exceptions import ClientError

    try:
        images = stage_images(config)
    except (ConfigError, ValueError) as exc:
        return [Finding("image", False, str(exc))]
    findings = []
    for image, stages in images.items():
        what = f"{image} ({', '.join(stages)})"
        match = _IMAGE.match(image)
        if match is None:
            findings.append(Finding("image", True, f"{what}: not an ECR image; not checked", checked=False))
            continue
        if match["region"] != config.job.region:
            findings.append(
                Finding(
                    "image",
                    False,
                    f"{what} is in {match['region']}, job.region is {config.job.region}: SageMaker "
                    "pulls images of its own region; push it to ECR there",
                )
            )
            continue
        ident = {"imageTag": match["tag"] or "latest"} if not match["digest"] else {"imageDigest": match["digest"]}
        own = match["account"] == account
        try:
            client("ecr").describe_images(registryId=match["account"], repositoryName=match["repo"], imageIds=[ident])
            findings.append(Finding("image", True, f"{what} exists"))
        except ClientError as exc:
            code = _code(exc)
            if code == "ImageNotFoundException" or (own and code == "RepositoryNotFoundException"):
                findings.append(
                    Finding(
                        "image",
                        False,
                        f"{what}: no such image in ECR ({code}); build and push it (docker push "
                        f"{image}) or fix the image setting",
                    )
                )
            elif not own and (code in _DENIED or code == "RepositoryNotFoundException"):
                findings.append(
                    Finding(
                        "image",
                        True,
                        f"{what}: in account {match['account']}'s registry (AWS's own for its deep "
                        "learning containers), which this account may not describe; SageMaker pulls it with the "
                        "execution role",
                        checked=False,
                    )
                )
            elif code in _DENIED:
                findings.append(
                    Finding("image", True, f"{what}: ecr:DescribeImages denied, not checked", checked=False)
                )
            else:
                raise
    return findings


# -- quotas -----------------------------------------------------------------------------------------------------
def instance_needs(config: HlatConfig) -> dict[str, tuple[int, list[str]]]:
    """The most instances of each type the run's jobs hold at once, and the stages needing them. Stages run in turn,
    except those set to run beside training."""
    job, trainer = config.job, training_stage()
    uses: list[tuple[str, int, str]] = []
    for row in stage_rows():
        if row.runs_on is None or not row.enabled(config):
            continue
        where = row.runs_on
        instance_type, count, what = where.instance_type(config), where.instance_count(config), row.name
        if row.beside is not None and setting(config, row.beside) is not None and instance_type == job.instance_type:
            count, what = count + job.instance_count, f"{row.name} beside {trainer.name}"
        uses.append((instance_type, count, what))
    needs: dict[str, tuple[int, list[str]]] = {}
    for instance_type, count, stage in uses:
        most, stages = needs.get(instance_type, (0, []))
        needs[instance_type] = (max(most, count), [*stages, stage])
    return needs


def _quotas(client: ClientFactory, config: HlatConfig) -> list[Finding]:
    """Each needed type's training-job quota, less other jobs' use, against instance_needs."""
    from botocore.exceptions import ClientError

    quotas = client("service-quotas")
    region = config.job.region
    try:
        listed = _all_quotas(quotas, "list_service_quotas")
    except ClientError as exc:
        if _code(exc) in _DENIED:
            return [Finding("quota", True, "servicequotas:ListServiceQuotas denied: quotas not checked", checked=False)]
        raise
    defaults: dict[str, dict[str, Any]] | None = None
    usage: dict[str, list[tuple[str, int]]] | None = None
    usage_unread = ""
    findings = []
    for instance_type, (count, stages) in instance_needs(config).items():
        name = QUOTA_NAME.format(instance_type=instance_type)
        quota = listed.get(name)
        if quota is None:
            if defaults is None:
                try:
                    defaults = _all_quotas(quotas, "list_aws_default_service_quotas")
                except ClientError:
                    defaults = {}
            quota = defaults.get(name)
        what = f"{instance_type} x {count} ({', '.join(stages)})"
        if quota is None:
            findings.append(Finding("quota", True, f"{what}: no quota named {name!r} in {region}", checked=False))
            continue
        value = int(quota.get("Value") or 0)
        planned = config.job.training_plan_arn and instance_type == config.job.instance_type
        if planned:  # the plan's reserved instances are checked instead (its AvailableInstanceCount)
            if value >= count:
                findings.append(Finding("quota", True, f"{what}: {name!r} is {value}"))
            else:
                findings.append(
                    Finding(
                        "quota",
                        True,
                        f"{what}: {name!r} is {value}; the training plan's capacity is checked instead",
                        checked=False,
                    )
                )
            continue
        if usage is None and not usage_unread:
            try:
                usage = instances_in_use(client("sagemaker"), own_job_names(config.resolved_run_id()))
            except ClientError as exc:
                if _code(exc) not in _DENIED:
                    raise
                usage_unread = f"sagemaker:ListTrainingJobs or DescribeTrainingJob denied ({_code(exc)})"
        held = (usage or {}).get(instance_type, [])
        in_use = sum(n for _, n in held)
        free = max(value - in_use, 0)
        jobs = _held_by(held)
        desired = count + in_use
        fix = (
            f"request {desired}: aws service-quotas request-service-quota-increase --service-code sagemaker "
            f"--quota-code {quota.get('QuotaCode')} --desired-value {desired} --region {region}"
        )
        if value < count:
            findings.append(Finding("quota", False, f"{what}: {name!r} is {value} in {region}{jobs}; {fix}"))
        elif free < count:
            findings.append(
                Finding(
                    "quota",
                    False,
                    f"{what}: {name!r} is {value} in {region}{jobs}: {free} free, {count} needed; wait for those "
                    f"jobs or stop them, or {fix}",
                )
            )
        elif usage_unread:
            findings.append(
                Finding(
                    "quota",
                    True,
                    f"{what}: {name!r} is {value}; what running jobs hold is not counted: {usage_unread}",
                    checked=False,
                )
            )
        else:
            held_line = jobs or ", none held by other running training jobs"
            findings.append(Finding("quota", True, f"{what}: {name!r} is {value}{held_line}: {free} free"))
    return findings


def _held_by(held: list[tuple[str, int]]) -> str:
    """', N held by K running training job(s) of other runs (...)', or '' when none."""
    if not held:
        return ""
    shown = ", ".join(f"{name}: {n}" for name, n in held[:3]) + (f", {len(held) - 3} more" if len(held) > 3 else "")
    return f", {sum(n for _, n in held)} held by {len(held)} running training job(s) of other runs ({shown})"


def own_job_names(run_id: str) -> Callable[[str], bool]:
    """Whether a training job name is one of run `run_id`'s own."""
    from hlat.infra.backends.protocol import job_name

    def own(name: str) -> bool:
        match = re.fullmatch(r".+-(\d+)", name)
        return match is not None and any(name == job_name(run_id, int(match[1]), s) for s in job_stages())

    return own


def instances_in_use(sagemaker: Any, own: Callable[[str], bool]) -> dict[str, list[tuple[str, int]]]:
    """Instances held by the account's running training jobs in this region, by type: [(job, count)]. Jobs `own` accepts
    are left out."""
    from botocore.exceptions import ClientError

    held: dict[str, list[tuple[str, int]]] = {}
    token: str | None = None
    while True:
        page = sagemaker.list_training_jobs(
            StatusEquals="InProgress", MaxResults=100, **({"NextToken": token} if token else {})
        )
        for summary in page.get("TrainingJobSummaries", []):
            name = str(summary["TrainingJobName"])
            if own(name):
                continue
            try:
                job = sagemaker.describe_training_job(TrainingJobName=name)
            except ClientError as exc:
                if _code(exc) in ("ValidationException", "ResourceNotFound"):
                    continue
                raise
            if job.get("TrainingJobStatus", "InProgress") != "InProgress":
                continue  # ended since the listing
            resources = job.get("ResourceConfig") or {}
            for group in resources.get("InstanceGroups") or [resources]:
                if group.get("InstanceType") and group.get("InstanceCount"):
                    held.setdefault(str(group["InstanceType"]), []).append((name, int(group["InstanceCount"])))
        token = page.get("NextToken")
        if not token:
            return held


def _all_quotas(quotas: Any, operation: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    token: str | None = None
    while True:
        page = getattr(quotas, operation)(ServiceCode="sagemaker", **({"NextToken": token} if token else {}))
        out.update({q["QuotaName"]: q for q in page.get("Quotas", [])})
        token = page.get("NextToken")
        if not token:
            return out


# -- the training plan ------------------------------------------------------------------------------------------
def _training_plan(client: ClientFactory, config: HlatConfig) -> list[Finding]:
    from botocore.exceptions import ClientError

    job = config.job
    arn = job.training_plan_arn
    if not arn:
        return []
    try:
        plan = client("sagemaker").describe_training_plan(TrainingPlanName=arn)
    except ClientError as exc:
        if _code(exc) in ("ResourceNotFound", "ValidationException"):
            return [Finding("training-plan", False, f"job.training_plan_arn: {arn} not found in {job.region}; fix it")]
        if _code(exc) in _DENIED:
            return [Finding("training-plan", True, f"{arn}: DescribeTrainingPlan denied, not checked", checked=False)]
        raise
    status = plan.get("Status")
    name = plan.get("TrainingPlanName", arn)
    if status not in ("Active", "Scheduled"):
        return [
            Finding(
                "training-plan",
                False,
                f"{name} is {status}: use an Active or Scheduled plan, or unset job.training_plan_arn",
            )
        ]
    if "training-job" not in plan.get("TargetResources", ["training-job"]):
        return [
            Finding(
                "training-plan", False, f"{name} reserves capacity for {plan.get('TargetResources')}, not training jobs"
            )
        ]
    reserved = sum(
        int(r.get("TotalInstanceCount") or 0)
        for r in plan.get("ReservedCapacitySummaries", [])
        if r.get("InstanceType") == job.instance_type
    )
    if reserved < job.instance_count:
        return [
            Finding(
                "training-plan",
                False,
                f"{name} reserves {reserved} x {job.instance_type}, the run needs "
                f"{job.instance_count}; use a larger plan or set job.instance_count",
            )
        ]
    available = plan.get("AvailableInstanceCount")
    if status == "Active" and available is not None and int(available) < job.instance_count:
        return [
            Finding(
                "training-plan",
                False,
                f"{name} has {available} of {reserved} x {job.instance_type} free now "
                f"({plan.get('InUseInstanceCount', 0)} in use), the run needs {job.instance_count}",
            )
        ]
    when = "" if status == "Active" else f"; jobs queue until it starts at {plan.get('StartTime')}"
    return [Finding("training-plan", True, f"{name} ({status}): {reserved} x {job.instance_type} reserved{when}")]


# -- the whole preflight ----------------------------------------------------------------------------------------
def run_preflight(
    config: HlatConfig,
    *,
    shape: SourceShape | None = None,
    clients: Mapping[str, Any] | None = None,
    aws: bool | None = None,
) -> PreflightResult:
    """The source checks and, for a SageMaker run (or `aws`), the AWS checks; credentials are already active."""
    findings: list[Finding] = []
    if shape is not None:
        findings += source_findings(config, shape)
    if aws if aws is not None else config.job.backend == "sagemaker":
        findings += aws_findings(config, clients)
    return PreflightResult(findings)


def require_sources(config: HlatConfig, shape: SourceShape) -> None:
    """Raise PreflightFailed (one line per failure) unless data.source can be read; what passed is not asked again
    for PASSED_TTL_S."""
    _require(_source_key(config), lambda: source_findings(config, shape))


def require_aws(config: HlatConfig, *, clients: Mapping[str, Any] | None = None) -> None:
    """For a SageMaker run, the AWS checks; raise PreflightFailed listing failures. Passes are cached PASSED_TTL_S."""
    if config.job.backend != "sagemaker":
        return
    _require(_aws_key(config), lambda: aws_findings(config, clients))


def _require(key: Any, check: Callable[[], list[Finding]]) -> None:
    """Run `check` unless it passed for `key` within PASSED_TTL_S; raise PreflightFailed with its failures."""
    if _recently_passed(key):
        return
    failures = [f for f in check() if not f.ok]
    if failures:
        raise PreflightFailed(failures)
    _passed[key] = time.monotonic()
