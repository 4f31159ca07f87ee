"""The KV-cache rule: a static cache written in place (``cache.index_copy_(dim, positions, new)``) keeps
this rank's heads only.

When ``new`` is sharded along a dim other than the written one (the keys or values of this rank's
heads, ``Shard(1)``) and ``cache`` is a user input nothing has read before, the cache becomes a
per-rank input sharded like ``new``: the caller passes this rank's shard (``fxpar.placement`` on the
placeholder says which), the write needs no communication, attention reads the shard as it reads the
sharded keys, and the updated cache is returned as it is, never gathered. Any other case (a replicated
``new``, e.g. fewer KV heads than ranks, or a cache read before it is written) gathers ``new`` and
keeps a whole cache on every rank.
"""

from __future__ import annotations

import torch

from fxpar.ir import meta
from fxpar.ir.placement import Shard
from fxpar.passes.tensor_parallel.rules.pointwise import pointwise_or_gather
from fxpar.passes.tensor_parallel.rules.registry import rule

aten = torch.ops.aten


def _fresh_user_input(rw, old_dst: torch.fx.Node, writer: torch.fx.Node) -> bool:
    """A user input whose only earlier reader is none: ``writer`` is the first node to touch it."""
    users = {b.placeholder for b in rw.program.inputs if b.kind == "user"}
    return old_dst.op == "placeholder" and old_dst.name in users and \
        all(u is writer or u not in rw.env for u in old_dst.users)


@rule(aten.index_copy_, aten.index_copy)
def index_copy(rw, old, args, kwargs):
    """``new`` sharded off the written dim into a fresh user input (a KV cache): the input becomes this
    rank's shard, nothing gathered; into a cache already sharded alike: the same; else: gathered."""
    dst, dim, index, src = args[:4]
    d, old_dst = rw.shard_dim(src), old.args[0]
    nd = rw.ndim(old)
    if d is not None and rw.is_replicated(index) and dim % nd != d % nd:
        full = old_dst.meta.get(meta.VAL)
        if rw.shard_dim(dst) == d:
            return rw.call(old.target, (dst, dim, index, src), kwargs, like=old, place=Shard(d))
        if rw.is_replicated(dst) and _fresh_user_input(rw, old_dst, old) and full.shape[d] % rw.tp == 0:
            dst.meta[meta.VAL] = full.narrow(d, 0, full.shape[d] // rw.tp)  # the caller passes this shard
            rw.place[dst] = Shard(d)
            rw.local_inputs[old_dst.name] = d
            new = rw.call(old.target, (dst, dim, index, src), kwargs, like=old, place=Shard(d))
            if old.target is aten.index_copy_.default:
                rw.local_values.add(new)  # the caller's shard, updated in place: returned ungathered
            return new
    return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
