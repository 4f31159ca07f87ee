"""The wire of every communication pattern of :data:`fxpar.ir.collectives.COMMS`: the one module of fxpar
that calls torch.distributed's collectives and transfers (calibration, which times the raw calls, apart;
``tests/test_collective_calls.py`` checks it). :data:`WIRES` keys each call here by its pattern.

Who calls it: the kernels of the records' ops (:mod:`fxpar.runtime.collectives`: one implementation per
pattern of :data:`fxpar.ir.collectives.PATTERNS`, which count the bytes of records with a ``counter``), the
collective matmuls' chunks (:mod:`fxpar.runtime.kernels.collective_matmul`), the pipeline's transfers
(:mod:`fxpar.runtime.pipeline`), and the runtime's other collectives: the DP engine's bucket reductions,
the loss's average, gradient norms, tied weights, gathering the full state, checkpoint transfers, the small
object gathers of set-up. So every collective of fxpar behaves alike:

* a wait is bounded by the process group's timeout (``Work.wait()`` without an argument: gloo raises,
  NCCL's watchdog aborts; the pipeline passes its own), nothing waits for ever;
* a failure or timeout becomes a :class:`~fxpar.ir.errors.CollectiveError` naming the call, the group,
  its ranks, the tensor's shape and dtype; which rank died is :mod:`fxpar.runtime.liveness`'s to say.

``group`` is a group name of :mod:`fxpar.runtime.groups`, a process group, or None (the default group).
Asynchronous calls return a :class:`Pending` whose ``wait()`` does the same. ``call`` / ``about``: what
an error names as the call and the input (default: the function's name and the tensor it sends), so a
record's kernel names its op (``fxpar.gather_params on group 'dp:0,1'``) and the tensor it was given.

Reads: tensors, group names / process groups. Writes: the tensors the call fills.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fxpar.ir.errors import CollectiveError
from fxpar.runtime.groups import resolve_group

__all__ = ["WIRES", "Pending", "all_gather_into", "all_gather_list", "all_gather_object",
           "all_reduce", "all_to_all_into", "barrier", "broadcast", "gather_by_broadcasts", "gather_object", "recv",
           "reduce_scatter_into", "run", "send"]

# pattern of fxpar.ir.collectives.COMMS -> the calls here that run it. A barrier is an all-reduce of no
# payload (as NCCL runs it); an object gather all-gathers the pickled sizes, then the payloads (to one
# rank for gather_object).
WIRES: dict[str, tuple[str, ...]] = {
    "all_reduce": ("all_reduce", "barrier"),
    "all_gather": ("all_gather_into", "gather_by_broadcasts", "all_gather_list", "all_gather_object",
                   "gather_object"),
    "reduce_scatter": ("reduce_scatter_into",),
    "all_to_all": ("all_to_all_into",),
    "broadcast": ("broadcast",),
    "send": ("send", "recv"),
}

# all_gather_single / reduce_scatter_single are the names since torch 2.13; older releases (our floor is
# 2.6) call them all_gather_into_tensor / reduce_scatter_tensor
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
    """An asynchronous call in flight: :meth:`wait` waits at most the group's timeout (or ``timeout``, a
    ``timedelta``) and raises a :class:`CollectiveError` on a failure; a second wait is a no-op."""

    def __init__(self, call: str, group, x, work):
        self.call, self.group, self.x, self.work = call, group, x, work

    def wait(self, timeout=None) -> None:
        if self.work is None:
            return
        try:
            self.work.wait() if timeout is None else self.work.wait(timeout)
        except RuntimeError as e:  # DistBackendError and gloo's timeouts are RuntimeErrors
            raise _failure(self.call, self.group, self.x, e) from e
        finally:
            self.work = None


def run(call: str, group, x, launch: Callable[[], Any], async_op: bool = False) -> Pending | None:
    """Start a call (``launch`` returns its work handle, or None once done) and, unless ``async_op``, wait
    for it: the one way every call here is started and waited for. ``call`` names it in errors."""
    try:
        work = launch()
    except RuntimeError as e:
        raise _failure(call, group, x, e) from e
    pending = Pending(call, group, x, work)
    if async_op:
        return pending
    pending.wait()
    return None


def _go(default: str, call, group, t, about, launch, async_op: bool) -> Pending | None:
    return run(call or default, group, t if about is None else about, launch, async_op)


def all_reduce(t: torch.Tensor, group=None, *, op: str = "sum", async_op: bool = False, call: str | None = None,
               about=None) -> Pending | None:
    """Reduce ``t`` in place over ``group`` ("sum", "max" or "min")."""
    return _go("all_reduce", call, group, t, about,
               lambda: dist.all_reduce(t, op=_OPS[op], group=_pg(group), async_op=True), async_op)


def reduce_scatter_into(out: torch.Tensor, t: torch.Tensor, group=None, *, async_op: bool = False,
                        call: str | None = None, about=None) -> Pending | None:
    """Sum ``t`` over ``group`` and write this rank's ``1 / size`` of it (along dim 0) into ``out``."""
    return _go("reduce_scatter", call, group, t, about,
               lambda: REDUCE_SCATTER_SINGLE(out, t, op=dist.ReduceOp.SUM, group=_pg(group), async_op=True),
               async_op)


class _Works:
    """Several works waited for as one (the broadcasts of :func:`gather_by_broadcasts`), each wait bounded."""

    def __init__(self, works: list):
        self.works = works

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True


def gather_by_broadcasts(out: torch.Tensor, inp: torch.Tensor, group=None) -> _Works:
    """``ALL_GATHER_SINGLE``'s result on gloo, one broadcast per member into its slice of ``out``. Gloo's own
    all-gather gathers into a flat buffer of the output's size and copies it out, so it holds the output twice;
    measured here (2026-11-29, 16 MiB per rank) it also ran 2.4x slower than the broadcasts at 2 ranks (74 ms
    against 31) and 2.5x at 4 (237 against 94), which hold no buffer beside ``out`` (``bench/gloo_gather.py``).
    Returns the broadcasts' works, waited for as one."""
    pg = group if group is not None else dist.group.WORLD
    # one profiler event names the gather ("allgather", as torch's own), around the broadcasts' events
    with torch.profiler.record_function("fxpar::allgather_by_broadcasts"):
        parts = out.view(-1).chunk(dist.get_world_size(pg))
        parts[dist.get_rank(pg)].copy_(inp.reshape(-1))
        return _Works([dist.broadcast(part, dist.get_global_rank(pg, i), group=pg, async_op=True)
                       for i, part in enumerate(parts)])


def _by_broadcasts(out: torch.Tensor, t: torch.Tensor, pg) -> bool:
    """Whether :func:`all_gather_into` gathers ``t`` into ``out`` by :func:`gather_by_broadcasts`: on gloo,
    where ``out`` is contiguous and ``size`` copies of ``t``."""
    pg = pg if pg is not None else dist.group.WORLD
    return (dist.get_backend(pg) == "gloo" and out.is_contiguous() and out.dtype == t.dtype and t.numel() > 0
            and out.numel() == dist.get_world_size(pg) * t.numel())


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group=None, *, async_op: bool = False,
                    call: str | None = None, about=None) -> Pending | None:
    """Every rank's ``t`` of ``group``, back to back along dim 0, into ``out`` (on gloo by broadcasts:
    :func:`gather_by_broadcasts`)."""
    pg = _pg(group)
    if _by_broadcasts(out, t, pg):
        launch = lambda: gather_by_broadcasts(out, t, group=pg)  # noqa: E731
    else:
        launch = lambda: ALL_GATHER_SINGLE(out, t, group=pg, async_op=True)  # noqa: E731
    return _go("all_gather", call, group, t, about, launch, async_op)


def all_gather_list(parts: list[torch.Tensor], t: torch.Tensor, group=None) -> None:
    """Every rank's ``t`` of ``group`` into ``parts`` (one tensor per rank, shapes may differ by rank)."""
    run("all_gather", group, t, lambda: dist.all_gather(parts, t, group=_pg(group), async_op=True))


def all_to_all_into(out: torch.Tensor, t: torch.Tensor, group=None, *, out_splits=None, in_splits=None,
                    async_op: bool = False, call: str | None = None, about=None) -> Pending | None:
    """Rows of ``t`` (dim 0) to every rank of ``group``, ``in_splits[r]`` of them to rank ``r`` (equal parts
    without), and theirs into ``out`` (``out_splits[r]`` rows from rank ``r``)."""
    return _go("all_to_all", call, group, t, about, lambda: dist.all_to_all_single(
        out, t, output_split_sizes=out_splits, input_split_sizes=in_splits, group=_pg(group), async_op=True), async_op)


def broadcast(t: torch.Tensor, src: int, group=None) -> None:
    """Rank ``src``'s (a global rank) ``t`` into every rank's ``t``."""
    run("broadcast", group, t, lambda: dist.broadcast(t, src, group=_pg(group), async_op=True))


def send(t: torch.Tensor, dst: int, group=None, *, async_op: bool = False, call: str | None = None,
         about=None) -> Pending | None:
    """``t`` to global rank ``dst`` (without ``async_op``, it waits until the transfer is done)."""
    return _go("send", call, group, t, about, lambda: dist.isend(t, dst, group=_pg(group)), async_op)


def recv(t: torch.Tensor, src: int, group=None, *, async_op: bool = False, call: str | None = None,
         about=None) -> Pending | None:
    """Global rank ``src``'s message into ``t``."""
    return _go("recv", call, group, t, about, lambda: dist.irecv(t, src, group=_pg(group)), async_op)


def barrier(group=None) -> None:
    """Wait until every rank of ``group`` is here."""
    run("barrier", group, None, lambda: dist.barrier(group=_pg(group), async_op=True))


def all_gather_object(obj: Any, group=None, *, call: str | None = None, about=None) -> list[Any]:
    """Every rank's picklable ``obj`` of ``group``, in rank order."""
    pg = _pg(group)
    out: list[Any] = [None] * dist.get_world_size(pg)
    _go("all_gather_object", call, group, None, about, lambda: dist.all_gather_object(out, obj, group=pg), False)
    return out


def gather_object(obj: Any, dst: int = 0, group=None) -> list[Any] | None:
    """Every rank's picklable ``obj`` of ``group`` on global rank ``dst`` (in rank order); None elsewhere."""
    pg = _pg(group)
    out: list[Any] | None = [None] * dist.get_world_size(pg) if dist.get_rank() == dst else None
    run("gather_object", group, None, lambda: dist.gather_object(obj, out, dst=dst, group=pg))
    return out
