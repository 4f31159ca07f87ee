"""Point factory calls of a graph traced on the meta device at the device its tensors now live on.

Reads: every node's args and kwargs. Writes: ``torch.device("meta")`` arguments replaced by
``ctx.device``, in the stage's graph and the graphs of its higher-order ops (``arange(...,
device=meta)`` becomes ``arange(..., device=cpu)``). Runs after the weights are materialised.
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
        for node in gm.graph.nodes:
            node.args = pytree.tree_map(fix, node.args)
            node.kwargs = pytree.tree_map(fix, node.kwargs)
        gm.recompile()


def retarget_device(stage: StageSpec, ctx) -> StageSpec:
    retarget_gm(stage.gm, ctx.device)
    return stage
