"""materialize_weights before/after: a program traced on the meta device gets this rank's tensors from
``ctx.load`` (here: ones of the shape asked for); the graph is the same, its attributes now on the CPU."""

from __future__ import annotations

import torch


def test_meta_weights_become_loaded_tensors(kit, golden):
    asked = []

    def load(fqns, layout, like):
        asked.append(fqns[0])
        return torch.ones(like.shape, dtype=like.dtype)

    ctx = kit.context("pp=1", load=load, traced_on_meta=True)
    before, stage = kit.run_stage_pass("materialize_weights", kit.tiny_program("meta"), ctx)
    assert sorted(asked) == sorted(stage.params + stage.buffers)
    golden(kit.graph_text(stage.gm), before)
