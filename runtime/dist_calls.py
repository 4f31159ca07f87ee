"""The runtime's torch.distributed calls outside the IR's collective ops: the DP engine's bucket
reductions, the loss's average, gradient norms, tied weights, gathering the full state, checkpoint
transfers, and the small object gathers of set-up. Besides this module only the kernels of fxpar's ops
(:mod:`fxpar.runtime.collectives`, expert parallelism's, the collective matmuls'), which wrap their own
calls alike, the pipeline's transfers and the calibration call torch.distributed's collectives
(``tests/test_collective_calls.py`` checks it), so every collective of fxpar behaves alike:

* a wait is bounded by the process group's timeout (``Work.wait()`` without an argument: gloo raises,
  NCCL's watchdog aborts), nothing waits for ever;
* a failure or timeout becomes a :class:`~fxpar.ir.errors.CollectiveError` naming the call, the group,
  its ranks, the tensor's shape and dtype; which rank died is :mod:`fxpar.runtime.liveness`'s to say.

``group`` is a group name of :mod:`fxpar.runtime.groups`, a process group, or None (the default group).
Asynchronous calls return a :class:`Pending` whose ``wait()`` does the same.

Reads: tensors, group names / process groups. Writes: the tensors the call fills.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fxpar.ir.errors import CollectiveError
from fxpar.runtime.groups import resolve_group

__all__ = ["Pending", "all_gather_into", "all_gather_list", "all_gather_object", "all_reduce", "barrier",
           "gather_object", "broadcast", "recv", "reduce_scatter_into", "send"]

# all_gather_single / reduce_scatter_single are the names since torch 2.13; older releases (our floor is
# 2.6) call them all_gather_into_tensor / reduce_scatter_tensor. fxpar.runtime.collectives reads them here.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _pg(group):
    return resolve_group(group) if isinstance(group, str) else group


def _name(group) -> str:
    if isinstance(group, str):
        return group
    return "world" if group is None else f"process group of ranks {_ranks(group)}"


def _ranks(group) -> list[int]:
    """The global ranks of ``group`` (for messages: empty where they cannot be known here)."""
    try:
        pg = _pg(group)
        return sorted(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD))
    except Exception:  # for a message only
        return []


def _failure(call: str, group, x, e: BaseException) -> CollectiveError:
    what = f"input shape {tuple(x.shape)}, dtype {x.dtype}" if isinstance(x, torch.Tensor) else "a Python object"
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CollectiveError(
        f"the collective failed or timed out ({what}, rank {rank} of the world; one of the group's ranks "
        f"{_ranks(group)} failed to arrive; the wait is bounded by the process group's timeout): {e}",
        op=call, group=_name(group), sizes=[tuple(x.shape)] if isinstance(x, torch.Tensor) else None)


class Pending:
    """An asynchronous call in flight: :meth:`wait` waits at most the group's timeout and raises a
    :class:`CollectiveError` on a failure."""

    def __init__(self, call: str, group, x, work):
        self.call, self.group, self.x, self.work = call, group, x, work

    def wait(self) -> None:
        if self.work is None:
            return
        try:
            self.work.wait()
        except RuntimeError as e:  # DistBackendError and gloo's timeouts are RuntimeErrors
            raise _failure(self.call, self.group, self.x, e) from e
        finally:
            self.work = None


def run(call: str, group, x, launch: Callable[[], Any], async_op: bool = False) -> Pending | None:
    """Start a call (``launch`` returns its work handle, or None once done) and, unless ``async_op``, wait
    for it: the one way every collective of fxpar is started and waited for (the IR ops' kernels in
    :mod:`fxpar.runtime.collectives` come through here too). ``call`` names it in errors."""
    try:
        work = launch()
    except RuntimeError as e:
        raise _failure(call, group, x, e) from e
    pending = Pending(call, group, x, work)
    if async_op:
        return pending
    pending.wait()
    return None


def all_reduce(t: torch.Tensor, group=None, *, op: str = "sum", async_op: bool = False) -> Pending | None:
    """Reduce ``t`` in place over ``group`` ("sum", "max" or "min")."""
    return run("all_reduce", group, t, lambda: dist.all_reduce(t, op=_OPS[op], group=_pg(group), async_op=True),
                async_op)


def reduce_scatter_into(out: torch.Tensor, t: torch.Tensor, group=None, *, async_op: bool = False) -> Pending | None:
    """Sum ``t`` over ``group`` and write this rank's ``1 / size`` of it into ``out``."""
    return run("reduce_scatter", group, t,
                lambda: REDUCE_SCATTER_SINGLE(out, t, group=_pg(group), async_op=True), async_op)


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group=None, *, async_op: bool = False) -> Pending | None:
    """Every rank's ``t`` of ``group``, back to back, into ``out``."""
    return run("all_gather", group, t, lambda: ALL_GATHER_SINGLE(out, t, group=_pg(group), async_op=True), async_op)


def all_gather_list(parts: list[torch.Tensor], t: torch.Tensor, group=None) -> None:
    """Every rank's ``t`` of ``group`` into ``parts`` (one tensor per rank, shapes may differ by rank)."""
    run("all_gather", group, t, lambda: dist.all_gather(parts, t, group=_pg(group), async_op=True), False)


def broadcast(t: torch.Tensor, src: int, group=None) -> None:
    """Rank ``src``'s (a global rank) ``t`` into every rank's ``t``."""
    run("broadcast", group, t, lambda: dist.broadcast(t, src, group=_pg(group), async_op=True), False)


def send(t: torch.Tensor, dst: int) -> None:
    """``t`` to global rank ``dst`` (it waits until the transfer is done)."""
    run("send", None, t, lambda: dist.isend(t, dst), False)


def recv(t: torch.Tensor, src: int) -> None:
    """Global rank ``src``'s message into ``t``."""
    run("recv", None, t, lambda: dist.irecv(t, src), False)


def barrier(group=None) -> None:
    """Wait until every rank of ``group`` is here."""
    run("barrier", group, None, lambda: dist.barrier(group=_pg(group), async_op=True), False)


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's picklable ``obj`` of ``group``, in rank order."""
    pg = _pg(group)
    out: list[Any] = [None] * dist.get_world_size(pg)
    try:
        dist.all_gather_object(out, obj, group=pg)
    except RuntimeError as e:
        raise _failure("all_gather_object", group, None, e) from e
    return out


def gather_object(obj: Any, dst: int = 0, group=None) -> list[Any] | None:
    """Every rank's picklable ``obj`` of ``group`` on global rank ``dst`` (in rank order); None elsewhere."""
    pg = _pg(group)
    out: list[Any] | None = [None] * dist.get_world_size(pg) if dist.get_rank() == dst else None
    try:
        dist.gather_object(obj, out, dst=dst, group=pg)
    except RuntimeError as e:
        raise _failure("gather_object", group, None, e) from e
    return out
