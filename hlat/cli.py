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
import json
import math
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hlat.core.config import ConfigError, apply_overrides, closest_match, flatten_config, parse_override
from hlat.core.presets import PRESETS, load_config
from hlat.core.stages import stage, stage_names, stages, training_stage
from hlat.deploy import DEFAULT_POOL, POOL_TYPES
from hlat.flows.params import build_config, handing_over

if TYPE_CHECKING:
    from hlat.infra.cost.pricing import ListedPrice


def _add_run_options(p: argparse.ArgumentParser) -> None:
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
    _add_run_options(p)
    _add_dry_run(p)
    p = add("run", help="run one stage flow alone")
    p.add_argument("stage", choices=stage_names())
    _add_run_options(p)
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
    _add_run_options(p)
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
    from hlat.preflight_cli import add_preflight_arguments

    p = add("preflight", help="check the account, role, storage, images, quotas and data source before a run")
    add_preflight_arguments(p)
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
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{file}: not valid YAML{where}: {problem}") from None


def check_mixture(config: Any, *, show: bool) -> None:
    """Refuse (ConfigError naming the source and its numbers) a run that would repeat a source of its data mixture
    more often than that source's max_epochs (core.mixture.check_repetition), before anything starts; `show`:
    print the per-source table first (dry run, plan), so the refusal comes with the numbers of every source."""
    from hlat.core.mixture import check_repetition

    try:
        check_repetition(config)
    except ConfigError:
        if show:
            from hlat.infra.stage_jobs import source_lines

            print("\n".join(source_lines(config)))
        raise


def presets_table() -> str:
    head = (
        "preset",
        "params",
        "layers",
        "d_model",
        "heads/kv",
        "seq",
        "vocab",
        "batch",
        "lr",
        "precision",
        "TPxPP",
        "nodes",
    )
    rows = [head]
    for name in PRESETS:
        c = load_config(name)
        m, t = c.model, c.training
        rows.append(
            (
                name,
                _human(m.num_params()),
                str(m.n_layers),
                str(m.d_model),
                f"{m.n_heads}/{m.kv_heads}",
                str(t.seq_len),
                str(m.vocab_size),
                str(t.global_batch_size),
                f"{t.lr:g}",
                c.precision.mode,
                f"{c.parallelism.tensor}x{c.parallelism.pipeline}",
                f"{c.job.instance_count} x {c.job.instance_type}",
            )
        )
    return "\n".join(columns(rows))


def columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


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


def _plan(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    from hlat.core.mixture import source_draws
    from hlat.infra.cost import planner
    from hlat.infra.stage_jobs import data_estimate, for_tokens, source_lines

    config = load_config(args.preset, overrides)
    # The sources' draws of the budget planned (--tokens, else the run's): a budget that would repeat a source past
    # its max_epochs is refused with the table (exit 2), as the run itself would be.
    budgeted = for_tokens(config, args.tokens) if args.tokens else config
    check_mixture(budgeted, show=not args.json)
    instance_type, note = planner.planning_instance(config)
    the_plan = planner.plan(config, nodes=args.nodes, instance_type=instance_type)
    if note:
        the_plan.notes.append(note)
    tokens = args.tokens or planner.default_tokens(config)
    costs = planner.compare_instances(config, the_plan, tokens) if the_plan.ranked else []
    data = data_estimate(config, tokens)  # the text behind those tokens, prepared before training
    if args.json:
        body = {**the_plan.to_dict(top=args.top), "tokens": tokens, "costs": [c.row() for c in costs]}
        body["prepare_data"] = {
            "bytes": data.bytes, "hours": round(data.hours, 3), "usd": None if data.usd is None else round(data.usd, 2),
            "workers": data.workers, "instances": data.instances, "instance_type": data.instance_type,
            "mb_per_s_per_worker": data.mb_per_s_per_worker, "basis": data.basis,
        }  # fmt: skip
        body["sources"] = [
            {"name": d.name, "share": round(d.share, 6), "tokens": d.tokens, "source_tokens": d.available,
             "epochs": None if d.epochs is None else round(d.epochs, 4), "max_epochs": d.max_epochs}
            for d in source_draws(budgeted)
        ]  # fmt: skip
        print(json.dumps(body, indent=2))
    else:
        print(planner.render(the_plan, costs, top=args.top, also=[data.line()], sources=source_lines(budgeted)))
        from hlat.infra.inputs.init_from import model_notes

        for note in model_notes(config):
            print(note)
    return 0


def _prices(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    from botocore.exceptions import BotoCoreError, ClientError

    from hlat.infra.cost.catalog import CATALOG
    from hlat.infra.cost.pricing import API_REGION, record_prices, training_prices

    config = load_config(args.preset, overrides)
    region = args.region or config.job.region
    types = args.instance_types or [name for name in CATALOG if name.startswith("ml.")]
    try:
        listed = training_prices(types, region)
    except (BotoCoreError, ClientError) as exc:  # no credentials, no network, access denied: one line, the cause
        raise ConfigError(
            f"the AWS Price List API ({API_REGION}) did not answer: {type(exc).__name__}: {exc}; it needs AWS "
            "credentials allowed pricing:GetProducts"
        ) from exc
    print(prices_table(types, region, listed, config.job.instance_type))
    if args.record:
        from hlat.infra.cost.catalog import PRICES

        recorded = record_prices(listed, datetime.now(UTC))
        print(f"recorded {len(recorded)} price(s) from the AWS Price List API ({region}) in {PRICES}")
    return 0


def prices_table(types: list[str], region: str, listed: dict[str, ListedPrice | None], run_type: str) -> str:
    """The catalog's price of each type beside the Price List's, and the setting that uses the listed one."""
    from hlat.infra.cost.catalog import CATALOG

    rows = [("instance type", "catalog $/h", "catalog's source", f"AWS Price List, {region}, $/h", "since")]
    for name in types:
        known, now = CATALOG.get(name), listed.get(name)
        source: str = known.price.basis if known and known.price else "-"
        if known and known.price and known.price.basis == "price-list":
            source = f"price list, {known.price.region}, read {known.price.read_at[:10]}"
        rows.append(
            (
                name,
                f"{known.price_per_hour_usd:,.3f}" if known else "-",
                source,
                f"{now.usd_per_hour:,.3f}" if now else "not offered",
                now.effective if now else "",
            )
        )
    lines = columns(rows)
    ours = listed.get(run_type)
    if ours is not None:
        lines.append(f"this run ({run_type}): --set job.price_per_hour_usd={ours.usd_per_hour:g}")
    others = {n: p.usd_per_hour for n, p in listed.items() if p is not None}
    if others:
        lines.append(f"the planner: --set 'planner.prices_usd_per_hour={json.dumps(others)}'")
    return "\n".join(lines)


FLOW_COMMANDS = ("pretrain", "run")  # the commands that run flows: their whole log goes to a file


def main(argv: Sequence[str] | None = None) -> int:
    from hlat.cli_log import CommandLog

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
        if _stopped_by_user(exc):  # `hlat stop` from another terminal: a deliberate end, not a failure
            _cancel_interrupted(log)
            print(f"hlat: stopped: {exc}", file=sys.stderr)
            return 0
        known = _known_error(exc)
        cause = known if known is not None else f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        print(f"hlat: error: {cause}", file=sys.stderr)
        if runs_flows or known is None:
            print(f"hlat: the full log: {log.path}", file=sys.stderr)
        return 1


def _stopped_by_user(exc: BaseException) -> bool:
    from hlat.infra.supervision.errors import StoppedByUser

    return isinstance(exc, StoppedByUser)


def _cancel_interrupted(log: Any) -> None:
    """The runs Ctrl-C or `hlat stop` ended are Cancelled, not Crashed or Failed (cli_log.Interruptions); a second
    Ctrl-C skips it."""
    with contextlib.suppress(KeyboardInterrupt):
        log.interruptions.cancel()


def _known_error(exc: BaseException) -> str | None:
    """User-facing errors print as one line; anything else keeps its traceback."""
    from hlat.core.storage import StorageError
    from hlat.deploy import DeployError
    from hlat.infra.supervision.errors import SupervisorError
    from hlat.tasks.burn_in import BurnInFailed
    from hlat.training.checkpoint import CheckpointError
    from hlat.training.data.sources import SourceError
    from hlat.training.data.validation import DataValidationError

    known = (
        DeployError,
        SourceError,
        StorageError,
        DataValidationError,
        SupervisorError,
        BurnInFailed,
        CheckpointError,
        ValueError,
    )
    if isinstance(exc, known):
        return str(exc)
    return None


def _dispatch(args: argparse.Namespace, log_path: Path | None = None) -> int:
    if args.command == "presets":
        print(presets_table())
        return 0
    if args.command == "export":
        return _export(args)
    if args.command == "average":
        return _average(args)
    if args.command == "compare":
        return _compare(args)
    if args.command == "status":
        return _status(args)
    if args.command == "stop":
        return _stop(args)
    if args.command == "deploy":
        from hlat.deploy import deploy

        return deploy(
            args.names,
            pool_type=args.pool_type,
            stack=args.stack,
            region=args.region,
            alerts_block=args.alerts_block,
            allow_open_server=args.allow_open_server,
        )
    if args.command == "worker":
        from hlat.deploy import worker

        worker(args.pool, pool_type=args.pool_type, limit=args.limit, name=args.name, stack=args.stack,
               region=args.region, allow_open_server=args.allow_open_server)  # fmt: skip
    overrides = command_overrides(args)
    if args.command == "preflight":
        from hlat.preflight_cli import preflight_command

        return preflight_command(args, overrides)
    if args.command == "plan":
        return _plan(args, overrides)
    if args.command == "prices":
        return _prices(args, overrides)
    if args.command == "config":
        config = load_config(args.preset, overrides, run_id=args.run_id, storage=args.storage)
        print(json.dumps(config.model_dump(mode="json") | {"run_id": config.resolved_run_id()}, indent=2))
        return 0
    # The command's one config: a bad one fails here, before Prefect starts (an ephemeral API takes seconds to come
    # up); the flow the command runs is handed this one (handing_over), not a second.
    config = build_config(args.preset, overrides, args.run_id, args.storage)
    # A run that would repeat a source past its max_epochs is refused here: before any job is shown or sent, and
    # before a server starts (the dry run shows the per-source table with the refusal).
    check_mixture(config, show=args.dry_run)
    if args.dry_run:
        from hlat.infra.stage_jobs import dry_run

        if args.command == "run" and stage(args.stage).runs_on is None:
            print(f"hlat: --dry-run shows a stage's job; {args.stage} runs in the flow's own process", file=sys.stderr)
            return 2
        from hlat.infra.checks.aws import AwsBlockError
        from hlat.tasks.aws import with_role

        try:
            config = with_role(config)
        except AwsBlockError as exc:  # shown with the placeholder role, as when none is set
            print(f"hlat: note: {exc}", file=sys.stderr)
        print(dry_run(config, stage=args.stage if args.command == "run" else training_stage().name))
        from hlat.preflight_cli import print_preflight

        print()
        print_preflight(config)  # what the run would meet on AWS; the dry run itself sends nothing
        return 0
    from hlat.preflight_cli import check_before_start

    # A run its storage refuses, a source that cannot be read, and (AWS) an account not ready fail here, in a line
    # each, before a server starts or a run opens.
    check_before_start(config, reads_source=args.command == "pretrain" or stage(args.stage).prepares_sources)
    flow_fn, params = flow_call(args, overrides)
    _identify_supervisor("hlat pretrain" if args.command == "pretrain" else f"hlat run {args.stage}")
    from hlat.temporary_server import start_temporary_server

    start_temporary_server(log_path)  # out of the terminal's process group: Ctrl-C interrupts the flow, not its API
    start = time.perf_counter()
    try:
        with handing_over(config, args.preset, overrides, args.run_id, args.storage):
            flow_fn(**params)
    except KeyboardInterrupt:
        raise Interrupted(where_interrupted(config)) from None
    print(f"hlat: {args.command} finished in {time.perf_counter() - start:.1f} s")
    return 0


def _identify_supervisor(command: str) -> None:
    """The heartbeat of the stages this command supervises names it and its flow run (infra.supervision.supervisor)."""
    from hlat.flows.stage import flow_run_identity
    from hlat.infra.supervision.lease import set_identity

    set_identity(lambda: (flow_run_identity()[0], command))


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a flow, with what the user needs to know: where the run stands, and how to go on."""


def where_interrupted(config: Any) -> str:
    """'the job stopped with its checkpoint at step N; run the same command to resume' (the flow stopped any
    running job on its way out: `infra.supervision.supervisor.follow`)."""
    from hlat.core.run import run_for
    from hlat.tasks.train import latest_checkpoint

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
    if args.command == "pretrain":
        from hlat.flows.pretrain import hlat

        flow_fn: Any = hlat
    else:
        from hlat.flows.pretrain import stage_flow_of

        flow_fn = stage_flow_of(stage(args.stage))
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


def _located_run(args: argparse.Namespace) -> Any:
    """The run `hlat status RUN` / `hlat stop RUN` names (its config.json read and validated here, once), with the
    AWS credentials block its config names (if any) made this process's credentials."""
    from hlat.core.run import Run
    from hlat.infra.supervision import status

    run = Run.of(status.locate(args.run, args.storage))
    job = run.config.job
    if job.aws_credentials_block:
        from hlat.tasks.aws import activate

        activate(job)
    return run


def _status(args: argparse.Namespace) -> int:
    from hlat.core.storage import Storage
    from hlat.infra.supervision import status

    if args.run is None:
        print(status.list_runs(Storage(args.storage or "./runs")))
        return 0
    print(status.render(status.run_status(_located_run(args))))
    return 0


def _stop(args: argparse.Namespace) -> int:
    from hlat.infra.supervision import status

    run = _located_run(args)
    results = status.stop_run(run, wait_s=args.wait, say=lambda text: print(f"hlat: {text}", flush=True))
    print(status.stop_summary(results, args.run))
    return 0


def _export(args: argparse.Namespace) -> int:
    from hlat.infra.inputs.tokenizer import export_hf_tokenizer
    from hlat.training.checkpoint.hf_export import export_checkpoint

    start = time.perf_counter()
    out, ref = export_checkpoint(
        args.source, args.out, step=args.step, tokenizer=args.tokenizer, build_tokenizer_json=export_hf_tokenizer
    )
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"hlat: exported {ref.uri} (step {ref.step}) to {out} in {time.perf_counter() - start:.1f} s: {files}")
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"  load it with transformers: {architecture}.from_pretrained({str(out)!r})")
    return 0


def _average(args: argparse.Namespace) -> int:
    from hlat.training.checkpoint.average import average_checkpoints

    start = time.perf_counter()
    averaged = average_checkpoints(args.run, args.last, out=args.out)
    steps = ", ".join(map(str, averaged.steps))
    print(f"hlat: averaged the model weights of steps {steps} ({averaged.layout}) into {averaged.uri} in "
          f"{time.perf_counter() - start:.1f} s (optimizer state left out)")  # fmt: skip
    print(f"  export it: hlat export {averaged.uri} <out> (--tokenizer <run>/tokenizer when it is not in the run)")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from hlat.core.layout import compare_path
    from hlat.core.run import Run
    from hlat.core.storage import Storage
    from hlat.infra.reports.eval_report import compare_line, compare_runs

    a, b = Run.at(args.run_a.rstrip("/")), Run.at(args.run_b.rstrip("/"))
    labels = tuple(args.labels) if args.labels else (a.run_id, b.run_id)
    out = Storage(args.out) if args.out else a.storage.child(compare_path(labels[1]))
    summary = compare_runs(a, b, out, labels=labels)
    print(f"hlat: compared {labels[0]} and {labels[1]} over {summary['common_steps']} common steps")
    for key in ("loss", "grad_norm"):
        d = summary.get(key) or {}
        if d:
            print(f"  {compare_line(key, d)}")
    for name, uri in summary.get("files", {}).items():
        print(f"  {name}: {uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
