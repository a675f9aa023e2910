"""`hlat pretrain` and `hlat run <stage>`: check the config, then run the flow on a Prefect API.

The checks run before a server starts, so a bad run fails in seconds. `--dry-run` shows the jobs instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from hlat import temporary_server
from hlat.commands import Interrupted, preflight
from hlat.commands.planning import check_mixture
from hlat.core.config import ConfigError
from hlat.core.run import run_for
from hlat.core.stages import stage, stages, training_stage
from hlat.flows.params import build_config, handing_over
from hlat.flows.pretrain import hlat, stage_flow_of
from hlat.flows.stage import flow_run_identity
from hlat.infra.checks.aws import AwsBlockError
from hlat.infra.dry_run import dry_run
from hlat.infra.supervision.lease import set_identity
from hlat.tasks.aws import with_role
from hlat.tasks.train import latest_checkpoint


def run_flow(args: argparse.Namespace, overrides: dict[str, Any], log_path: Path | None) -> int:
    """`hlat pretrain` and `hlat run`: the flow, or with --dry-run the jobs it would send."""
    # The command's one config: a bad one fails here, before Prefect starts (an ephemeral API takes seconds to come
    # up); the flow the command runs is handed this one (handing_over), not a second.
    config = build_config(args.preset, overrides, args.run_id, args.storage)
    # A run that would repeat a source past its max_epochs is refused here: before any job is shown or sent, and
    # before a server starts (the dry run shows the per-source table with the refusal).
    check_mixture(config, show=args.dry_run)
    if args.dry_run:
        return _dry_run(args, config)
    # A run its storage refuses, a source that cannot be read, and (AWS) an account not ready fail here, in a line
    # each, before a server starts or a run opens.
    reads_source = args.command == "pretrain" or stage(args.stage).prepares_sources
    preflight.check_before_start(config, reads_source=reads_source)  # by its module: tests replace it there
    flow_fn, params = flow_call(args, overrides)
    _identify_supervisor("hlat pretrain" if args.command == "pretrain" else f"hlat run {args.stage}")
    temporary_server.start_temporary_server(
        log_path
    )  # out of the terminal's process group: Ctrl-C interrupts the flow, not its API
    start = time.perf_counter()
    try:
        with handing_over(config, args.preset, overrides, args.run_id, args.storage):
            flow_fn(**params)
    except KeyboardInterrupt:
        raise Interrupted(where_interrupted(config)) from None
    print(f"hlat: {args.command} finished in {time.perf_counter() - start:.1f} s")
    return 0


def _dry_run(args: argparse.Namespace, config: Any) -> int:
    if args.command == "run" and stage(args.stage).runs_on is None:
        print(f"hlat: --dry-run shows a stage's job; {args.stage} runs in the flow's own process", file=sys.stderr)
        return 2
    try:
        config = with_role(config)
    except AwsBlockError as exc:  # shown with the placeholder role, as when none is set
        print(f"hlat: note: {exc}", file=sys.stderr)
    print(dry_run(config, stage=args.stage if args.command == "run" else training_stage().name))
    print()
    preflight.print_preflight(config)  # what the run would meet on AWS; the dry run itself sends nothing
    return 0


def _identify_supervisor(command: str) -> None:
    """The heartbeat of the stages this command supervises names it and its flow run (infra.supervision.supervisor)."""
    set_identity(lambda: (flow_run_identity()[0], command))


def where_interrupted(config: Any) -> str:
    """'the job stopped with its checkpoint at step N; run the same command to resume' (the flow stopped any
    running job on its way out: `infra.supervision.watch.follow`)."""
    try:
        step = latest_checkpoint(run_for(config))
    except Exception:  # the message must not fail: it is what the user reads last
        step = None
    how = "run the same command to resume (finished stages are cached)"
    if step is None:
        return f"no checkpoint yet; {how}"
    return f"the run's newest checkpoint is step {step}; {how}"


def flow_call(args: argparse.Namespace, overrides: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The flow `hlat pretrain` or `hlat run <stage>` calls, and its parameters."""
    flow_fn: Any = hlat if args.command == "pretrain" else stage_flow_of(stage(args.stage))
    picks = args.command == "run" and stage(args.stage).takes_checkpoint
    if args.command == "run" and not picks and (args.step is not None or args.averaged):
        which = " or ".join(f"'hlat run {s.name}'" for s in stages() if s.takes_checkpoint)
        raise ConfigError(f"--step and --averaged apply to {which} only, not {args.stage}")
    params = {"preset": args.preset, "overrides": overrides, "run_id": args.run_id, "storage": args.storage}
    if picks:
        params["step"] = args.step
        if args.averaged:
            params["averaged"] = True
    return flow_fn, params
