"""Remove export's ``_assert_tensor_metadata`` checks from a stage's graph.

They assert the dtype and device each value had at trace time, and both can differ when the stage runs:
under bf16 autocast the same values are bf16; a model traced with inputs on ``"cuda"`` records that
device without an index, which the fake tensors of ``torch.compile`` on CUDA (``"cuda:0"``) fail
("Tensor device mismatch! Expected: cuda, Got: cuda:0", measured on an H100: ZeRO-3 stages fell back to
eager, docs/benchmarks.md "GPU checks"). They compute nothing, so removing them changes no result; the
pass runs where either can happen: under bf16, and where the stage will be compiled.
Reads and writes: ``call_function`` nodes of that target, in the stage's graph and in every graph nested in it
(export puts a ``torch.no_grad()`` block, such as a rotary embedding's, in a ``wrap_with_set_grad_enabled``
subgraph: its asserts made ZeRO-3 stages fall back to eager on an H100, docs/benchmarks.md "GPU checks").
"""

from __future__ import annotations

import torch

from fxpar.ir.stage import StageSpec

_ASSERT = torch.ops.aten._assert_tensor_metadata.default


def drop_dtype_asserts(stage: StageSpec, ctx) -> StageSpec:
    for gm in stage.gm.modules():
        if isinstance(gm, torch.fx.GraphModule):
            for node in list(gm.graph.nodes):
                if node.op == "call_function" and node.target is _ASSERT:
                    gm.graph.erase_node(node)
            gm.recompile()
    return stage
