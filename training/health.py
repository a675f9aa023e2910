"""Health checks of the devices, collectives and storage a training job runs on, each returning a plain dict.

Run by the burn-in program (`training/burn_in.py`) on every rank before training, and in part (the all-reduce)
by the trainer every `burn_in.health_check_every` steps. A faulty node rarely crashes: it computes slowly, or
computes wrong numbers, or its link drops to a fraction of its bandwidth, and a 64-node job then wastes days at
the speed of its worst member or trains on corrupted gradients. So each check measures a speed and verifies a
result, and `evaluate` compares all ranks' results against the instance type's floors
(`burn_in.thresholds[job.instance_type]`) and against each other.

Nothing here touches the global RNGs (operands come from a private `torch.Generator`, scratch bytes from
`os.urandom`), the model or the optimizer: a periodic check must leave training bitwise unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hlat.core.config import HealthThresholds
from hlat.core.storage import Storage
from hlat.training.parallel.distributed import World

log = logging.getLogger("hlat.health")

MB = 1e6
"""Sizes and bandwidths are decimal (MB, MB/s, GB/s), as nccl-tests and nccom-test report them."""
REFERENCE_ROWS = 64
"""Rows of a matmul result checked against the float64 reference: the reference then costs rows x n² multiply-
adds on the CPU instead of n³, and every row is as likely as any other to show a faulty device."""
ALLREDUCE_ITERS = 5
"""Timed all-reduces after the (untimed) one whose result is checked."""


class UnhealthyCollective(RuntimeError):
    """The periodic all-reduce gave a wrong result or ran below the instance type's bandwidth floor."""


def host_name() -> str:
    """The node's name as the job sees it: SageMaker's 'algo-N' where set (it names the instance in the job's
    logs and describe output), else the machine's host name."""
    return os.environ.get("SM_CURRENT_HOST") or socket.gethostname()


def compute_dtype(precision_mode: str, device: torch.device) -> torch.dtype:
    """The dtype training's matmuls run in: BF16 for the bf16 modes on an accelerator, else float32 (a CPU's
    BF16 matmul is an emulation whose speed says nothing about the machine)."""
    if precision_mode in ("bf16-mixed", "bf16-sr") and device.type in ("cuda", "xla"):
        return torch.bfloat16
    return torch.float32


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xla":
        import torch_xla.core.xla_model as xm  # only inside the Neuron container (device type xla)

        xm.mark_step()
        xm.wait_device_ops()


def _materialize(device: torch.device) -> None:
    """On XLA, cut the graph so that each timed matmul really executes: lazily traced, repeated matmuls of the
    same operands would be one graph in which only the last result is live."""
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.mark_step()


# -- inventory -------------------------------------------------------------------------------------------
def parse_neuron_ls(text: str) -> dict[str, Any]:
    """Devices and NeuronCores from `neuron-ls --json-output`: a list of devices each with `nc_count` (newer tools
    wrap it as {"neuron_devices": [...]})."""
    data = json.loads(text)
    devices = data.get("neuron_devices", []) if isinstance(data, dict) else data
    if not isinstance(devices, list):
        raise ValueError(f"unexpected neuron-ls output: {text[:200]!r}")
    return {"devices": len(devices), "neuron_cores": sum(int(d.get("nc_count", 0)) for d in devices)}


def neuron_inventory() -> dict[str, Any]:
    """What `neuron-ls` sees on this node, or why nothing could be seen."""
    binary = shutil.which("neuron-ls") or (
        "/opt/aws/neuron/bin/neuron-ls" if os.path.exists("/opt/aws/neuron/bin/neuron-ls") else None
    )
    if binary is None:
        return {"available": False, "reason": "not available: neuron-ls not found (not a Neuron instance/container)"}
    try:
        proc = subprocess.run([binary, "--json-output"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"available": False, "reason": f"not available: neuron-ls failed: {exc}"}
    if proc.returncode != 0:
        return {
            "available": False,
            "reason": f"not available: neuron-ls exited {proc.returncode}: {proc.stderr[-300:]}",
        }
    try:
        return {"available": True, **parse_neuron_ls(proc.stdout)}
    except (ValueError, TypeError, AttributeError) as exc:
        return {"available": False, "reason": f"not available: unreadable neuron-ls output: {exc}"}


def inventory(world: World, expected_world_size: int | None = None) -> dict[str, Any]:
    """The devices this rank sees, and `problems` (each a dict with check, value, threshold, message): fewer
    ranks than the job's world size joined, or this node has fewer devices than processes (on CUDA and trn1 each
    rank needs a device of its own: two ranks sharing one halve each other's speed or run out of memory)."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    out: dict[str, Any] = {
        "device_type": world.device.type,
        "world_size": world.world_size,
        "expected_world_size": expected_world_size,
        "local_world_size": local_ranks,
        "cpus": os.cpu_count(),
    }
    problems: list[dict[str, Any]] = []
    if expected_world_size is not None and world.world_size != expected_world_size:
        problems.append(
            {
                "check": "inventory_ranks",
                "value": world.world_size,
                "threshold": expected_world_size,
                "message": f"{world.world_size} rank(s) joined, the job needs job.instance_count x "
                f"job.processes_per_node = {expected_world_size}",
            }
        )
    if world.device.type == "cuda":
        count = torch.cuda.device_count()
        out["devices"] = count
        out["names"] = [torch.cuda.get_device_name(i) for i in range(count)]
        if count < local_ranks or world.local_rank >= count:
            problems.append(
                {
                    "check": "inventory_devices",
                    "value": count,
                    "threshold": local_ranks,
                    "message": f"{count} GPU(s) visible for {local_ranks} process(es) on this node "
                    f"(local rank {world.local_rank})",
                }
            )
    on_xla_cpu = world.device.type == "xla" and os.environ.get("PJRT_DEVICE") == "CPU"
    if on_xla_cpu:  # the local rehearsal of trn1: the XLA device is this host's CPU, there is no NeuronCore
        out["pjrt_device"] = "CPU"
    neuron = neuron_inventory()
    if neuron["available"] or (world.device.type == "xla" and not on_xla_cpu):
        out["neuron"] = neuron
    if world.device.type == "xla" and not on_xla_cpu:
        cores = int(neuron.get("neuron_cores", 0))
        if cores < local_ranks:
            problems.append(
                {
                    "check": "inventory_devices",
                    "value": cores,
                    "threshold": local_ranks,
                    "message": f"{cores} NeuronCore(s) visible for {local_ranks} process(es) on this node"
                    + ("" if neuron["available"] else f" ({neuron['reason']})"),
                }
            )
    out["problems"] = problems
    return out


# -- matmul ----------------------------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    """What makes two devices' results comparable bit for bit: the GPU model, or the device type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _checksum(tensor: torch.Tensor) -> str:
    raw = tensor.detach().cpu().contiguous().flatten().view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]


def matmul_check(
    device: torch.device,
    n: int,
    repeats: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    corrupt: bool = False,
    batch: int = 1,
) -> dict[str, Any]:
    """Time `repeats` launches of one batched matmul, `batch` n x n products each (after one untimed launch of
    the same graph), and check the result: TFLOP/s = 2n³ x batch / seconds per launch. One 2048² product is a
    fifth of a millisecond of a NeuronCore's work, less than a launch costs; a batch of them per launch measures
    the core, not the launch. `rel_error` = max |C - R| / max |R| over the first REFERENCE_ROWS rows of the first
    product, R the float64 product of the same (dtype-rounded) operands on the CPU, so only the device's arithmetic
    is measured, not the rounding of the inputs; `checksum` hashes every bit of that product, which equal devices
    given equal operands reproduce exactly. On XLA, `timed_compilations` counts the graphs compiled inside the
    timer (0, or the figure is not a speed).

    `corrupt` (fault injection, HLAT_FAULT_BURN_IN_WRONG_RANK) perturbs one element of the result by about 1% of
    its value, as a faulty device would: large enough to change it in BF16 too."""
    gen = torch.Generator(device="cpu").manual_seed(seed)  # private: the global RNG stream is training's
    a_host = torch.randn(n, n, generator=gen).to(dtype)
    b_host = torch.randn(n, n, generator=gen).to(dtype)
    a, b = a_host.to(device), b_host.to(device)
    if batch > 1:  # distinct operands (rows rolled), built once on the device: no host memory per product
        a = torch.stack([a.roll(shift, dims=0) for shift in range(batch)])  # (batch, n, n)
        b = b.expand(batch, n, n)
    _materialize(device)
    c = a @ b  # warm-up: kernel selection, the XLA compilation of exactly the timed graph
    _materialize(device)
    synchronize(device)
    compiled = _compilations(device)
    start = time.perf_counter()
    for _ in range(repeats):
        c = a @ b  # (n, n) or (batch, n, n)
        _materialize(device)
    synchronize(device)
    seconds = (time.perf_counter() - start) / repeats
    timed_compilations = _compilations(device) - compiled
    first = c[0] if batch > 1 else c
    if corrupt:
        first[0, 0] += 1e-2 * (1 + first[0, 0].abs())
        _materialize(device)
    rows = min(n, REFERENCE_ROWS)
    reference = a_host[:rows].double() @ b_host.double()  # (rows, n)
    got = first[:rows].double().cpu()
    rel_error = float((got - reference).abs().max() / reference.abs().max().clamp_min(1e-30))
    out = {
        "device": str(device),
        "device_name": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "n": n,
        "batch": batch,
        "repeats": repeats,
        "seconds": seconds,
        "tflops": 2 * n**3 * batch / seconds / 1e12 if seconds > 0 else float("inf"),
        "rel_error": rel_error,
        "reference_rows": rows,
        "checksum": _checksum(first),
        "fault_injected": corrupt,
    }
    if device.type == "xla":
        out["timed_compilations"] = timed_compilations
    return out


def _compilations(device: torch.device) -> int:
    """Graphs XLA has compiled so far in this process (0 off XLA: nothing compiles behind a timer there)."""
    if device.type != "xla":
        return 0
    from hlat.training import xla

    return int(xla.counters()["compilations"])


def device_element_bytes(dtype: torch.dtype, device: torch.device) -> int:
    """Bytes an element of `dtype` takes on `device`: float32 is BF16 on an XLA device under XLA_USE_BF16 or
    XLA_DOWNCAST_BF16 (HLAT's precision flags), so a collective of it moves half the bytes its dtype says."""
    bf16_on_device = os.environ.get("XLA_USE_BF16") == "1" or os.environ.get("XLA_DOWNCAST_BF16") == "1"
    if device.type == "xla" and dtype == torch.float32 and bf16_on_device:
        return 2
    return torch.empty((), dtype=dtype).element_size()


# -- all-reduce ------------------------------------------------------------------------------------------
def allreduce_check(world: World, mb: float, iters: int = ALLREDUCE_ITERS) -> dict[str, Any]:
    """All-reduce (SUM) a buffer of `mb` MB (as the device holds it) and check the result, then time `iters`
    all-reduces of it: algbw = bytes moved / seconds, busbw = algbw x 2(n-1)/n, the nccl-tests convention (what
    each link carries in a ring; comparable across world sizes). The bytes are the device's: a float32 buffer
    under XLA_USE_BF16 is BF16 there, half the bytes.

    The check: element i is 1 on rank i mod n and 0 on the others, so every element must sum to exactly 1 in any
    float format and order (the device adds in BF16 under XLA_USE_BF16, where a sum like n(n+1)/2 is not exact
    beyond a few ranks), and a rank whose share is lost or corrupted shows in its own elements. The timed graph
    (one all-reduce, then a cut on XLA) runs once untimed first, so nothing compiles inside the timer
    (`timed_compilations` on XLA).

    One rank gets busbw = algbw (the formula gives 0), and one process without a process group has nothing to
    all-reduce: the sum over one rank is its own buffer, so a copy of it is timed. `note` says so."""
    n = world.world_size
    device = world.device
    element = device_element_bytes(torch.float32, device)
    numel = max(n, int(mb * MB) // element)
    nbytes = numel * element
    host = torch.zeros(numel, dtype=torch.float32)
    host[world.rank :: n] = 1.0
    buf = host.to(device)
    expected = 1.0
    out: dict[str, Any] = {"mb": nbytes / MB, "ranks": n, "iters": iters, "expected": expected}
    if world.collective:
        buf = world.all_reduce(buf)  # also sets up the connections

        def reduce() -> None:
            nonlocal buf
            buf = world.all_reduce(buf)
    else:
        copy = torch.empty_like(buf)

        def reduce() -> None:
            copy.copy_(buf)

    synchronize(device)
    wrong = (buf - expected).abs() > 0
    bad = int(wrong.sum())
    out["correct"] = bad == 0
    if bad:
        first = int(wrong.nonzero()[0, 0])
        out["error"] = (
            f"rank {world.rank} saw {float(buf[first])} at element {first} where every rank should see {expected} "
            f"({bad} of {numel} elements wrong)"
        )
    buf.zero_()  # sums of zeros stay zero however often they are reduced
    _materialize(device)
    reduce()  # the warm-up of exactly the timed graph
    _materialize(device)
    world.barrier("hlat-health-allreduce")  # start the clock together
    synchronize(device)
    compiled = _compilations(device)
    start = time.perf_counter()
    for _ in range(iters):
        reduce()
        _materialize(device)  # one all-reduce per graph, as warmed up (not `iters` chained in one)
    synchronize(device)
    seconds = (time.perf_counter() - start) / iters
    if device.type == "xla":
        out["timed_compilations"] = _compilations(device) - compiled
    algbw = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    out.update(seconds=seconds, algbw_gbps=algbw)
    if n > 1:
        out["busbw_gbps"] = algbw * 2 * (n - 1) / n
    else:
        out["busbw_gbps"] = algbw
        out["note"] = "one rank: busbw reported as algbw" + (
            "" if world.collective else " (no process group: the time of a local copy of the buffer)"
        )
    return out


# -- storage ---------------------------------------------------------------------------------------------
def write_check(storage: Storage, mb: float) -> dict[str, Any]:
    """Write `mb` MB of random bytes (incompressible, never deduplicated) as one object under `storage` the way a
    checkpoint shard is written (atomic whole-object write: fsync locally, a PUT on S3), read its size back,
    delete it; MB/s of the write. A size that does not match is reported as `error`."""
    size = max(1, int(mb * MB))
    data = os.urandom(size)  # not `random`/torch: the training RNG streams stay untouched
    name = f"{host_name()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    start = time.perf_counter()
    storage.write_bytes(name, data)
    seconds = time.perf_counter() - start
    try:
        written = storage.size(name)
    finally:
        storage.remove(name)
    out: dict[str, Any] = {
        "uri": storage.uri(name),
        "mb": size / MB,
        "seconds": seconds,
        "mbps": size / MB / seconds if seconds > 0 else float("inf"),
    }
    if written != size:
        out["error"] = f"wrote {size} bytes to {storage.uri(name)} but it holds {written}"
    return out


# -- evaluation ------------------------------------------------------------------------------------------
def _failure(row: Mapping[str, Any], check: str, value: Any, threshold: Any, message: str) -> dict[str, Any]:
    rank, host = row.get("rank"), row.get("host")
    return {
        "rank": rank,
        "host": host,
        "check": check,
        "value": value,
        "threshold": threshold,
        "message": f"rank {rank} on {host}: {message}",
    }


def _majority_checksums(results: Sequence[Mapping[str, Any]]) -> dict[tuple[Any, ...], str]:
    """Per group of comparable devices (same device model, dtype, size): the checksum most ranks agree on; a tie
    goes to the checksum whose result is closest to the float64 reference (two ranks, one faulty)."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for row in results:
        m = row.get("matmul") or {}
        if "checksum" in m:
            groups.setdefault((m["device_name"], m["dtype"], m["n"]), []).append(m)
    majority = {}
    for key, members in groups.items():
        counts = Counter(m["checksum"] for m in members)
        top = max(counts.values())
        tied = sorted(c for c, k in counts.items() if k == top)
        best_error = {c: min(m["rel_error"] for m in members if m["checksum"] == c) for c in tied}
        majority[key] = min(tied, key=lambda c: best_error[c])
    return majority


def evaluate(results: Sequence[Mapping[str, Any]], thresholds: HealthThresholds | None) -> list[dict[str, Any]]:
    """Failures among all ranks' results, each naming the rank and host, the check, the measured value and the
    threshold it missed.

    Performance floors and the matmul error bound come from `thresholds` (None: an instance type without
    thresholds, measured but not failed on them). Wrong answers fail whatever the instance type: a check that
    raised, a wrong all-reduce sum, a scratch object of the wrong size, missing ranks or devices, and a matmul
    checksum that differs from the majority of the ranks with the same device and operands (a faulty device can
    stay under the error bound and still compute different bits than its peers)."""
    failures: list[dict[str, Any]] = []
    majority = _majority_checksums(results)
    for row in results:
        inv = row.get("inventory") or {}
        for problem in inv.get("problems", []):
            failures.append(_failure(row, problem["check"], problem["value"], problem["threshold"], problem["message"]))
        for check in ("inventory", "matmul", "allreduce", "write"):
            raised = (row.get(check) or {}).get("exception")
            if raised:
                failures.append(_failure(row, check, raised, "no exception", f"the {check} check raised {raised}"))
        m = row.get("matmul") or {}
        if "checksum" in m:
            want = majority[(m["device_name"], m["dtype"], m["n"])]
            if m["checksum"] != want:
                failures.append(
                    _failure(
                        row,
                        "matmul_checksum",
                        m["checksum"],
                        want,
                        f"matmul result checksum {m['checksum']} differs from the other ranks' {want} "
                        f"(same seed, same {m['device_name']}, {m['dtype']})",
                    )
                )
            if thresholds is not None and m["tflops"] < thresholds.min_matmul_tflops:
                failures.append(
                    _failure(
                        row,
                        "matmul_tflops",
                        m["tflops"],
                        thresholds.min_matmul_tflops,
                        f"matmul {m['tflops']:.4g} TFLOP/s < {thresholds.min_matmul_tflops:g}",
                    )
                )
            if thresholds is not None and m["rel_error"] > thresholds.max_matmul_rel_error:
                failures.append(
                    _failure(
                        row,
                        "matmul_rel_error",
                        m["rel_error"],
                        thresholds.max_matmul_rel_error,
                        f"matmul relative error {m['rel_error']:.3g} > {thresholds.max_matmul_rel_error:g}",
                    )
                )
        a = row.get("allreduce") or {}
        if a.get("correct") is False:
            failures.append(_failure(row, "allreduce_result", a.get("error"), a["expected"], a["error"]))
        if thresholds is not None and "busbw_gbps" in a and a["busbw_gbps"] < thresholds.min_allreduce_gbps:
            failures.append(
                _failure(
                    row,
                    "allreduce_busbw",
                    a["busbw_gbps"],
                    thresholds.min_allreduce_gbps,
                    f"all-reduce busbw {a['busbw_gbps']:.4g} GB/s < {thresholds.min_allreduce_gbps:g}",
                )
            )
        w = row.get("write") or {}
        if "error" in w:
            failures.append(_failure(row, "write_size", w["error"], "the bytes written", w["error"]))
        if thresholds is not None and "mbps" in w and w["mbps"] < thresholds.min_write_mbps:
            failures.append(
                _failure(
                    row,
                    "write_mbps",
                    w["mbps"],
                    thresholds.min_write_mbps,
                    f"write to {w['uri']} {w['mbps']:.4g} MB/s < {thresholds.min_write_mbps:g}",
                )
            )
    return failures


# -- the periodic check inside training ------------------------------------------------------------------
def periodic_health_check(
    world: World, mb: float, thresholds: HealthThresholds | None, step: int, instance_type: str = ""
) -> dict[str, Any]:
    """The trainer's health hook: an all-reduce check on every rank, then one small all-reduce so that every rank
    knows every rank's verdict and all take the same branch (a rank raising alone would leave the others hanging
    in the next collective). Raises UnhealthyCollective, on every rank, when any rank saw a wrong sum or a busbw
    below `thresholds.min_allreduce_gbps`."""
    result = allreduce_check(world, mb)
    floor = thresholds.min_allreduce_gbps if thresholds is not None else None
    # Per rank: (wrong result, busbw in KB/s), as integers: under XLA_USE_BF16 a float would be BF16 on the device.
    mine = torch.zeros(world.world_size, 2, dtype=torch.int64)
    mine[world.rank] = torch.tensor([0 if result["correct"] else 1, round(min(result["busbw_gbps"], 1e9) * 1e6)])
    if world.collective:
        mine = world.to_host(world.all_reduce(mine.to(world.device)))
    table = [(wrong, kbps / 1e6) for wrong, kbps in mine.tolist()]
    problems = []
    for rank, (wrong, busbw) in enumerate(table):
        if wrong:
            problems.append(f"rank {rank} got a wrong all-reduce sum")
        if floor is not None and busbw < floor:
            problems.append(f"rank {rank} all-reduce busbw {busbw:.4g} GB/s < {floor:g} ({instance_type})")
    slowest = min(busbw for _, busbw in table)
    result["slowest_busbw_gbps"] = slowest
    if "error" in result:
        log.error("health check at step %d on %s: %s", step, host_name(), result["error"])
    if problems:
        message = f"step {step}: " + "; ".join(problems)
        log.error("health check failed at %s", message)
        raise UnhealthyCollective(message)
    if world.is_main:
        log.info(
            "health check at step %d: all-reduce of %.1f MB over %d rank(s) correct, busbw %.3g GB/s (slowest rank)"
            ", floor %s",
            step, result["mb"], world.world_size, slowest, f"{floor:g} GB/s" if floor is not None else "none",
        )  # fmt: skip
    return result
