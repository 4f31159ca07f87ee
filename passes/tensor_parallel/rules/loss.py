"""The loss rule: cross-entropy over vocabulary-sharded logits without gathering them."""

from __future__ import annotations

import torch

from fxpar.ir import fused_ops, meta
from fxpar.ir.placement import Replicate, Shard
from fxpar.passes.tensor_parallel.rules.pointwise import pointwise_or_gather
from fxpar.passes.tensor_parallel.rules.registry import rule

aten = torch.ops.aten
fxpar_ops = torch.ops.fxpar
_NAMES = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")


@rule(aten.cross_entropy_loss)
def vocab_parallel_cross_entropy(rw, old, args, kwargs):
    """Logits ``Shard(-1)``: the max, the sum of exponentials and the target's logit are all-reduced
    (Megatron's parallel loss), a replicated loss out; every all-reduce's backward is the identity. A
    vocabulary tp does not divide: each rank's ``torch.chunk`` share of it (its offset and size). Other
    layouts, class weights or label smoothing: the fallback."""
    if rw.shard_dim(args[0]) != rw.ndim(old.args[0]) - 1:
        return pointwise_or_gather(rw, old, args, kwargs)
    given = dict(zip(_NAMES, args)) | dict(kwargs)
    reduction, ignore = given.get("reduction", 1), given.get("ignore_index", -100)
    if given.get("weight") is not None or given.get("label_smoothing", 0.0) or old.args[0].meta[meta.VAL].dim() != 2:
        return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
    x, target = given["input"], given["target"]
    vocab = old.args[0].meta[meta.VAL].shape[-1]
    start, per = rw.local_start(vocab), rw.local_size(vocab)
    s1 = Shard(1)

    def c(target_, *a, place=Replicate()):
        return rw.call(target_, a, like=old, place=place)

    x = c(aten.to.dtype, x, torch.float32, place=s1)
    top = c(fxpar_ops.all_reduce.default, c(aten.amax.default, c(aten.detach.default, x, place=s1), [-1]),
            rw.group, "max")
    shifted = c(aten.sub.Tensor, x, c(aten.unsqueeze.default, top, -1), place=s1)
    sumexp = c(fxpar_ops.all_reduce.default, c(aten.sum.dim_IntList, c(aten.exp.default, shifted, place=s1), [-1]),
               rw.group)
    local = c(aten.sub.Tensor, target, start)
    inside = c(aten.__and__.Tensor, c(aten.ge.Scalar, local, 0), c(aten.lt.Scalar, local, per))
    index = c(aten.unsqueeze.default, c(aten.masked_fill.Scalar, local, c(aten.logical_not.default, inside), 0), -1)
    picked = c(aten.squeeze.dim, c(aten.gather.default, shifted, 1, index), -1)
    picked = c(fxpar_ops.all_reduce.default, c(aten.mul.Tensor, picked, inside), rw.group)
    valid = c(aten.ne.Scalar, target, ignore)
    per_token = c(aten.mul.Tensor, c(aten.sub.Tensor, c(aten.log.default, sumexp), picked), valid)
    if reduction == 0:
        return per_token
    total = c(aten.sum.default, per_token)
    if reduction == 2:
        return total
    return c(aten.div.Tensor, total, c(aten.sum.default, valid))


@rule(fused_ops.FUSED_OPS["linear_cross_entropy"].overloadpacket)
def vocab_parallel_fused_loss(rw, old, args, kwargs):
    """The fused loss (``passes/fused_loss.py``) with the head cut by vocabulary rows (``Shard(0)``, as
    the unfused head is column-parallel): each rank computes its rows' logits chunk by chunk, the max
    and sum-exp reductions run inside the op, and its hidden-state gradient is this rank's partial sum,
    reduced by Megatron's f before it (or the sequence-parallel gather's reduce-scatter), which
    :meth:`column_input` emits where it is visible to the counters. A replicated head: the op as it is
    on replicated inputs."""
    h, w, labels, _, _, ignore, chunk, _ = args
    labels = rw.replicate(labels, old.args[2])
    if rw.shard_dim(w) != 0:
        return rw.call(old.target, (rw.replicate(h, old.args[0]), rw.replicate(w, old.args[1]), labels,
                                    *args[3:]), like=old)
    start = rw.local_start(old.args[1].meta[meta.VAL].shape[0])  # this rank's first vocabulary row
    h = rw.column_input(h, old.args[0])
    return rw.call(old.target, (h, w, labels, start, rw.group, ignore, chunk, False), like=old)
