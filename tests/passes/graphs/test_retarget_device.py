"""retarget_device before/after: a program traced on the meta device, its weights loaded: the factory
call (``arange`` of the positions) moves from the meta device to the CPU."""

from __future__ import annotations

import torch


def test_factory_calls_follow_the_weights(kit, golden):
    ctx = kit.context("pp=1", load=lambda fqns, layout, like: torch.zeros(like.shape, dtype=like.dtype),
                      traced_on_meta=True)
    before, stage = kit.run_stage_pass("retarget_device", kit.tiny_program("meta"), ctx,
                                       first=("materialize_weights",))
    golden(kit.graph_text(stage.gm), before)
