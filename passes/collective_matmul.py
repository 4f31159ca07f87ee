"""Collective matmul: sequence-parallel gathers and reduce-scatters chunked together with their matmuls.

Reads: a pipeline stage's GraphModule after the TP pass with ``sequence_parallel`` (``Plan(
collective_matmul=k)``, ``k >= 2``): ``fxpar.all_gather_rs_bwd`` nodes read by ``aten.linear`` nodes
(their input), and ``aten.linear`` nodes read only by an ``fxpar.reduce_scatter``; ``meta["val"]``.
Writes: the graph, in place. Per gather, one ``fxpar_kernels.all_gather_linear`` node for it and every
linear reading it (q/k/v, gate/up: they share its chunks), a ``getitem`` per output (the gathered
tensor, for its other readers and the backward, then each linear's result); per linear + reduce-scatter
pair, one ``fxpar_kernels.linear_reduce_scatter`` node. Schemas: :mod:`fxpar.ir.collective_matmul_ops`;
kernels and the design notes: :mod:`fxpar.runtime.kernels.collective_matmul`. The new nodes carry the
replaced nodes' ``fxpar.module`` (the collective's), placements and summed costs, and
``collective_matmul_ops.PAYLOAD``; :func:`fxpar.ir.ops.count_collectives` counts them as the collective
they replace, so inspection shows the same communication with or without chunking.

A stage pass, after ``zero3`` (whose weight views it reads as plain inputs) and before ``recompute``
(which outlines layers): the program and the pipeline cuts stay those of the unchunked graph. A
linear whose weight is produced after the gather's first reader (a late ZeRO-3 view) is left reading
the gathered output. The chunk count must divide every rank's sequence shard: a
:class:`~fxpar.ir.errors.PlanError` here, at compile time, says which shard and which counts fit.
Only ``aten.linear`` is matched (GPT-2's ``Conv1D``, an ``addmm`` on a flattened view, stays unchunked).
With ``Plan(compile=True)`` on CUDA, ``collective_matmul=0`` leaves the unchunked shapes to torch's own
async TP (micro-pipeline TP, :mod:`fxpar.runtime.compile`), which these opaque ops would hide from it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from fxpar.ir import collective_matmul_ops as cm_ops
from fxpar.ir import meta
from fxpar.ir.errors import CollectiveError, PlanError
from fxpar.ir.numeric import nbytes
from fxpar.ir.ops import group_size
from fxpar.ir.stage import StageSpec

__all__ = ["collective_matmul", "fuse_collective_matmuls"]

aten = torch.ops.aten
_GATHER = torch.ops.fxpar.all_gather_rs_bwd.default
_SCATTER = torch.ops.fxpar.reduce_scatter.default
_AGL = torch.ops.fxpar_kernels.all_gather_linear.default
_LRS = torch.ops.fxpar_kernels.linear_reduce_scatter.default


def collective_matmul(stage: StageSpec, ctx) -> StageSpec:
    fuse_collective_matmuls(stage.gm, ctx.plan.collective_matmul)
    return stage


def fuse_collective_matmuls(gm: torch.fx.GraphModule, chunks: int) -> dict[str, int]:
    """Rewrite ``gm`` as the module docstring says; how many nodes of each fused op it now has."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = {"all_gather_linear": 0, "linear_reduce_scatter": 0}
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _GATHER:
            done["all_gather_linear"] += _fuse_gather(gm.graph, node, chunks, order)
        elif node.target is _SCATTER:
            done["linear_reduce_scatter"] += _fuse_scatter(gm.graph, node, chunks)
    if any(done.values()):
        gm.graph.lint()
        gm.recompile()
    return done


def _linear_args(node: torch.fx.Node):
    """(input, weight, bias) of an ``aten.linear`` node."""
    names = ("input", "weight", "bias")
    vals = list(node.args) + [node.kwargs.get(k) for k in names[len(node.args):]]
    return vals[0], vals[1], vals[2]


def _check(node: torch.fx.Node, local: torch.Size, d: int, chunks: int) -> bool:
    """Whether the shard divides into ``chunks`` (False for a symbolic length: left unchunked)."""
    if not isinstance(local[d], int):
        return False
    if local[d] % chunks:
        fits = [c for c in range(2, local[d] + 1) if local[d] % c == 0]
        raise PlanError(
            f"Plan.collective_matmul={chunks}: each rank's sequence shard at {node.name} (module "
            f"{node.meta.get(meta.MODULE, '?')!r}) has {local[d]} tokens along dim {d}, which do not split into "
            f"{chunks} chunks; use one of {fits} (a divisor of the sequence length / tp) or 0 to turn it off")
    return True


def _token_dim(node: torch.fx.Node, val: torch.Tensor, dim: int) -> int | None:
    try:
        return cm_ops.check_token_dim(node.name, str(node.args[1]), val, dim)
    except CollectiveError:
        return None


def _carry(new: torch.fx.Node, old: torch.fx.Node, cost=None) -> None:
    for key in ("stack_trace", "nn_module_stack", meta.MODULE, meta.PLACEMENT):
        if key in old.meta:
            new.meta[key] = old.meta[key]
    if cost is not None:
        new.meta[meta.COST] = cost


def _cost(nodes) -> meta.NodeCost:
    total = meta.ZERO_COST
    for n in nodes:
        total = total + n.meta.get(meta.COST, meta.ZERO_COST)
    return total


def _fuse_gather(graph: torch.fx.Graph, gather: torch.fx.Node, chunks: int, order) -> int:
    x, group, dim = gather.args[:3]
    xval = x.meta.get(meta.VAL)
    d = _token_dim(gather, xval, dim) if isinstance(xval, torch.Tensor) else None
    if d is None or not gather.users:
        return 0
    first = min(gather.users, key=lambda u: order.get(u, len(order)))
    linears = []
    for u in sorted(gather.users, key=lambda u: order.get(u, len(order))):
        if u.op != "call_function" or u.target is not aten.linear.default:
            continue
        inp, w, b = _linear_args(u)
        ready = all(not isinstance(a, torch.fx.Node) or order.get(a, len(order)) < order[first] for a in (w, b))
        if inp is gather and w is not gather and b is not gather and ready:
            linears.append(u)
    if not linears or not _check(gather, xval.shape, d, chunks):
        return 0
    weights = [_linear_args(u)[1] for u in linears]
    biases = [_linear_args(u)[2] for u in linears]
    with graph.inserting_before(first):
        fused = graph.call_function(_AGL, (
            x, group, d, chunks, weights, [b for b in biases if b is not None], [b is not None for b in biases]))
        outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(linears) + 1)]
    _carry(fused, gather, _cost([gather, *linears]))
    fused.meta[meta.VAL] = [gather.meta[meta.VAL]] + [u.meta[meta.VAL] for u in linears]
    fused.meta[cm_ops.PAYLOAD] = nbytes(gather.meta[meta.VAL])
    for out, old in zip(outs, [gather, *linears]):
        _carry(out, old, meta.ZERO_COST)
        out.meta[meta.VAL] = old.meta[meta.VAL]
    for out, old in zip(outs[1:], linears):
        old.replace_all_uses_with(out)
        graph.erase_node(old)
    gather.replace_all_uses_with(outs[0])
    graph.erase_node(gather)
    return 1


def _fuse_scatter(graph: torch.fx.Graph, scatter: torch.fx.Node, chunks: int) -> int:
    lin, group, dim = scatter.args[:3]
    if len(scatter.args) > 3 or scatter.kwargs.get("comm_dtype") is not None:  # a quantized reduce-scatter
        return 0
    if not isinstance(lin, torch.fx.Node) or lin.target is not aten.linear.default or len(lin.users) != 1:
        return 0
    x, w, b = _linear_args(lin)
    yval = lin.meta.get(meta.VAL)
    d = _token_dim(scatter, yval, dim) if isinstance(yval, torch.Tensor) else None
    if d is None or d >= yval.dim() - 1:
        return 0
    local = list(yval.shape)
    local[d] = local[d] // group_size(group)
    if not _check(scatter, local, d, chunks):
        return 0
    with graph.inserting_before(scatter):
        fused = graph.call_function(_LRS, (x, group, d, chunks, w, b))
    _carry(fused, scatter, _cost([lin, scatter]))
    fused.meta[meta.VAL] = scatter.meta[meta.VAL]
    fused.meta[cm_ops.PAYLOAD] = nbytes(yval)
    scatter.replace_all_uses_with(fused)
    graph.erase_node(scatter)
    graph.erase_node(lin)
    return 1
