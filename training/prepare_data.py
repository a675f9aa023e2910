"""The prepare-data job: `python -m hlat.training.prepare_data --config <run>/config.json --key <key> --sources
<json>`.

Rules:
- each source is prepared on its own into `<storage root>/sources/<name>-<key>/`, once per key.
- each host starts its data.workers / H workers as child processes; a dead one restarts alone.
- host 0 plans, merges, and finally writes the run's mixture manifest and report.
- exit 0 done, EXIT_DATA_INVALID (6) for data breaking its policy (not relaunched), 1 otherwise.
- a relaunched job continues from its key's plan and committed units.
docs/stages.md ("prepare-data") explains the stage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hlat
from hlat.core.config import ConfigError, DataConfig, HlatConfig, SourceConfig
from hlat.core.contract import EXIT_DATA_INVALID, read_job_config, write_failure
from hlat.core.layout import DATA_DIR, source_folder
from hlat.core.run import Run
from hlat.core.storage import Storage
from hlat.training.data.reader import Unit
from hlat.training.data.sources import SourceError
from hlat.training.data.units import (
    assign,
    committed,
    curate_units,
    merge,
    plan,
    prepared,
    run_worker,
    work_dir,
    write_mixture,
)
from hlat.training.data.validation import DataValidationError
from hlat.training.hooks import hooks

log = logging.getLogger("hlat.data")

WORKER_FAILURE_ENV = "HLAT_WORKER_FAILURE"
POLL_S = 0.5


def hosts() -> tuple[int, int]:
    """(this host's index, the number of hosts) of the job."""
    names = json.loads(os.environ.get("SM_HOSTS", '["algo-1"]'))
    current = os.environ.get("SM_CURRENT_HOST", names[0])
    return names.index(current), len(names)


def host_workers(workers: int, host: int, count: int) -> range:
    """The workers host `host` of `count` runs: a contiguous block of ceil(workers / count)."""
    per = -(-workers // count)
    return range(min(host * per, workers), min((host + 1) * per, workers))


def shares(cfg: DataConfig, units: list[Unit]) -> list[list[Unit]]:
    """Each worker's units; with max_documents the plan is read in order by worker 0 (the limit is a prefix)."""
    if cfg.max_documents is not None:
        return [units] + [[] for _ in range(cfg.workers - 1)]
    return assign(units, cfg.workers)


def job_sources(cfg: HlatConfig, given: str) -> list[tuple[SourceConfig, str]]:
    """The sources of the mixture with the keys the stage gave them (`--sources`, a JSON object name -> key)."""
    keys = json.loads(given)
    sources = cfg.data.mixture
    names = [s.resolved_name for s in sources]
    if sorted(keys) != sorted(names):
        raise ConfigError(f"--sources names {sorted(keys)}, but the config's sources are {names}")
    return [(s, keys[s.resolved_name]) for s in sources]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlat.training.prepare_data", description=__doc__)
    parser.add_argument("--config", required=True, help="path or s3:// URI of the run's config.json")
    parser.add_argument("--key", required=True, help="the stage's cache key: the run's mixture manifest carries it")
    parser.add_argument("--sources", required=True, help="JSON object: each source's name -> its cache key")
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--life", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # datatrove's dedup steps draw tqdm bars into the job's log; tqdm reads this when it is first imported (below).
    os.environ.setdefault("TQDM_DISABLE", "1")
    prefix = f"worker{args.worker} " if args.worker is not None else "prepare-data "
    logging.basicConfig(level=logging.INFO, format=prefix + "%(message)s", force=True)
    _quiet_great_expectations(worker=args.worker is not None)
    run = read_job_config(args.config.rstrip("/"))
    cfg = run.config
    try:
        sources = job_sources(cfg, args.sources)
        if args.worker is not None:
            source, key = next((s, k) for s, k in sources if s.resolved_name == args.only)
            data_cfg = cfg.data.source_data_config(source)
            return _worker(data_cfg, source_folder(run.root, source.resolved_name, key), work_dir(key), args.worker,
                           args.life)  # fmt: skip
        return _all_sources(cfg, run, sources, args)
    except (DataValidationError, SourceError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        log.error("%s", reason)
        _report(reason)
        return EXIT_DATA_INVALID
    except Exception as exc:
        _report(f"{type(exc).__name__}: {exc}")
        raise


def _quiet_great_expectations(worker: bool) -> None:
    """Quiet great-expectations' own INFO logging to warnings (one of its loggers resets its level after import)."""
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    if worker:
        import great_expectations  # noqa: F401

        logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.WARNING)


def _report(reason: str) -> None:
    """A worker tells its host (a file the host named); the host tells the job's backend (the failure file)."""
    path = os.environ.get(WORKER_FAILURE_ENV)
    if path:
        Path(path).write_text(reason, encoding="utf-8")
    else:
        write_failure(reason)


def _worker(cfg: DataConfig, data: Storage, work: str, worker: int, life: int) -> int:
    units = plan(cfg, data, work)
    mine = shares(cfg, units)[worker]
    job = os.environ.get("TRAINING_JOB_NAME", "")
    on_batch = hooks().prepared_batch(worker, life, job)
    extra = {"on_batch": on_batch} if on_batch else {}
    run_worker(cfg, data, work, mine, worker, limit=cfg.max_documents, job=job, **extra)
    return 0


def _all_sources(cfg: HlatConfig, run: Run, sources: list[tuple[SourceConfig, str]], args: argparse.Namespace) -> int:
    """Prepare each source not prepared yet, in order; then host 0 writes the run's mixture manifest and report."""
    host, count = hosts()
    folders = []
    for source, key in sources:
        name = source.resolved_name
        folder = source_folder(run.root, name, key)
        folders.append(folder)
        if prepared(folder, key):
            log.info("source %s: prepared before (%s)", name, folder.uri())
            continue
        _host(cfg.data.source_data_config(source), folder, key, name, args, host, count, cfg.evaluation.tasks)
    if host != 0:
        return 0
    while not all(prepared(folder, key) for folder, (_, key) in zip(folders, sources, strict=True)):
        time.sleep(POLL_S * 4)  # the other hosts' share of the last source (host 0 merges it: never long)
    report = write_mixture(cfg.data, run.stage(DATA_DIR), [(s, f) for (s, _), f in zip(sources, folders, strict=True)],
                           args.key)  # fmt: skip
    log.info(
        "%d source(s): %d rows read = %d kept + %d removed %s", len(sources), report.rows_read, report.rows_kept,
        report.rows_quarantined, report.quarantined_by_reason,
    )  # fmt: skip
    return 0


def _host(
    cfg: DataConfig,
    data: Storage,
    key: str,
    name: str,
    args: argparse.Namespace,
    host: int,
    count: int,
    evaluation_tasks: list[str],
) -> None:
    """One source on this host: its workers, then its share of curation, then (host 0) the merge."""
    started = time.time()
    work = work_dir(key)
    if host != 0:  # host 0 writes the plan
        while not data.exists(f"{work}/plan.json"):
            time.sleep(POLL_S)
    units = plan(cfg, data, work)
    mine = [w for w in host_workers(cfg.workers, host, count) if shares(cfg, units)[w]]
    log.info(
        "source %s: %d units of %s; host %d of %d runs worker(s) %s", name, len(units), cfg.source, host, count,
        ", ".join(map(str, mine)) or "none",
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hlat-prepare-") as tmp:
        _supervise_workers(args, name, mine, cfg.worker_retries, Path(tmp))
    _await_units(data, work, units, cfg)
    workers = len(host_workers(cfg.workers, host, count))
    curated = curate_units(
        cfg, data, work, units, evaluation_tasks=evaluation_tasks, host=host, hosts=count, workers=max(workers, 1)
    )
    if host != 0:
        return
    report = merge(cfg, data, work, units, key, started=started, curated=curated)
    log.info(
        "source %s: merged %d units: %d rows read = %d kept + %d quarantined %s; %d duplicates across units",
        name, report.units, report.rows_read, report.rows_kept, report.rows_quarantined, report.quarantined_by_reason,
        report.cross_unit_duplicates,
    )  # fmt: skip


class WorkerFailed(RuntimeError):
    """A worker died more often than data.worker_retries allows."""


def _supervise_workers(args: argparse.Namespace, name: str, workers: list[int], retries: int, tmp: Path) -> None:
    """Run source `name`'s workers as child processes; restart a dead one alone; stop all on a data error."""
    lives = dict.fromkeys(workers, 1)
    procs = {w: _start(args, name, w, 1, tmp) for w in workers}
    try:
        while procs:
            time.sleep(POLL_S)
            for w, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[w]
                if code == 0:
                    continue
                failure = tmp / f"worker-{w}.failure"
                reason = failure.read_text(encoding="utf-8") if failure.exists() else ""
                if code == EXIT_DATA_INVALID:
                    kind, _, message = reason.partition(": ")
                    raise (SourceError if kind == "SourceError" else DataValidationError)(message or reason)
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
                if lives[w] > retries:
                    raise WorkerFailed(
                        f"worker {w} died {lives[w]} times ({how}{': ' + reason if reason else ''}); "
                        "its committed units are kept for the next attempt"
                    )
                lives[w] += 1
                log.warning("worker %d died (%s): starting it again, alone (life %d of %d)", w, how, lives[w],
                            retries + 1)  # fmt: skip
                procs[w] = _start(args, name, w, lives[w], tmp)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def _start(args: argparse.Namespace, name: str, worker: int, life: int, tmp: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, WORKER_FAILURE_ENV: str(tmp / f"worker-{worker}.failure")}
    env.setdefault("OMP_NUM_THREADS", "1")  # one core per worker: the workers are the parallelism
    command = [sys.executable, "-m", "hlat.training.prepare_data", "--config", args.config, "--key", args.key,
               "--sources", args.sources, "--only", name, "--worker", str(worker), "--life", str(life)]  # fmt: skip
    # From the folder holding the hlat package this program runs from (the checkout, or a job's uploaded source), where
    # `-m` finds the same package.
    return subprocess.Popen(command, env=env, cwd=Path(hlat.__file__).resolve().parents[1])


def _await_units(data: Storage, work: str, units: list[Unit], cfg: DataConfig) -> None:
    """Wait until every unit to read is committed (the other hosts' workers write theirs)."""
    if cfg.max_documents is not None:
        return  # worker 0 (this host) read the prefix it needed
    waiting = [u for u in units if committed(data, work, u) is None]
    while waiting:
        time.sleep(POLL_S * 4)
        waiting = [u for u in waiting if committed(data, work, u) is None]


if __name__ == "__main__":
    sys.exit(main())
