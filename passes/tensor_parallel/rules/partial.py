"""The rule for ops that read a partial sum (a row-parallel output before its all-reduce): ops linear in
it keep it partial, so the sum is taken later, on what is often a smaller tensor."""

from __future__ import annotations

import torch

from fxpar.ir import meta
from fxpar.ir.op_classes import ASSERTS, LINEAR_UNARY, packet
from fxpar.ir.placement import Partial

aten = torch.ops.aten


def keep_partial(rw, old, args, kwargs) -> torch.fx.Node | None:
    """Ops linear in their partial operand stay ``Partial()`` (an MoE block sums its experts' outputs
    before reducing). Only along single-use chains: a partial value used twice is reduced once, where
    it is made (so the residual stream is summed where Megatron sums it). None: reduce first."""
    pkt = packet(old)
    olds = old.all_input_nodes
    partial = [a for a in olds if rw.is_partial(rw.env[a])]
    if any(not rw.is_replicated(rw.env[a]) and not rw.is_partial(rw.env[a]) for a in olds):
        return None  # a sharded operand: reduce first
    if any(sum(packet(u) not in ASSERTS for u in a.users) != 1 for a in partial):
        return None
    first = old.args[0] if old.args and isinstance(old.args[0], torch.fx.Node) else None
    ok = False
    if pkt in LINEAR_UNARY or pkt in ASSERTS or pkt is aten.index:
        ok = partial == [first]
    elif pkt in (aten.mul, aten.neg):
        ok = len(partial) == 1
    elif pkt is aten.div:
        ok = partial == [first]
    elif pkt is aten.cat:  # the experts' partial outputs of a loop over experts, put back together
        ok = len(partial) == len(olds)
    elif pkt in (aten.add, aten.sub, aten.add_):  # partial + scalar would add the scalar tp times
        ok = len(partial) == len(olds) and kwargs.get("alpha", 1) == 1 and (len(args) < 3 or args[2] == 1) \
            and all(isinstance(a, torch.fx.Node) for a in old.args[:2])
    if not ok:
        return None
    fixed = {}
    for a in olds:  # a replicated factor of a partial value gets a partial gradient: sum it
        v = a.meta.get(meta.VAL)  # (integer values, e.g. the experts' token order, carry none)
        if a not in partial and a in rw.grad_flows and isinstance(v, torch.Tensor) and v.is_floating_point():
            n = rw.env[a]
            fixed[n] = rw.sum_grad(n, like=a)
    args, kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: fixed.get(n, n))
    return rw.call(old.target, args, kwargs, like=old, place=Partial())
