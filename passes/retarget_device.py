"""Point factory calls of a graph traced on the meta device at the device its tensors now live on.

Reads: every node's args and kwargs, and ``meta["val"]`` of ``histc``'s input. Writes: ``torch.device("meta")``
arguments replaced by ``ctx.device``, in the stage's graph and the graphs of its higher-order ops (``arange(...,
device=meta)`` becomes ``arange(..., device=cpu)``). Runs after the weights are materialised.

Code that reads the device picks its ops by it, and on meta it picks the accelerator's: ``histc`` of integers (the
MoE layers of transformers count tokens per expert so off the CPU), which the CPU has no kernel for. On a CPU
target such a ``histc`` reads its input as fp32 and gives its integer dtype back (counts below 2**24 are exact).
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from fxpar.ir.stage import StageSpec

_META = torch.device("meta")


def retarget_gm(root: torch.fx.GraphModule, device: torch.device) -> None:
    def fix(v):
        return device if isinstance(v, torch.device) and v == _META else v

    for gm in [m for m in root.modules() if isinstance(m, torch.fx.GraphModule)]:
        for node in list(gm.graph.nodes):
            node.args = pytree.tree_map(fix, node.args)
            node.kwargs = pytree.tree_map(fix, node.kwargs)
            if device.type == "cpu" and node.target is torch.ops.aten.histc.default:
                _histc_in_float(gm.graph, node)
        gm.recompile()


def _histc_in_float(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """``histc(x)`` of an integer ``x`` as ``histc(x.float()).to(x.dtype)``."""
    val = getattr(node.args[0], "meta", {}).get("val")
    if val is None or val.dtype.is_floating_point:
        return
    to = torch.ops.aten._to_copy.default
    with graph.inserting_before(node):
        x = graph.call_function(to, (node.args[0],), {"dtype": torch.float32})
    with graph.inserting_after(node):
        back = graph.call_function(to, (node,), {"dtype": val.dtype})
    node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    node.args = (x, *node.args[1:])


def retarget_device(stage: StageSpec, ctx) -> StageSpec:
    retarget_gm(stage.gm, ctx.device)
    return stage
