"""The job's gloo group as init_world forms it (training/parallel/distributed.py): lazily connected
(TORCH_GLOO_LAZY_INIT=1: no socket to any peer until a collective needs one, where gloo's default full mesh opens one
to every other rank at once), with job.collective_timeout_minutes as its deadline, and the open-file limit raised at
start. Four real gloo ranks on CPU."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from tests.integration.conftest import free_port

pytestmark = pytest.mark.slow

RANKS = 4


def sockets() -> int:
    """This process's open sockets."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return count


def rank_main(rank: int, port: int, out: str, lazy: str | None, timeout_minutes: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    if lazy is not None:
        os.environ["TORCH_GLOO_LAZY_INIT"] = lazy  # init_world keeps a value the job's environment sets
    import resource

    import torch
    import torch.distributed as dist

    from hlat.core.presets import load_config
    from hlat.training.parallel.distributed import close_world, init_world

    cfg = load_config(
        "tiny",
        {
            "job.processes_per_node": RANKS,
            "training.micro_batch_size": 2,
            "job.collective_timeout_minutes": timeout_minutes,
        },
        run_id="g",
    )
    before = sockets()
    world = init_world("cpu", cfg)
    result: dict[str, Any] = {"formed": sockets() - before, "lazy": os.environ.get("TORCH_GLOO_LAZY_INIT")}
    result["nofile"] = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Every rank counts before any rank runs a collective: a peer's first collective would connect to this rank
    # before it counted (seen on a loaded machine). The barrier is files, not a collective, to open no gloo socket.
    Path(out, f"counted-{rank}").touch()
    while len(list(Path(out).glob("counted-*"))) < RANKS:
        time.sleep(0.05)
    world.all_reduce(torch.ones(1))
    result["after_all_reduce"] = sockets() - before
    if timeout_minutes < 1:
        # Rank 0 alone in a collective: it fails at the group's deadline, not gloo's 30 minutes.
        if rank == 0:
            began = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1))
                result["timed_out_after"] = None
            except Exception as exc:
                result["timed_out_after"] = time.monotonic() - began
                result["error"] = str(exc)[:300]
        else:
            time.sleep(timeout_minutes * 60 + 5)
    Path(out, f"rank-{rank}.json").write_text(json.dumps(result))
    if timeout_minutes < 1:
        os._exit(0)  # the group is broken on purpose: no orderly teardown
    close_world()


def run_ranks(tmp_path: Path, lazy: str | None, timeout_minutes: float = 20.0) -> list[dict[str, Any]]:
    context = mp.start_processes(
        rank_main, args=(free_port(), str(tmp_path), lazy, timeout_minutes), nprocs=RANKS, start_method="spawn",
        join=False,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while not context.join(timeout=1):
        assert time.monotonic() < deadline, "the ranks did not end"
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(RANKS)]


def test_the_group_opens_no_peer_socket_until_a_collective_where_the_full_mesh_opens_one_to_every_rank(
    tmp_path: Path,
) -> None:
    (tmp_path / "lazy").mkdir()
    (tmp_path / "mesh").mkdir()
    lazy = run_ranks(tmp_path / "lazy", None)  # init_world's default
    mesh = run_ranks(tmp_path / "mesh", "0")  # gloo's full mesh, as without the switch
    assert {r["lazy"] for r in lazy} == {"1"}
    # The full mesh: a socket to every peer once the group exists. Lazily: none yet; the first collective connects
    # the peers it needs. (Rank 0 also holds the store's server, whose accepted connections vary: not counted.)
    for lazy_rank, mesh_rank in list(zip(lazy, mesh, strict=True))[1:]:
        assert mesh_rank["formed"] - lazy_rank["formed"] >= RANKS - 1, (lazy, mesh)
        assert lazy_rank["after_all_reduce"] > lazy_rank["formed"], lazy_rank
        assert mesh_rank["after_all_reduce"] == mesh_rank["formed"], mesh_rank
    soft, hard = lazy[0]["nofile"]
    assert soft == hard or hard == -1, lazy[0]["nofile"]  # raised to the hard limit at start


def test_a_collective_alone_fails_at_job_collective_timeout_minutes(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, None, timeout_minutes=0.05)  # 3 s
    waited = results[0]["timed_out_after"]
    assert waited is not None and 2.5 < waited < 30, results[0]
