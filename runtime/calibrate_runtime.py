"""fxpar's own per-step costs for a device profile (``fxpar calibrate``), measured on the runtime's code paths:
``torch.ops.fxpar.*`` collectives against the raw torch.distributed calls, the DP engine
(:class:`~fxpar.runtime.data_parallel.DataParallelEngine`) against the raw all-reduce of its buckets, a compiled
pipeline of negligible compute per schedule, torch's AdamW over many tensors and groups, and a collective while
other ranks compute. :func:`fxpar.cost.overheads.runtime_fields` turns the dict into profile fields.

Reads: a process group of at least 2 ranks (every rank calls :func:`runtime_measurements`; ranks 0 and 1
measure, the others wait); :func:`comm_share` the whole world. Writes: nothing; plain dicts of seconds and rates.
Differences of two timings are taken pairwise (the two calls alternate, the median of their differences), so a
slow spell of a shared host counts on both sides.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from fxpar.ir.errors import FxparError
from fxpar.runtime import dist_calls
from fxpar.runtime.calibrate_step import rate_loop, typical

__all__ = ["collective_op", "comm_share", "lm_step", "measure_optimizer_tensors", "runtime_measurements"]

_GROUP = "calibrate:0,1"
# the raw calls (timed without fxpar's wrapping): the all-gather as the runtime sends it (on gloo one broadcast
# per member, fxpar.runtime.dist_calls.gather_by_broadcasts), the reduce-scatter under the release's name
def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    dist_calls.all_gather_into(out, inp, group)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collective_op(kind: str, nbytes: int, pg, n: int, me: int, device, gloo: bool):
    """A callable running ``kind`` once on ``nbytes`` of payload (the convention above), on group rank ``me``."""
    numel = max(n, nbytes // 4 // n * n)
    full = torch.ones(numel, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=pg)
    if kind == "all_gather":
        part = torch.ones(numel // n, device=device)
        return lambda: all_gather_single(full, part, group=pg)
    if kind == "reduce_scatter":
        part = torch.empty(numel // n, device=device)
        if gloo:  # fxpar's gloo kernel (fxpar.runtime.collectives): all-reduce the whole, keep a slice
            return lambda: (dist.all_reduce(full, group=pg),
                            part.copy_(full[me * part.numel():(me + 1) * part.numel()]))
        return lambda: _reduce_scatter(part, full, group=pg)
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=pg)
    if kind == "broadcast":
        return lambda: dist.broadcast(full, dist.get_global_rank(pg, 0) if pg is not None else 0, group=pg)
    raise FxparError(f"fxpar.runtime.calibrate: unknown collective {kind!r}")


def lm_step(seed: int = 0):
    """One training step of a tiny language model written in torch ops (1024 tokens, width 256, 8 heads,
    a SwiGLU-sized MLP, a 4096-word head, log-softmax, backward): the mix of matmuls, attention,
    elementwise ops and fresh allocations a rank runs, small enough to repeat many times a second."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 256, generator=g)
    w = [torch.randn(*s, generator=g, requires_grad=True) for s in ((256, 768), (256, 256), (256, 688),
                                                                    (688, 256), (256, 4096))]

    def step():
        q, k, v = (x @ w[0]).view(8, 128, 3, 4, 64).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2), is_causal=True)
        h = x + a.transpose(1, 2).reshape(1024, 256) @ w[1]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = h + torch.nn.functional.silu(h @ w[2]) @ w[3]
        (h @ w[4]).log_softmax(-1).mean().backward()

    return step




def _paired(fx, raw, reps: int, pg) -> float:
    """Median over ``reps`` of (seconds of ``fx`` - seconds of ``raw``), both called in turn on every member of
    ``pg``; the members' largest median."""
    fx(), raw()
    dist.barrier(group=pg)
    diffs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        raw()
        t1 = time.perf_counter()
        fx()
        diffs.append(time.perf_counter() - t1 - (t1 - t0))
    d = torch.tensor([statistics.median(diffs)], dtype=torch.float64)
    dist.all_reduce(d, op=dist.ReduceOp.MAX, group=pg)
    return d.item()


def _fit(points) -> tuple[float, float]:
    """(a, b) of ``excess = a + b * x`` by least squares, both kept >= 0."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx) if sxx else 0.0
    return max(0.0, my - b * mx), b


def _collective_calls(pg, me: int, sizes, reps: int) -> dict:
    """{kind: (s per call, s per full-tensor byte)} of ``torch.ops.fxpar.<kind>`` beyond the raw collective
    fxpar's kernel calls (the autograd record of a training forward included); ``gather_params``: ZeRO-3's."""

    ops = torch.ops.fxpar
    out = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "gather_params"):
        pts = []
        for nbytes in sizes:
            numel = nbytes // 4 // 2 * 2
            full = torch.ones(numel, requires_grad=True)
            part = torch.ones(numel // 2, requires_grad=True)
            if kind == "all_reduce":
                fx = lambda: ops.all_reduce(full, _GROUP, "sum")  # noqa: E731
            elif kind == "reduce_scatter":
                fx = lambda: ops.reduce_scatter(full, _GROUP, 0)  # noqa: E731
            else:
                fx = lambda k=kind: getattr(ops, k)(part, _GROUP, 0)  # noqa: E731
            if kind == "gather_params":
                buf = torch.empty(numel)
                raw = lambda: all_gather_single(buf, part.detach(), group=pg)  # noqa: E731
            else:
                raw = collective_op(kind, nbytes, pg, 2, me, torch.device("cpu"), True)
            with torch.enable_grad():
                pts.append((numel * 4, _paired(fx, raw, reps, pg)))
        out[kind] = _fit(pts)
    return out


def _ep_calls(pg, me: int, sizes, reps: int, experts: int = 4) -> dict:
    """{op: (s per call, s per byte of its input rows)} of ``torch.ops.fxpar.ep_dispatch`` / ``ep_combine``
    (:mod:`fxpar.runtime.collectives`: the layout read off the counts, the reorder into and out of the
    static ``[2 * N, H]`` buffer, the autograd record) beyond the raw ``all_to_all_single`` of the same rows, and
    ``ep_counts`` beyond the raw all-gather of its ``experts`` counts, on two ranks with balanced routing."""
    import fxpar.runtime.collectives  # noqa: F401  (registers the ops' kernels)

    ops = torch.ops.fxpar
    per = torch.full((experts,), 1, dtype=torch.long)
    offs = torch.cumsum(per, 0)
    gathered = torch.empty(2 * experts, dtype=torch.long)
    out = {"ep_counts": (max(0.0, _paired(lambda: ops.ep_counts(offs, _GROUP, "calibrate"),
                                          lambda: all_gather_single(gathered, per, group=pg), reps, pg)), 0.0)}
    pts: dict[str, list] = {"ep_dispatch": [], "ep_combine": []}
    for nbytes in sizes:
        rows = max(experts, nbytes // 4 // 64 // experts * experts)
        counts = torch.full((2, experts), rows // experts, dtype=torch.long)  # every expert gets rows / E of each rank
        x = torch.ones(rows, 64, requires_grad=True)
        y = torch.ones(2 * rows, 64, requires_grad=True)
        got = torch.empty(rows, 64)
        raw = lambda: dist.all_to_all_single(got, x.detach(), group=pg)  # noqa: E731
        with torch.enable_grad():
            pts["ep_dispatch"].append((rows * 256, _paired(lambda: ops.ep_dispatch(x, counts, _GROUP, "calibrate"),
                                                          raw, reps, pg)))
            pts["ep_combine"].append((rows * 256, _paired(lambda: ops.ep_combine(y, counts, _GROUP, "calibrate"),
                                                         raw, reps, pg)))
    out.update({k: _fit(v) for k, v in pts.items()})
    return out


def gather_scratch(pg, numel: int = 1 << 20) -> float:
    """Bytes the backend holds beside an all-gather's output while it runs, per output byte (the allocator's
    peak over one all-gather into a buffer made before it, less that buffer; the larger of the members'):
    0 where the gather writes in place (NCCL; gloo through fxpar's broadcasts), 1.0 where the backend gathers
    into a flat buffer of the output's size and copies it out (gloo's own all-gather)."""
    from fxpar.runtime.memtrack import AllocatorPeak

    x = torch.ones(numel)
    out = torch.empty(2 * numel)
    dist_calls.all_gather_into(out, x, _GROUP)
    with AllocatorPeak() as mem:
        dist_calls.all_gather_into(out, x, _GROUP)
        mem.mark()
        dist_calls.all_gather_into(out, x, _GROUP)
    got = torch.tensor([max(0, mem.peak - mem.start) / out.nbytes], dtype=torch.float64)
    dist.all_reduce(got, op=dist.ReduceOp.MAX, group=pg)
    return round(got.item(), 2)


def _bucket_costs(me: int, reps: int) -> tuple[float, float]:
    """(s per bucket, bytes/s) of the DP engine's buckets: a backward into 8 tensors through
    :class:`DataParallelEngine` (hooks, copies into the buckets, launch, wait, views) against the same backward
    and the raw all-reduce of the same buckets, at 1 and 8 buckets of 4 MB and 1 bucket of 1 MB."""
    from fxpar.runtime.data_parallel import DataParallelEngine

    pg = _pg()

    def case(total: int, buckets: int) -> float:
        ps = [torch.nn.Parameter(torch.ones(total // 4 // 8)) for _ in range(8)]
        eng = DataParallelEngine([(f"p{i}", p) for i, p in enumerate(ps)], None, dp=2, rank=me, zero=0,
                                 group=_GROUP, bucket_bytes=total // buckets, first_bucket_bytes=total // buckets)
        flats = [torch.ones(b.flat.numel()) for b in eng.buckets] if eng.buckets[0].flat is not None else \
            [torch.ones(total // 4 // buckets) for _ in range(buckets)]

        def backward():
            for p in ps:
                p.grad = None
            sum(p.sum() for p in ps).backward()

        def fx():
            eng.start_step("calibrate")
            backward()
            eng.finish()

        def raw():
            backward()
            for w in [dist.all_reduce(f, group=pg, async_op=True) for f in flats]:
                w.wait()
        fx()  # the first step learns the gradient counts
        try:
            return _paired(fx, raw, reps, pg)
        finally:
            eng.close()
    one_small, one, many = case(1 << 20, 1), case(4 << 20, 1), case(4 << 20, 8)
    fixed = max(0.0, (many - one) / 7)
    per_byte = max(0.0, (one - one_small) / (3 << 20))
    return fixed, (1 / per_byte if per_byte else 0.0)


def _pg():
    from fxpar.runtime.groups import resolve_group

    return resolve_group(_GROUP)


def measure_optimizer_tensors(seconds: float = 0.15, numel: int = 1 << 18) -> tuple[float, float]:
    """(s per tensor, s per group) of ``torch.optim.AdamW``'s step beyond its time per entry: ``numel`` entries
    as 1 tensor, as 64 tensors in one group, and as 64 tensors in 8 groups."""
    def step_time(tensors: int, groups: int) -> float:
        ps = [torch.nn.Parameter(torch.randn(numel // tensors)) for _ in range(tensors)]
        for p in ps:
            p.grad = torch.randn_like(p)
        per = tensors // groups
        opt = torch.optim.AdamW([{"params": ps[i:i + per]} for i in range(0, tensors, per)], lr=1e-4)
        return typical(rate_loop(opt.step, torch.device("cpu"), seconds))
    one, flat, grouped = step_time(1, 1), step_time(64, 1), step_time(64, 8)
    return max(0.0, (flat - one) / 63), max(0.0, (grouped - flat) / 7)


def comm_share(counts, *, nbytes: int = 1 << 20, seconds: float = 0.4) -> dict:
    """{k: a 1 MB all-reduce's speed between ranks 0 and 1 while ranks 2..k-1 run a small training step, over
    its speed with them idle} for each ``k`` of ``counts`` within the world (ranks sharing the host's cores
    with gloo's threads). Every rank of the world calls. The pair runs a count of all-reduces agreed on beforehand
    (from the idle time, to fill about ``seconds``); the others compute until the pair is done."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.new_group([0, 1])
    x = torch.ones(nbytes // 4)
    step = lm_step(rank)
    out, base, reps = {}, None, 10
    for k in [2, *(k for k in counts if 2 < k <= world)]:
        dist.barrier()
        times, done = [], torch.zeros(1)
        if rank < 2:
            dist.all_reduce(x, group=pg)
            for _ in range(reps):
                t = time.perf_counter()
                dist.all_reduce(x, group=pg)
                times.append(time.perf_counter() - t)
            if rank == 0:
                done.fill_(1.0)
        work = dist.all_reduce(done, async_op=True)  # the pair's end, heard by the computing ranks
        if 2 <= rank < k:
            while not work.is_completed():
                step()
        work.wait()
        t = torch.tensor([statistics.median(times) if times else 0.0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if base is None:
            base = t.item()
            n = torch.tensor([max(5, min(200, int(seconds / max(base, 1e-6))))])
            dist.broadcast(n, 0)
            reps = int(n.item())
        out[k] = base / t.item()
    return out


def runtime_measurements(*, quick: bool = False, pipeline=None) -> dict:
    """What ranks 0 and 1 measure of fxpar's runtime (every rank calls; the others wait): the dict
    :func:`fxpar.cost.overheads.runtime_fields` reads (``comm_share`` is :func:`comm_share`'s, measured apart).
    ``pipeline(quick=)``: {schedule: s per action} on a world of 2 (it compiles a model: the ``cli`` layer's);
    not with ``quick``."""
    from fxpar.runtime.groups import new_group

    new_group(_GROUP, [0, 1])
    rank = dist.get_rank()
    out: dict = {}
    if rank < 2:
        reps = 8 if quick else 40
        pg = _pg()
        out["collective_call"] = _collective_calls(pg, rank, (4 << 10, 256 << 10) if quick else
                                                   (4 << 10, 256 << 10, 2 << 20), reps)
        out["collective_call"].update(_ep_calls(pg, rank, (16 << 10, 256 << 10) if quick else
                                                (16 << 10, 256 << 10, 2 << 20), reps))
        out["gather_copy"] = out["collective_call"].pop("gather_params")
        a, b = out["gather_copy"]
        out["gather_copy"] = (a, 1 / b if b else 0.0)
        out["bucket_copy"] = _bucket_costs(rank, reps)
        out["gather_scratch"] = gather_scratch(pg)
        out["optimizer_tensor"] = measure_optimizer_tensors(0.05 if quick else 0.15)
    if pipeline is not None and dist.get_world_size() == 2 and not quick:  # (compiling takes seconds)
        out["pipeline_action"] = pipeline(quick=quick)
    dist.barrier()
    return out
