"""ZeRO-3's gathers and reduce-scatters per pipeline stage, as :class:`fxpar.cost.estimate.Pricer` prices them:
each part's bucket gathered in the forward and again in the backward, its gradient reduce-scattered
(``runtime/zero3.py``), one bucket ahead of use; and the head ZeRO-3 leaves on its shards under the fused loss
(``passes/zero3.py``): not gathered, the hidden states it reads gathered in its place."""

from __future__ import annotations

from fxpar.cost.overheads import comm_share, gather_copy_time

__all__ = ["head_figures", "head_on_shards_entries", "shard_head", "zero3_times"]


def shard_head(pricer, tp: int, fused: bool):
    """The head ZeRO-3 leaves on its shards (:class:`fxpar.planner.variants.HeadOnShards`) where ``fused``
    (the plan's fused loss) at ``tp`` = 1 (TP splits it by vocabulary instead), else None."""
    return pricer.costs.fused.head if fused and tp == 1 and pricer.costs.fused is not None else None


def head_figures(names: list[str], ks: list, head) -> tuple[int, int, int]:
    """Of one stage (its parts' ``names`` and :meth:`~fxpar.cost.estimate.Pricer.kind` figures ``ks``, with their
    shares): the entries of ``head`` (:func:`shard_head`) it holds, the entries of its embedding part ("pre",
    gathered as the forward starts: its backward reads the token ids alone) and the largest bucket gathered
    after the forward's start with the head on its shards (the head not gathered, "pre" apart)."""
    mine = head.rows * head.cols if head is not None and "post" in names else 0
    pre = next((k[5] for (k, _), n in zip(ks, names) if n == "pre"), 0)
    big = max((k[5] - (mine if n == "post" else 0) for (k, _), n in zip(ks, names) if n != "pre"), default=0)
    return mine, pre, big


def head_on_shards_entries(pricer, plan, st: dict, stages: list[int], shard: int, fused: bool) -> tuple[int, bool]:
    """(the head's entries ``stages`` leave on their shards, whether it trains): 0 where ZeRO-3 over ``shard``
    ranks gathers it (no fused loss, tp > 1, rows not dividing by ``shard``, not zero=3)."""
    head = shard_head(pricer, plan.tp, fused)
    if plan.zero != 3 or head is None or not head.applies(shard):
        return 0, False
    return sum(st["head"][s] for s in stages), head.trained


def zero3_times(self, plan, n_stages, b, dtype, groups, gbytes, var=()) -> tuple:
    """ZeRO-3's exposed gather / reduce-scatter time per stage and microbatch (forward, backward):
    each part's bucket is gathered one ahead of use (``prefetch``), so only what its compute cannot
    cover shows; the first bucket of the model always shows. A head the fused loss reads on its shards is not
    gathered; the hidden states it reads are, over the same ranks (``passes/zero3.py``). Frozen entries
    (``kind``'s last figure) are gathered as the others but never reduce-scattered (``runtime/zero3.py``: their
    buckets have no gradient).
    ``self``: the :class:`~fxpar.cost.estimate.Pricer`; ``groups``: the plan's DpGroups (zeros unless ZeRO-3
    shards over more than one rank); ``var``: the plan's variant (``estimate._variant``)."""
    if plan.zero != 3 or groups.shard <= 1:
        return [0.0] * n_stages, [0.0] * n_stages
    tp, sp, rc, world, dp, inter = (plan.tp, plan.sequence_parallel, plan.recompute, plan.world_size, groups.shard,
                                    groups.shard_inter)
    rbytes, prefetch = 1 if plan.quantize_grads else 4, plan.prefetch > 0
    key = (n_stages, tp, sp, b, rc, world, dtype, dp, inter, gbytes, rbytes, prefetch, var)
    got = self._stage_cache.get(key)
    if got is not None:
        return got
    p = self.profile
    cshare = p.share(min(world, p.ranks_per_node))
    slow = comm_share(p, min(world, p.ranks_per_node), dp)  # collectives slowed by ranks computing beside them
    head = shard_head(self, tp, bool(var and var[2]))
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
