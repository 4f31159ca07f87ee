"""Classes of ATen ops, defined once for the cost model and the passes (keyed by ``OpOverloadPacket``).

Each set is named for what its consumer relies on, so two consumers that need different lines draw
them apart here rather than in private copies:

* :data:`VIEW_OPS`, :data:`MOVE_OPS`: the cost model's free ops (views, metadata, no arithmetic) and
  data movement (bytes, no FLOPs);
* :data:`RESHAPES`, :data:`PASS_THROUGH`, :data:`SPLITS`, :data:`REDUCTIONS`, :data:`SOFTMAX`,
  :data:`LINEAR_UNARY`, :data:`ASSERTS`: what the tensor-parallel pass reasons about (a layout flows
  through them, or they are linear in their operand);
* :func:`is_pointwise`, :func:`is_grouped_mm`: predicates on a node.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

# views, metadata and no-copy ops: no FLOPs and no bytes moved (fxpar.cost.flops)
VIEW_OPS = frozenset({
    aten.view, aten.reshape, aten._unsafe_view, aten.expand, aten.slice, aten.select, aten.transpose,
    aten.t, aten.permute, aten.unsqueeze, aten.squeeze, aten.alias, aten.detach, aten.as_strided,
    aten.unflatten, aten.flatten, aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, aten.narrow,
    aten.contiguous, aten._assert_tensor_metadata, aten.lift_fresh_copy, aten.sym_size, aten.view_as,
    aten.expand_as, aten.movedim, aten.diagonal, aten.unfold,
})
# data movement and creation: no arithmetic, but bytes (fxpar.cost.flops)
MOVE_OPS = frozenset({
    aten.embedding, aten.index, aten.index_select, aten.gather, aten.cat, aten.stack, aten.clone, aten.copy,
    aten.copy_, aten._to_copy, aten.to, aten.pad, aten.constant_pad_nd, aten.new_ones, aten.new_zeros,
    aten.zeros, aten.ones, aten.full, aten.arange, aten.empty, aten.zeros_like, aten.ones_like,
    aten.full_like, aten.scalar_tensor, aten.repeat, aten.repeat_interleave, aten.roll, aten.flip,
    aten.masked_fill, aten.where, aten.index_put, aten.scatter,
})

# reshapes by a size list: a shard of a merged dim moves to its leading factor
RESHAPES = frozenset({aten.view, aten.reshape, aten._unsafe_view})
# one input, same shape and dims out (copies, casts, dropout): any layout passes through unchanged
PASS_THROUGH = frozenset({aten.contiguous, aten.alias, aten.clone, aten.detach, aten.dropout, aten.to,
                          aten._to_copy, aten.lift_fresh_copy})
# checks with no output a later op reads: they neither use nor change a layout
ASSERTS = frozenset({aten._assert_tensor_metadata})
# cut a tensor into pieces along one dim (slice is a split with one piece, handled alongside)
SPLITS = frozenset({aten.chunk, aten.split, aten.split_with_sizes})
REDUCTIONS = frozenset({aten.mean, aten.sum, aten.amax, aten.amin})
SOFTMAX = frozenset({aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax})
# unary ops linear in their input (f(a + b) = f(a) + f(b)): a partial sum stays one through them
LINEAR_UNARY = RESHAPES | (PASS_THROUGH - {aten.dropout}) | {
    aten.transpose, aten.permute, aten.unsqueeze, aten.squeeze, aten.expand, aten.sum, aten.mean, aten.t}

# names of grouped (per-expert) matmul ops, whichever library defines them
GROUPED_MM = ("_grouped_mm", "grouped_mm", "grouped_mm_fallback")


def packet(node: torch.fx.Node):
    """The node's ``OpOverloadPacket`` (``aten.view`` for ``aten.view.default``), or None."""
    return getattr(node.target, "overloadpacket", None)


def is_pointwise(node: torch.fx.Node) -> bool:
    """An elementwise op (torch's ``pointwise`` tag, or a user autograd.Function found elementwise when
    captured): each output element reads the same place of each input."""
    from fxpar.ir.function_op import call_of, is_function_node

    if is_function_node(node):
        return call_of(node.args[1]).elementwise
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


def is_grouped_mm(node: torch.fx.Node) -> bool:
    """A grouped (per-expert) matmul ``x[T, K] @ w[E, K, N]``."""
    return node.op == "call_function" and getattr(packet(node), "__name__", "") in GROUPED_MM
