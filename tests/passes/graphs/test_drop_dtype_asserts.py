"""drop_dtype_asserts before/after: under bf16 autocast the dtype asserts torch.export records for
``.to`` go; everything else stays."""

from __future__ import annotations


def test_the_dtype_asserts_go(kit, golden):
    before, stage = kit.run_stage_pass("drop_dtype_asserts", kit.tiny_program(), kit.context("mixed_precision=bf16"))
    golden(kit.graph_text(stage.gm), before)
