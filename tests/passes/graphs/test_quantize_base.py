"""quantize_base before/after (``Plan(base_dtype="int8")``): each frozen weight a linear reads (the blocks' up and
down projections) becomes int8 codes + scales read by ``fxpar_kernels.int8_linear``, a frozen embedding table
codes + scales read by ``int8_embedding``; trainable ones (the LM head, the positions) stay as they were; the
stage computes the loss it computed, within the int8 bound."""

from __future__ import annotations

import torch


def test_frozen_linear_weights_become_int8_blocks(kit, golden):
    program = kit.tiny_program()
    for fqn in program.params:
        if "layers" in fqn or fqn == "embed.weight":
            program.tensor(fqn).requires_grad_(False)
    ctx = kit.context("pp=1", {"base_dtype": "int8"})
    ids = torch.arange(kit.BATCH * kit.SEQ).reshape(kit.BATCH, kit.SEQ) % kit.VOCAB
    kit.split(program, ctx)
    want = ctx.my_stages[0].gm(ids, ids.flip(1))
    before, stage = kit.run_stage_pass("quantize_base", program, ctx)
    held = {n for n, _ in stage.gm.named_buffers()}
    assert held == {f"{w}.weight_int8{s}" for w in ("embed", "layers.0.up", "layers.0.down", "layers.1.up",
                                                     "layers.1.down") for s in ("", "_scales")}
    assert {n for n, _ in stage.gm.named_parameters()} == {"pos.weight", "lm_head.weight"}
    assert all(program.tensor(f"layers.{i}.{p}.weight").is_meta for i in (0, 1) for p in ("up", "down"))
    got = stage.gm(ids, ids.flip(1))
    assert 0 < abs(got[0] - want[0]).item() < 2e-2, (got, want)  # the embedding is N(0, 1): steps of ~0.02
    golden(kit.graph_text(stage.gm), before)
