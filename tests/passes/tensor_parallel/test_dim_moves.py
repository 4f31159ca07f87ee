"""The dim-movement table of the tensor-parallel pass (``dim_moves.py``), read by its rules, its pair
inference and its fused-projection search: where a shard's dim lands through views, permutes,
transposes and reshapes, checked against what torch does to a tensor that varies along that dim only,
and the cases where the shard cannot pass."""

from __future__ import annotations

import pytest
import torch

from fxpar.ir import meta
from fxpar.ir.op_classes import DIM_MOVES_AND_CUTS, RESHAPES
from fxpar.passes.tensor_parallel.dim_moves import DIM_MAPS, moved, relabel

aten = torch.ops.aten

# (op, arguments after the input, input shape, input dim d, the output dim carrying d)
PASSES = [
    (aten.transpose.int, (0, 2), (2, 3, 4), 0, 2),
    (aten.transpose.int, (-1, 1), (2, 3, 4), 0, 0),
    (aten.permute.default, ([2, 0, 1],), (2, 3, 4), 0, 1),
    (aten.permute.default, ([-1, 0, 1],), (2, 3, 4), 2, 0),
    (aten.t.default, (), (3, 4), 0, 1),
    (aten.unsqueeze.default, (1,), (2, 3, 4), 1, 2),
    (aten.unsqueeze.default, (-1,), (2, 3, 4), 2, 2),  # -1 of the output: after every input dim
    (aten.squeeze.dims, ([1],), (2, 1, 4), 2, 1),
    (aten.squeeze.dims, ([0],), (2, 3, 4), 1, 1),  # dim 0 is not of size 1: torch keeps it
    (aten.expand.default, ([5, 2, 3, 4],), (2, 3, 4), 1, 2),
    (aten.flatten.using_ints, (0, 1), (2, 3, 4), 0, 0),  # the leading factor of the merged dim
    (aten.flatten.using_ints, (0, 1), (2, 3, 4), 2, 1),
    (aten.select.int, (0, 1), (2, 3, 4), 2, 1),
    (aten.slice.Tensor, (2, 0, 2), (2, 3, 4), 1, 1),
    (aten.view.default, ([2, 3, 2, 2],), (2, 3, 4), 2, 2),  # [.., H * D] into [.., H, D]: the heads
    (aten.reshape.default, ([6, 4],), (2, 3, 4), 0, 0),
    (aten.view.default, ([2, 12],), (2, 3, 4), 1, 1),
]
# (op, arguments after the input, input shape, input dim d): d does not come out as one dim
STOPS = [
    (aten.view.default, ([6, 4],), (2, 3, 4), 1),  # merged behind dim 0: no output dim starts at it
    (aten.view.default, ([2, 2, 6],), (2, 3, 4), 2),  # 3 * 4 regrouped as 2 * 6: no dim starts at it
    (aten.flatten.using_ints, (1, 2), (2, 3, 4), 2),
    (aten.select.int, (1, 0), (2, 3, 4), 1),
    (aten.squeeze.dims, ([1],), (2, 1, 4), 1),
    (aten.slice.Tensor, (1, 0, 2), (2, 3, 4), 1),
]


def _node(op, args, shape):
    """A traced-like node of ``op`` on an input of ``shape``, both with ``val``; and that output."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta[meta.VAL] = torch.empty(shape)
    node = graph.call_function(op, (x, *args))
    node.meta[meta.VAL] = op(torch.empty(shape), *args)
    return node


def _along(shape, d):
    """A tensor of ``shape`` whose values vary along dim ``d`` only."""
    view = [1] * len(shape)
    view[d] = shape[d]
    return torch.arange(float(shape[d])).reshape(view).expand(shape).contiguous()


@pytest.mark.parametrize(("op", "args", "shape", "d", "out"), PASSES)
def test_a_dim_lands_where_torch_puts_it(op, args, shape, d, out):
    assert moved(_node(op, args, shape), d) == out
    y = op(_along(shape, d), *args)
    varies = [i for i in range(y.dim()) if not torch.equal(y, y.narrow(i, 0, 1).expand_as(y))]
    assert varies and varies[0] == out, f"torch moves dim {d} to {varies}"


@pytest.mark.parametrize(("op", "args", "shape", "d"), STOPS)
def test_a_dim_merged_or_cut_does_not_pass(op, args, shape, d):
    assert moved(_node(op, args, shape), d) is None


def test_the_table_holds_every_op_the_pair_inference_follows():
    assert set(DIM_MAPS) == set(RESHAPES | DIM_MOVES_AND_CUTS)


def test_labels_follow_their_dims():
    """What channels.py and experts.py track: the parameter dim at each dim, through the table."""
    assert relabel(_node(aten.transpose.int, (0, 2), (2, 3, 4)), ("a", "b", "c")) == ("c", "b", "a")
    assert relabel(_node(aten.unsqueeze.default, (1,), (2, 3)), ("a", "b")) == ("a", None, "b")
    assert relabel(_node(aten.squeeze.dims, ([0, 1],), (1, 3, 4)), ("a", "b", "c")) == ("b", "c")
