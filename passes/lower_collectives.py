"""Lower fxpar's collective ops to torch's functional collectives, each wait placed at its first use.

Reads: an fx graph (a stage, or the forward / backward graph AOTAutograd made of one) whose nodes call
``torch.ops.fxpar.*``, and a resolver from fxpar group names (``"tp:0,1"``) to the process group name
torch's functional collectives take, with the group's size and this rank's index in it. Writes: the
graph, in place: every fxpar op replaced by ``torch.ops._c10d_functional.*`` + ``wait_tensor`` (or by
local ops where no communication is needed).

Why: fxpar's own ops wait inside their kernels, so to a compiler each is an opaque call that can be
neither moved nor merged. Functional collectives return at once and ``wait_tensor`` marks where the
result is needed; with the wait just before the result's first use (views of the result, which compute
nothing, move down with it), compute that does not depend on it runs while the collective is in flight (gloo and
NCCL progress asynchronously), and Inductor's reordering and bucketing passes recognise them. The IR keeps fxpar's
ops everywhere else (inspection and the byte counters read them): this runs last, on a copy of a stage's graph
inside torch.compile (``fxpar.runtime.compile`` installs it as Inductor's ``post_grad_custom_pre_pass``, where it
sees the forward and the backward graphs alike).

Per op (``n`` the group size, ``r`` this rank's index in it):

* ``all_reduce(x, op)``: ``all_reduce(x, op)``; "avg" as a sum divided by ``n`` after the wait (the
  eager kernels do the same; gloo has no average).
* ``identity_fwd_all_reduce_bwd``: the identity (its backward's all-reduce is an ``all_reduce`` node of
  the backward graph).
* ``all_gather`` / ``all_gather_rs_bwd`` along ``d``: ``all_gather_into_tensor`` along dim 0, then for
  ``d != 0`` the ``n`` rank blocks split off dim 0 and concatenated along ``d`` (the form Inductor's
  micro-pipeline TP pass matches).
* ``reduce_scatter`` along ``d``: for ``d != 0`` the input cut into ``n`` chunks along ``d`` and stacked
  along dim 0 first, then ``reduce_scatter_tensor`` (which scatters dim 0).
* ``gather_params`` (ZeRO-3's flat bucket): cast to its compute dtype, ``all_gather_into_tensor``.
* ``scatter_slice``: this rank's slice (no communication).
* ``all_to_all`` (Ulysses attention): ``all_to_all_single`` with ``n`` equal blocks of dim 0 each way.

A group of one rank needs no communication: its ops become copies. A ``gather_params`` with a
``comm_dtype`` (its 5th argument, ``"int8"``: quantised gathers) stays as it is and runs its own kernel
(quantise, gather, dequantise), opaque to Inductor; so does a ``reduce_scatter`` with ``comm_dtype``
``"int8"`` (the gradient of an ``"int8+grads"`` gather: an all-to-all of int8 blocks).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fxpar.ir.collectives import collective
from fxpar.ir.ops import collective_kind

__all__ = ["GroupRef", "Resolver", "lower_collectives"]

GroupRef = tuple[str, int, int]  # (process group name for _c10d_functional, group size, this rank's index)
Resolver = Callable[[str], "GroupRef | None"]  # None: a one-rank group (no communication)

aten = torch.ops.aten
prims = torch.ops.prims


def _funcol():
    return torch.ops._c10d_functional


def lower_collectives(graph: torch.fx.Graph, resolve: Resolver) -> int:
    """Rewrite every fxpar collective of ``graph`` (in place; not the bodies of sub-graphs) as described
    in the module docstring. Returns how many fxpar nodes were replaced."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    lowered = 0
    for node in list(graph.nodes):
        kind = collective_kind(node)
        if kind is None:
            continue
        if _comm_dtype(node, kind) is not None:  # a quantised wire format: its own kernel, opaque
            continue
        _Lowering(graph, node, order).run(kind, resolve)
        lowered += 1
    if lowered:
        graph.lint()
    return lowered


def _comm_dtype(node: torch.fx.Node, kind: str):
    """The ``comm_dtype`` of a node whose op's record has one (``gather_params``' 5th argument,
    ``reduce_scatter``'s 4th: the gradient of a gather with ``"int8+grads"``); None for every other op."""
    at = collective(kind).comm_dtype_arg
    if at is None:
        return None
    return node.args[at] if len(node.args) > at else node.kwargs.get("comm_dtype")


def _is_view(node: torch.fx.Node) -> bool:
    return getattr(node.target, "is_view", False) or node.target is operator.getitem


class _Lowering:
    """Replaces one fxpar node: the collective where the node stood, the wait (and what follows it)
    just before the result's first user that is not a view. The views of the result (ZeRO-3's parameter
    slices of a gathered bucket stand right after the gather) move down after the wait with it: they
    compute nothing, and a wait placed before them would come before any compute could overlap."""

    def __init__(self, graph: torch.fx.Graph, node: torch.fx.Node, order: dict[torch.fx.Node, int]):
        self.graph, self.node = graph, node
        self.fake_mode = torch._guards.detect_fake_mode(
            [a.meta.get("val") for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)])
        self.views, todo = set(), [node]
        while todo:  # the views of the result, and their views
            for u in todo.pop().users:
                if _is_view(u) and u not in self.views:
                    self.views.add(u)
                    todo.append(u)
        position = lambda u: order.get(u, len(order))  # noqa: E731
        self.views = sorted(self.views, key=position)
        users = sorted({u for n in (node, *self.views) for u in n.users} - set(self.views), key=position)
        self.first_user = users[0] if users else node.next
        self.to_output = any(u.op == "output" for u in node.users)

    def call(self, target, *args, **kwargs) -> torch.fx.Node:
        """A new node ``target(*args, **kwargs)`` at the current insertion point, with its fake value."""
        new = self.graph.call_function(target, args, kwargs)
        for key in ("stack_trace", "nn_module_stack", "fxpar.module"):
            if key in self.node.meta:
                new.meta[key] = self.node.meta[key]
        vals = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta.get("val"), (args, kwargs))
        if self.fake_mode is not None and all(
                v is not None for v in pytree.tree_leaves(vals) if not isinstance(v, (int, float, str, bool))):
            with self.fake_mode:
                new.meta["val"] = target(*vals[0], **vals[1])
        return new

    def run(self, kind: str, resolve: Resolver) -> None:
        """Lower the node by its op's record (:class:`fxpar.ir.collectives.Collective`: ``lowering``, ``cast_arg``)."""
        node, graph, rec = self.node, self.graph, collective(kind)
        x, group = node.args[0], node.args[1]
        ref = resolve(group)
        if rec.lowering == "identity":
            self.replace(self._copy(x) if self.to_output else x)
            return
        if rec.lowering == "slice":
            dim = self._dim(x, node.args[2])
            n, r = (1, 0) if ref is None else ref[1:]
            with graph.inserting_before(node):
                k = x.meta["val"].shape[dim] // n
                out = self.call(aten.clone.default, self.call(aten.slice.Tensor, x, dim, r * k, (r + 1) * k))
            self.replace(out)
            return
        if rec.cast_arg is not None:
            dtype = node.args[rec.cast_arg] if len(node.args) > rec.cast_arg else node.kwargs.get("dtype")
            if dtype is not None:
                with graph.inserting_before(node):
                    x = self.call(prims.convert_element_type.default, x, dtype)
        if ref is None:
            with graph.inserting_before(node):
                self.replace(self._copy(x))
            return
        pg, n, _ = ref
        f = _funcol()
        if rec.lowering == "all_reduce":
            op = node.args[2] if len(node.args) > 2 else node.kwargs.get("op", "sum")
            with graph.inserting_before(node):
                started = self.call(f.all_reduce.default, x, "sum" if op == "avg" else op, pg)
            with graph.inserting_before(self.first_user):
                out = self.call(f.wait_tensor.default, started)
                if op == "avg":
                    out = self.call(aten.div.Tensor, out, n)
        elif rec.lowering == "all_gather_into_tensor":
            dim = self._dim(x, node.args[2])
            with graph.inserting_before(node):
                started = self.call(f.all_gather_into_tensor.default, x, n, pg)
            with graph.inserting_before(self.first_user):
                out = self.call(f.wait_tensor.default, started)
                if dim != 0:
                    blocks = self.call(aten.split.Tensor, out, x.meta["val"].shape[0], 0)
                    parts = [self.call(operator.getitem, blocks, i) for i in range(n)]
                    out = self.call(aten.cat.default, parts, dim)
        elif rec.lowering == "reduce_scatter_tensor":
            dim = self._dim(x, node.args[2])
            with graph.inserting_before(node):
                if dim != 0:
                    k = x.meta["val"].shape[dim] // n
                    chunks = self.call(aten.split.Tensor, x, k, dim)
                    x = self.call(aten.cat.default, [self.call(operator.getitem, chunks, i) for i in range(n)], 0)
                started = self.call(f.reduce_scatter_tensor.default, x, "sum", n, pg)
            with graph.inserting_before(self.first_user):
                out = self.call(f.wait_tensor.default, started)
        elif rec.lowering == "all_to_all_single":  # equal blocks of dim 0: block j to rank j
            k = x.meta["val"].shape[0] // n
            with graph.inserting_before(node):
                started = self.call(f.all_to_all_single.default, x, [k] * n, [k] * n, pg)
            with graph.inserting_before(self.first_user):
                out = self.call(f.wait_tensor.default, started)
        else:  # a lowering this pass does not know: leave the node (it still runs, opaquely)
            return
        self.replace(out)

    def _dim(self, x: torch.fx.Node, dim: int) -> int:
        return dim % x.meta["val"].dim()

    def _copy(self, x: torch.fx.Node) -> torch.fx.Node:
        with self.graph.inserting_before(self.node):
            return self.call(aten.clone.default, x)

    def replace(self, new: torch.fx.Node) -> None:
        self.node.replace_all_uses_with(new)
        self.graph.erase_node(self.node)
        if self.views and self.first_user.prev is new:  # the wait went down: its views follow it
            for view in self.views:
                self.first_user.prepend(view)
