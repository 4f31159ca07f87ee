"""Rules for fused projections cut part by part (:mod:`..packing`): the cuts that take q, k, v (or gate,
up) out of a fused value, and the gradient bookkeeping of the pieces every rank holds whole.

A cut (split, chunk, slice, select, or indexing by constant heads) of a value sharded along its fused
dim becomes the same cut at local offsets: a cut piece is ``Shard(d)``, a whole piece (multi-query
attention's one K/V head) ``Replicate()``. Per-output placements of a split are kept in
``rw.item_place`` for the getitems that take them.

Gradients. A replicated value carries the full gradient on every rank. A whole piece is computed from
the column input, whose gradient the column-parallel layer all-reduces (Megatron's f): its full
gradient would be summed ``tp`` times. So the cut scales a whole piece's gradient by 1/tp (forward
unchanged), and the weight's whole rows (and bias) get theirs scaled back by tp where the parameter is
read (:func:`scale_whole_rows`): those rows' gradients are equal on every rank, no communication.
"""

from __future__ import annotations

import operator

import torch

from fxpar.ir import meta
from fxpar.ir.op_classes import SPLITS, packet
from fxpar.ir.placement import Replicate, Shard, chunk_sizes

aten = torch.ops.aten


def is_fused_cut(rw, old, args) -> bool:
    """Whether ``old`` cuts a fused value this rank holds sharded along the fused dim."""
    fused = rw.packing.cuts.get(old)
    return fused is not None and rw.shard_dim(args[0]) == fused.dim


def cut(rw, old, args, kwargs):
    """The cut at this rank's offsets: each piece ``Shard(d)``, or ``Replicate()`` where it is whole."""
    fused, x, spans = rw.packing.cuts[old], args[0], rw.packing.spans[old]
    d, pkt, tp = fused.dim, packet(old), rw.tp
    local = [(fused.local_pos(lo, tp, rw.rank), fused.local_pos(hi, tp, rw.rank)) for lo, hi in spans]
    if pkt in SPLITS:
        new = rw.call(aten.split_with_sizes.default, (x, [b - a for a, b in local], d), like=old, place=Shard(d))
        rw.item_place[new] = [Replicate() if fused.is_whole(*s) else Shard(d) for s in spans]
        return new
    (a, b), = local
    if pkt is aten.select:  # one head: always whole
        return whole_piece(rw, rw.call(aten.select.int, (x, d, a), like=old), old)
    if fused.is_whole(*spans[0]):  # a slice, or an index by a run of heads
        return whole_piece(rw, rw.call(aten.slice.Tensor, (x, d, a, b), like=old), old)
    return rw.call(aten.slice.Tensor, (x, d, a, b), like=old, place=Shard(d))


def whole_piece(rw, new, old):
    """A whole piece of a fused value: replicated, its gradient scaled by 1/tp (see the module doc)."""
    return _scale_grad(rw, new, 1.0 / rw.tp, old, Replicate())


def _scale_grad(rw, x, factor: float, like, place):
    """``x`` forward, ``factor`` times its gradient backward: ``detach(x) + (x - detach(x)) * factor``."""
    frozen = rw.call(aten.detach.default, (x,), like=like, place=place)
    delta = rw.call(aten.sub.Tensor, (x, frozen), like=like, place=place)
    scaled = rw.call(aten.mul.Tensor, (delta, factor), like=like, place=place)
    return rw.call(aten.add.Tensor, (frozen, scaled), like=like, place=place)


def scale_whole_rows(rw) -> None:
    """Every parameter with whole pieces, read through a node that scales those rows' gradient by tp
    (``rw.env`` of its placeholder replaced). Called once, after the placeholders."""
    for old, new in list(rw.env.items()):
        fqn = old.meta.get(meta.PARAM) if old.op == "placeholder" else None
        whole = rw.packing.whole.get(fqn) if fqn else None
        d, nd = rw.shard_dim(new), rw.ndim(old)
        if not whole or d != (0 if nd == 1 else nd - 1 if fqn in rw.transposed else nd - 2):
            continue  # not cut along its output features: no fused pieces
        pieces = rw.packing.params[fqn]
        local = [p if i in whole else chunk_sizes(p, rw.tp)[rw.rank] for i, p in enumerate(pieces)]
        parts = rw.call(aten.split_with_sizes.default, (new, local, d), like=old, place=Shard(d))
        items = [rw.call(operator.getitem, (parts, i), like=old, place=Shard(d))
                 for i in range(len(local))]
        items = [_scale_grad(rw, it, float(rw.tp), old, Shard(d)) if i in whole else it for i, it in enumerate(items)]
        rw.env[old] = rw.call(aten.cat.default, (items, d), like=old, place=Shard(d))
