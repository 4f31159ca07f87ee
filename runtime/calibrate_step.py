"""Single-process measurements for ``fxpar calibrate`` (:mod:`fxpar.runtime.calibrate`): the timing loop,
and what a training step pays besides square matmuls: a linear layer's forward and backward products, the
elementwise ops' rate, the first touch of newly mapped outputs, and the optimizer's time per entry. Plain
dicts of seconds, bytes and rates; nothing here needs a process group."""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["at_host_speed", "host_reference", "measure_elementwise", "measure_fresh_memory", "measure_optimizer",
           "rate_loop", "sync", "typical", "training_matmuls"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def typical(times: list[float]) -> float:
    """The median call time: what a training step is measured by (the median step), so that rates measured
    here predict it (the 20th percentile, used before, rated this host's calls 16-25% faster than its median
    steps ran: the one-rank plans of bench/planner_accuracy.py predicted 25% too fast on 2026-11-27)."""
    return statistics.median(times)


def rate_loop(fn, device, seconds: float) -> list[float]:
    """Seconds per call of ``fn``: a warm-up call, then calls until ``seconds`` pass (at least 3)."""
    fn()
    sync(device)
    times, end = [], time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return times


def training_matmuls(device, dtype, seconds: float) -> float:
    """FLOP/s of the three products a linear layer runs in a training step (``x @ W^T``, ``g @ W`` and
    ``g^T @ x``: the transposed operands and thin shapes run slower than square ones) over a few
    (tokens, in, out) shapes: their total FLOPs over their total time. 0.0 where it cannot run."""
    shapes = ((1024, 256, 256), (1024, 256, 1024), (1024, 1024, 256)) if device.type == "cpu" else \
        ((8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096))
    flops = secs = 0.0
    try:
        for m, k, n in shapes:
            x, w, g = (torch.randn(*s, device=device).to(dtype) for s in ((m, k), (n, k), (m, n)))
            secs += typical(rate_loop(lambda x=x, w=w, g=g: (x @ w.t(), g @ w, g.t() @ x), device, seconds / 3))
            flops += 3 * 2 * m * k * n
    except RuntimeError:  # a dtype this device has no matmul for
        return 0.0
    return flops / secs


def measure_elementwise(device="cpu", numel: int = 1 << 21, seconds: float = 0.15) -> dict:
    """{"rate": elements/s, "by_op": {op: elements/s}} of the non-matmul ops a transformer step runs most
    (add, mul, SiLU, exp, rsqrt, a mean, softmax, log-softmax), each counted as fxpar's cost model counts it:
    one FLOP per output element. ``rate`` is the mix's total elements over its total time; with memory
    bandwidth it bounds each elementwise node (on a CPU core the transcendental ones are bound by arithmetic)."""
    device = torch.device(device)
    x = torch.randn(numel // 1024, 1024, device=device)
    y = torch.randn_like(x)
    ops = {"add": lambda: x + y, "mul": lambda: x * y, "silu": lambda: torch.nn.functional.silu(x),
           "exp": lambda: x.exp(), "rsqrt": lambda: y.abs().rsqrt(), "mean": lambda: x.pow(2).mean(-1, keepdim=True),
           "softmax": lambda: x.softmax(-1), "log_softmax": lambda: x.log_softmax(-1)}
    by, total = {}, 0.0
    for name, fn in ops.items():
        t = typical(rate_loop(fn, device, seconds / len(ops)))
        by[name] = numel / t
        total += t
    return {"rate": len(ops) * numel / total, "by_op": by}


def measure_fresh_memory(sizes_mb=(4, 8, 16, 32, 48, 64), seconds: float = 0.1) -> dict:
    """{"threshold": bytes, "bytes_per_s": rate, "by_size": {MB: (reused rate, fresh rate)}}: writing into a
    tensor allocated anew for each write (as every eager op's output is) against writing into one kept
    alive. Where the allocator maps large blocks anew on each allocation (glibc's mmap above its threshold)
    the fresh write page-faults: ``threshold`` is the smallest size whose fresh rate is under half the
    reused one (0 and rate 0.0: no size was), ``bytes_per_s`` the fresh rate there and above (CPU only)."""
    by, threshold, rates = {}, 0, []
    for mb in sizes_mb:
        n = mb * 2**20 // 4
        kept = torch.empty(n)
        reused = n * 4 / typical(rate_loop(lambda: kept.fill_(1.0), torch.device("cpu"), seconds / 2))
        fresh = n * 4 / typical(rate_loop(lambda: torch.empty(n).fill_(1.0), torch.device("cpu"), seconds / 2))
        by[mb] = (reused, fresh)
        if fresh < reused / 2:
            threshold = threshold or mb * 2**20
            rates.append(fresh)
        elif threshold:  # faster again above: no single threshold
            threshold, rates = 0, []
    return {"threshold": threshold, "bytes_per_s": statistics.median(rates) if rates else 0.0, "by_size": by}


def measure_optimizer(device="cpu", numel: int = 1 << 21, seconds: float = 0.15) -> dict:
    """{"seconds_per_entry": s} of ``torch.optim.AdamW``'s step (its default implementation on this device)
    over one fp32 parameter of ``numel`` entries with a gradient."""
    device = torch.device(device)
    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4)
    return {"seconds_per_entry": typical(rate_loop(opt.step, device, seconds)) / numel}


def host_reference(reps: int = 5) -> float:
    """Seconds of one fixed piece of training work on this process's core: a two-layer MLP's forward and
    backward (512 x 256 -> 512 -> 256, SiLU, twice), the median of ``reps``. What the host's speed is at this
    moment: a shared CPU host runs the same work 1.5x slower or faster from one minute to the next (measured
    on this project's 2-core host: 46-83 GFLOP/s for one core's matmuls within an hour), so ``fxpar calibrate``
    takes each measurement at the speed it finds around it (:func:`at_host_speed`) and records the median, and
    a measured step can be read at the calibration's speed (``bench/planner_accuracy.py``)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g)
    w1 = torch.randn(256, 512, generator=g, requires_grad=True)
    w2 = torch.randn(512, 256, generator=g, requires_grad=True)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(2):
            (torch.nn.functional.silu(x @ w1) @ w2).pow(2).mean().backward()
            w1.grad = w2.grad = None
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def at_host_speed(fn, speeds: list[float]):
    """``(fn(), the host's reference seconds around it)``: :func:`host_reference` before and after, both
    appended to ``speeds``."""
    before = host_reference()
    out = fn()
    after = host_reference()
    speeds += [before, after]
    return out, (before + after) / 2
