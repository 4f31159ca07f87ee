"""The real kernels of fxpar's collective ops (schemas, fake kernels, autograd: :mod:`fxpar.ir.ops`).

Reads: tensors and group names at run time, resolved to process groups by :mod:`fxpar.runtime.groups`.
Writes: the kernel of every ``torch.ops.fxpar.*`` op for real tensors (importing this module registers
them, for every device: the dispatcher's ``CompositeExplicitAutograd`` key, as ``custom_op`` does).

* Kernels call the plain torch.distributed collectives (gloo on CPU, NCCL on GPU) and wait with the
  process group's own timeout (``timeout=`` of ``init_process_group`` / ``new_group``): nothing waits
  for ever. A failure or timeout becomes a :class:`~fxpar.ir.errors.CollectiveError` naming the op,
  group, its ranks and shapes; so do local shape errors. Which of the ranks died is for
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
from collections.abc import Callable

import torch
import torch.distributed as dist

from fxpar.ir import ops as ir_ops
from fxpar.ir import wire
from fxpar.ir.errors import CollectiveError, FxparError
from fxpar.ir.ops import check_dim, check_reduce_op, shard_len
from fxpar.ir.options import run_options
from fxpar.runtime import dist_calls
from fxpar.runtime.groups import resolve_group

__all__ = ["all_gather_single", "observing_param_gathers", "set_shape_checks"]

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


def _communicate(op: str, group: str, x: torch.Tensor, launch: Callable[[], object]) -> None:
    """Start a collective (``launch`` returns its work handle) and wait for it, at most the process group's
    timeout; a failure is a CollectiveError naming the op, group, ranks and shape (:func:`dist_calls.run`)."""
    dist_calls.run(op, group, x, launch)


def _cross_check(op: str, group: str, pg, x: torch.Tensor) -> None:
    """With shape checks on: every rank of the group must bring the same shape and dtype."""
    if not _shape_checks():
        return
    mine = (tuple(x.shape), str(x.dtype))
    seen: list = [None] * pg.size()
    _communicate(op, group, x, lambda: dist.all_gather_object(seen, mine, group=pg))
    if any(s != mine for s in seen):
        listing = ", ".join(f"rank {r}: {s[0]} {s[1]}" for r, s in enumerate(seen))
        raise CollectiveError(f"the ranks' inputs differ ({listing}); every rank must pass the same shape",
                              op=op, group=group, sizes=[s[0] for s in seen])


# torch's single-tensor all-gather / reduce-scatter under the installed release's names (module globals:
# tests count the bytes at these calls by replacing them)
_all_gather_single = dist_calls.ALL_GATHER_SINGLE
_reduce_scatter_single = dist_calls.REDUCE_SCATTER_SINGLE
all_gather_single = _all_gather_single  # torch's single-tensor all-gather under its current name


def _copy(x: torch.Tensor) -> torch.Tensor:
    # A custom op may not return (a view of) its input, so the one-rank case still copies.
    return x.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------------------------
# The kernels


def _all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    check_reduce_op("all_reduce", group, op, x)
    pg, n, _ = _membership("all_reduce", group)
    out = _copy(x)
    if n == 1 or x.numel() == 0:
        return out
    _cross_check("all_reduce", group, pg, x)
    # "avg" is a sum then a division on every backend: one code path, and older gloo rejects ReduceOp.AVG.
    red = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
           "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    _communicate("all_reduce", group, x, lambda: dist.all_reduce(out, op=red, group=pg, async_op=True))
    if op == "avg":
        out.div_(n)
    return out


def _identity_fwd_all_reduce_bwd(x: torch.Tensor, group: str) -> torch.Tensor:
    return _copy(x)


def _gather_impl(op: str, x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    d = check_dim(op, group, x, dim)
    pg, n, _ = _membership(op, group)
    if n == 1:
        return _copy(x)
    _cross_check(op, group, pg, x)
    # The single-tensor all-gather concatenates along dim 0: bring dim to the front, gather, move back.
    front = x.movedim(d, 0).contiguous()
    buf = front.new_empty((n * front.shape[0], *front.shape[1:]))
    if x.numel():
        _communicate(op, group, x, lambda: _all_gather_single(buf, front, group=pg, async_op=True))
    return buf.movedim(0, d).contiguous()


def _all_gather(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    return _gather_impl("all_gather", x, group, dim)


def _all_gather_rs_bwd(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    return _gather_impl("all_gather_rs_bwd", x, group, dim)


# the observer of the current context while a ZeRO-3 forward runs (fxpar.runtime.zero3.Zero3Regather):
# told of every gathered parameter bucket, so that autograd saves a handle instead of the bucket
_param_gather_observer: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "fxpar_param_gather_observer", default=None)


@contextlib.contextmanager
def observing_param_gathers(observer: Callable):
    """Within the block (this context only), ``observer(out, shard, group, dim, dtype, comm_dtype)``
    hears of every bucket ``gather_params`` gathers."""
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


def _gather_params_int8(x: torch.Tensor, group: str, dim: int, dtype: torch.dtype, comm_dtype: str):
    """ZeRO++ qwZ: this rank's shard as int8 codes + fp32 block scales in one all-gather, every rank's
    part dequantized to ``dtype`` after it. Blocks never straddle two ranks' shards, so no rank needs
    another's statistics."""
    d = check_dim("gather_params", group, x, dim)
    _check_float("gather_params", group, x, comm_dtype)
    pg, n, _ = _membership("gather_params", group)
    front = x.movedim(d, 0).contiguous()
    if n == 1 or not x.numel():
        return _copy(front.to(dtype)).movedim(0, d).contiguous()
    packed = _int8_pack(front.view(-1), 1, 0)
    _cross_check("gather_params", group, pg, packed)
    buf = packed.new_empty(n * packed.numel())
    _communicate("gather_params", group, packed,
                 lambda: _all_gather_single(buf, packed, group=pg, async_op=True))
    full = _int8_unpack(buf, n, front.numel(), dtype)
    return full.view(n * front.shape[0], *front.shape[1:]).movedim(0, d).contiguous()


def _gather_params(x: torch.Tensor, group: str, dim: int, dtype: torch.dtype | None = None,
                   comm_dtype: str | None = None) -> torch.Tensor:
    wire.check_comm_dtype("gather_params", group, comm_dtype, wire.GATHER_COMM_DTYPES)
    if comm_dtype is None:
        out = _gather_impl("gather_params", x if dtype is None else x.to(dtype), group, dim)
    else:
        out = _gather_params_int8(x, group, dim, dtype or x.dtype, comm_dtype)
    observer = _param_gather_observer.get()
    if observer is not None:
        observer(out, x, group, dim, dtype, comm_dtype)
    return out


def _reduce_scatter_int8(x: torch.Tensor, group: str, d: int, k: int, pg, n: int, rank: int) -> torch.Tensor:
    """ZeRO++ qgZ: slice ``r`` of this rank's ``x`` goes to rank ``r`` block-quantized (int8 codes + fp32
    scales, one all-to-all), and each rank sums the ``n`` slices it holds in fp32. Its own slice never
    leaves the rank, so it is summed exact (what it sends itself is ignored); the error bound is in
    :mod:`fxpar.runtime.kernels.quant`. Gloo runs the all-to-all as pairwise sends: ``(n-1)/n`` of the
    quantized buffer leaves each rank, as in a ring reduce-scatter."""
    _check_float("reduce_scatter", group, x, "int8")
    front = x.movedim(d, 0).contiguous()
    flat = front.view(-1)
    m = flat.numel() // n
    send = torch.cat([_int8_pack(flat, n, r) for r in range(n)])
    _cross_check("reduce_scatter", group, pg, send)
    recv = torch.empty_like(send)
    _communicate("reduce_scatter", group, x,
                 lambda: dist.all_to_all_single(recv, send, group=pg, async_op=True))
    parts = _int8_unpack(recv, n, m, torch.float32).view(n, m)
    parts[rank] = flat[rank * m:(rank + 1) * m]  # this rank's own slice, unquantized
    out = parts.sum(0, dtype=torch.float32).to(x.dtype)
    return out.view(k, *front.shape[1:]).movedim(0, d).contiguous()


def _reduce_scatter(x: torch.Tensor, group: str, dim: int, comm_dtype: str | None = None) -> torch.Tensor:
    wire.check_comm_dtype("reduce_scatter", group, comm_dtype, wire.REDUCE_SCATTER_COMM_DTYPES)
    d = check_dim("reduce_scatter", group, x, dim)
    pg, n, rank = _membership("reduce_scatter", group)
    k = shard_len("reduce_scatter", group, x, d, n)
    if n == 1:
        return _copy(x)
    if comm_dtype == "int8" and x.numel():
        return _reduce_scatter_int8(x, group, d, k, pg, n, rank)
    _cross_check("reduce_scatter", group, pg, x)
    if _backend_of(pg, x.device) == "gloo":
        # Gloo has no reduce-scatter algorithm of its own: where a torch release offers a single-tensor
        # reduce-scatter on gloo at all, it is an all-reduce followed by taking this rank's chunk (twice
        # the traffic of a ring reduce-scatter; pytorch PR #118911), and older gloo had none. Doing the
        # all-reduce + slice here costs the same, is one code path on every torch we support, and keeps
        # the 2x visible where it happens. Gloo is our CPU test backend, so the traffic does not matter.
        full = _copy(x)
        if x.numel():
            _communicate("reduce_scatter", group, x,
                         lambda: dist.all_reduce(full, op=dist.ReduceOp.SUM, group=pg, async_op=True))
        return _copy(full.narrow(d, rank * k, k))  # a copy: a view (dim 0) would keep the whole sum alive
    # Native path (NCCL, ...): the single-tensor reduce-scatter splits along dim 0.
    front = x.movedim(d, 0).contiguous()
    out = front.new_empty((k, *front.shape[1:]))
    if x.numel():
        _communicate("reduce_scatter", group, x,
                     lambda: _reduce_scatter_single(out, front, op=dist.ReduceOp.SUM, group=pg, async_op=True))
    return out.movedim(0, d).contiguous()


def _scatter_slice(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    d = check_dim("scatter_slice", group, x, dim)
    _, n, rank = _membership("scatter_slice", group)
    k = shard_len("scatter_slice", group, x, d, n)
    return _copy(x.narrow(d, rank * k, k))


# device_types=None: one kernel for every device (it replaces the op's placeholder body in fxpar.ir.ops)
for _op, _kernel in ((ir_ops.all_reduce, _all_reduce),
                     (ir_ops.identity_fwd_all_reduce_bwd, _identity_fwd_all_reduce_bwd),
                     (ir_ops.all_gather, _all_gather),
                     (ir_ops.all_gather_rs_bwd, _all_gather_rs_bwd),
                     (ir_ops.gather_params, _gather_params),
                     (ir_ops.reduce_scatter, _reduce_scatter),
                     (ir_ops.scatter_slice, _scatter_slice)):
    _op.register_kernel(None, _kernel)
