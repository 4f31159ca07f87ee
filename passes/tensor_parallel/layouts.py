"""Layout analysis for the tensor-parallel pass: which weights are fused or transposed, and where a
shard goes through a reshape.

Reads: ``fxpar.param``, ``val`` of the traced graph. Writes nothing: pure functions of the graph.

* :func:`linear_weight`: the weight (and bias) parameter of a linear-like node (``linear``, GPT-2's
  Conv1D ``addmm``, grouped mm, ``x @ W.T``);
* :func:`conv1d_weights`: the weights an ``addmm`` reads as ``[in, out]``;
* :func:`packed_segments`: fused projections (``[q; k; v]``, ``[gate; up]``), cut part by part;
* :func:`reshape_dim`, :func:`transpose_map`, :func:`split_dim`, :func:`slice_bounds`: dim arithmetic.
"""

from __future__ import annotations

import math

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.op_classes import ASSERTS, PASS_THROUGH, RESHAPES, SPLITS, is_grouped_mm, packet
from fxpar.ir.program import Program

aten = torch.ops.aten

# argument names of the split-like ops, to read them whether given by position or by keyword
SPLIT_ARGS = {aten.chunk: ("self", "chunks", "dim"), aten.split: ("self", "split_size", "dim"),
              aten.split_with_sizes: ("self", "split_sizes", "dim"), aten.slice: ("self", "dim", "start", "end", "step")}


def node_ndim(node) -> int:
    """Dims of a node's value; -1 for a non-tensor (or a non-node)."""
    v = node.meta.get(meta.VAL) if isinstance(node, torch.fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else -1


def split_args(node: torch.fx.Node) -> dict:
    """A split-like node's arguments by name."""
    return dict(zip(SPLIT_ARGS[node.target.overloadpacket], node.args)) | dict(node.kwargs)


def split_dim(node: torch.fx.Node) -> int:
    return split_args(node).get("dim", 0)


def slice_bounds(given: dict, size: int) -> tuple[int, int]:
    """``[start, end)`` of a slice's arguments over a dim of ``size``, clamped as ``aten.slice`` does."""
    start = given.get("start") or 0
    end = given.get("end")
    end = size if end is None or end > size else end
    start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
    return max(0, min(start, size)), max(0, min(end, size))


def linear_weight(node: torch.fx.Node) -> tuple[torch.fx.Node | None, torch.fx.Node | None]:
    """(weight parameter, bias parameter or None) of a linear-like node (linear, addmm, grouped mm,
    weight possibly reached through a transpose), else (None, None)."""
    pkt = packet(node)
    w = b = None
    if pkt is aten.linear:
        w, b = node.args[1], node.args[2] if len(node.args) > 2 else None
    elif pkt is aten.addmm:
        w, b = node.args[2], node.args[0]
    elif is_grouped_mm(node) or (pkt is aten.matmul and node_ndim(node.args[1]) == 2):
        w = node.args[1]
        while isinstance(w, torch.fx.Node) and packet(w) in (aten.transpose, aten.t, aten.numpy_T):
            w = w.args[0]
        if pkt is aten.matmul and w is node.args[1]:  # x @ W with W not transposed: not a linear layer
            w = None
    w = w if isinstance(w, torch.fx.Node) and w.meta.get(meta.PARAM) else None
    b = b if isinstance(b, torch.fx.Node) and b.meta.get(meta.PARAM) else None
    return w, b


def conv1d_weights(program: Program) -> set[str]:
    """FQNs of the weights an ``addmm`` reads as ``[in, out]`` (GPT-2's Conv1D), found from the graph."""
    return {n.args[2].meta.get(meta.PARAM) for n in program.graph.nodes
            if packet(n) is aten.addmm and isinstance(n.args[2], torch.fx.Node)} - {None}


def packed_segments(program: Program, tp: int) -> tuple[dict, dict]:
    """Fused projections: a linear-like node whose output features are only ever cut into pieces
    (chunk/split/slice along the last dim, after views that keep it) is laid out as the concatenation
    of those pieces ([q; k; v], [gate; up]); sharding it cuts every piece, so each rank's pieces are
    the local q, k, v. Returns (split node -> piece sizes, parameter FQN -> piece sizes)."""
    splits: dict[torch.fx.Node, list[int]] = {}
    params: dict[str, list[int]] = {}
    for node in program.graph.nodes:
        w, b = linear_weight(node)
        v = node.meta.get(meta.VAL)
        if w is None or not isinstance(v, torch.Tensor) or v.dim() == 0:
            continue
        found = _piece_cuts(node, v.shape[-1])
        if found is None:
            continue
        cuts, pieces = found
        if any(p % tp for p in pieces):
            continue
        for user in cuts:
            splits[user] = pieces
        for p in (w, b):
            if p is not None:
                params[p.meta[meta.PARAM]] = pieces
    return splits, params


def _piece_cuts(node: torch.fx.Node, n_out: int) -> tuple[list[torch.fx.Node], list[int]] | None:
    """The split nodes that cut ``node``'s last dim (of ``n_out``) into pieces, and the piece sizes;
    None when the output is used otherwise or not cut into at least two pieces."""
    bounds, found, other, todo = {0, n_out}, [], False, list(node.users)
    while todo and not other:
        user = todo.pop()
        pkt = packet(user)
        uv = user.meta.get(meta.VAL)
        if pkt in ASSERTS:
            continue
        if pkt in PASS_THROUGH - {aten.dropout} or (pkt in RESHAPES and isinstance(uv, torch.Tensor)
                                                    and uv.shape[-1] == n_out):
            todo.extend(user.users)
        elif pkt in SPLITS or pkt is aten.slice:
            nd = user.args[0].meta[meta.VAL].dim()
            given = split_args(user)
            if given.get("dim", 0) % nd != nd - 1 or given.get("step", 1) != 1:
                other = True
            elif pkt is aten.chunk:
                other = n_out % given["chunks"] != 0
                bounds |= set(range(0, n_out, n_out // given["chunks"]))
            elif pkt is aten.split:
                bounds |= set(range(0, n_out, given["split_size"]))
            elif pkt is aten.split_with_sizes:
                bounds |= {sum(given["split_sizes"][:i]) for i in range(len(given["split_sizes"]))}
            else:
                bounds |= set(slice_bounds(given, n_out))
            found.append(user)
        else:
            other = True
    edges = sorted(bounds)
    pieces = [hi - lo for lo, hi in zip(edges, edges[1:])]
    if other or not found or len(pieces) < 2:
        return None
    return found, pieces


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
