"""Rules for matrix products: linear, GPT-2's Conv1D addmm, matmul and grouped (per-expert) mm.

Column-parallel (weight cut by output features): the input is replicated with its gradient
all-reduced (Megatron's f), the output is ``Shard(-1)``. Row-parallel (cut by input features): the
input is sliced to ``Shard(-1)``, the output is ``Partial()``, reduced where a consumer needs the sum.
"""

from __future__ import annotations

import torch

from fxpar.ir.op_classes import GROUPED_MM
from fxpar.ir.placement import Partial, Shard
from fxpar.passes.tensor_parallel.experts import expert_input, expert_matmul
from fxpar.passes.tensor_parallel.layouts import linear_weight
from fxpar.passes.tensor_parallel.rules.pointwise import pointwise_or_gather
from fxpar.passes.tensor_parallel.rules.registry import rule
from fxpar.passes.tensor_parallel.rules.ssm import summed_grad

aten = torch.ops.aten


@rule(aten.linear)
def linear(rw, old, args, kwargs):
    """Weight ``Shard(0)``: column-parallel, ``Shard(-1)`` out; ``Shard(1)``: row-parallel, ``Partial()`` out
    (bias added after the sum); replicated weight: replicated input and output."""
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    xo = old.args[0]
    wd = rw.shard_dim(w)
    last = rw.ndim(old) - 1
    if wd == 0:  # column-parallel (one expert's weight of a loop over experts: f on the tokens once)
        x = expert_input(rw, old, x) if expert_matmul(old) is not None else rw.column_input(x, xo)
        # colwise_gather_output too: gathered only where a consumer needs the full tensor
        return rw.call(old.target, (x, w, b) if b is not None else (x, w), like=old, place=Shard(last))
    if wd == 1:  # row-parallel: a partial sum, reduced where a consumer needs the sum
        x = rw.slice_to(x, xo, rw.ndim(xo) - 1)
        out = rw.call(old.target, (x, w), like=old, place=Partial())
        if b is not None:
            out = rw.materialize(out)
            out = rw.call(aten.add.Tensor, (out, rw.grad_reduced(b, out)), like=old, place=rw.place[out])
        return out
    x = rw.replicate(x, xo)
    return rw.call(old.target, (x, w, b) if b is not None else (x, w), like=old)


@rule(aten.addmm)
def addmm(rw, old, args, kwargs):
    """``addmm(bias, x, w)`` with ``w`` laid out [in, out] (GPT-2's Conv1D): column-parallel shards
    w by columns (``Shard(1)`` out), row-parallel by rows (summed, then the bias added)."""
    b, x, w = args[0], args[1], args[2]
    if rw.is_replicated(w):
        return pointwise_or_gather(rw, old, args, kwargs)
    xo = old.args[1]
    if rw.shard_dim(w) == 1:  # column-parallel
        x = rw.replicate(x, xo)
        return rw.call(old.target, (b, rw.sum_grad(x, like=xo), w), kwargs, like=old, place=Shard(1))
    x = rw.slice_to(x, xo, 1)  # row-parallel
    out = rw.materialize(rw.call(aten.mm.default, (x, w), like=old, place=Partial()))
    return rw.call(aten.add.Tensor, (out, rw.grad_reduced(b, out)), like=old, place=rw.place[out])


@rule(aten.matmul)
def matmul(rw, old, args, kwargs):
    """Batched matmul with both operands sharded on the same batch dim keeps it (attention heads), a
    replicated operand sliced to match. ``x @ W.T`` with a 2-D parameter W (a linear written as
    matmul) is column- (``Shard(-1)``) or row-parallel (``Partial()``). Else gathered."""
    a, b = args[0], args[1]
    na, nb, no = rw.ndim(old.args[0]), rw.ndim(old.args[1]), rw.ndim(old)
    da, db = rw.shard_dim(a), rw.shard_dim(b)
    if da is None and db is None:
        return pointwise_or_gather(rw, old, args, kwargs)
    if da is not None and db is not None and da - na == db - nb and da < na - 2 and db < nb - 2:
        return rw.call(old.target, args, kwargs, like=old, place=Shard(da - na + no))
    if da is not None and db is None and na == nb and da < na - 2:  # e.g. scores of this rank's heads
        return rw.call(old.target, (a, rw.slice_to(b, old.args[1], da)), kwargs, like=old, place=Shard(da - na + no))
    if db is not None and da is None and na == nb and db < nb - 2:
        return rw.call(old.target, (rw.slice_to(a, old.args[0], db), b), kwargs, like=old, place=Shard(db - nb + no))
    if nb == 2 and linear_weight(old)[0] is not None:
        if db == 1 and da is None:  # column-parallel
            return rw.call(old.target, (rw.column_input(a, old.args[0]), b), kwargs, like=old, place=Shard(no - 1))
        if db == 0 and da is not None:  # row-parallel
            a = rw.slice_to(a, old.args[0], na - 1)
            return rw.call(old.target, (a, b), kwargs, like=old, place=Partial())
    if min(na, nb) >= 2:
        return _matrix_dims(rw, old, args, kwargs)
    return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)


def _matrix_dims(rw, old, args, kwargs):
    """``a[.., M, K] @ b[.., K, N]`` sharded along a matrix dim (a state-space scan's channels, ``W @ x``
    with W a 2-D parameter: Mamba's dt_proj): rows of a -> ``Shard(M)``, columns of b -> ``Shard(N)``
    (the other operand's gradient a partial sum, all-reduced); K on either side -> ``Partial()``, the
    other operand sliced to it. Else gathered."""
    (a, b), (ao, bo) = args[:2], old.args[:2]
    na, nb, no = rw.ndim(ao), rw.ndim(bo), rw.ndim(old)
    da, db = rw.shard_dim(a), rw.shard_dim(b)
    if da == na - 2 and db is None:
        return rw.call(old.target, (a, summed_grad(rw, b, bo) if bo in rw.grad_flows else b), kwargs, like=old,
                       place=Shard(no - 2))
    if db == nb - 1 and da is None:
        return rw.call(old.target, (summed_grad(rw, a, ao) if ao in rw.grad_flows else a, b), kwargs, like=old,
                       place=Shard(no - 1))
    if da in (na - 1, None) and db in (nb - 2, None):
        a, b = rw.slice_to(a, ao, na - 1), rw.slice_to(b, bo, nb - 2)
        return rw.call(old.target, (a, b), kwargs, like=old, place=Partial())
    return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)


@rule(aten.bmm)
def bmm(rw, old, args, kwargs):
    """Batched matmul, as matmul: experts' weights gathered per token by router output (``w[ids] @ x``,
    ``x @ w[ids]``) cut along their output features are column-parallel, along their input features
    row-parallel (``Partial()``); a shard of the batch dim stays."""
    use = expert_matmul(old)
    if use is not None:
        wi = 0 if use.act is old.args[1] else 1  # which operand holds the weights
        w, x = args[wi], args[1 - wi]
        if rw.shard_dim(w) == use.feature and rw.is_replicated(x):  # column-parallel: f on the tokens
            x = expert_input(rw, old, x)
            return rw.call(old.target, (w, x) if wi == 0 else (x, w), kwargs, like=old, place=Shard(use.feature))
    return matmul(rw, old, args, kwargs)


@rule(*GROUPED_MM)
def grouped_mm(rw, old, args, kwargs):
    """Grouped (per-expert) matmul ``x[T, K] @ w[E, K, N]``: experts' weights cut along N are
    column-parallel (``Shard(-1)`` out), along K row-parallel (``Partial()`` out; transformers'
    moe_tp_experts). Else gathered."""
    x, w = args[0], args[1]
    dw, nw = rw.shard_dim(w), rw.ndim(old.args[1])
    if dw == nw - 1 and rw.is_replicated(x):
        x = expert_input(rw, old, x)
        return rw.call(old.target, (x, *args[1:]), kwargs, like=old, place=Shard(rw.ndim(old) - 1))
    if dw == nw - 2 and rw.shard_dim(x) == rw.ndim(old.args[0]) - 1:
        return rw.call(old.target, args, kwargs, like=old, place=Partial())
    return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)
