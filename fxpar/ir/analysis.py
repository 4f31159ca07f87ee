"""Analyses of a program's graph that several layers need, each defined once.

Which values a gradient flows through: the placeholders a gradient flows to (trainable parameters,
and, where asked, floating user inputs that require grad, e.g. ``inputs_embeds``), then every node
that reads one of them. The cost model prices backward only there; the pipeline split sends
gradients back only for those values; the TP pass adds a backward all-reduce only where one flows.
"""

from __future__ import annotations

import torch

from fxpar.ir import meta


def grad_sources(program, *, user_inputs: bool = False) -> set[str]:
    """Names of the placeholders a gradient flows to."""
    names = {b.placeholder for b in program.inputs
             if b.kind == "parameter" and program.params[b.target].requires_grad}
    if user_inputs:
        nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        for b in program.inputs:
            v = nodes[b.placeholder].meta.get(meta.VAL) if b.kind == "user" else None
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad:
                names.add(b.placeholder)
    return names


def grad_flow(program, *, user_inputs: bool = False, autograd: bool = False) -> set[torch.fx.Node]:
    """Top-level nodes whose value depends on a gradient source. ``autograd``: only those autograd records,
    as the cost model's saved tensors need: a ``detach`` and a value that is not a floating tensor (a
    comparison, an index) stop the flow (the vocabulary-parallel loss's max is taken of a detached input)."""
    sources = grad_sources(program, user_inputs=user_inputs)
    flows: set[torch.fx.Node] = set()
    for node in program.graph.nodes:
        if node.op == "placeholder":
            if node.name in sources:
                flows.add(node)
        elif any(a in flows for a in node.all_input_nodes):
            if autograd and (node.target is torch.ops.aten.detach.default or not _floating(node)):
                continue
            flows.add(node)
    return flows


def _floating(node: torch.fx.Node) -> bool:
    """Whether a node's value holds a floating tensor (tuples: any of them); unknown values count as floating."""
    v = node.meta.get(meta.VAL)
    if v is None:
        return True
    vals = v if isinstance(v, (tuple, list)) else (v,)
    return any(not isinstance(x, torch.Tensor) or x.is_floating_point() for x in vals)
