"""The one roofline: what a node, a piece of work, or a pipeline hop costs in seconds on a device profile.

Reads a :class:`~fxpar.cost.profiles.DeviceProfile` (its sustained matmul rate per dtype, memory bandwidth,
per-op overhead, first-touch rate, inter-node link) and a node's :class:`~fxpar.ir.meta.NodeCost` or its
FLOPs and bytes. Writes nothing. Everything that turns FLOPs and bytes into seconds calls it: the cut
balancing and stage times of :mod:`fxpar.cost.partition`, the planner's per-part times
(:class:`~fxpar.planner.model_costs.RankPart`) and the weights its stages are balanced by.

* :func:`node_time`: (forward, backward) seconds of a node by the roofline alone, the larger of its
  FLOPs over the matmul rate and its bytes over the memory bandwidth (backward: its backward FLOPs and
  twice the bytes); what the cuts are balanced by, so compile and the planner weigh stages alike;
* :func:`work_time`: the same with the per-op overhead, the elementwise rate for ops that are not matrix
  products, and first touch of new outputs: the planner's predicted step time (:func:`work_terms`: the
  same by term, for ``fxpar calibrate --reference``'s fit);
* :func:`transfer_time`: one point-to-point message between pipeline neighbours on the inter-node link.
"""

from __future__ import annotations

from fxpar.ir.meta import NodeCost

__all__ = ["is_matmul", "node_time", "roofline", "transfer_time", "work_terms", "work_time"]


def roofline(profile, flops: float, bwd_flops: float, nbytes: float, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of ``flops`` forward, ``bwd_flops`` backward and ``nbytes`` of memory
    traffic forward (backward moves twice as many; no backward FLOPs: no backward), no per-op overhead."""
    rate, bw = profile.matmul_flops(dtype), profile.mem_bw
    fwd = max(flops / rate, nbytes / bw)
    return fwd, (max(bwd_flops / rate, 2 * nbytes / bw) if bwd_flops else 0.0)


def node_time(profile, cost: NodeCost, dtype: str) -> tuple[float, float]:
    """(forward, backward) roofline seconds of one node of ``cost`` computing in ``dtype``."""
    return roofline(profile, cost.flops, cost.bwd_flops, cost.bytes_read + cost.bytes_written, dtype)


def is_matmul(flops: float, nbytes: float) -> bool:
    """Whether work of ``flops`` over ``nbytes`` is a matrix product or attention (at least one FLOP per
    byte moved) rather than an elementwise op, a reduction or a copy (fxpar counts those one FLOP per
    output element)."""
    return flops >= nbytes


def work_time(profile, flops: float, bwd_flops: float, nbytes: float, out_bytes: float,
              dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of one op with the launch overhead: one op forward and two backward,
    the elementwise rate for ops that are not matrix products (:func:`is_matmul`), and the first touch
    of its output (forward) and of the gradients it makes (backward, about the output's size)."""
    mm = is_matmul(flops, nbytes)
    fresh = profile.fresh_time(out_bytes) if out_bytes else 0.0
    fwd = profile.compute_time(flops, nbytes, dtype, ops=1, matmul=mm) + fresh
    bwd = profile.compute_time(bwd_flops, 2 * nbytes, dtype, ops=2, matmul=mm) + fresh if bwd_flops else 0.0
    return fwd, bwd


def work_terms(profile, flops: float, bwd_flops: float, nbytes: float, out_bytes: float, dtype: str) -> dict:
    """:func:`work_time`'s forward + backward seconds of one op, by term: ``"matmul"`` or ``"elementwise"``
    (its roofline, by :func:`is_matmul`), ``"fresh_matmul"`` or ``"fresh_elementwise"`` (first touch of its
    output and gradients) and ``"overhead"`` (its launches): what a fit to a measured step compares."""
    mm = is_matmul(flops, nbytes)
    kind = "matmul" if mm else "elementwise"
    fresh = profile.fresh_time(out_bytes) if out_bytes else 0.0
    got = {kind: 0.0, "fresh_" + kind: 0.0, "overhead": 0.0}
    for f, moved, ops in ((flops, nbytes, 1), (bwd_flops, 2 * nbytes, 2 if bwd_flops else 0)):
        if ops:
            got[kind] += profile.compute_time(f, moved, dtype, matmul=mm)
            got["fresh_" + kind] += fresh
            got["overhead"] += ops * profile.op_overhead
    return got


def transfer_time(profile, nbytes: float) -> float:
    """Seconds to send ``nbytes`` to a pipeline neighbour: one message on the inter-node link, as
    ``profile.collective_time("send", nbytes, 2, inter_node=True)`` prices it (one step of latency, every
    byte over the bandwidth), without its checks: the cut search calls it for every pair of candidates."""
    if nbytes <= 0:
        return 0.0
    link = profile.inter
    return link.latency + nbytes / link.bandwidth
