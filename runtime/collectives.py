"""The real kernels of fxpar's collective ops (schemas, fake kernels, autograd: :mod:`fxpar.ir.ops`, from
the records of :mod:`fxpar.ir.collectives`).

Reads: the records, at import; tensors and group names at run time, resolved to process groups by
:mod:`fxpar.runtime.groups`. Writes: the kernel of every record's ``torch.ops.fxpar.*`` op for real tensors
(importing this module registers them by :func:`register_kernel`, looped over the records, for every
device: the dispatcher's ``CompositeExplicitAutograd`` key, as ``custom_op`` does), and the byte counters
active now (:class:`Counting`) for records with a ``counter`` (expert parallelism's).

* One implementation per communication pattern (:data:`PATTERN_KERNELS`, keyed by
  :data:`fxpar.ir.collectives.PATTERNS`): a record's ``kernel`` picks it, and its fields steer it (the
  reduction's, the dtype's and the wire format's argument positions, the ``route`` of an all-to-all, the
  observer, the counter). A new record that runs an existing pattern needs nothing here.

* Kernels communicate through the wire of their pattern (:mod:`fxpar.runtime.dist_calls`: the plain
  torch.distributed calls, gloo on CPU, NCCL on GPU) and wait with the process group's own timeout
  (``timeout=`` of ``init_process_group`` / ``new_group``): nothing waits for ever. A failure or timeout
  becomes a :class:`~fxpar.ir.errors.CollectiveError` naming the op, group, its ranks and shapes; so do
  local shape errors. Which of the ranks died is for
  :mod:`fxpar.runtime.liveness` to say (``CompiledModel.step`` runs under its guard). Without
  torch.distributed, or on a one-rank group, every op is a copy.
* :func:`set_shape_checks` (or ``FXPAR_CHECK_COLLECTIVES=1``) also compares shapes across ranks before
  each collective, for debugging.
* ZeRO-3's regathering (:class:`fxpar.runtime.zero3.Zero3Regather`) needs to hear of every parameter
  bucket ``gather_params`` gathers during a forward: :func:`observing_param_gathers` installs an
  observer for the current context only (a ``ContextVar``, set and reset by the regather object).
* ``comm_dtype="int8"`` (ZeRO++, ``Plan(comm_dtype=...)``): ``gather_params`` sends each shard as int8
  codes and fp32 block scales packed into one int8 buffer (one all-gather), ``reduce_scatter`` its
  slices the same way through one all-to-all, summed in fp32 by the receiving rank. Quantization and
  its error bounds: :mod:`fxpar.runtime.kernels.quant`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from fxpar.ir import ops as ir_ops
from fxpar.ir import wire
from fxpar.ir.collectives import COLLECTIVES
from fxpar.ir.errors import CollectiveError, FxparError
from fxpar.ir.ops import check_dim, check_reduce_op, shard_len
from fxpar.ir.options import run_options
from fxpar.runtime import dist_calls
from fxpar.runtime.groups import resolve_group

__all__ = ["PATTERN_KERNELS", "Call", "Counting", "all_gather_single", "observing_param_gathers",
           "register_kernel", "set_shape_checks"]

_SHAPE_CHECKS: bool | None = None  # set_shape_checks's choice; None: FXPAR_CHECK_COLLECTIVES (run options)


def set_shape_checks(enabled: bool) -> bool:
    """Compare every collective's input shape and dtype across the group before running it (one more
    small collective each); a mismatch raises :class:`CollectiveError` on every rank instead of a
    hang or garbage. Off by default (``FXPAR_CHECK_COLLECTIVES=1`` turns it on). Returns the old value."""
    global _SHAPE_CHECKS
    old, _SHAPE_CHECKS = _shape_checks(), bool(enabled)
    return old


def _shape_checks() -> bool:
    return run_options().check_collectives if _SHAPE_CHECKS is None else _SHAPE_CHECKS


# ---------------------------------------------------------------------------------------------------
# Communication helpers


def _membership(op: str, group: str):
    """(process group or None, group size, this rank's index in the group)."""
    try:
        pg = resolve_group(group)
    except CollectiveError:
        raise
    except FxparError as e:
        raise CollectiveError(str(e), op=op, group=group) from e
    if pg is None:
        return None, 1, 0
    return pg, pg.size(), dist.get_rank(pg)


def _backend_of(pg, device: torch.device) -> str:
    """The backend that runs collectives on ``device`` tensors: "gloo", "nccl", ... ("" if unknown)."""
    try:
        name = str(dist.get_backend(pg)).lower()
    except (RuntimeError, ValueError):
        return ""
    if ":" not in name:
        return name
    by_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)  # "cpu:gloo,cuda:nccl"
    return by_device.get(device.type, "")


def _cross_check(op: str, group: str, x: torch.Tensor) -> None:
    """With shape checks on: every rank of the group must bring the same shape and dtype."""
    if not _shape_checks():
        return
    mine = (tuple(x.shape), str(x.dtype))
    seen = dist_calls.all_gather_object(mine, group, call=op, about=x)
    if any(s != mine for s in seen):
        listing = ", ".join(f"rank {r}: {s[0]} {s[1]}" for r, s in enumerate(seen))
        raise CollectiveError(f"the ranks' inputs differ ({listing}); every rank must pass the same shape",
                              op=op, group=group, sizes=[s[0] for s in seen])


# the wire of the all_gather and reduce_scatter patterns (module globals: tests count the bytes at these
# calls by replacing them)
_all_gather_single = dist_calls.all_gather_into
_reduce_scatter_single = dist_calls.reduce_scatter_into
all_gather_single = _all_gather_single  # (out, t, group=None): the all_gather pattern's single-tensor wire call


def _copy(x: torch.Tensor) -> torch.Tensor:
    # A custom op may not return (a view of) its input, so the one-rank case still copies.
    return x.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------------------------
# One implementation per communication pattern (fxpar.ir.collectives.PATTERNS), run for every record
# whose ``kernel`` names it


class Call:
    """One call of a record's op: ``rec``, ``values`` (every argument in schema order, defaults filled in),
    ``args`` (the arguments after the tensor, by name)."""

    __slots__ = ("rec", "values", "args")

    def __init__(self, rec, values: tuple, args: dict):
        self.rec, self.values, self.args = rec, values, args

    @property
    def x(self) -> torch.Tensor:
        return self.values[0]

    @property
    def group(self) -> str:
        return self.args["group"]

    def at(self, position: int | None):
        """The argument at ``position`` (a record's ``cast_arg``, ...); None where the record has none."""
        return None if position is None else self.values[position]


class Counting:
    """The counters the kernels of records with a ``counter`` add the bytes they send off-rank to now
    (``active.comm``: key -> bytes), and that a record's ``tally`` hook tells of its output (``ep_counts``:
    the load per MoE layer): a per-process slot, because torch's custom-op machinery calls the
    kernels with the op's arguments only (tensors, names), so no counter object can be passed to them. The
    expert-parallel record makes its own counters the active ones for its step
    (:meth:`fxpar.runtime.expert_parallel.ExpertParallelRecord.start` / ``finish``); a kernel run outside a
    step counts into nothing. A plain attribute, not a ContextVar: autograd runs a CUDA backward on a thread
    of its own."""

    active = None


def _count(c: Call, sent: int) -> None:
    counters = Counting.active
    if c.rec.counter is None or counters is None:
        return
    key = c.rec.counter + ("_bwd" if c.args.get("backward") else "")
    counters.comm[key] = counters.comm.get(key, 0) + sent


def _all_reduce(c: Call) -> torch.Tensor:
    name, x, group, op = c.rec.name, c.x, c.group, c.at(c.rec.reduce_arg)
    check_reduce_op(name, group, op, x)
    _, n, _ = _membership(name, group)
    out = _copy(x)
    if n == 1 or x.numel() == 0:
        return out
    _cross_check(name, group, x)
    # "avg" is a sum then a division on every backend: one code path, and older gloo rejects ReduceOp.AVG.
    dist_calls.all_reduce(out, group, op="sum" if op == "avg" else op, call=name, about=x)
    if op == "avg":
        out.div_(n)
    return out


def _identity(c: Call) -> torch.Tensor:
    return _copy(c.x)


def _gather_impl(c: Call, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` of every rank concatenated along ``dim``; the bytes sent off-rank counted for ``c``'s record."""
    op, group = c.rec.name, c.group
    d = check_dim(op, group, x, dim)
    _, n, _ = _membership(op, group)
    if n == 1:
        return _copy(x)
    _cross_check(op, group, x)
    # The single-tensor all-gather concatenates along dim 0: bring dim to the front, gather, move back.
    front = x.movedim(d, 0).contiguous()
    buf = front.new_empty((n * front.shape[0], *front.shape[1:]))
    if x.numel():
        _all_gather_single(buf, front, group=group, call=op, about=x)
    _count(c, front.numel() * front.element_size() * (n - 1))
    return buf.movedim(0, d).contiguous()


# the observer of the current context while a ZeRO-3 forward runs (fxpar.runtime.zero3.Zero3Regather):
# told of every gathered parameter bucket, so that autograd saves a handle instead of the bucket
_param_gather_observer: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "fxpar_param_gather_observer", default=None)


@contextlib.contextmanager
def observing_param_gathers(observer: Callable):
    """Within the block (this context only), ``observer(out, shard, group, dim, dtype, comm_dtype)``
    hears of every bucket ``gather_params`` (a record with ``observed``) gathers."""
    token = _param_gather_observer.set(observer)
    try:
        yield
    finally:
        _param_gather_observer.reset(token)


def _int8_pack(front: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Slice ``r`` of ``n`` of the flat ``front``, block-quantized (the copy-in kernel of
    :mod:`fxpar.runtime.kernels.quant`) into one int8 buffer: its codes, then its fp32 scales' bytes, so
    one collective carries both."""
    from fxpar.runtime.kernels import quant  # imported on first use: the kernels module loads triton

    q, scales = quant.quantize_shard([front], n, r, wire.INT8_BLOCK)
    return torch.cat([q, scales.view(torch.int8)])


def _int8_unpack(buf: torch.Tensor, n: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` packed slices of ``m`` entries each (:func:`_int8_pack`, back to back) dequantized to
    ``dtype``: ``[n * m]``."""
    from fxpar.runtime.kernels import quant

    rows = buf.view(n, -1)
    codes = rows[:, :m].reshape(-1)
    scales = rows[:, m:].clone(memory_format=torch.contiguous_format).view(torch.float32).reshape(-1)  # fresh, aligned
    return quant.dequantize(codes, scales, n, wire.INT8_BLOCK, dtype=dtype)


def _check_float(op: str, group: str, x: torch.Tensor, comm_dtype: str) -> None:
    if not x.is_floating_point():
        raise CollectiveError(f"comm_dtype={comm_dtype!r} quantizes floating tensors, not {x.dtype}",
                              op=op, group=group, sizes=[tuple(x.shape)])


def _gather_params_int8(x: torch.Tensor, group: str, dim: int, dtype: torch.dtype, comm_dtype: str,
                        op: str = "gather_params"):
    """ZeRO++ qwZ: this rank's shard as int8 codes + fp32 block scales in one all-gather, every rank's
    part dequantized to ``dtype`` after it. Blocks never straddle two ranks' shards, so no rank needs
    another's statistics."""
    d = check_dim(op, group, x, dim)
    _check_float(op, group, x, comm_dtype)
    _, n, _ = _membership(op, group)
    front = x.movedim(d, 0).contiguous()
    if n == 1 or not x.numel():
        return _copy(front.to(dtype)).movedim(0, d).contiguous()
    packed = _int8_pack(front.view(-1), 1, 0)
    _cross_check(op, group, packed)
    buf = packed.new_empty(n * packed.numel())
    _all_gather_single(buf, packed, group=group, call=op)
    full = _int8_unpack(buf, n, front.numel(), dtype)
    return full.view(n * front.shape[0], *front.shape[1:]).movedim(0, d).contiguous()


def _all_gather(c: Call) -> torch.Tensor:
    """Along ``dim`` (dim 0 without one) of what the record's ``prepare`` makes of the input, cast first (the
    record's ``cast_arg``), in the wire format (``comm_dtype_arg``); the output told to the observer
    (``observed``) and to the active counters' ``tally``."""
    rec, x, group, dim = c.rec, c.x, c.group, c.args.get("dim", 0)
    dtype, comm_dtype = c.at(rec.cast_arg), c.at(rec.comm_dtype_arg)
    wire.check_comm_dtype(rec.name, group, comm_dtype, rec.comm_dtypes)
    if comm_dtype is None:
        sent = x if rec.prepare is None else rec.prepare(x)
        out = _gather_impl(c, sent if dtype is None else sent.to(dtype), dim)
    else:
        out = _gather_params_int8(x, group, dim, dtype or x.dtype, comm_dtype, rec.name)
    observer = _param_gather_observer.get() if rec.observed else None
    if observer is not None:
        observer(out, x, group, dim, dtype, comm_dtype)
    if rec.tally is not None and Counting.active is not None:
        rec.tally(Counting.active, out, c.args)
    return out


def _reduce_scatter_int8(x: torch.Tensor, group: str, d: int, k: int, n: int, rank: int,
                         op: str = "reduce_scatter") -> torch.Tensor:
    """ZeRO++ qgZ: slice ``r`` of this rank's ``x`` goes to rank ``r`` block-quantized (int8 codes + fp32
    scales, one all-to-all), and each rank sums the ``n`` slices it holds in fp32. Its own slice never
    leaves the rank, so it is summed exact (what it sends itself is ignored); the error bound is in
    :mod:`fxpar.runtime.kernels.quant`. Gloo runs the all-to-all as pairwise sends: ``(n-1)/n`` of the
    quantized buffer leaves each rank, as in a ring reduce-scatter."""
    _check_float(op, group, x, "int8")
    front = x.movedim(d, 0).contiguous()
    flat = front.view(-1)
    m = flat.numel() // n
    send = torch.cat([_int8_pack(flat, n, r) for r in range(n)])
    _cross_check(op, group, send)
    recv = torch.empty_like(send)
    dist_calls.all_to_all_into(recv, send, group, call=op, about=x)
    parts = _int8_unpack(recv, n, m, torch.float32).view(n, m)
    parts[rank] = flat[rank * m:(rank + 1) * m]  # this rank's own slice, unquantized
    out = parts.sum(0, dtype=torch.float32).to(x.dtype)
    return out.view(k, *front.shape[1:]).movedim(0, d).contiguous()


def _reduce_scatter(c: Call) -> torch.Tensor:
    """Sum over the group, keep this rank's slice along ``dim``, in the wire format (``comm_dtype_arg``)."""
    op, x, group, comm_dtype = c.rec.name, c.x, c.group, c.at(c.rec.comm_dtype_arg)
    wire.check_comm_dtype(op, group, comm_dtype, c.rec.comm_dtypes)
    d = check_dim(op, group, x, c.args.get("dim", 0))
    pg, n, rank = _membership(op, group)
    k = shard_len(op, group, x, d, n)
    if n == 1:
        return _copy(x)
    _count(c, x.numel() // n * x.element_size() * (n - 1))  # a ring's share (gloo runs it as an all-reduce)
    if comm_dtype is not None and x.numel():
        return _reduce_scatter_int8(x, group, d, k, n, rank, op)
    _cross_check(op, group, x)
    if _backend_of(pg, x.device) == "gloo":
        # Gloo has no reduce-scatter algorithm of its own: where a torch release offers a single-tensor
        # reduce-scatter on gloo at all, it is an all-reduce followed by taking this rank's chunk (twice
        # the traffic of a ring reduce-scatter; pytorch PR #118911), and older gloo had none. Doing the
        # all-reduce + slice here costs the same, is one code path on every torch we support, and keeps
        # the 2x visible where it happens. Gloo is our CPU test backend, so the traffic does not matter.
        full = _copy(x)
        if x.numel():
            dist_calls.all_reduce(full, group, call=op, about=x)
        return _copy(full.narrow(d, rank * k, k))  # a copy: a view (dim 0) would keep the whole sum alive
    # Native path (NCCL, ...): the single-tensor reduce-scatter splits along dim 0.
    front = x.movedim(d, 0).contiguous()
    out = front.new_empty((k, *front.shape[1:]))
    if x.numel():
        _reduce_scatter_single(out, front, group=group, call=op, about=x)
    return out.movedim(0, d).contiguous()


def _slice(c: Call) -> torch.Tensor:
    op, x, group = c.rec.name, c.x, c.group
    d = check_dim(op, group, x, c.args["dim"])
    _, n, rank = _membership(op, group)
    k = shard_len(op, group, x, d, n)
    return _copy(x.narrow(d, rank * k, k))


def _all_to_all(c: Call) -> torch.Tensor:
    """Rows along dim 0 with variable split sizes, as the record's ``route`` lays them out (what to send,
    how many rows to and from each rank, the output made of the received rows); the rows a rank sends to
    itself never leave it, and only the others count. No cross-rank shape check: the ranks' row counts
    differ by design."""
    rec, x, group = c.rec, c.x, c.group
    _, n, me = _membership(rec.name, group)
    if rec.check is not None:
        rec.check(rec.name, group, x, c.args, n)
    rows, send, recv, finish = rec.route(x, c.args, n, me)
    got = rows.new_empty((sum(recv), *rows.shape[1:]))
    if n == 1:
        got.copy_(rows[:got.shape[0]])
    else:
        dist_calls.all_to_all_into(got, rows.contiguous(), group, out_splits=recv, in_splits=send, call=rec.name,
                                   about=rows)
    _count(c, (sum(send) - send[me]) * math.prod(rows.shape[1:]) * rows.element_size())
    return finish(got)


PATTERN_KERNELS: dict[str, Callable[[Call], torch.Tensor]] = {
    "all_reduce": _all_reduce, "identity": _identity, "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter, "slice": _slice, "all_to_all": _all_to_all}


def register_kernel(rec) -> None:
    """Register the real kernel of ``rec``'s op (:func:`fxpar.ir.ops.define` made it): its pattern's
    implementation, for every device (``device_types=None``: it replaces the op's placeholder body)."""
    impl, sig = PATTERN_KERNELS[rec.kernel], ir_ops.SIGNATURES[rec.name]

    def kernel(*args, **kwargs):
        values = sig.bind(args, kwargs)
        return impl(Call(rec, values, sig.named(values)))

    ir_ops.OPS[rec.name].register_kernel(None, kernel)


for _rec in COLLECTIVES.values():
    register_kernel(_rec)
