"""The fused loss: ``cross_entropy(lm_head(h))`` becomes one chunked op that never holds the logits whole.

Reads: a traced :class:`~fxpar.ir.program.Program` (before tensor parallelism) with ``Plan(fused_loss=
True)``. Writes: the program's graph, in place: each matching loss computed by
``torch.ops.fxpar_kernels.linear_cross_entropy`` (schema: :mod:`fxpar.ir.fused_ops`; kernels:
``fxpar.runtime.kernels.cross_entropy``), the logits output dropped, costs priced again.

The pattern, keyed on the graph alone (no model names): ``aten.cross_entropy_loss(x, target)`` without
class weights or label smoothing, where ``x`` is ``aten.linear(h, W)`` (no bias) seen through ops that
change neither the values' order nor the vocabulary dim (views, reshapes, dtype casts, contiguous,
clone, alias), and nothing else reads the logits but the program's output. That is how every
transformers causal LM that computes ``loss_function(logits, labels)`` on an untouched head traces (the
labels are shifted, not the logits). Heads that transform the logits first (final logit soft-capping,
scaling) or slice them keep the unfused loss: the fused kernel would compute another function.

The program's logits output becomes None (a training step returns the loss only, as the TP pass already
drops the logits); a signature without labels has no loss and keeps its logits. The TP rule for the op
(``passes/tensor_parallel/rules/loss.py``) splits it over the vocabulary.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from fxpar.cost.flops import annotate_costs
from fxpar.ir import fused_ops, meta
from fxpar.ir.op_classes import ASSERTS, ORDER_KEEPING
from fxpar.ir.program import Program, graph_module

aten = torch.ops.aten
_CE_ARGS = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")

__all__ = ["fuse_loss"]


def fuse_loss(program: Program) -> tuple[Program, list[str]]:
    """``program`` with every matching loss fused (see the module docstring; ``program`` itself is left
    as it is), and the names of the loss nodes fused (empty, and ``program`` returned, where none
    matches)."""
    if not any(_match(n) for n in program.graph.nodes
               if n.op == "call_function" and n.target == aten.cross_entropy_loss.default):
        return program, []
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    program = program.with_gm(graph_module(program.gm, graph))
    fused = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == aten.cross_entropy_loss.default:
            match = _match(node)
            if match is not None:
                _rewrite(graph, node, *match)
                fused.append(node.name)
    if fused:
        graph.eliminate_dead_code()
        graph.lint()
        program.gm.recompile()
        annotate_costs(program)
    return program, fused


def _match(ce: torch.fx.Node):
    """(linear node, chain of order-keeping nodes, ignore_index, reduction) or None."""
    given = dict(zip(_CE_ARGS, ce.args)) | dict(ce.kwargs)
    if given.get("weight") is not None or given.get("label_smoothing", 0.0):
        return None
    x = given["input"]
    xv = x.meta.get(meta.VAL)
    if not isinstance(xv, torch.Tensor) or xv.dim() != 2:
        return None
    vocab = xv.shape[-1]
    chain = []
    while x.op == "call_function" and x.target in ORDER_KEEPING:
        v = x.meta.get(meta.VAL)
        if not isinstance(v, torch.Tensor) or v.shape[-1] != vocab:
            return None
        chain.append(x)
        x = x.args[0]
    if not (x.op == "call_function" and x.target == aten.linear.default) or \
            (len(x.args) > 2 and x.args[2] is not None):
        return None
    h, w = x.args[0], x.args[1]
    hv, wv = h.meta.get(meta.VAL), w.meta.get(meta.VAL)
    if not (isinstance(hv, torch.Tensor) and isinstance(wv, torch.Tensor)) or wv.shape[0] != vocab:
        return None
    if hv.numel() // max(hv.shape[-1], 1) != xv.shape[0]:
        return None
    allowed = set(chain) | {ce}
    for n in [x, *chain]:
        for u in n.users:
            if u not in allowed and u.op != "output" and not _is_assert(u):
                return None  # the logits feed something else: that needs them whole
    return x, chain, int(given.get("ignore_index", -100)), int(given.get("reduction", 1))


def _is_assert(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in ASSERTS


def _rewrite(graph: torch.fx.Graph, ce: torch.fx.Node, linear: torch.fx.Node, chain: list, ignore: int,
             reduction: int) -> None:
    h, w = linear.args[0], linear.args[1]
    target = ce.args[1] if len(ce.args) > 1 else ce.kwargs["target"]
    mode = torch._guards.detect_fake_mode([h.meta.get(meta.VAL), w.meta.get(meta.VAL)])
    tokens = list(h.meta[meta.VAL].shape[:-1])

    def call(op, *args):
        new = graph.call_function(op, args)
        for key in (meta.MODULE, meta.NN_MODULE_STACK, "stack_trace"):
            if key in linear.meta:
                new.meta[key] = linear.meta[key]
        vals = torch.fx.node.map_arg(args, lambda a: a.meta[meta.VAL])
        if mode is not None:
            with mode:
                new.meta[meta.VAL] = op(*vals)
        return new

    with graph.inserting_before(ce):
        labels = call(aten.view.default, target, tokens)
        both = call(fused_ops.FUSED_OPS["linear_cross_entropy"], h, w, labels, 0, None, ignore, 0, True)
        loss = call(operator.getitem, both, 0)
        if reduction == 0:
            out = call(aten.view.default, loss, [-1])
        else:
            out = call(aten.sum.default, loss)
            if reduction == 1:  # mean over the labels that count, as F.cross_entropy (NaN if none does)
                out = call(aten.div.Tensor, out, call(aten.sum.default, call(aten.ne.Scalar, labels, ignore)))
    ce.replace_all_uses_with(out)
    graph.erase_node(ce)
    output = next(n for n in graph.nodes if n.op == "output")
    dropped = {linear, *chain}
    output.args = (tuple(None if a in dropped else a for a in output.args[0]),)
    for n in [*chain, linear]:
        for u in list(n.users):
            if _is_assert(u):
                graph.erase_node(u)
