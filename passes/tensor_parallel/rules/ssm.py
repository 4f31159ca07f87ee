"""Rules for the ops of state-space and linear-attention scans: the steps of a recurrence picked
(``select``), stacked back (``stack``), summed along time (``cumsum``), size-1 dims dropped (``squeeze``),
padded to whole chunks (``pad``), groups repeated for their heads (``repeat_interleave``), and the
chunked scan's ``einsum`` contractions.

Mamba's selective scan, run by transformers on the CPU as a loop over time, is per channel (Mamba-1)
or per head (Mamba-2, gated delta-net): every op of it works along time or the state dim, never
across channels or heads. So a shard of the channels (the column-parallel output of ``in_proj``)
flows through the whole scan with no communication, as Megatron's Mamba tensor parallelism runs it::

    h = mul(select(dA, 2, t), h) + select(dBx, 2, t)    # [B, C/tp, N]: Shard(1) throughout
    y_t = select(matmul(h, unsqueeze(select(C, 1, t), -1)), 2, 0)
    y = stack([y_0, .., y_T], -1)                        # [B, C/tp, T]: Shard(1)

Each rule keeps a shard along the dims it does not touch and gathers only when it works along the
sharded dim itself.
"""

from __future__ import annotations

import torch

from fxpar.ir.op_classes import VIEW_OPS, VIEWS_AND_CASTS, packet
from fxpar.ir.placement import Partial, as_placement
from fxpar.passes.tensor_parallel.dim_moves import moved
from fxpar.passes.tensor_parallel.rules.pointwise import pointwise_or_gather
from fxpar.passes.tensor_parallel.rules.registry import rule

aten = torch.ops.aten


def summed_grad(rw, new: torch.fx.Node, old: torch.fx.Node) -> torch.fx.Node:
    """Replicated ``new`` (of traced node ``old``) with its gradient summed over the ranks, the sum taken
    once on the tensor it views: a scan unrolled over time reads one step of the whole ``C`` per step,
    and one all-reduce of ``C``'s gradient replaces one per step (the views are taken again after it)."""
    chain, root = [], old
    while (root.op == "call_function" and packet(root) in VIEWS_AND_CASTS and len(root.all_input_nodes) == 1
           and root.args and root.args[0] is root.all_input_nodes[0] and rw.env.get(root) is not None
           and rw.env[root].target == root.target and rw.is_replicated(rw.env[root.args[0]])):
        chain.append(root)
        root = root.args[0]
    if not chain or root not in rw.grad_flows:
        return rw.sum_grad(new, like=old)
    cur = rw.sum_grad(rw.env[root], like=root)
    for n in reversed(chain):
        cur = rw.call(n.target, (cur, *rw.env[n].args[1:]), dict(rw.env[n].kwargs), like=n)
    return cur


def _written(old: torch.fx.Node) -> bool:
    """A later op writes into ``old`` (or a view of it) in place, as a chunked delta rule fills a buffer
    step by step: a shard of it would take writes that run on gathered values, so it stays whole."""
    todo, seen = list(old.users), set()
    while todo:
        user = todo.pop()
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        schema = getattr(user.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
        if packet(user) in VIEW_OPS:
            todo.extend(user.users)
    return False


@rule(aten.select)
def select(rw, old, args, kwargs):
    """select(x, dim, i) along another dim than the shard keeps it (moved left past ``dim``)."""
    d = rw.shard_dim(args[0])
    if d is None:
        return pointwise_or_gather(rw, old, args, kwargs)
    od = moved(old, d)
    if od is None:
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    return rw.call(old.target, args, kwargs, like=old, place=as_placement(od))


@rule(aten.squeeze)
def squeeze(rw, old, args, kwargs):
    """Dropping size-1 dims keeps a shard (moved left past the dims dropped before it)."""
    d = rw.shard_dim(args[0])
    if d is None:
        return pointwise_or_gather(rw, old, args, kwargs)
    od = moved(old, d)
    if od is None:
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    return rw.call(old.target, args, kwargs, like=old, place=as_placement(od))


@rule(aten.stack)
def stack(rw, old, args, kwargs):
    """stack along a new dim: inputs sharded alike keep it (replicated ones sliced to it); else gathered."""
    parts, olds = list(args[0]), list(old.args[0])
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % rw.ndim(old)
    shards = {rw.shard_dim(p) for p in parts} - {None}
    if not shards:
        return rw.call(old.target, args, kwargs, like=old)
    if len(shards) > 1 or any(rw.is_partial(p) for p in parts):
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    d = shards.pop()
    parts = [rw.slice_to(p, o, d) for p, o in zip(parts, olds)]
    return rw.call(old.target, (parts, *args[1:]), kwargs, like=old, place=as_placement(d + 1 if d >= dim else d))


@rule(aten.cumsum)
def cumsum(rw, old, args, kwargs):
    """A running sum along another dim than the shard (time, in a chunked scan) keeps it."""
    d = rw.shard_dim(args[0])
    if d is None:
        return pointwise_or_gather(rw, old, args, kwargs)
    dim = (old.args[1] if len(old.args) > 1 else old.kwargs["dim"]) % rw.ndim(old.args[0])
    if dim == d or _written(old):
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    return rw.call(old.target, args, kwargs, like=old, place=as_placement(d))


@rule(aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like)
def like(rw, old, args, kwargs):
    """A fresh tensor shaped like a shard is that shard's shape: the placement passes through (a buffer
    written in place later: made whole)."""
    if _written(old):
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    return rw.keep(old, args, kwargs, lambda d: d)


@rule(aten.pad, aten.constant_pad_nd)
def pad(rw, old, args, kwargs):
    """Padding (``[last_lo, last_hi, prev_lo, ..]``) of other dims than the shard keeps it; else gathered."""
    d = rw.shard_dim(args[0])
    if d is None:
        return pointwise_or_gather(rw, old, args, kwargs)
    widths, nd = list(old.args[1]), rw.ndim(old)
    at = 2 * (nd - 1 - d)
    if any(widths[at:at + 2]) or _written(old):
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    return rw.call(old.target, args, kwargs, like=old, place=as_placement(d))


@rule(aten.repeat_interleave)
def repeat_interleave(rw, old, args, kwargs):
    """``repeat_interleave(x, k, dim)`` (Mamba-2's B and C groups repeated for their heads): along another
    dim the shard stays; along the shard, each rank repeats its groups into its heads (``output_size``
    the local one)."""
    d = rw.shard_dim(args[0])
    if d is None or not isinstance(old.args[1] if len(old.args) > 1 else None, int):
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=d is not None)
    dim = old.args[2] if len(old.args) > 2 else old.kwargs.get("dim")
    if dim is None:
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    if dim % rw.ndim(old) == d and rw.uneven(old.args[0], d) is not None:  # each rank's groups: not a chunk
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    if dim % rw.ndim(old) == d and kwargs.get("output_size") is not None:
        kwargs = {**kwargs, "output_size": kwargs["output_size"] // rw.tp}
    return rw.call(old.target, args, kwargs, like=old, place=as_placement(d))


@rule(aten.einsum)
def einsum(rw, old, args, kwargs):
    """An einsum whose sharded operands are all cut along one letter: kept in the output -> ``Shard`` there
    (a chunked scan's heads); summed over -> ``Partial()``. Replicated operands with that letter are
    sliced to it; those without it get their gradient summed over ranks. Else gathered."""
    eq, parts, olds = old.args[0].replace(" ", ""), list(args[1]), list(old.args[1])
    ins, _, out = eq.partition("->")
    ins = ins.split(",")
    if "." in eq or not out and "->" not in eq or len(ins) != len(parts):
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    letters = {ins[i][rw.shard_dim(p)] for i, p in enumerate(parts) if rw.shard_dim(p) is not None}
    if len(letters) != 1 or any(rw.is_partial(p) for p in parts):
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    c = letters.pop()
    fixed = []
    for term, p, o in zip(ins, parts, olds):
        if c in term:
            fixed.append(rw.slice_to(p, o, term.index(c)))
        else:
            fixed.append(summed_grad(rw, p, o) if o in rw.grad_flows and c in out else p)
    place = as_placement(out.index(c)) if c in out else Partial()
    return rw.call(old.target, (old.args[0], fixed), kwargs, like=old, place=place)
