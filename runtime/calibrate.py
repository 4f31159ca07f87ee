"""Measuring this machine for a device profile (``fxpar calibrate``): plain dicts of seconds, bytes and FLOP/s.

Reads: the devices and, for communication, a process group (gloo on CPU, NCCL on CUDA). Writes: nothing;
:func:`fxpar.cost.profiles.profile_from_measurements` turns :func:`calibrate`'s dict into a profile
(fitting alpha/beta there).

What is measured and how:

* matmul FLOP/s per dtype at 2-3 square sizes, the best size's median rate (fp32 everywhere; bf16 too,
  and on CUDA tf32 and fp16), elementwise memory bandwidth (an ``add`` of large tensors: 2 reads + 1 write),
  the per-op overhead (a chain of tiny ops: forward with autograd recording, and its backward), all on one
  process;
* each rank's throughput when ``k`` ranks compute at once on the host (``compute_share``; CPU only: ranks
  share its cores), and alpha/beta of each collective per group size by a least-squares fit of
  ``alpha + beta * bytes`` (relative error) over message sizes, a group of ``n`` ranks running while the
  others wait (on gloo each timed call after 5 ms of matmuls, as a step reaches it); also the all-reduce
  with every rank busy in its own group at once (``concurrent``, for the record). Payload bytes follow
  :mod:`fxpar.cost.comm`: the full tensor (the all-gather's output, the reduce-scatter's input); all-to-all
  and broadcast: one rank's tensor; send: the bytes sent. Gloo's reduce-scatter is what fxpar's kernel does
  there: an all-reduce of the full tensor, then a slice.

Without a process group, :func:`calibrate` forks ``world`` gloo ranks (``torch.multiprocessing``, a file
store in a temporary directory) and waits for them with a deadline; under torchrun it uses the group there is.
Every timed loop is short (a fraction of a second), so the whole run stays within a minute or two.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from fxpar.ir.errors import FxparError
from fxpar.runtime.calibrate_runtime import collective_op as _collective_op
from fxpar.runtime.calibrate_runtime import comm_share as _comm_share
from fxpar.runtime.calibrate_runtime import lm_step as _lm_step
from fxpar.runtime.calibrate_runtime import runtime_measurements
from fxpar.runtime.calibrate_step import (
    at_host_speed,
    host_reference,
    measure_elementwise,
    measure_fresh_memory,
    measure_optimizer,
    rate_loop,
    sync,
    training_matmuls,
    typical,
)

__all__ = ["calibrate", "measure_elementwise", "measure_matmul", "measure_memory_bandwidth", "measure_op_overhead",
           "measure_fresh_memory", "measure_optimizer", "rank_measurements"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
SIZES = (4 << 10, 64 << 10, 512 << 10, 4 << 20, 16 << 20)
QUICK_SIZES = (4 << 10, 256 << 10, 4 << 20)
AFTER_COMPUTE = 0.005  # seconds of matmuls before each timed gloo collective (a layer's work here; see _busy)
_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure_matmul(device="cpu", dtypes=None, sizes=(256, 512, 1024), seconds: float = 0.15) -> dict:
    """{dtype: {"flops": the best size's rate, "by_size": {n: FLOP/s}}} for ``n x n @ n x n`` (rates from
    the 20th percentile call time)."""
    device = torch.device(device)
    if dtypes is None:
        dtypes = ["fp32", "bf16"] + (["tf32", "fp16"] if device.type == "cuda" else [])
    out = {}
    for key in dtypes:
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = key == "tf32"
        try:
            by = {}
            for n in sizes:
                a = torch.randn(n, n, device=device).to(_DTYPES[key])
                b = torch.randn(n, n, device=device).to(_DTYPES[key])
                by[n] = 2 * n**3 / typical(rate_loop(lambda a=a, b=b: a @ b, device, seconds))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        train = training_matmuls(device, _DTYPES[key], seconds)
        out[key] = {"flops": train or max(by.values()), "square": max(by.values()), "by_size": by}
    return out


def measure_memory_bandwidth(device="cpu", sizes_mb=(1, 16, 64), seconds: float = 0.15) -> dict:
    """{"bytes_per_s": the largest size's rate, "by_size": {MB: rate}} of ``torch.add(a, b, out=c)``
    (3 tensors of MB each: two read, one written)."""
    device = torch.device(device)
    by = {}
    for mb in sizes_mb:
        n = mb * 2**20 // 4
        a, b, c = (torch.ones(n, device=device) for _ in range(3))
        by[mb] = 3 * n * 4 / typical(rate_loop(lambda: torch.add(a, b, out=c), device, seconds))
    return {"bytes_per_s": by[max(by)], "by_size": by}


def measure_op_overhead(device="cpu", ops: int = 200, repeats: int = 7) -> dict:
    """{"forward": s, "backward": s} per op of a chain of ``ops`` multiplications of a tiny tensor that
    needs its gradient (forward records autograd; backward runs one node per op)."""
    device = torch.device(device)
    fwd, bwd = [], []
    for _ in range(repeats):
        x = torch.ones(8, device=device, requires_grad=True)
        sync(device)
        t = time.perf_counter()
        y = x
        for _ in range(ops):
            y = y * 1.0001
        s = y.sum()
        sync(device)
        t1 = time.perf_counter()
        s.backward()
        sync(device)
        fwd.append((t1 - t) / (ops + 1))
        bwd.append((time.perf_counter() - t1) / (ops + 1))
    return {"forward": statistics.median(fwd), "backward": statistics.median(bwd)}


# ---- on every rank: compute share and collectives ------------------------------------------------------

def _time_collective(op, pg, device, budget: float, after: float = 0.0) -> float:
    """Seconds per call of ``op`` on the group ``pg`` (every member calls): a warm-up, the repeat count
    agreed on (the slowest member's), a barrier, each call timed; the slowest member's median (a median,
    so that a call another process on the host delayed does not count). ``after``: seconds of matmuls each
    member runs before each timed call, as a training step reaches its collectives (see :func:`_busy`)."""
    op()
    sync(device)
    t = time.perf_counter()
    op()
    sync(device)
    probe = time.perf_counter() - t
    reps = torch.tensor([max(7 if after else 3, min(40, int(budget / max(probe + after, 1e-6))))], device=device)
    dist.all_reduce(reps, op=dist.ReduceOp.MIN, group=pg)
    dist.barrier(group=pg)
    busy = _busy(after, device) if after else None
    times = []
    for _ in range(int(reps.item())):
        if busy:
            busy()
        t = time.perf_counter()
        op()
        sync(device)
        times.append(time.perf_counter() - t)
    el = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(el, op=dist.ReduceOp.MAX, group=pg)
    return el.item()


def _busy(seconds: float, device):
    """Matmuls for about ``seconds`` on this rank. Gloo ranks reach a collective of a training step after
    compute, not right after the last collective, and on a host whose cores every rank keeps busy that
    costs: on this project's 2-core CI host a 1 MiB all-reduce of 2 ranks took 0.8 ms back to back and
    2.7-3.5 ms after 5-20 ms of matmuls (4 KiB: 0.5 and 2.7-3.6 ms), which is what a tensor-parallel step's
    all-reduces took in ``torch.profiler``. Timed back to back, the table priced them 2-3x too fast."""
    a = torch.randn(128, 128, device=device)

    def run():
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            a @ a
    return run


def _ping_pong(nbytes: int, device):
    """Rank 0 sends ``nbytes`` to rank 1 and gets them back; half of it is one send."""
    buf = torch.ones(max(1, nbytes // 4), device=device)
    rank = dist.get_rank()
    if rank == 0:
        return lambda: (dist.send(buf, 1), dist.recv(buf, 1))
    return lambda: (dist.recv(buf, 0), dist.send(buf, 0))


def _compute_share(counts, seconds: float, device, windows: int = 5) -> dict:
    """{k: mean steps/s of the ranks < k while they run :func:`_lm_step` at once}, the median of ``windows``
    windows of ``seconds / windows`` (gathered to every rank); the idle ranks sleep through the windows.
    A training step, not a matmul alone: ranks sharing a host contend for its memory bandwidth and caches
    as well as its cores (on this project's 2-core CI host a cache-resident matmul gave 1.0 at 2 ranks and a
    large one 0.5, where training steps got 0.9, as this step does). Each window's rate is read at the host's
    speed just before it (:func:`~fxpar.runtime.calibrate_step.host_reference` on rank 0, the others idle):
    the host drifts between windows by more than sharing costs (2 ranks here read 0.78-1.05 over three
    calibrations without it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step = _lm_step(rank)
    step()
    rates = {}
    # the counts in turn within each round, so that a slow spell of the host falls on one window of each count
    # rather than on every window of one (one calibration here read 0.71 for 2 ranks, the next 0.95)
    for k in (k for _ in range(windows) for k in counts if k <= world):
        speed = torch.tensor([host_reference() if rank == 0 else 0.0], dtype=torch.float64, device=device)
        dist.broadcast(speed, 0)  # (steps per second x seconds of the reference work: the same at any speed)
        t0 = torch.tensor([time.time() + 0.02], dtype=torch.float64, device=device)
        dist.broadcast(t0, 0)
        start, end, done = t0.item(), t0.item() + seconds / windows, 0
        time.sleep(max(0.0, start - time.time()))
        if rank < k:
            while time.time() < end:
                step()
                done += 1
            rate = done / (time.time() - start) * speed.item()
        else:
            time.sleep(max(0.0, end - time.time()))
            rate = 0.0
        got = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(got, torch.tensor([rate], dtype=torch.float64, device=device))
        rates.setdefault(k, []).append(sum(g.item() for g in got[:k]) / k)
    return {k: statistics.median(r) for k, r in rates.items()}


def rank_measurements(groups=(2, 4, 8), sizes=SIZES, kinds=KINDS, *, budget: float = 0.08,
                      share_counts=(1, 2, 4, 8), share_seconds: float = 0.4, concurrent: bool = True,
                      after: float | None = None) -> dict:
    """What every rank of the current process group measures together (call on every rank): compute share
    (CPU), then per group size ``n`` (ranks 0..n-1, the others waiting) and kind the seconds per message
    size. Returns {"compute_share": {k: factor}, "times": {kind: {n: [[bytes, s], ...]}}, "concurrent":
    {n: [[bytes, s], ...]}, "after_compute_s": s} (rank 0's copy holds the group's slowest times). ``after``:
    seconds of compute before each timed call (default: :data:`AFTER_COMPUTE` on gloo, none under NCCL,
    whose calls only enqueue work on a stream)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gloo = dist.get_backend() == "gloo"
    device = torch.device("cuda", torch.cuda.current_device()) if not gloo else torch.device("cpu")
    after = (AFTER_COMPUTE if gloo else 0.0) if after is None else after
    out = {"compute_share": {}, "times": {k: {} for k in kinds}, "concurrent": {}, "after_compute_s": after}
    if device.type == "cpu" and share_counts:
        rates = _compute_share(share_counts, share_seconds, device)
        # at most the physical bound: no rank runs faster for company, k ranks on c cores at most c / k each
        # (a window read at a slow moment can say more: 2 ranks read 1.09 and 4 ranks 0.54 on 2 cores here)
        cores = os.cpu_count() or 1
        out["compute_share"] = {k: min(r / rates[1], 1.0, cores / k) for k, r in rates.items()}
        out["comm_share"] = _comm_share(share_counts, seconds=share_seconds / 4) if world > 2 else {}
    for n in (g for g in groups if 2 <= g <= world):
        pg = dist.new_group(list(range(n)))
        for kind in kinds:
            if kind == "send" and n != 2:
                continue
            for nbytes in sizes:
                if rank < n:
                    if kind == "send":
                        t = _time_collective(_ping_pong(nbytes, device), pg, device, budget, after) / 2
                    else:
                        t = _time_collective(_collective_op(kind, nbytes, pg, n, rank, device, gloo), pg, device,
                                             budget, after)
                    out["times"][kind].setdefault(n, []).append([nbytes, t])
        dist.barrier()
    if concurrent:
        for n in (g for g in groups if 2 <= g <= world and world % g == 0 and world > g):
            parts = [dist.new_group(list(range(i, i + n))) for i in range(0, world, n)]
            pg, me = parts[rank // n], rank % n
            for nbytes in sizes:
                t = _time_collective(_collective_op("all_reduce", nbytes, pg, n, me, device, gloo), pg, device, budget)
                slowest = torch.tensor([t], dtype=torch.float64, device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                out["concurrent"].setdefault(n, []).append([nbytes, slowest.item()])
            dist.barrier()
    return out


def _worker(rank: int, world: int, store: str, result: str, kwargs: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        kwargs = dict(kwargs)
        got = kwargs.pop("fn", rank_measurements)(**kwargs)
        if rank == 0:
            with open(result, "w") as f:
                json.dump(got, f)
    finally:
        dist.destroy_process_group()


def _forked(world: int, kwargs: dict, timeout: float) -> dict:
    """:func:`rank_measurements` on ``world`` forked gloo ranks; rank 0's result. Ranks still running
    after ``timeout`` seconds are killed (they are this call's own children) and an error says so."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fxpar-calibrate-") as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        ctx = mp.start_processes(_worker, args=(world, store, result, kwargs), nprocs=world, join=False,
                                 start_method="fork")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise FxparError(f"fxpar.runtime.calibrate: {world} ranks did not finish in {timeout:.0f} s; "
                                 "the machine may be busy: try again, or with --quick / a smaller --world")
        with open(result) as f:
            return json.load(f)


def calibrate(world: int = 8, *, quick: bool = False, device=None, timeout: float = 600.0, runtime=None) -> dict:
    """Measure this machine: matmul, memory bandwidth and op overhead on ``device`` (default: this rank's
    CUDA device under NCCL, else the CPU), compute share and collectives on ``world`` ranks (forked gloo
    ranks, or the process group torchrun made: then every rank calls and rank 0 gets the dict). ``quick``:
    fewer sizes, group sizes 2 only and shorter loops (a test's seconds). ``runtime``: what measures fxpar's own
    costs on 2 ranks (default :func:`~fxpar.runtime.calibrate_runtime.runtime_measurements` without the pipeline,
    which needs ``fxpar.compile``: ``fxpar calibrate`` passes one with it), into ``"runtime"``."""
    t_start = time.perf_counter()
    kw = {"groups": (2,) if quick else (2, 4, 8), "sizes": QUICK_SIZES if quick else SIZES,
          "budget": 0.03 if quick else 0.08, "share_counts": (1, 2) if quick else (1, 2, 4, 8),
          "share_seconds": 0.25 if quick else 1.5, "concurrent": not quick}
    in_group = dist.is_available() and dist.is_initialized()
    speeds: list[float] = []  # the host's reference seconds as the calibration went (host_reference)
    if in_group:
        world, backend = dist.get_world_size(), dist.get_backend()
        kw["groups"] = tuple(g for g in (2, 4, 8, 16, 32, 64) if g <= world)[: 1 if quick else None]
        comm = rank_measurements(**kw)
        if device is None and backend != "gloo":
            device = torch.device("cuda", torch.cuda.current_device())
        comm["runtime"] = (runtime or runtime_measurements)(quick=quick)
    else:
        backend = "gloo"
        speeds.append(host_reference())
        comm = _forked(world, kw, timeout) if world > 1 else {"compute_share": {}, "times": {}, "concurrent": {}}
        # fxpar's own costs on 2 ranks of their own (a pipeline of 2 stages needs a world of 2)
        comm["runtime"] = _forked(2, {"fn": runtime or runtime_measurements, "quick": quick}, timeout) \
            if world > 1 else {}
        speeds.append(host_reference())
    comm["runtime"]["comm_share"] = comm.pop("comm_share", {})
    device = torch.device(device or "cpu")
    if in_group and dist.get_rank() != 0:
        dist.barrier()
        return {}
    seconds = 0.05 if quick else 0.15
    cpu = device.type == "cpu"
    # each measurement at the host's speed around it, then read at the calibration's median speed (a shared
    # CPU host's speed drifts by tens of percent within a calibration; host_reference); a GPU's are as taken
    at = [] if cpu else None

    def measured(fn, rate: bool):  # on a CPU: 3 rounds (1 if quick), each at its speed, their median read later
        if not cpu:
            return fn()
        rounds = [at_host_speed(fn, speeds) for _ in range(1 if quick else 3)]
        at.append((rounds, rate))
        return rounds[0][0]
    mm = measured(lambda: measure_matmul(device, sizes=(256, 512) if quick and cpu else
                                         ((256, 512, 1024) if cpu else (2048, 4096, 8192)), seconds=seconds), True)
    bw = measured(lambda: measure_memory_bandwidth(device, sizes_mb=(16, 64) if cpu else (256, 1024),
                                                   seconds=seconds), True)
    ovh = measured(lambda: measure_op_overhead(device), False)
    ew = measured(lambda: measure_elementwise(device, numel=(1 << 21) if cpu else (1 << 26), seconds=seconds), True)
    opt = measured(lambda: measure_optimizer(device, numel=(1 << 21) if cpu else (1 << 26), seconds=seconds), False)
    fresh = measured(lambda: measure_fresh_memory(seconds=seconds), True) if cpu else {"threshold": 0,
                                                                                       "bytes_per_s": 0.0}
    host = {}
    if cpu:
        ref = statistics.median(speeds)
        for rounds, rate in at:  # rates x speed / ref, times x ref / speed; the rounds' median into the first
            for out, speed in rounds:
                _scale_floats(out, speed / ref if rate else ref / speed)
            _median_floats(rounds[0][0], [out for out, _ in rounds])
        host = {"host_speed": {"reference_s": ref, "samples": speeds, "spread": max(speeds) / min(speeds)}}
    if in_group:
        dist.barrier()
    mem = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return {"host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine(), "cores": os.cpu_count(), "world": world,
            "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            "backend": backend, "quick": quick, "device_memory": mem, "matmul": mm, "memory_bandwidth": bw,
            "op_overhead": ovh, "elementwise": ew, "optimizer": opt, "fresh": fresh, **comm, **host,
            "seconds": time.perf_counter() - t_start}


def _median_floats(into: dict, rounds: list[dict]) -> None:
    """Each float of ``into`` (nested dicts and tuples, as :func:`_scale_floats` walks them) becomes the median of
    that float over ``rounds`` (dicts of the same shape, ``into`` among them)."""
    for k, v in into.items():
        if isinstance(v, dict):
            _median_floats(v, [r[k] for r in rounds])
        elif isinstance(v, float):
            into[k] = statistics.median(r[k] for r in rounds)
        elif isinstance(v, tuple):
            into[k] = tuple(statistics.median(r[k][i] for r in rounds) if isinstance(x, float) else x
                            for i, x in enumerate(v))


def _scale_floats(d: dict, factor: float) -> None:
    """Multiply every float of ``d`` (nested dicts and tuples; keys and ints left alone) by ``factor``."""
    for k, v in d.items():
        if isinstance(v, dict):
            _scale_floats(v, factor)
        elif isinstance(v, float):
            d[k] = v * factor
        elif isinstance(v, tuple):
            d[k] = tuple(x * factor if isinstance(x, float) else x for x in v)
