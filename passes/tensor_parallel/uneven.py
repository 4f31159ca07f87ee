"""Collectives over a dim the TP degree does not divide: every rank holds its ``torch.chunk`` share
(``ceil(n / tp)`` entries, the last rank fewer; :func:`fxpar.ir.placement.chunk_sizes`), as DTensor's
``Shard`` does.

Reads: the traced node's ``val`` (the full size) and the rewriter's placements. Writes: nodes into the
rewriter's graph, the even collectives of :mod:`fxpar.ir.ops` between a pad and a slice, so their fake
kernels, autograd formulas, byte counts and lowering stay those of an even cut.

With ``torch.chunk``'s shares only the last ranks are short, so once every share is padded at its end to
``ceil(n / tp)`` the padding sits after entry ``n`` of the gathered dim: the first ``n`` entries are the
tensor. Gathering is therefore pad, all-gather, slice (backward: the gradient's ``[0, n)`` padded back,
this rank's part of it, trimmed); cutting a replicated value is pad to ``tp * ceil(n / tp)``,
``scatter_slice``, trim (backward: an all-gather of the gradient, as for an even cut)::

    x: [T, 16001] on rank 0, [T, 16000] on rank 1       (a vocabulary of 32,001 at tp=2)
    p = constant_pad_nd(x, [0, 1], 0)                   # rank 1 only: [T, 16001]
    g = all_gather(p, "tp:0,1", 1)                      # [T, 32002]
    full = slice(g, 1, 0, 32001)                        # [T, 32001]
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten
fxpar_ops = torch.ops.fxpar


def _padded(rw, x: torch.fx.Node, old: torch.fx.Node, d: int, n: int, to: int) -> torch.fx.Node:
    """``x`` (``n`` entries along ``d``) zero-padded at the end of ``d`` to ``to`` entries."""
    if to == n:
        return x
    widths = [0, 0] * (rw.ndim(old) - 1 - d) + [0, to - n]
    return rw.call(aten.constant_pad_nd.default, (x, widths, 0), like=old, place=rw.place[x])


def gather(rw, new: torch.fx.Node, old: torch.fx.Node, d: int, n: int) -> torch.fx.Node:
    """The whole value of ``new`` (this rank's share along ``d`` of ``n`` entries) on every rank."""
    step = -(-n // rw.tp)
    full = rw.call(fxpar_ops.all_gather.default, (_padded(rw, new, old, d, rw.local_size(n), step), rw.group, d),
                   like=old)
    return rw.call(aten.slice.Tensor, (full, d, 0, n), like=old)


def scatter(rw, new: torch.fx.Node, old: torch.fx.Node, d: int, n: int, place) -> torch.fx.Node:
    """This rank's share along ``d`` (``n`` entries) of the replicated ``new``, without communication."""
    step = -(-n // rw.tp)
    part = rw.call(fxpar_ops.scatter_slice.default, (_padded(rw, new, old, d, n, step * rw.tp), rw.group, d),
                   like=old, place=place)
    mine = rw.local_size(n)
    return part if mine == step else rw.call(aten.slice.Tensor, (part, d, 0, mine), like=old, place=place)
