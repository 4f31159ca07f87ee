"""Collective matmul for sequence-parallel TP: ``torch.ops.fxpar_kernels.all_gather_linear`` and
``torch.ops.fxpar_kernels.linear_reduce_scatter`` (Domino / Wang et al. style chunking, any backend).

Reads: activations sharded (or to be reduce-scattered) along a token dim ``dim`` over the group named
``group`` (resolved by :mod:`fxpar.runtime.groups`), ``aten.linear`` weights and biases, a chunk count.
Writes: the kernels of the ops :mod:`fxpar.ir.collective_matmul_ops` declares (importing this module
registers them, for every device); the issue order inside :func:`recording`.

Sequence parallelism puts an all-gather before each column-parallel block and a reduce-scatter after
each row-parallel one, and the plain kernels (:mod:`fxpar.runtime.collectives`) wait inside: the matmul
cannot start before the whole sequence has arrived. Here each rank's sequence shard of ``L`` tokens is
cut into ``chunks`` pieces of ``p = L / chunks`` tokens. Piece ``j`` gathered from every rank is a set
of whole tokens (rank ``k``'s tokens ``j*p .. (j+1)*p``), and a linear maps each token on its own, so
the chunk's output rows are exactly the rows the unchunked matmul would give them (the sum over the
input features runs the same way); they are written straight into their places in the full output.

* ``all_gather_linear(x, group, dim, chunks, weights, biases, has_bias)`` -> ``[gathered, y_0, ..]``:
  the all-gather of ``x`` along ``dim`` and ``linear(gathered, W_k, b_k)`` for every weight (the q/k/v
  or gate/up projections reading one gather share its chunks). Chunk ``j+1``'s gather is started
  before chunk ``j`` is waited for and multiplied. The gathered tensor is an output because the
  backward needs it for the weight gradients (the unchunked path saves it as the linears' input too)
  and other readers of the gather use it. Backward (the mirror: a matmul then a reduce-scatter per
  chunk): chunk ``j``'s input gradient ``sum_k gy_k W_k`` is computed and its reduce-scatter started
  before chunk ``j+1``'s matmul; the weight gradients are one matmul over the whole sequence, issued
  while the last reduce-scatters are in flight, so they equal the unchunked path's bit for bit.
* ``linear_reduce_scatter(x, group, dim, chunks, weight, bias)`` -> ``y``: ``reduce_scatter(linear(x))``.
  Chunk ``j`` multiplies the tokens every rank's piece ``j`` of the result needs, then starts its
  reduce-scatter while chunk ``j+1`` multiplies; all are waited for at the end. Backward: chunk
  ``j+1``'s all-gather of the output gradient is started before chunk ``j``'s input-gradient matmul;
  the weight gradient is again one matmul over the gathered gradient.

Communication goes through the wire of the all_gather, all_reduce and reduce_scatter patterns
(:mod:`fxpar.runtime.dist_calls`, as the plain kernels of :mod:`fxpar.runtime.collectives`), started
asynchronously: every wait is bounded by the process group's timeout, errors name op, group, ranks and
shape. On gloo the reduce-scatter is an all-reduce and a slice, for the reason given in
``collectives._reduce_scatter``. On CUDA the same code overlaps by streams: NCCL runs on its own stream
and ``Work.wait()`` only makes the compute stream wait, so chunk ``j``'s matmul runs while chunk
``j+1`` is on the wire; no Triton kernel is needed (the matmuls are cuBLAS).

How this relates to torch's async-TP: with ``Plan(compile=True)`` on CUDA, ``passes/lower_collectives``
leaves the unchunked shapes Inductor's ``_micro_pipeline_tp`` pass matches (``all_gather_into_tensor``
along dim 0 -> split/cat -> mm, and mm -> ``reduce_scatter_tensor``) and torch decomposes them with
symmetric memory itself; that path wants ``collective_matmul=0``. These ops are the decomposition for
every other case (eager, CPU/gloo, no symmetric memory); under ``torch.compile`` they stay opaque calls.

:func:`recording`: within the block each kernel appends ``(op, "comm_start" | "comm_done" | "mm_done",
chunk)`` to the list it yields, in the order things are issued, which is how tests show the overlap on
CPU, where timing would say little.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from fxpar.ir import collective_matmul_ops as cm_ops
from fxpar.ir.collective_matmul_ops import check_chunks, check_token_dim, compute_dtype
from fxpar.ir.ops import check_dim, group_size, shard_len
from fxpar.runtime import collectives as coll
from fxpar.runtime import dist_calls

__all__ = ["all_gather_linear", "linear_reduce_scatter", "recording"]


class _Recording:
    """The list the kernels append their issue order to, inside :func:`recording` (None outside). A
    per-process slot: torch's custom-op machinery calls the kernels with the op's arguments only, so the list
    cannot be passed to them. A plain attribute, not a ContextVar: autograd runs a CUDA backward on a
    thread of its own."""

    events: list | None = None


@contextlib.contextmanager
def recording():
    """Within the block, the kernels' issue order: yields the list each kernel appends to."""
    before, _Recording.events = _Recording.events, []
    try:
        yield _Recording.events
    finally:
        _Recording.events = before


def _log(op: str, what: str, chunk: int) -> None:
    if _Recording.events is not None:
        _Recording.events.append((op, what, chunk))


class _ReduceScatter:
    """Reduce-scatter of ``src [n * p, ...]`` along dim 0 into ``out [p, ...]``, started now, finished
    by :meth:`finish` (on gloo: an all-reduce of ``src`` in place, then this rank's slice)."""

    def __init__(self, op: str, group: str, pg, src: torch.Tensor, out: torch.Tensor, rank: int):
        self.src, self.out, self.rank = src, out, rank
        self.gloo = coll._backend_of(pg, src.device) == "gloo"
        if self.gloo:
            self.work = dist_calls.all_reduce(src, group, async_op=True, call=op)
        else:
            self.work = coll._reduce_scatter_single(out, src, group=group, async_op=True, call=op)

    def finish(self) -> None:
        self.work.wait()
        if self.gloo:
            p = self.out.shape[0]
            self.out.copy_(self.src.narrow(0, self.rank * p, p))


def _setup(op, group, x, dim, chunks, gathered):
    d = check_token_dim(op, group, x, dim)
    p = check_chunks(op, group, x.shape, d, chunks, gathered)
    pg, n, rank = coll._membership(op, group)
    if pg is not None:
        coll._cross_check(op, group, x)
    return d, p, pg, n, rank


def _unfront(t: torch.Tensor, tokens: int, d: int) -> torch.Tensor:
    """``t [n, chunks, p, ...]`` (rank-major, as gathered) back to the natural layout with ``tokens``
    along ``d``."""
    return t.reshape(tokens, *t.shape[3:]).movedim(0, d).contiguous()


def _biases(has_bias, biases):
    it = iter(biases)
    return [next(it) if h else None for h in has_bias]


def _cast(dt, *ts):
    """``ts`` in dtype ``dt`` (None stays None): what autocast does to a linear's inputs."""
    return [t if t is None else t.to(dt) for t in ts]


# ---------------------------------------------------------------------------------------------------
# all-gather -> linear


def all_gather_linear_impl(x, group, dim, chunks, weights, biases, has_bias):
    op = "all_gather_linear"
    d, p, pg, n, rank = _setup(op, group, x, dim, chunks, gathered=True)
    dt = compute_dtype(x)
    wbs = [_cast(dt, w, b) for w, b in zip(weights, _biases(has_bias, biases))]
    if n == 1:
        return [coll._copy(x)] + [F.linear(x.to(dt), w, b) for w, b in wbs]
    xf = x.movedim(d, 0)  # [L, *rest]: the token dim in front, as the single-tensor all-gather wants it
    rest = tuple(xf.shape[1:])
    ys = [xf.new_empty((n, chunks, p, *rest[:-1], w.shape[0]), dtype=dt) for w in weights]
    gathered, works = _gather_chunks(op, group, x, xf, n, chunks, p)
    for j in range(chunks):
        if j + 1 < chunks:
            works[j + 1] = works[j + 1]()  # started: in flight while chunk j multiplies
        works[j].wait()
        _log(op, "comm_done", j)
        piece = gathered[j].to(dt)  # [n, p, ...]: every rank's tokens j*p .. (j+1)*p
        for y, (w, b) in zip(ys, wbs):
            y[:, j] = F.linear(piece, w, b)
        _log(op, "mm_done", j)
    tokens = n * chunks * p
    return [_unfront(gathered.transpose(0, 1), tokens, d)] + [_unfront(y, tokens, d) for y in ys]


def _gather_chunks(op, group, x, xf, n, chunks, p):
    """``(buffer [chunks, n, p, ...], works)``: chunk ``j`` of ``xf [L, ...]`` from every rank lands in
    ``buffer[j]`` (contiguous: the single-tensor all-gather writes it directly). Chunk 0's gather is
    started; ``works[j]`` of a later chunk is a function that starts it and returns its handle."""
    rest = tuple(xf.shape[1:])
    buf = xf.new_empty((chunks, n, p, *rest))

    def starter(j):
        def start():
            src = xf.narrow(0, j * p, p).contiguous()
            out = buf[j].view(n * p, *rest)  # flat along dim 0, as the single-tensor all-gather writes it
            work = coll._all_gather_single(out, src, group=group, async_op=True, call=op, about=x)
            _log(op, "comm_start", j)
            return work
        return start

    works = [starter(j) for j in range(chunks)]
    works[0] = works[0]()
    return buf, works


def all_gather_linear_backward_impl(grads, gathered, group, dim, chunks, weights, has_bias):
    """``grads``: of the gathered tensor, then of each output. Returns ``[dx, dW_0.., db_k (with bias)..]``."""
    op = "all_gather_linear_backward"
    n = group_size(group)
    d = check_dim(op, group, gathered, dim)
    local = shard_len(op, group, gathered, d, n)
    check_chunks(op, group, gathered.shape, d, chunks, gathered=False)
    g_gathered, gys = grads[0], list(grads[1:])

    # the output gradients come in the dtype the forward multiplied in (autocast's): the matmuls run in
    # it, each result cast to its input's dtype, as autocast's casts do in the unchunked backward
    dt = gys[0].dtype if gys else gathered.dtype
    ws = _cast(dt, *weights)

    def weight_grads():  # one matmul over every token each, as aten.linear's backward does them
        flat = gathered.reshape(-1, gathered.shape[-1]).to(dt)
        dws = [torch.mm(gy.reshape(-1, gy.shape[-1]).t(), flat).to(w.dtype) for gy, w in zip(gys, weights)]
        return dws + [gy.reshape(-1, gy.shape[-1]).sum(0).to(w.dtype)
                      for gy, w, h in zip(gys, weights, has_bias) if h]

    pg, n, rank = coll._membership(op, group)
    if n == 1:
        dx = g_gathered.clone()
        for gy, w in zip(gys, ws):
            dx += torch.matmul(gy, w).to(dx.dtype)
        return [dx] + weight_grads()
    p = local // chunks
    rest = tuple(gathered.movedim(d, 0).shape[1:])
    views = [gy.movedim(d, 0).reshape(n, chunks, p, *gy.movedim(d, 0).shape[1:]) for gy in gys]
    gview = g_gathered.movedim(d, 0).reshape(n, chunks, p, *rest)
    dx = gathered.new_empty((chunks, p, *rest))
    pending = []
    for j in range(chunks):
        part = gview[:, j].clone(memory_format=torch.contiguous_format)
        for v, w in zip(views, ws):
            part += torch.matmul(v[:, j], w).to(part.dtype)
        _log(op, "mm_done", j)
        pending.append(_ReduceScatter(op, group, pg, part.view(n * p, *rest), dx[j], rank))
        _log(op, "comm_start", j)
    grads_w = weight_grads()  # while the last reduce-scatters are in flight
    for j, rs in enumerate(pending):  # waited as late as possible
        rs.finish()
        _log(op, "comm_done", j)
    return [dx.reshape(local, *rest).movedim(0, d).contiguous()] + grads_w


# ---------------------------------------------------------------------------------------------------
# linear -> reduce-scatter


def linear_reduce_scatter_impl(x, group, dim, chunks, weight, bias):
    op = "linear_reduce_scatter"
    d, p, pg, n, rank = _setup(op, group, x, dim, chunks, gathered=False)
    dt = compute_dtype(x)
    x, weight, bias = _cast(dt, x, weight, bias)
    if n == 1:
        return F.linear(x, weight, bias)
    xf = x.movedim(d, 0)
    rest = tuple(xf.shape[1:])
    xv = xf.reshape(n, chunks, p, *rest)  # [destination rank, chunk, token, ...]
    out = xf.new_empty((chunks, p, *rest[:-1], weight.shape[0]))
    pending = []
    for j in range(chunks):
        y = F.linear(xv[:, j], weight, bias).contiguous()
        _log(op, "mm_done", j)
        pending.append(_ReduceScatter(op, group, pg, y.view(n * p, *y.shape[2:]), out[j], rank))
        _log(op, "comm_start", j)  # chunk j on the wire while chunk j+1 multiplies
    for j, rs in enumerate(pending):
        rs.finish()
        _log(op, "comm_done", j)
    return out.reshape(chunks * p, *out.shape[2:]).movedim(0, d).contiguous()


def linear_reduce_scatter_backward_impl(grad, x, group, dim, chunks, weight, has_bias):
    """Returns ``[dx, dW]`` (+ ``[db]`` with a bias)."""
    op = "linear_reduce_scatter_backward"
    d, p, pg, n, rank = _setup(op, group, grad, dim, chunks, gathered=True)
    x_dtype, w_dtype = x.dtype, weight.dtype
    x, weight = _cast(grad.dtype, x, weight)  # the forward's dtype (autocast's): see the gather's backward
    if n == 1:
        full = grad
    else:
        xv = x.movedim(d, 0).reshape(n, chunks, p, *x.movedim(d, 0).shape[1:])
        dx = x.new_empty(xv.shape)
        gathered, works = _gather_chunks(op, group, grad, grad.movedim(d, 0), n, chunks, p)
        for j in range(chunks):
            if j + 1 < chunks:
                works[j + 1] = works[j + 1]()
            works[j].wait()
            _log(op, "comm_done", j)
            dx[:, j] = torch.matmul(gathered[j], weight)
            _log(op, "mm_done", j)
        full = _unfront(gathered.transpose(0, 1), n * chunks * p, d)
    dx = torch.matmul(full, weight) if n == 1 else _unfront(dx, n * chunks * p, d)
    g2 = full.reshape(-1, full.shape[-1])
    out = [dx.to(x_dtype), torch.mm(g2.t(), x.reshape(-1, x.shape[-1])).to(w_dtype)]
    return out + ([g2.sum(0).to(w_dtype)] if has_bias else [])


# ---------------------------------------------------------------------------------------------------
# Entry points


def all_gather_linear(x, group: str, dim: int, chunks: int, weights, biases=None) -> list[torch.Tensor]:
    """``[all_gather(x, dim), linear(that, W_0, b_0), ...]`` over ``group`` in ``chunks`` overlapped pieces
    (its backward reduce-scatters the input gradient, as ``fxpar.all_gather_rs_bwd``'s does)."""
    biases = list(biases) if biases is not None else [None] * len(weights)
    return cm_ops.all_gather_linear(x, group, dim, chunks, list(weights), [b for b in biases if b is not None],
                                    [b is not None for b in biases])


def linear_reduce_scatter(x, group: str, dim: int, chunks: int, weight, bias=None) -> torch.Tensor:
    """``reduce_scatter(linear(x, weight, bias), dim)`` over ``group`` in ``chunks`` overlapped pieces."""
    return cm_ops.linear_reduce_scatter(x, group, dim, chunks, weight, bias)


# device_types=None: one kernel for every device (it replaces the schema's placeholder body)
for _op, _kernel in ((cm_ops.all_gather_linear, all_gather_linear_impl),
                     (cm_ops.all_gather_linear_backward, all_gather_linear_backward_impl),
                     (cm_ops.linear_reduce_scatter, linear_reduce_scatter_impl),
                     (cm_ops.linear_reduce_scatter_backward, linear_reduce_scatter_backward_impl)):
    _op.register_kernel(None, _kernel)
