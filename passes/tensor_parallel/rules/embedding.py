"""The embedding rule: a vocabulary-parallel table looks up the ids it holds and yields a partial sum."""

from __future__ import annotations

import torch

from fxpar.ir import meta
from fxpar.ir.placement import Partial, Shard
from fxpar.passes.tensor_parallel.rules.registry import rule

aten = torch.ops.aten


@rule(aten.embedding)
def embedding(rw, old, args, kwargs):
    """Table ``Shard(1)`` (hidden features): ``Shard(-1)`` out. ``Shard(0)`` (vocabulary): a masked local
    lookup, zero for ids other ranks hold, ``Partial()`` out (a padding id is made local, or none where
    another rank holds it); a vocabulary tp does not divide: each rank its ``torch.chunk`` share of the
    rows (``ceil(V / tp)``, the last rank fewer). Replicated table: replicated out."""
    w, ids = args[0], args[1]
    if rw.shard_dim(w) == 1:  # embedding_colwise: each rank looks up its hidden features
        return rw.call(old.target, args, kwargs, like=old, place=Shard(rw.ndim(old) - 1))
    if rw.shard_dim(w) != 0:
        return rw.call(old.target, args, kwargs, like=old)
    vocab = old.args[0].meta[meta.VAL].shape[0]
    lo = rw.local_start(vocab)
    hi = lo + rw.local_size(vocab)
    outside = rw.call(aten.__or__.Tensor, (rw.call(aten.lt.Scalar, (ids, lo), like=old),
                                           rw.call(aten.ge.Scalar, (ids, hi), like=old)), like=old)
    local = rw.call(aten.masked_fill.Scalar, (rw.call(aten.sub.Tensor, (ids, lo), like=old), outside, 0), like=old)
    rest = list(args[2:])
    pad = rest[0] if rest else kwargs.get("padding_idx", -1)
    if isinstance(pad, int) and pad >= 0:  # the padding row (no gradient) is a global id: this rank's, or none
        pad = pad - lo if lo <= pad < hi else -1
        rest, kwargs = ([pad, *rest[1:]], kwargs) if rest else (rest, {**kwargs, "padding_idx": pad})
    out = rw.call(old.target, (w, local, *rest), kwargs, like=old)
    return rw.call(aten.masked_fill.Scalar, (out, rw.call(aten.unsqueeze.default, (outside, -1), like=old), 0.0),
                   like=old, place=Partial())
