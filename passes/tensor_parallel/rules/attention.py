"""The attention rule: scaled dot-product attention over this rank's heads."""

from __future__ import annotations

import torch

from fxpar.ir import meta
from fxpar.ir.placement import Shard
from fxpar.passes.tensor_parallel.rules.pointwise import pointwise_or_gather
from fxpar.passes.tensor_parallel.rules.registry import rule

aten = torch.ops.aten


@rule(aten.scaled_dot_product_attention)
def attention(rw, old, args, kwargs):
    """q, k, v ``Shard(1)`` (heads): ``Shard(1)`` out, replicated keys/values (fewer KV heads than ranks) and
    a per-head mask sliced to this rank's heads; any other layout: gathered."""
    q, k, v = args[:3]
    if rw.shard_dim(q) == 1:  # keys/values replicated (fewer KV heads than ranks): take this rank's
        k = rw.slice_to(k, old.args[1], 1) if rw.is_replicated(k) else k
        v = rw.slice_to(v, old.args[2], 1) if rw.is_replicated(v) else v
    if rw.shard_dim(q) != 1 or rw.shard_dim(k) != 1 or rw.shard_dim(v) != 1:
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    rest = list(args[3:])
    mask = rest[0] if rest else kwargs.get("attn_mask")
    if isinstance(mask, torch.fx.Node):
        mval = (old.args[3] if len(old.args) > 3 else old.kwargs["attn_mask"]).meta[meta.VAL]
        if mval.dim() == 4 and mval.shape[1] > 1:  # per-head bias (ALiBi): this rank's heads
            mask = rw.slice_to(mask, old, 1)
        if rest:
            rest[0] = mask
        else:
            kwargs = {**kwargs, "attn_mask": mask}
    return rw.call(old.target, (q, k, v, *rest), kwargs, like=old, place=Shard(1))
