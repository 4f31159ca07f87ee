"""The ``dp_replicate`` values (HSDP) the search prices: the planner's enumeration of data parallelism's
groups. Their collectives are priced in :mod:`fxpar.cost.data_parallel`."""

from __future__ import annotations

__all__ = ["replica_options"]


def replica_options(dp: int, inner: int, ranks_per_node: int) -> list[int]:
    """``dp_replicate`` values the search prices for ``dp`` ranks ``inner`` (``pp * tp``) ranks apart on nodes
    of ``ranks_per_node`` ranks: 1, and where the dp group spans nodes, the one whose shard groups are the
    largest that stay inside a node (more replicas only add memory, larger shard groups cross nodes
    again). A shard group's block of ``shard * inner`` consecutive ranks must tile a node."""
    def inside(shard: int) -> bool:
        block = shard * inner
        return block <= ranks_per_node and ranks_per_node % block == 0
    if dp == 1 or inside(dp):
        return [1]
    shard = max((s for s in range(2, dp) if dp % s == 0 and inside(s)), default=1)
    return [1, dp // shard] if shard > 1 else [1]
