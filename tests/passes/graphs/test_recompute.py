"""recompute before/after: each layer of the tiny LM outlined into a recomputed submodule (its body
printed after its caller)."""

from __future__ import annotations


def test_each_layer_is_outlined(kit, golden):
    program = kit.tiny_program()
    ctx = kit.context("recompute=layer")
    ctx.program = program
    before, stage = kit.run_stage_pass("recompute", program, ctx)
    golden(kit.graph_text(stage.gm), before)
