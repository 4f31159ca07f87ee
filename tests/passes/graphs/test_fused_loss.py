"""fused_loss before/after: ``cross_entropy(view(lm_head(h)))`` becomes one chunked loss op that reads the
hidden states and the head's weight, never the logits."""

from __future__ import annotations


def test_the_lm_head_and_its_loss_fuse(kit, golden):
    ctx = kit.context("fused_loss=True")
    before, program = kit.run_program_pass("fused_loss", kit.tiny_program(), ctx)
    assert ctx.out.fused_losses == ["cross_entropy_loss"]
    golden(kit.graph_text(program.gm), before)
