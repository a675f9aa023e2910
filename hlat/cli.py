"""The `hlat` command line: run the whole DAG or one stage, list presets, show a resolved config.

    hlat pretrain --preset tiny [--run-id R] [--storage DIR|s3://...] [--config FILE] [--set training.lr=1e-3 ...]
                  [--dry-run]
    hlat run prepare-data|train-tokenizer|precompile|burn-in|train|evaluate --preset tiny --run-id R --storage DIR
    hlat run evaluate ... --step N          evaluate checkpoint N instead of the newest
    hlat export <checkpoint dir | checkpoints dir | run dir> <out dir> [--step N] [--tokenizer DIR]
    hlat compare <run A> <run B> [--out DIR] [--labels A B]
    hlat status [RUN] [--storage S]        each stage, the live job, its step, cost and supervisor (no RUN: every run)
    hlat stop RUN [--storage S]           stop the run's live job at a checkpoint, from any terminal
    hlat presets
    hlat config --preset hlat-7b [--set ...]
    hlat plan --preset hlat-7b [--nodes N] [--tokens T] [--json] [--set ...]   rank parallel layouts; time and cost
    hlat preflight --preset hlat-7b --storage s3://... [--set ...]   check account, role, storage, images, quotas, data
    hlat deploy [--name '*-tiny' ...] [--type process|ecs|kubernetes] [--stack S]   register deployments/prefect.yaml
    hlat worker [--pool hlat] [--type process|ecs|kubernetes] [--limit N] [--stack S]   create the pool, serve it

Every command that takes --set takes --config FILE too: a YAML or JSON file holding a partial config, nested by
section (deployments/mix-example.yaml), laid over the preset before the --set overrides.

Flows run on the Prefect API configured in the environment, or in Prefect's ephemeral mode when none is.
User mistakes (config, data, storage) end with one line on stderr and exit code 2 (config) or 1; any other
failure ends with one line too, its traceback in the command's log file (hlat/cli_log.py) or, with --verbose, on
the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import yaml

from hlat.cli_log import CommandLog
from hlat.commands import Interrupted
from hlat.core.config import ConfigError, apply_overrides, closest_match, flatten_config, parse_override
from hlat.core.presets import PRESETS
from hlat.core.stages import stage_names
from hlat.pools import DEFAULT_POOL, POOL_TYPES


def add_run_options(p: argparse.ArgumentParser) -> None:
    """--preset, --config, --set, --run-id and --storage: the options of a command that runs or checks a run."""
    _add_config_options(p)
    p.add_argument("--run-id", help="run identifier (default: <preset>-<config hash>)")
    p.add_argument("--storage", help="storage root: a folder or s3://bucket/prefix (default: ./runs)")


def _preset(name: str) -> str:
    """A preset's name, or argparse's error with the one the user probably meant."""
    if name in PRESETS:
        return name
    close = closest_match(name, list(PRESETS))
    hint = f"did you mean {close!r}? " if close else ""
    raise argparse.ArgumentTypeError(f"unknown preset {name!r}; {hint}(choose from {', '.join(PRESETS)})")


DEFAULT_PRESET = "tiny"


def _add_config_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default=None,  # not given: the --config file's `preset:`, else DEFAULT_PRESET (command_overrides)
        type=_preset,
        metavar="{" + ",".join(PRESETS) + "}",
        help=f"named preset (default: the --config file's preset:, else {DEFAULT_PRESET})",
    )
    p.add_argument(
        "--config",
        dest="config_file",
        metavar="FILE",
        help="a YAML (.yaml, .yml) or JSON file of config fields nested by section, e.g. "
        "deployments/mix-example.yaml, laid over the preset; --set applies after it",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a config field by dotted path, e.g. --set training.lr=1e-3 (repeatable)",
    )


def _add_dry_run(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the training job requests, the hourly cost and an estimate of total time and cost; send nothing",
    )


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print tracebacks on the terminal too (they always go to the command's log file)",
    )
    parser = argparse.ArgumentParser(prog="hlat", description="HLAT-style LLM pretraining pipeline (Prefect DAG).")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kwargs)

    p = add("pretrain", help="run the whole DAG (the parent flow 'hlat')")
    add_run_options(p)
    _add_dry_run(p)
    p = add("run", help="run one stage flow alone")
    p.add_argument("stage", choices=stage_names())
    add_run_options(p)
    _add_dry_run(p)
    p.add_argument("--step", type=int, help="evaluate: the checkpoint step to evaluate (default: the newest)")
    p.add_argument(
        "--averaged", action="store_true", help="evaluate: hlat average's checkpoint (<run>/averaged) instead"
    )
    p = add("export", help="write a checkpoint as a Hugging Face folder: Llama or GPT-NeoX, weights, config, tokenizer")
    p.add_argument("source", help="a checkpoint folder (.../checkpoints/step-N), a run's checkpoints folder, or a run")
    p.add_argument("out", help="output folder (local)")
    p.add_argument("--step", type=int, help="the step to export when source is a run (default: the newest)")
    p.add_argument("--tokenizer", help="tokenizer folder or s3:// URI (default: <run>/tokenizer)")
    p = add("average", help="average the model weights of a run's last K checkpoints into a new checkpoint")
    p.add_argument("run", help="a run folder or s3:// URI (or its checkpoints folder)")
    p.add_argument("--last", type=_positive_int, required=True, metavar="K", help="how many of the newest complete "
                   "checkpoints to average")  # fmt: skip
    p.add_argument("--out", help="the folder the averaged step-N goes into (default: <run>/averaged)")
    p = add("compare", help="two runs' loss and gradient-norm curves on one chart, with the difference")
    p.add_argument("run_a", help="run folder or s3:// URI (with metrics.jsonl)")
    p.add_argument("run_b", help="run folder or s3:// URI")
    p.add_argument("--out", help="where to write compare.md and the charts (default: <run A>/compare/<run B id>)")
    p.add_argument("--labels", nargs=2, metavar=("A", "B"), help="labels of the two runs (default: their ids)")
    p = add("status", help="where a run stands: each stage, the live job, its step, cost and supervisor")
    p.add_argument("run", nargs="?", help="run id under --storage, or a run folder / s3:// URI (default: every run)")
    p.add_argument("--storage", help="storage root: a folder or s3://bucket/prefix (default: ./runs)")
    p = add("stop", help="stop a run's live job at a checkpoint (from any terminal) and record it")
    p.add_argument("run", help="run id under --storage, or a run folder / s3:// URI")
    p.add_argument("--storage", help="storage root: a folder or s3://bucket/prefix (default: ./runs)")
    p.add_argument(
        "--wait", type=float, default=600.0, metavar="SECONDS",
        help="how long to wait for the job to end (default: 600; Ctrl-C stops waiting, not the stop)",
    )  # fmt: skip
    add("presets", help="list presets with their key figures")
    p = add("config", help="print the resolved config as JSON")
    add_run_options(p)
    p = add("plan", help="rank TP/PP/DP, SP, ZeRO-1, checkpointing and micro-batch layouts on trn1, with time and cost")
    _add_config_options(p)
    p.add_argument("--nodes", type=_positive_int, help="nodes (default: the preset's job.instance_count)")
    p.add_argument(
        "--tokens",
        type=_token_count,
        help="token budget, e.g. 1.8e12 or 1.8T (default: training.max_steps x tokens per step)",
    )
    p.add_argument("--top", type=_positive_int, default=10, help="layouts shown (default: 10)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p = add("prices", help="today's SageMaker training prices from the AWS Price List API, beside the catalog's")
    _add_config_options(p)
    p.add_argument("--region", help="the region priced (default: the config's job.region)")
    p.add_argument(
        "--instance-type",
        dest="instance_types",
        action="append",
        default=[],
        metavar="TYPE",
        help="an ml. instance type (repeatable; default: every type in the catalog)",
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="write the listed prices, with their SKU, effective date and today's date, into the catalog's price "
        "file (infra/cost/prices.json), replacing derived figures",
    )
    p = add("deploy", help="register deployments/prefect.yaml on the Prefect API (prefect deploy, checked)")
    p.add_argument(
        "--name",
        dest="names",
        action="append",
        default=[],
        metavar="PATTERN",
        help="deploy only these deployments, by name or glob, e.g. --name '*-tiny' (repeatable; default: all)",
    )
    _add_pool_type(p, "type of the work pool when it is created")
    _add_stack(p)
    p.add_argument(
        "--alerts-block",
        metavar="TYPE/NAME",
        help="Prefect notification block the alert automations send through, e.g. slack-webhook/hlat-alerts "
        "(default: the deployments' alerts.block, or HLAT_ALERTS_BLOCK)",
    )
    p.add_argument(
        "--allow-open-server",
        action="store_true",
        help="register AWS deployments on a Prefect API that answers without credentials (refused otherwise, "
        "except a process pool on this machine's loopback)",
    )
    p = add("worker", help="create the work pool if missing and start a worker on it")
    p.add_argument("--pool", default=DEFAULT_POOL, help=f"work pool (default: {DEFAULT_POOL})")
    _add_pool_type(p, "worker and pool type")
    p.add_argument("--limit", type=_positive_int, help="most flow runs at once (default: no limit)")
    p.add_argument("--name", help="worker name (default: Prefect's)")
    _add_stack(p)
    p.add_argument(
        "--allow-open-server",
        action="store_true",
        help="serve the stack's ECS pool from a Prefect API that answers without credentials (refused otherwise)",
    )
    p = add("preflight", help="check the account, role, storage, images, quotas and data source before a run")
    add_run_options(p)
    return parser


def _add_stack(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stack",
        help="the CloudFormation stack of deployments/account.yaml: the ECS pool's template, HLAT_S3_ROOT and the "
        "Secret block hlat-sagemaker-role from its outputs (pool type ecs unless --type)",
    )
    p.add_argument("--region", help="the stack's region (default: boto3's, e.g. AWS_DEFAULT_REGION)")


def _add_pool_type(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--type",
        dest="pool_type",
        choices=POOL_TYPES,
        help=f"{what}: process (this host), ecs or kubernetes (production) (default: the existing pool's type; "
        "process for a new pool)",
    )


def _overrides(items: list[str]) -> dict[str, Any]:
    return dict(parse_override(item) for item in items)


def command_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The command's one overrides dict: its --config file's fields as dotted paths, then its --set ones (a --set
    wins over the file). Without --preset, `args.preset` becomes the file's `preset:`, else DEFAULT_PRESET."""
    file_preset, overrides = read_config_file(args.config_file) if args.config_file else (None, {})
    if args.preset is None:
        args.preset = file_preset or DEFAULT_PRESET
    overrides.update(_overrides(args.overrides))
    return overrides


def read_config_file(path: str) -> tuple[str | None, dict[str, Any]]:
    """A --config file: its `preset:` (None if it names none) and its fields as dotted-path overrides
    (core.config.flatten_config: sections are descended into, any other value, data.sources included, is one
    field). A missing file, bad YAML or JSON (with its line), a top level that is not a mapping, an unknown preset
    or an unknown field is a ConfigError of one line naming the file."""
    data = _parse_config_file(Path(path))
    if data is None:  # an empty file (or every line commented out): the preset as it is
        return None, {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of config sections (e.g. 'training: {{max_steps: 100}}'), "
            f"not a {type(data).__name__}"
        )
    data = dict(data)
    preset = data.pop("preset", None)
    if preset is not None and preset not in PRESETS:
        close = closest_match(str(preset), list(PRESETS))
        hint = f"did you mean {close!r}? " if close else ""
        raise ConfigError(f"{path}: preset: unknown preset {preset!r}; {hint}(choose from {', '.join(PRESETS)})")
    overrides = flatten_config(data)
    for dotted, value in overrides.items():
        if not _finite(value):  # YAML's .inf and .nan: refused as --set refuses them
            raise ConfigError(f"{path}: {dotted}: values must be finite")
    try:
        apply_overrides({}, overrides)  # every path known: the same message as --set's, naming the file
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return preset, overrides


def _finite(value: Any) -> bool:
    """No inf or nan anywhere in a value (lists and mappings included)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(map(_finite, value.values()))
    if isinstance(value, list):
        return all(map(_finite, value))
    return True


def _parse_config_file(file: Path) -> Any:
    """The file's content as plain data, by its extension: YAML (PyYAML's safe loader) or JSON."""
    suffix = file.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"{file}: a config file is YAML (.yaml, .yml) or JSON (.json), not {suffix or 'no suffix'!r}")
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: cannot be read: {exc}") from None
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file}: not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{file}: not valid YAML{where}: {problem}") from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _token_count(text: str) -> float:
    """'1.8e12', '1800000000000' or '1.8T' (K, M, B, T suffixes)."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(text[-1:].upper(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count; use e.g. 1.8e12 or 1.8T") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the token budget must be > 0, got {text!r}")
    return value


FLOW_COMMANDS = ("pretrain", "run")  # the commands that run flows: their whole log goes to a file


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = CommandLog(args.command)
    runs_flows = args.command in FLOW_COMMANDS and not getattr(args, "dry_run", False)
    try:
        if runs_flows:
            log.attach(verbose=args.verbose)
        return _dispatch(args, log.path if runs_flows else None)
    except ConfigError as exc:
        print(f"hlat: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        if runs_flows:
            _cancel_interrupted(log)
        print(f"hlat: interrupted: {exc}" if isinstance(exc, Interrupted) else "hlat: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        log.write(traceback.format_exc())
        if args.verbose:
            traceback.print_exc()
        errors = command_module(ERRORS)
        if errors.stopped_by_user(exc):  # `hlat stop` from another terminal: a deliberate end, not a failure
            _cancel_interrupted(log)
            print(f"hlat: stopped: {exc}", file=sys.stderr)
            return 0
        known = errors.known_error(exc)
        cause = known if known is not None else f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        print(f"hlat: error: {cause}", file=sys.stderr)
        if runs_flows or known is None:
            print(f"hlat: the full log: {log.path}", file=sys.stderr)
        return 1


def _cancel_interrupted(log: CommandLog) -> None:
    """The runs Ctrl-C or `hlat stop` ended are Cancelled, not Crashed or Failed (cli_log.Interruptions); a second
    Ctrl-C skips it."""
    with contextlib.suppress(KeyboardInterrupt):
        log.interruptions.cancel()


class Command(NamedTuple):
    """Where a command's handler lives: `hlat.commands.<module>.<handler>`."""

    module: str
    handler: str
    config: bool = False  # takes --preset, --config and --set: the handler gets the command's overrides too


COMMANDS = {
    "pretrain": Command("flows", "run_flow", config=True),
    "run": Command("flows", "run_flow", config=True),
    "preflight": Command("preflight", "preflight_command", config=True),
    "presets": Command("planning", "presets"),
    "config": Command("planning", "show_config", config=True),
    "plan": Command("planning", "plan", config=True),
    "prices": Command("prices", "prices", config=True),
    "status": Command("runs", "status"),
    "stop": Command("runs", "stop"),
    "compare": Command("runs", "compare"),
    "export": Command("checkpoints", "export"),
    "average": Command("checkpoints", "average"),
    "deploy": Command("deploy", "deploy"),
    "worker": Command("deploy", "worker"),
}
ERRORS = "errors"  # hlat.commands.errors: which failures print as one line, read when a command fails


def command_module(name: str) -> ModuleType:
    """`hlat.commands.<name>`, imported when one of its commands runs (or, `errors`, when one fails).

    The CLI's one lazy import, for start-up time: the command modules import Prefect, torch or boto3 at their top,
    and `hlat --help`, `hlat presets` or a mistyped option must not wait for them."""
    return importlib.import_module(f"hlat.commands.{name}")


def _dispatch(args: argparse.Namespace, log_path: Path | None = None) -> int:
    command = COMMANDS[args.command]
    # The overrides first: a bad --config file or --set fails before the command's module is imported.
    overrides = command_overrides(args) if command.config else None
    handler = getattr(command_module(command.module), command.handler)
    if overrides is None:
        return int(handler(args))
    if args.command in FLOW_COMMANDS:
        return int(handler(args, overrides, log_path))
    return int(handler(args, overrides))


if __name__ == "__main__":
    sys.exit(main())
