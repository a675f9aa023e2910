"""`hlat preflight`: a run's live preflight (infra/checks/preflight.py), one line per check, before anything is paid
for.

    hlat preflight --preset hlat-7b --storage s3://my-bucket/hlat --set job.role_arn=arn:aws:iam::...:role/...

Exit status 0 when no check failed (`??`: not verifiable here), else 1. Also the CLI's checks before a server starts.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hlat.core.config import ConfigError, HlatConfig
from hlat.core.run import check_run, continued
from hlat.flows.params import build_config
from hlat.flows.stage import source_shape
from hlat.infra.checks.findings import Finding, PreflightResult
from hlat.infra.checks.preflight import require_aws, require_sources, run_preflight
from hlat.infra.checks.requests import preflight as check_requests
from hlat.tasks.aws import activate, with_role


def preflight_result(config: HlatConfig) -> PreflightResult:
    """Every check of a run before it starts, as findings; a SageMaker run's AWS checks use its blocks."""
    findings: list[Finding] = []
    try:
        config = continued(config)
        check_run(config)
        findings.append(Finding("run", True, f"{config.resolved_run_id()} under {config.storage.root}"))
    except ConfigError as exc:
        findings.append(Finding("run", False, str(exc)))
    except Exception as exc:  # storage not readable yet (credentials): the storage check below says why
        findings.append(Finding("run", True, f"config.json not read ({type(exc).__name__})", checked=False))
    try:
        check_requests(config)
        findings.append(Finding("config", True, "the jobs' requests and the budget"))
    except (ConfigError, ValueError) as exc:
        findings.append(Finding("config", False, str(exc)))
    aws = config.job.backend == "sagemaker"
    if aws:
        try:
            activate(config.job)
            config = with_role(config)
        except ConfigError as exc:
            findings.append(Finding("credentials", False, str(exc)))
            return PreflightResult(findings + run_preflight(config, shape=source_shape, aws=False).findings)
    return PreflightResult(findings + run_preflight(config, shape=source_shape, aws=aws).findings)


def preflight_command(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    config = build_config(args.preset, overrides, args.run_id, args.storage)
    return print_preflight(config)


def print_preflight(config: HlatConfig) -> int:
    """Run the preflight of `config`, print its lines and a failure count; 0 when none failed, else 1."""
    result = preflight_result(config)
    for line in result.lines():
        print(line)
    failed = len(result.failures)
    if failed:
        print(f"hlat: preflight: {failed} check(s) failed; nothing was started", file=sys.stderr)
        return 1
    return 0


def check_before_start(config: HlatConfig, *, reads_source: bool) -> None:
    """What the CLI checks before starting a Prefect server, so it fails in seconds; raises ConfigError.

    AWS checks run here only when no Prefect block is named. The flow reuses what passed (PASSED_TTL_S)."""
    try:
        config = continued(config)
        check_run(config)
    except ConfigError:
        raise
    except Exception:  # storage not readable without the run's credentials: the flow opens the run and says why
        pass
    if reads_source:
        require_sources(config, source_shape)
    if not (config.job.aws_credentials_block or config.job.role_arn_secret):
        require_aws(config)
