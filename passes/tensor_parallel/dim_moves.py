"""Where a dim goes through an op that moves, adds, drops, merges or cuts dims: one table for the
tensor-parallel pass, read by its rules (``rules/views.py``, ``rules/ssm.py``), its inference of
column/row pairs (``inference.py``) and its search for fused projections (``packing.py``).

Reads: an op's arguments and the shapes of its first input and of its output (``val``). Writes nothing.

:data:`DIM_MAPS` maps an op (``OpOverloadPacket``) to ``fn(args, kwargs, src, dst, d)``: the dim of the
output (shape ``dst``) that carries dim ``d`` of the first input (shape ``src``), or None where ``d``
does not come out as one dim (dropped, merged behind another dim, selected or sliced along). A reshape
that splits ``d`` into several dims gives the leading one (a shard of ``d`` is a shard of it); whether
tp divides the sizes there is the reader's question, as sizes are local in the rules and global in the
analyses. What the table does not hold (splits into several outputs, cat, indexing, reductions) each
reader decides itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.op_classes import RESHAPES, packet

aten = torch.ops.aten

DimMap = Callable[[tuple, dict, tuple, tuple, int], "int | None"]


def transpose_map(a: int, b: int, nd: int):
    """Where ``transpose(a, b)`` moves each dim of an ``nd``-dim tensor."""
    a, b = a % nd, b % nd
    return lambda d: b if d == a else a if d == b else d


def reshape_dim(src: tuple, dst: tuple, d: int) -> int | None:
    """The dim of ``dst`` that starts where ``src`` dim d starts (so it carries the leading part of a
    shard of d), or None when no dim of ``dst`` starts there."""
    before = math.prod(src[:d])
    acc = 1
    for i, s in enumerate(dst):
        if acc == before and s != 1:
            return i if (src[d] % s == 0 or s % src[d] == 0) else None
        acc *= s
        if acc > before:
            return None
    return None


def _arg(args: tuple, kwargs: dict, i: int, name: str, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _squeeze(args, kwargs, src, dst, d):
    """Only size-1 dims go (a named dim of another size stays, as in torch); the shard moves left past them."""
    given = _arg(args, kwargs, 1, "dim", range(len(src)))
    given = [given] if isinstance(given, int) else list(given)
    gone = {g % len(src) for g in given if src[g % len(src)] == 1}
    return None if d in gone else d - sum(g < d for g in gone)


def _flatten(args, kwargs, src, dst, d):
    """flatten(start, end) keeps a dim outside the range, or its first dim (the leading factor)."""
    start = _arg(args, kwargs, 1, "start_dim", 0) % len(src)
    end = _arg(args, kwargs, 2, "end_dim", -1) % len(src)
    return None if start < d <= end else d - (end - start) if d > end else d


def _select(args, kwargs, src, dst, d):
    """One index along ``dim``: that dim goes, the dims after it move left."""
    dim = _arg(args, kwargs, 1, "dim", 0) % len(src)
    return None if dim == d else d - 1 if dim < d else d


def _slice(args, kwargs, src, dst, d):
    """A range along ``dim``: the dims stay; ``dim`` itself is cut (the readers say when a cut may pass)."""
    return None if _arg(args, kwargs, 1, "dim", 0) % len(src) == d else d


DIM_MAPS: dict[object, DimMap] = {
    **{op: lambda a, k, src, dst, d: reshape_dim(src, dst, d) for op in RESHAPES},
    aten.transpose: lambda a, k, src, dst, d: transpose_map(a[1], a[2], len(src))(d),
    aten.t: lambda a, k, src, dst, d: len(src) - 1 - d,
    aten.numpy_T: lambda a, k, src, dst, d: len(src) - 1 - d,
    aten.permute: lambda a, k, src, dst, d: [p % len(src) for p in a[1]].index(d),
    aten.unsqueeze: lambda a, k, src, dst, d: d + 1 if d >= a[1] % len(dst) else d,
    aten.squeeze: _squeeze,
    aten.expand: lambda a, k, src, dst, d: d + len(dst) - len(src),  # new dims come first
    aten.broadcast_to: lambda a, k, src, dst, d: d + len(dst) - len(src),
    aten.flatten: _flatten,
    aten.select: _select,
    aten.slice: _slice,
}


def dim_after(op, args: tuple, kwargs: dict, src: tuple, dst: tuple, d: int) -> int | None:
    """The output dim of ``op`` (a packet) that carries input dim ``d``; None where it does not pass or
    the table does not hold ``op``."""
    fn = DIM_MAPS.get(op)
    return None if fn is None else fn(tuple(args), dict(kwargs), tuple(src), tuple(dst), d)


def _shape(node) -> tuple:
    v = node.meta.get(meta.VAL) if isinstance(node, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def moved(node: torch.fx.Node, d: int) -> int | None:
    """The dim of traced ``node``'s output that carries dim ``d`` of its first input (shapes from ``val``)."""
    return dim_after(packet(node), node.args, node.kwargs, _shape(node.args[0]), _shape(node), d)


def relabel(node: torch.fx.Node, labels: tuple) -> tuple:
    """``labels`` (one per dim of ``node``'s first input: the parameter dim each is) at the output dims the
    table puts them on; None at the output's new dims."""
    out = [None] * len(_shape(node))
    for i, label in enumerate(labels):
        od = moved(node, i)
        if od is not None:
            out[od] = label
    return tuple(out)
