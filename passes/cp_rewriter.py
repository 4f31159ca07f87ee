"""The context-parallel rewrite: each value's state followed through the graph in order, and the building
blocks the rules (:mod:`fxpar.passes.cp_ops`) rewrite with: cutting a whole value to this rank's rows,
gathering a sharded one, summing a partial one, falling back to whole inputs.

Reads and writes: the graph copy :mod:`fxpar.passes.context_parallel` hands it, in place.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.op_classes import NEW_TENSOR_FACTORIES
from fxpar.passes import cp_ops, cp_tokens, cp_ulysses
from fxpar.passes.cp_rules import (
    PARTIAL,
    Layout,
    Sh,
    is_local,
    lost_write,
    packet,
    shape_of,
    srcs,
    tensor_args,
    user_input_of,
)

aten = torch.ops.aten
fxpar_ops = torch.ops.fxpar


class Rewriter:
    """Visits the graph's nodes in order, keeps each value's state, rewrites what the state asks for."""

    def __init__(self, gm, program, layout: Layout, roots, result, uly: cp_ulysses.Plan | None = None,
                 refused: frozenset | None = frozenset()):
        self.gm, self.g, self.program, self.l, self.roots, self.res = gm, gm.graph, program, layout, roots, result
        self.uly = uly or cp_ulysses.Plan()  # the attentions that trade sequence for heads (cp_attention="ulysses")
        self.state: dict[torch.fx.Node, object] = {}
        self.cuts: dict[tuple, torch.fx.Node] = {}
        self.fed: set[torch.fx.Node] = set()
        self.refused = refused  # ops a token-local rule leaves to the fallback (a reader it had no rule for; None: all)
        self.broken: set[torch.fx.Node] = set()  # this run's such ops: the pass runs again with them refused

    # ---- building blocks ----------------------------------------------------------------------------
    def call(self, target, *args, **kwargs) -> torch.fx.Node:
        return self.g.call_function(target, args, kwargs)

    def local_shape(self, node, s: Sh) -> list[int]:
        shape = list(shape_of(node))
        shape[s.dim] = s.outer * self.l.seq // self.l.cp
        return shape

    def cut(self, x: torch.fx.Node, dim: int, outer: int = 1) -> torch.fx.Node:
        """This rank's rows of whole value ``x`` along ``dim`` (no communication; once per value and dim, the
        first reader's insertion point coming before every later reader)."""
        key = (x, dim, outer)
        if key not in self.cuts:
            shape, src = list(shape_of(x)), x
            if outer > 1:
                src = self.call(aten.view.default, x, shape[:dim] + [outer, self.l.seq] + shape[dim + 1:])
            d = dim + (outer > 1)
            parts = [self.call(aten.slice.Tensor, src, d, a, b) for a, b in self.l.ranges()]
            out = self.call(aten.cat.default, parts, d)
            if outer > 1:
                out = self.call(aten.view.default, out, shape[:dim] + [outer * 2 * self.l.chunk] + shape[dim + 1:])
            self.cuts[key] = out
            self.res.cut.append(x.name)
        return self.cuts[key]

    def gather(self, x: torch.fx.Node, s: Sh) -> torch.fx.Node:
        """The whole of sharded ``x``, in sequence order: all-gather over cp (backward: reduce-scatter)."""
        shape, c, whole = self.local_shape(x, s), self.l.chunk, x.meta.get(meta.VAL)
        d = s.dim
        if s.outer > 1:
            x = self.call(aten.view.default, x, shape[:d] + [s.outer, 2 * c] + shape[d + 1:])
            d += 1
        g = self.call(fxpar_ops.all_gather_rs_bwd.default, x, self.l.group, d)
        parts = [self.call(aten.slice.Tensor, g, d, j * c, (j + 1) * c) for j in self.l.natural_order()]
        out = self.call(aten.cat.default, parts, d)
        if s.outer > 1:
            out = self.call(aten.view.default, out, shape[:s.dim] + [s.outer * self.l.seq] + shape[s.dim + 1:])
        out.meta[meta.VAL] = whole  # the traced value's (whole) shape, for the rules that read the gathered value
        return out

    def materialize(self, x: torch.fx.Node) -> torch.fx.Node:
        """The sum of partial ``x`` over cp, for a rule that reads it whole; its backward hands each rank's
        part the gradient summed over cp (the whole value is read on every rank, each counting 1/cp of it)."""
        y = self.call(fxpar_ops.identity_fwd_all_reduce_bwd.default, x, self.l.group)
        return self.call(fxpar_ops.all_reduce.default, y, self.l.group, "sum")

    def whole(self, node: torch.fx.Node, x: torch.fx.Node) -> None:
        """Make input ``x`` of ``node`` whole (gathered or summed) for this node only."""
        s = self.state.get(x)
        if s is None:
            return
        if is_local(s):  # its rows are in an order only this rank knows: no gather can make it whole
            self.broken |= srcs(s)
            return
        if lost_write(node, x):
            raise PlanError(f"Plan(cp=...): {node.name} ({node.target}) needs the whole of {x.name}, which is "
                            f"split over the sequence, and is written in place (or a view of it is) and read "
                            f"again: the write would land in a gathered copy (fxpar/passes/cp_rewriter.py); "
                            f"context parallelism has no rule for this model's step-by-step buffer")
        with self.g.inserting_before(node):
            y = self.materialize(x) if s == PARTIAL else self.gather(x, s)
        node.replace_input_with(x, y)
        self.res.gathered.append(node.name)

    def fallback(self, node: torch.fx.Node) -> None:
        for x in dict.fromkeys(tensor_args(node)):
            self.whole(node, x)

    # ---- the visit ----------------------------------------------------------------------------------
    def visit(self, node: torch.fx.Node) -> None:
        op = packet(node)
        if any(a in self.fed or self.state.get(a) is not None for a in tensor_args(node)):
            self.fed.add(node)  # the sequence fed it (a whole value that depends on the tokens)
        if node.target is operator.getitem:
            src = self.state.get(node.args[0])
            self.state[node] = src[node.args[1]] if isinstance(src, tuple) else src
        elif op is aten.embedding and self.state.get(node.args[1]) is None:
            if user_input_of(node.args[1], self.program) is not None:  # a seed: cut the ids to this rank's rows
                with self.g.inserting_before(node):
                    node.update_arg(1, self.cut(node.args[1], 1))
                self.state[node] = Sh(1)
                self.fed.add(node)
        elif any(self.state.get(a) is not None for a in tensor_args(node)) or node in self.uly.attention:
            self.rule(node, op)
        if node in self.uly.roots:
            cp_ulysses.root(self, node)
        elif node in self.roots and isinstance(self.state.get(node), Sh):
            with self.g.inserting_before(node.next):
                full = self.gather(node, self.state[node])
            for reader, pos in self.roots[node]:
                reader.update_arg(pos, full)
            self.res.kv_gathers.append(node.name)

    def rule(self, node: torch.fx.Node, op) -> None:
        if node.meta.get(meta.VAL) is None and "assert" in str(node.target):
            return  # export's metadata checks: dtype and device only
        if op in NEW_TENSOR_FACTORIES:
            return
        if node in self.uly.attention:
            return cp_ulysses.attention(self, node)
        if cp_tokens.rule(self, node, op):
            return
        rule = cp_ops.rule_for(node, op)
        if rule is None:
            return self.fallback(node)
        rule(self, node, op)

    def input_state(self, node, x) -> Sh | None:
        """The state of input ``x``, partial inputs summed first (a rule that has no use for a partial)."""
        if self.state.get(x) == PARTIAL:
            self.whole(node, x)
            return None
        return self.state.get(x)

    def aligned(self, node, want: Sh, nd: int | None = None) -> bool:
        """Cut each whole input spanning the sequence at ``want`` of ``node``'s ``nd`` dims (aligned from the
        right, as broadcasting does); False where a sharded input sits elsewhere."""
        nd = len(shape_of(node)) if nd is None else nd
        for x in dict.fromkeys(tensor_args(node)):
            s, shape = self.state.get(x), shape_of(x)
            if shape is None:
                continue
            at = want.dim - (nd - len(shape))
            if isinstance(s, Sh):
                if (s.dim, s.outer) != (at, want.outer):
                    return False
            elif s is None and 0 <= at and shape[at] == want.outer * self.l.seq:
                with self.g.inserting_before(node):
                    node.replace_input_with(x, self.cut(x, at, want.outer))
        return True
