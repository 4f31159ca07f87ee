"""ZeRO-3's gathers and reduce-scatters per pipeline stage, as :class:`fxpar.cost.estimate.Pricer` prices them:
each part's bucket gathered in the forward and again in the backward, its gradient reduce-scattered
(``runtime/zero3.py``), one bucket ahead of use."""

from __future__ import annotations

from fxpar.cost.overheads import comm_share, gather_copy_time

__all__ = ["zero3_times"]


def zero3_times(self, n_stages, tp, sp, b, rc, world, dtype, dp, inter, gbytes, rbytes, prefetch, var=()) -> tuple:
    """ZeRO-3's exposed gather / reduce-scatter time per stage and microbatch (forward, backward):
    each part's bucket is gathered one ahead of use (``prefetch``), so only what its compute cannot
    cover shows; the first bucket of the model always shows. A head the fused loss reads on its shards is not
    gathered; the hidden states it reads are, over the same ranks (``passes/zero3.py``). Frozen entries (``kind``'s last figure) are
    gathered as the others but never reduce-scattered (``runtime/zero3.py``: their buckets have no gradient).
    ``self``: the :class:`~fxpar.cost.estimate.Pricer`."""
    key = (n_stages, tp, sp, b, rc, world, dtype, dp, inter, gbytes, rbytes, prefetch, var)
    got = self._stage_cache.get(key)
    if got is not None:
        return got
    p = self.profile
    cshare = p.share(min(world, p.ranks_per_node))
    slow = comm_share(p, min(world, p.ranks_per_node), dp)  # collectives slowed by ranks computing beside them
    head = self.head(tp, bool(var and var[2]))
    head = head if head is not None and head.applies(dp) else None
    zf, zb = [], []
    for s, e in self.segs.cuts(n_stages, b, dtype):
        f = bw = 0.0
        for u in range(s, e):
            i, share = self.units[u]
            k = self.kind(self.names[i], tp, sp, b, rc, world, dtype, *var)
            gathered, reduced = k[5], k[5] - k[-1]
            if head is not None and self.names[i] == "post":  # the head stays on its shards: the loss gathers the
                # hidden states (forward) and reduce-scatters their gradient (backward) instead (passes/zero3.py)
                gathered -= head.rows * head.cols
                reduced -= head.rows * head.cols if head.trained else 0
            ck = ("z3", gathered, reduced, gbytes, rbytes, dp, inter)
            both = self._kinds.get(ck)
            if both is None:
                both = self._kinds[ck] = (p.collective_time("all_gather", gathered * gbytes, dp, inter),
                                          p.collective_time("reduce_scatter", reduced * rbytes, dp, inter))
            if head is not None and self.names[i] == "post":
                tokens = b * self.costs.seq // (var[3] if len(var) > 3 else 1)  # this rank's (cp: its chunk)
                states = dp * tokens * head.cols * (2 if dtype == "bf16" else 4)
                both = (both[0] + p.collective_time("all_gather", states, dp, inter),
                        both[1] + p.collective_time("reduce_scatter", states, dp, inter))
            gather, rs = both[0] * share / slow, both[1] * share / slow
            copy = gather_copy_time(p, gathered * gbytes) / cshare * share  # the op's copies (fxpar.cost.overheads)
            gather, rs = gather + copy, rs + copy
            hide = prefetch and u > 0 and p.comm_overlaps
            f += max(0.0, gather - k[0] * share) if hide else gather
            bw += max(0.0, gather + rs - k[1] * share) if hide else gather + rs
        zf.append(f)
        zb.append(bw)
    self._stage_cache[key] = got = (zf, zb)
    return got
