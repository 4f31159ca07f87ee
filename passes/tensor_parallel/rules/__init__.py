"""The placement rules of the tensor-parallel pass: one function per op family, registered in a table.

A rule receives the rewriter, the traced node and its arguments already mapped into the new graph
(partial sums reduced), and returns the new node, its placement recorded through ``rw.call(...,
place=...)``. :data:`RULES` maps an op to its rule: an ``OpOverloadPacket`` (``aten.view``), a Python
target (``operator.getitem``), or the name of an op another library defines (``"grouped_mm"``). An
op with no rule goes to :func:`~.pointwise.pointwise_or_gather`. A new op is one decorated function,
the way DTensor registers a strategy per op::

    @rule(aten.view, aten.reshape, aten._unsafe_view)
    def view(rw, old, args, kwargs):
        \"\"\"A shard of a merged dim moves to its leading factor; the size named there becomes the local one.\"\"\"
"""

from __future__ import annotations

import torch.fx

from fxpar.ir.op_classes import packet
from fxpar.passes.tensor_parallel.rules import (  # the families register their rules on import
    attention,
    cache,
    conv,
    embedding,
    linear,
    loss,
    pointwise,
    ssm,
    views,
)
from fxpar.passes.tensor_parallel.rules.pointwise import pointwise_or_gather
from fxpar.passes.tensor_parallel.rules.registry import RULES, Rule, rule

__all__ = ["RULES", "Rule", "attention", "cache", "conv", "embedding", "linear", "loss", "pointwise", "rule",
           "rule_for", "ssm", "views"]


def rule_for(node: torch.fx.Node) -> Rule:
    """The rule of ``node``'s op: by packet, by Python target, or by op name; else the fallback."""
    pkt = packet(node)
    if pkt is None:
        return RULES.get(node.target, pointwise_or_gather) if node.op == "call_function" else pointwise_or_gather
    return RULES.get(pkt) or RULES.get(getattr(pkt, "__name__", None), pointwise_or_gather)
