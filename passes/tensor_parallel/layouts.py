"""Layout analysis for the tensor-parallel pass: which weights are fused or transposed, and where a
split cuts.

Reads: ``fxpar.param``, ``val`` of the traced graph. Writes nothing: pure functions of the graph.

* :func:`linear_weight`: the weight (and bias) parameter of a linear-like node (``linear``, GPT-2's
  Conv1D ``addmm``, grouped mm, ``x @ W.T``);
* :func:`conv1d_weights`: the weights an ``addmm`` reads as ``[in, out]``;
* :func:`packed_segments`: fused projections (``[q; k; v]``, ``[gate; up]``, multi-query ``[q | k | v]``
  with k and v whole), cut part by part (found by :mod:`.packing`);
* :func:`split_dim`, :func:`slice_bounds`: where a split cuts (where a dim goes through a view:
  :mod:`.dim_moves`).
"""

from __future__ import annotations

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.op_classes import is_grouped_mm, packet
from fxpar.ir.program import Program
from fxpar.passes.tensor_parallel.packing import (  # noqa: F401  (the cut-argument helpers, re-exported)
    SPLIT_ARGS,
    find_packing,
    slice_bounds,
    split_args,
)

aten = torch.ops.aten

def node_ndim(node) -> int:
    """Dims of a node's value; -1 for a non-tensor (or a non-node)."""
    v = node.meta.get(meta.VAL) if isinstance(node, torch.fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else -1


def split_dim(node: torch.fx.Node) -> int:
    return split_args(node).get("dim", 0)


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
    (chunk/split/slice/select/index, after views, transposes and one-input elementwise ops) is laid
    out as the concatenation of those pieces ([q; k; v], [gate; up], Falcon's [H q heads | k | v]);
    sharding it cuts every piece but the whole ones (:mod:`.packing`). Returns (cut node -> piece
    sizes along the cut dim, parameter FQN -> piece sizes along its output features)."""
    packing = find_packing(program, tp, linear_weight)
    return {n: list(f.pieces) for n, f in packing.cuts.items()}, packing.params
