"""`hlat preflight`: the live preflight of a run (infra/preflight.py) on the terminal, one line per check, before
anything is started, written or paid for; and the checks the CLI makes before it starts a Prefect server.

    hlat preflight --preset hlat-7b --storage s3://my-bucket/hlat --set job.role_arn=arn:aws:iam::...:role/...

Exit status 0 when every check passed (or could not be verified from here: `??` lines), 1 when any failed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hlat.core.config import ConfigError, HlatConfig
from hlat.infra.preflight import Finding, PreflightResult, require_aws, require_sources, run_preflight


def add_preflight_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `hlat preflight`: the run's preset, overrides, run id and storage, as `hlat pretrain` takes
    them (the probe goes under the run id)."""
    from hlat.cli import _add_run_options

    _add_run_options(p)


def preflight_result(config: HlatConfig) -> PreflightResult:
    """Every check of a run before it starts, as findings: the config against the run's config.json, what SageMaker
    would refuse and the budget (stage_jobs.preflight), the data source, and for a SageMaker run the AWS checks
    (with the run's AWS credentials block activated and its role read from its Secret block)."""
    from hlat.core.run import check_run, continued
    from hlat.flows.stage import source_shape
    from hlat.infra.stage_jobs import preflight as check_requests

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
        from hlat.tasks.aws import activate, with_role

        try:
            activate(config.job)
            config = with_role(config)
        except ConfigError as exc:
            findings.append(Finding("credentials", False, str(exc)))
            return PreflightResult(findings + run_preflight(config, shape=source_shape, aws=False).findings)
    return PreflightResult(findings + run_preflight(config, shape=source_shape, aws=aws).findings)


def preflight_command(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """`hlat preflight`: one line per check; 0 when none failed, 1 otherwise."""
    from hlat.flows.params import build_config

    config = build_config(args.preset, overrides, args.run_id, args.storage)
    return print_preflight(config)


def print_preflight(config: HlatConfig) -> int:
    """Run the preflight of `config` and print its lines (what `hlat pretrain --dry-run` prints after its own):
    0 when no check failed, 1 otherwise, with a last line counting the failures."""
    result = preflight_result(config)
    for line in result.lines():
        print(line)
    failed = len(result.failures)
    if failed:
        print(f"hlat: preflight: {failed} check(s) failed; nothing was started", file=sys.stderr)
        return 1
    return 0


def check_before_start(config: HlatConfig, *, reads_source: bool) -> None:
    """What the CLI checks before it starts a Prefect server (seconds, where the flow would fail after its server's
    ~10 s and with Prefect's ERROR lines): the config against the run's config.json (`check_run`), the data source
    when the command reads it (`reads_source`: pretrain, run prepare-data), and a SageMaker run's AWS checks when
    no Prefect block is named (a block is read from the server: the flow checks those runs, before writing
    anything). Raises ConfigError (PreflightFailed: one line per failure). The flow's own checks then reuse what
    passed here (infra/preflight.py: PASSED_TTL_S)."""
    from hlat.core.run import check_run, continued

    try:
        config = continued(config)
        check_run(config)
    except ConfigError:
        raise
    except Exception:  # storage not readable without the run's credentials: the flow opens the run and says why
        pass
    if reads_source:
        from hlat.flows.stage import source_shape

        require_sources(config, source_shape)
    if not (config.job.aws_credentials_block or config.job.role_arn_secret):
        require_aws(config)
