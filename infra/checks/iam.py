"""The execution role's checks: it exists, SageMaker may assume it, and the caller may pass it.

IAM's policy simulator decides PassRole where the caller may call it. Elsewhere the caller's policies are read and
evaluated here; a condition only IAM evaluates leaves the check unverified, never failed.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote

from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

from hlat.core.config import HlatConfig
from hlat.infra.backends.protocol import job_name
from hlat.infra.checks.aws_clients import DENIED, ClientFactory, error_code
from hlat.infra.checks.findings import Finding

SAGEMAKER_SERVICE = "sagemaker.amazonaws.com"


def role_findings(client: ClientFactory, config: HlatConfig, caller: str, account: str) -> list[Finding]:
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
        if error_code(exc) == "NoSuchEntity":
            return [
                Finding(
                    "role",
                    False,
                    f"job.role_arn: no role {name!r} in account {account}; create it (trusting "
                    f"{SAGEMAKER_SERVICE}) or fix the ARN",
                )
            ]
        if error_code(exc) in DENIED:
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
        simulated = error_code(exc)
    try:
        allowed = passrole_decision(_principal_policies(iam, principal), role_arn)
    except (ClientError, BotoCoreError) as exc:
        return Finding(
            "passrole",
            True,
            f"not checked: the policy simulator answered {simulated} and the caller's policies "
            f"cannot be read ({error_code(exc)}); allow iam:SimulatePrincipalPolicy to verify",
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
