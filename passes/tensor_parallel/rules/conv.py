"""The convolution rule: grouped (depthwise) convolutions cut by channels.

A Mamba mixer's and a gated delta-net's short causal ``conv1d`` has ``groups == channels``: each
channel is filtered alone, so a rank holding a part of the channels (the column-parallel output of
``in_proj``) filters that part with its rows of the weight and bias and ``groups / tp`` groups, with no
communication. Any grouped convolution whose groups divide over the ranks is cut the same way (rank r
holds groups ``r*g/tp .. (r+1)*g/tp``, contiguous channels of input and output alike). A dense
convolution (one group) mixes every channel: it runs on replicated inputs.
"""

from __future__ import annotations

import torch

from fxpar.ir import meta
from fxpar.ir.op_classes import CONV_GROUPS_AT
from fxpar.ir.placement import Shard
from fxpar.passes.tensor_parallel.rules.pointwise import pointwise_or_gather
from fxpar.passes.tensor_parallel.rules.registry import rule

aten = torch.ops.aten



@rule(*CONV_GROUPS_AT)
def convolution(rw, old, args, kwargs):
    """Input ``Shard(channel)`` (or a weight already cut by output channels) with groups divisible by tp:
    this rank's channels, weight and bias rows sliced to them, ``groups / tp``; ``Shard(channel)`` out.
    Anything else: replicated inputs."""
    pkt = old.target.overloadpacket
    at = CONV_GROUPS_AT[pkt]
    args = list(args) + [None] * (at + 1 - len(args))
    groups = args[at] if args[at] is not None else kwargs.get("groups", 1)
    x, w, b = args[0], args[1], args[2]
    xo, wo, bo = old.args[0], old.args[1], old.args[2] if len(old.args) > 2 else None
    cd = rw.ndim(xo) - (rw.ndim(wo) - 1)  # the channel dim: 1 batched, 0 unbatched
    transposed = pkt is aten.convolution and args[6]
    cut = not transposed and groups % rw.tp == 0 and (rw.shard_dim(x) == cd or rw.shard_dim(w) == 0)
    if not cut or any(not rw.is_replicated(t) and rw.shard_dim(t) != want
                      for t, want in ((x, cd), (w, 0), (b, 0)) if isinstance(t, torch.fx.Node)):
        if all(rw.is_replicated(t) for t in (x, w, b) if isinstance(t, torch.fx.Node)):
            return rw.call(old.target, tuple(args[:len(old.args)]), kwargs, like=old)
        return pointwise_or_gather(rw, old, tuple(args[:len(old.args)]), kwargs, force_gather=True)
    args[0] = rw.slice_to(x, xo, cd)
    args[1] = rw.slice_to(w, wo, 0)
    if isinstance(b, torch.fx.Node):
        args[2] = rw.slice_to(b, bo, 0)
    args[at] = groups // rw.tp
    kw = dict(kwargs)
    if "groups" in kw:
        kw["groups"], args = groups // rw.tp, args[:len(old.args)]
    else:
        args = args[:max(len(old.args), at + 1)]
    out_val = old.meta.get(meta.VAL)
    return rw.call(old.target, tuple(args), kw, like=old, place=Shard(out_val.dim() - (rw.ndim(wo) - 1)))
