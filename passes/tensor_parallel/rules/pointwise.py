"""Rules for ops that keep a layout in place: pass-through ops, softmax and reductions over other dims
(a sum or mean over the shard: a partial sum), and the fallback for every op without a rule: elementwise ops keep
a shard, any other op is gathered."""

from __future__ import annotations

import math

import torch

from fxpar.ir import (
    function_op,  # noqa: F401  (defines torch.ops.fxpar.autograd_function)
    meta,
)
from fxpar.ir.op_classes import ASSERTS, PASS_THROUGH, REDUCTIONS, SOFTMAX, is_pointwise, packet
from fxpar.ir.placement import Partial, as_placement
from fxpar.passes.tensor_parallel.rules.registry import rule

aten = torch.ops.aten


@rule(*ASSERTS)
def assertion(rw, old, args, kwargs):
    """A metadata check: kept as it is, replicated."""
    return rw.call(old.target, args, kwargs, like=old)


@rule(*PASS_THROUGH)
def pass_through(rw, old, args, kwargs):
    """Copies, casts, dropout: the input's placement passes through unchanged."""
    return rw.keep(old, args, kwargs, lambda d: d)


@rule(*SOFTMAX)
def softmax(rw, old, args, kwargs):
    """Softmax over another dim than the shard keeps it; over the sharded dim, the fallback."""
    d = rw.shard_dim(args[0])
    if d is not None and old.args[1] % rw.ndim(old) != d:
        return rw.keep(old, args, kwargs, lambda d: d)
    return pointwise_or_gather(rw, old, args, kwargs)


@rule(*REDUCTIONS)
def reduction(rw, old, args, kwargs):
    """A reduction over other dims than the shard keeps it (moved left past removed dims). A sum over it
    is this rank's sum, ``Partial()``; a mean over it this rank's sum divided by the full count (an RMS
    norm over sharded channels: the sum of squares all-reduced, one small tensor); max/min, gathered."""
    d = rw.shard_dim(args[0])
    if d is None:
        return pointwise_or_gather(rw, old, args, kwargs)
    nd = rw.ndim(old.args[0])
    dims = old.args[1] if len(old.args) > 1 else kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or range(nd))
    dims = [x % nd for x in dims]
    keep = old.args[2] if len(old.args) > 2 else kwargs.get("keepdim", False)
    if d in dims and packet(old) in (aten.sum, aten.mean):
        dtype = {"dtype": kwargs["dtype"]} if kwargs.get("dtype") is not None else {}
        out = rw.call(aten.sum.dim_IntList, (args[0], dims, keep), dtype, like=old, place=Partial())
        if packet(old) is aten.mean:
            count = math.prod(old.args[0].meta[meta.VAL].shape[x] for x in dims)
            out = rw.call(aten.div.Tensor, (out, count), like=old, place=Partial())
        return out
    if d in dims:
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    return rw.call(old.target, args, kwargs, like=old, place=as_placement(d if keep else d - sum(x < d for x in dims)))


def pointwise_or_gather(rw, old, args, kwargs, force_gather: bool = False):
    """Elementwise ops keep a shard (replicated operands sliced to it, or their gradient summed where
    they broadcast along it); everything else runs on replicated inputs and is listed in fallbacks."""
    current = [rw.reduced.get(rw.env[a], rw.env[a]) for a in old.all_input_nodes]  # partials summed
    tensor_args = list(zip(old.all_input_nodes, current))
    sharded = [(o, n) for o, n in tensor_args if not rw.is_replicated(n)]
    if not sharded:
        return rw.call(old.target, args, kwargs, like=old)
    out_val = old.meta.get(meta.VAL)
    d_out = None
    if not force_gather and isinstance(out_val, torch.Tensor) and is_pointwise(old):
        nd = out_val.dim()
        dims = {rw.shard_dim(n) - rw.ndim(o) + nd for o, n in sharded}
        if len(dims) == 1:
            d_out = dims.pop()
    if d_out is None:
        rw.fallbacks.append(f"{old.name} ({old.target}) in {old.meta.get(meta.MODULE, '')}")
        new_inputs = {n: rw.replicate(n, o) for o, n in tensor_args}
        a2, k2 = torch.fx.node.map_arg((args, kwargs), lambda n: new_inputs.get(n, n))
        return rw.call(old.target, a2, k2, like=old)
    fixed = {}
    for o, n in tensor_args:
        if rw.is_replicated(n):
            dd = d_out - (out_val.dim() - rw.ndim(o))
            if dd >= 0 and o.meta[meta.VAL].shape[dd] > 1:
                fixed[n] = rw.slice_to(n, o, dd)
            elif o in rw.grad_flows:
                # broadcast along the shard: each rank's gradient is a partial sum over its shard
                fixed[n] = rw.sum_grad(n, like=o)
    a2, k2 = torch.fx.node.map_arg((args, kwargs), lambda n: fixed.get(n, n))
    return rw.call(old.target, a2, k2, like=old, place=as_placement(d_out))


@rule(torch.ops.fxpar.autograd_function)
def autograd_function(rw, old, args, kwargs):
    """A user autograd.Function found elementwise on capture (one tensor in, its list of one out) keeps
    its input's shard; any other runs on replicated inputs."""
    xs, srcs = list(args[0]), list(old.args[0])
    dims = [rw.shard_dim(x) for x in xs]
    if len(xs) == 1 and dims[0] is not None and is_pointwise(old):
        return rw.call(old.target, args, kwargs, like=old, place=as_placement(dims[0]))
    if any(not rw.is_replicated(x) for x in xs):
        rw.fallbacks.append(f"{old.name} ({old.target}) in {old.meta.get(meta.MODULE, '')}")
    return rw.call(old.target, ([rw.replicate(x, o) for x, o in zip(xs, srcs)], *args[1:]), kwargs, like=old)
