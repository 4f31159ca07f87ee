"""The attention rules: scaled dot-product attention over this rank's heads, and norms over the dims after
a shard (per-head query/key norms: persimmon's q_layernorm over head_dim, with the heads cut)."""

from __future__ import annotations

import torch

from fxpar.ir import meta
from fxpar.ir.op_classes import packet
from fxpar.ir.placement import Shard
from fxpar.passes.tensor_parallel.rules.pointwise import pointwise_or_gather
from fxpar.passes.tensor_parallel.rules.registry import rule

aten = torch.ops.aten


@rule(aten.scaled_dot_product_attention)
def attention(rw, old, args, kwargs):
    """q, k, v ``Shard(1)`` (heads): ``Shard(1)`` out, replicated keys/values (fewer KV heads than ranks) and
    a per-head mask sliced to this rank's heads, a replicated key/value of one head (multi-query)
    broadcast; any other layout: gathered."""
    q, k, v = args[:3]
    if rw.shard_dim(q) == 1:  # keys/values replicated (fewer KV heads than ranks): take this rank's
        k, v = (_kv(rw, t, o) for t, o in zip((k, v), old.args[1:3]))
    if rw.shard_dim(q) != 1 or not all(rw.shard_dim(t) == 1 or _one_head(rw, t, o)
                                       for t, o in zip((k, v), old.args[1:3])):
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


def _one_head(rw, t, o) -> bool:
    """A replicated key/value of one head, broadcast over this rank's query heads (multi-query)."""
    return rw.is_replicated(t) and o.meta[meta.VAL].shape[1] == 1


def _kv(rw, t, o):
    """A replicated key/value: its one head used by this rank's query heads only (its gradient a partial
    sum over ranks: summed), or this rank's heads of it."""
    if not rw.is_replicated(t):
        return t
    if _one_head(rw, t, o):
        return rw.sum_grad(t, like=o) if o in rw.grad_flows else t
    return rw.slice_to(t, o, 1)


@rule(aten.layer_norm, aten.rms_norm)
def norm(rw, old, args, kwargs):
    """A norm over trailing dims after the shard keeps it; its weight and bias, broadcast along the shard,
    get their gradient summed over the ranks. Over the sharded dim: the fallback (gathered)."""
    x = args[0]
    d = rw.shard_dim(x)
    if d is None or d >= rw.ndim(old.args[0]) - len(old.args[1]):
        return pointwise_or_gather(rw, old, args, kwargs)
    n_params = 2 if packet(old) is aten.layer_norm else 1
    params = list(args[2:2 + n_params])
    olds = list(old.args[2:2 + n_params])
    params = [rw.sum_grad(p, like=o) if isinstance(o, torch.fx.Node) and o in rw.grad_flows else p
              for p, o in zip(params, olds)]
    return rw.call(old.target, (x, args[1], *params, *args[2 + n_params:]), kwargs, like=old, place=Shard(d))
