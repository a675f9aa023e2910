"""Health checks of the devices, collectives and storage a job runs on, each returning a plain dict.

burn_in.py runs them before training; the trainer repeats the all-reduce periodically.
A faulty node is slow or wrong rather than dead, so each check times a speed and verifies a result.
Rules:
- nothing here touches the global RNGs, the model or the optimizer.
- the all-reduce floor depends on size and rank count (`allreduce_floor_gbps`).
- the cross-rank checksum is of a product exact in BF16: only a faulty device changes its bits.
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
from hlat.training.hooks import hooks
from hlat.training.parallel.distributed import World

log = logging.getLogger("hlat.health")

MB = 1e6
"""Sizes and bandwidths are decimal, as nccl-tests and nccom-test report them."""
REFERENCE_ROWS = 64
"""Rows of a matmul result checked against the float64 reference (cheaper than the whole product)."""
ALLREDUCE_ITERS = 5
"""Timed all-reduces after the (untimed) one whose result is checked."""

# -- the all-reduce floor: a latency-bandwidth model (a model, not a measurement) ----------------------------------
# A ring all-reduce of S bytes over n ranks takes 2(n-1)a + 2(n-1)/n * S/B, plus one launch L (Thakur, Rabenseifner
# and Gropp, "Optimization of Collective Communication Operations in MPICH", IJHPCA 19(1), 2005; busbw as in
# https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md). The latencies are generous upper bounds, so
# the floor errs towards passing; a degraded link is caught by the relative check. Verified only on trn1.
RING_STEP_LATENCY_S = 50e-6
"""Upper bound of one ring step's latency: an EFA hop, with margin."""
LAUNCH_LATENCY_S = 1e-3
"""Upper bound of one graph launch and its wait around a timed all-reduce."""

# -- the matmul floor: per precision ------------------------------------------------------------------------------
FP32_SHARE_OF_BF16_PEAK = {"xla": 47.5 / 190.0, "cuda": 1 / 16}
"""An FP32 matmul's peak as a share of BF16's, per device type (CPU computes in float32 only).

Trainium: 190 BF16 and 47.5 FP32 TFLOP/s per chip
(https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trainium.html).
A100: 19.5 FP32 and 312 BF16 dense TFLOP/s (A100 datasheet).
"""
EXACT_TERMS = 128
"""Non-zero terms per row of the checksum's left operand: partial sums stay exact in BF16."""


def allreduce_floor_gbps(floor_gbps: float, nbytes: float, ranks: int) -> float:
    """The busbw floor, GB/s, for an all-reduce of `nbytes` over `ranks` by the ring model (B = `floor_gbps`)."""
    if floor_gbps <= 0 or nbytes <= 0:
        return 0.0
    share = 2 * (ranks - 1) / ranks if ranks > 1 else 1.0
    seconds = LAUNCH_LATENCY_S + 2 * max(ranks - 1, 0) * RING_STEP_LATENCY_S + share * nbytes / (floor_gbps * 1e9)
    return share * nbytes / seconds / 1e9


def matmul_floor_tflops(thresholds: HealthThresholds, dtype: str, device: str) -> float:
    """The matmul floor for `dtype` on `device`: the BF16 floor, scaled by FP32's peak for FP32."""
    floor = thresholds.min_matmul_tflops
    if dtype == "float32":
        return floor * FP32_SHARE_OF_BF16_PEAK.get(device.split(":")[0], 1.0)
    return floor


class UnhealthyCollective(RuntimeError):
    """The periodic all-reduce was wrong or below the bandwidth floor."""


def host_name() -> str:
    """The node's name: SageMaker's 'algo-N' where set, else the host name."""
    return os.environ.get("SM_CURRENT_HOST") or socket.gethostname()


def compute_dtype(precision_mode: str, device: torch.device) -> torch.dtype:
    """The dtype training's matmuls run in: BF16 for bf16 modes on an accelerator, else float32 (CPU BF16 is
    emulated).
    """
    if precision_mode in ("bf16-mixed", "bf16-sr") and device.type in ("cuda", "xla"):
        return torch.bfloat16
    return torch.float32


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer measures the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xla":
        import torch_xla.core.xla_model as xm  # only inside the Neuron container (device type xla)

        xm.mark_step()
        xm.wait_device_ops()


def _materialize(device: torch.device) -> None:
    """On XLA, cut the graph so each timed matmul really executes."""
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.mark_step()


# -- inventory -------------------------------------------------------------------------------------------
def parse_neuron_ls(text: str) -> dict[str, Any]:
    """Devices and NeuronCores from `neuron-ls --json-output`."""
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
    """The devices this rank sees, and `problems`: missing ranks, or fewer devices than processes."""
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
    """What makes two devices' results comparable bit for bit: GPU model or device type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _checksum(tensor: torch.Tensor) -> str:
    raw = tensor.detach().cpu().contiguous().flatten().view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]


def exact_operands(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer operands whose n x n product is exact in any float format from BF16 up, in any order.

    No rounding happens, so stochastic rounding cannot change a bit; only a faulty device can.
    """
    terms = min(n, EXACT_TERMS)
    i = torch.arange(n)
    band = (i[None, :] - i[:, None]) % n < terms  # (n, n): row r holds columns r .. r+terms-1 (mod n)
    signs = torch.randint(0, 2, (n, n), generator=gen) * 2 - 1
    left = (band * signs).float()
    right = (torch.randint(0, 3, (n, n), generator=gen) - 1).float()
    return left, right


def matmul_check(
    device: torch.device,
    n: int,
    repeats: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    corrupt: bool = False,
    batch: int = 1,
) -> dict[str, Any]:
    """Time `repeats` launches of `batch` n x n matmuls and check the result.

    `rel_error` compares REFERENCE_ROWS rows with a float64 CPU product. `checksum` hashes an
    `exact_operands` product; `exact` says it is right. `timed_compilations` must be 0 on XLA.
    `corrupt` (tests only) perturbs one element by about 1%, as a faulty device would.
    """
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
    left, right = exact_operands(n, gen)
    exact = left.to(dtype).to(device) @ right.to(dtype).to(device)  # (n, n), integers: no rounding anywhere
    _materialize(device)
    if corrupt:
        exact[0, 0] += 1  # still an integer of magnitude <= EXACT_TERMS + 1: exact, and wrong
        _materialize(device)
    exact_host = exact.cpu()
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
        "checksum": _checksum(exact_host),
        "exact": bool(torch.equal(exact_host[:rows].double(), left[:rows].double() @ right.double())),
        "fault_injected": corrupt,
    }
    if device.type == "xla":
        out["timed_compilations"] = timed_compilations
    return out


def _compilations(device: torch.device) -> int:
    """Graphs XLA has compiled so far in this process (0 off XLA)."""
    if device.type != "xla":
        return 0
    from hlat.training import xla

    return int(xla.counters()["compilations"])


def device_element_bytes(dtype: torch.dtype, device: torch.device) -> int:
    """Bytes an element of `dtype` takes on `device` (float32 is BF16 on XLA under HLAT's flags)."""
    bf16_on_device = os.environ.get("XLA_USE_BF16") == "1" or os.environ.get("XLA_DOWNCAST_BF16") == "1"
    if device.type == "xla" and dtype == torch.float32 and bf16_on_device:
        return 2
    return torch.empty((), dtype=dtype).element_size()


# -- all-reduce ------------------------------------------------------------------------------------------
def allreduce_check(world: World, mb: float, iters: int = ALLREDUCE_ITERS, judge: bool = True) -> dict[str, Any]:
    """All-reduce (SUM) an `mb` MB buffer, check the sum, then time `iters` all-reduces of it.

    busbw = algbw x 2(n-1)/n, as nccl-tests counts it, in the device's bytes.
    Element i is 1 on rank i mod n only, so each sum is exactly 1 in any format.
    `judge` off (graph extraction): the same device work, no verdict.
    """
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
    bad = int(wrong.sum())  # read in every run (graph extraction traces what the job runs)
    if judge:
        out["correct"] = bad == 0
    if bad and judge:
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
    slower = hooks().collective_delay()  # tests' degraded link (0 here)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        reduce()
        _materialize(device)  # one all-reduce per graph, as warmed up (not `iters` chained in one)
        if slower:
            time.sleep(slower)
        synchronize(device)  # each iteration timed to its end: one launch and one all-reduce, as the floor's model
        times.append(time.perf_counter() - start)
    seconds = sum(times) / iters
    if device.type == "xla":
        out["timed_compilations"] = _compilations(device) - compiled

    def bus(seconds: float) -> float:
        algbw = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
        return algbw * 2 * (n - 1) / n if n > 1 else algbw

    algbw = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    # The best iteration: what the link delivers when nothing else (a preempted host thread) got in the way; a
    # degraded link slows every iteration. The trainer's relative check compares it (`min_allreduce_share_of_first`).
    out.update(seconds=seconds, algbw_gbps=algbw, best_busbw_gbps=bus(min(times)))
    if n > 1:
        out["busbw_gbps"] = bus(seconds)
    else:
        out["busbw_gbps"] = algbw
        out["note"] = "one rank: busbw reported as algbw" + (
            "" if world.collective else " (no process group: the time of a local copy of the buffer)"
        )
    return out


# -- storage ---------------------------------------------------------------------------------------------
def write_check(storage: Storage, mb: float) -> dict[str, Any]:
    """Write `mb` MB of random bytes as one object under `storage`, read its size, delete it; return MB/s."""
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
    """Per group of comparable devices: the majority checksum (a tie: the one nearest the reference)."""
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
    """Failures among all ranks' results, each naming rank, host, check, value and threshold.

    Floors come from `thresholds` (None: not judged). Wrong answers always fail,
    including a checksum off the majority of comparable ranks.
    """
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
            if m.get("exact") is False:
                failures.append(
                    _failure(
                        row,
                        "matmul_exact",
                        m["checksum"],
                        "the exact product",
                        f"the integer matmul (exact in {m['dtype']}) differs from the exact product: a faulty device",
                    )
                )
            floor = matmul_floor_tflops(thresholds, m["dtype"], m.get("device", "")) if thresholds else None
            if floor is not None and m["tflops"] < floor:
                failures.append(
                    _failure(
                        row,
                        "matmul_tflops",
                        m["tflops"],
                        floor,
                        f"matmul {m['tflops']:.4g} TFLOP/s < {floor:.4g} ({m['dtype']})",
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
        if thresholds is not None and "busbw_gbps" in a:
            bus_floor = allreduce_floor_gbps(
                thresholds.min_allreduce_gbps, a.get("mb", 0.0) * MB, a.get("ranks", len(results))
            )
            if a["busbw_gbps"] < bus_floor:
                failures.append(
                    _failure(
                        row,
                        "allreduce_busbw",
                        a["busbw_gbps"],
                        bus_floor,
                        f"all-reduce busbw {a['busbw_gbps']:.4g} GB/s < {bus_floor:.4g} (the floor for "
                        f"{a.get('mb', 0.0):.4g} MB over {a.get('ranks', len(results))} rank(s))",
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
    world: World,
    mb: float,
    thresholds: HealthThresholds | None,
    step: int,
    instance_type: str = "",
    reference_gbps: float | None = None,
    judge: bool = True,
) -> dict[str, Any]:
    """The trainer's health hook: an all-reduce check, then a vote so every rank takes the same branch.

    Raises UnhealthyCollective on every rank for a wrong sum, a busbw under its floor, or one under
    `min_allreduce_share_of_first` of the first check's (`reference_gbps`). `judge` off: no verdict.
    """
    result = allreduce_check(world, mb, judge=judge)
    floor, floor_from = None, ""
    if thresholds is not None:
        floor = allreduce_floor_gbps(thresholds.min_allreduce_gbps, result["mb"] * MB, world.world_size)
        floor_from = (
            f"the floor for {result['mb']:.3g} MB over {world.world_size} rank(s) from {instance_type}'s "
            f"{thresholds.min_allreduce_gbps:g} GB/s"
        )

    # Per rank: (wrong result, busbw and best busbw in KB/s), as integers: under XLA_USE_BF16 a float would be BF16
    # on the device.
    def kbps(gbps: float) -> int:
        return round(min(max(gbps, 0.0), 1e9) * 1e6)

    mine = torch.zeros(world.world_size, 3, dtype=torch.int64)
    wrong_here = 0 if result.get("correct", True) else 1
    mine[world.rank] = torch.tensor([wrong_here, kbps(result["busbw_gbps"]), kbps(result["best_busbw_gbps"])])
    if world.collective:
        mine = world.to_host(world.all_reduce(mine.to(world.device)))
    table = [(wrong, mean / 1e6, best / 1e6) for wrong, mean, best in mine.tolist()]
    if not judge:
        result["judged"] = False
        if world.is_main:
            log.info("health check at step %d: traced, not judged (graph extraction: the outputs are invalid)", step)
        return result
    share = thresholds.min_allreduce_share_of_first if thresholds is not None else 0.0
    relative = share * reference_gbps if reference_gbps and share else None
    problems = []
    for rank, (wrong, busbw, best) in enumerate(table):
        if wrong:
            problems.append(f"rank {rank} got a wrong all-reduce sum")
        if floor is not None and busbw < floor:
            problems.append(f"rank {rank} all-reduce busbw {busbw:.4g} GB/s < {floor:.4g} ({floor_from})")
        if relative is not None and best < relative:
            problems.append(
                f"rank {rank} all-reduce busbw {best:.4g} GB/s at best < {relative:.4g} ({share:g} of this "
                f"job's first measurement, {reference_gbps:.4g} GB/s)"
            )
    slowest = min(busbw for _, busbw, _ in table)
    slowest_best = min(best for _, _, best in table)
    result.update(
        judged=True,
        slowest_busbw_gbps=slowest,
        slowest_best_busbw_gbps=slowest_best,
        floor_gbps=floor,
        relative_floor_gbps=relative,
    )
    if "error" in result:
        log.error("health check at step %d on %s: %s", step, host_name(), result["error"])
    if problems:
        message = f"step {step}: " + "; ".join(problems)
        log.error("health check failed at %s", message)
        raise UnhealthyCollective(message)
    if world.is_main:
        floors = [f"{floor:.4g} GB/s for this size" if floor is not None else "no floor"]
        if relative is not None:
            floors.append(f"{relative:.4g} GB/s relative")
        log.info(
            "health check at step %d: all-reduce of %.1f MB over %d rank(s) correct, busbw %.3g GB/s (slowest rank)"
            ", floor %s",
            step, result["mb"], world.world_size, slowest, ", ".join(floors),
        )  # fmt: skip
    return result
