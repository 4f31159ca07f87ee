"""Data parallelism's groups and what their collectives cost: the one ZeRO / DP communication model the
planner's Estimate (:mod:`fxpar.planner.price`) reads.

Reads a plan's ``dp``, ``dp_replicate`` and ``zero``, and a device profile; writes nothing. Without HSDP there
is one group of ``dp`` ranks. With HSDP (``Plan(dp_replicate=R)``) ZeRO shards over the shard group of
``dp / R`` ranks (neighbours in the mesh: ``fxpar.ir.mesh``) and each shard has ``R`` copies, one per
replica group. Each group is priced on the link its ranks use: a group whose ranks lie on several nodes
(``ranks_per_node`` consecutive ranks per node) uses the inter-node link. That is where HSDP pays: the
sharding traffic (whole buckets) stays inside a node, only the replicas' all-reduce of a shard (``1 / (dp /
R)`` of the gradients) crosses nodes. The collectives are the runtime's (``runtime/data_parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpar.cost.comm import sent_bytes as sent

__all__ = ["DpGroups", "engine_times", "sent_bytes"]


@dataclass(frozen=True)
class DpGroups:
    """The shard group (``shard`` ranks; all of dp without HSDP) and the replica group (``replicas`` ranks,
    1 without HSDP), each with whether it spans nodes."""

    shard: int
    shard_inter: bool
    replicas: int = 1
    replicas_inter: bool = False

    @classmethod
    def of(cls, plan, spans) -> DpGroups:
        """``spans(stride, size)``: whether the mesh's groups of ``size`` ranks ``stride`` apart cross nodes.
        The dp coordinate is ``replica * shard + shard rank``, dp ranks ``pp * tp`` ranks apart."""
        inner, r = plan.pp * plan.tp, plan.dp_replicate
        shard = plan.dp // r
        return cls(shard, spans(inner, shard), r, spans(inner * shard, r))


def engine_times(p, zero: int, n: int, g: DpGroups, bucket: int) -> tuple[float, float, float]:
    """Seconds of a step's data-parallel collectives for ``n`` fp32 entries on this rank, as
    ``(reduction, the last bucket's, after backward)``: the gradient reduction overlaps backward bucket by
    bucket (ZeRO-0/1/2; all but the last ``bucket`` bytes may hide), the rest follows it. Flat: an
    all-reduce (zero=0/1, and gloo's zero=2), then the updated shards' all-gather (zero=1/2). HSDP: a
    reduce-scatter inside the shard group, then after backward the shard's all-reduce across replicas,
    ZeRO-1's gather of the reduced gradients and the updated shards' gather (both inside the shard group).
    ZeRO-3's gathers and reduce-scatters are priced per part (``price._zero3``); with HSDP only the
    replicas' all-reduce of its shard gradients follows the backward here."""
    full, part = 4 * n, 4 * -(-n // g.shard)
    across = p.collective_time("all_reduce", part, g.replicas, g.replicas_inter) if g.replicas > 1 else 0.0
    if zero == 3:
        return 0.0, 0.0, across
    if g.replicas == 1:
        red = p.collective_time("all_reduce", full, g.shard, g.shard_inter)
        last = p.collective_time("all_reduce", min(full, bucket), g.shard, g.shard_inter)
        after = p.collective_time("all_gather", full, g.shard, g.shard_inter) if zero else 0.0
        return red, last, after
    red = p.collective_time("reduce_scatter", full, g.shard, g.shard_inter)
    last = p.collective_time("reduce_scatter", min(full, bucket), g.shard, g.shard_inter)
    gather = p.collective_time("all_gather", full, g.shard, g.shard_inter)
    return red, last, across + gather * (2 if zero == 1 else 1)


def sent_bytes(zero: int, n: int, m: int, gbytes: int, g: DpGroups, frozen: int = 0) -> tuple[float, float]:
    """Bytes one rank sends per step for data parallelism over ``n`` trainable entries, ``m`` microbatches
    (``gbytes``: ZeRO-3's gather wire bytes per entry), as ``(inside the shard group, across replicas)``
    (ring algorithms, :data:`fxpar.cost.comm.RING`). ``frozen`` entries more have no gradient to reduce:
    only ZeRO-3 sends them, its gathers."""
    full, s = 4 * n, g.shard
    across = sent("all_reduce", 4 * -(-n // s), g.replicas)
    if zero == 3:  # each microbatch gathers forward and backward, and reduce-scatters the gradients
        return m * (2 * sent("all_gather", (n + frozen) * gbytes, s) + sent("reduce_scatter", full, s)), across
    if g.replicas == 1:
        return sent("all_reduce", full, s) + (sent("all_gather", full, s) if zero else 0.0), 0.0
    return sent("reduce_scatter", full, s) * (3 if zero == 1 else 2), across
