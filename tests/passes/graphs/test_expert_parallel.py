"""expert_parallel before/after, rank 0 of ep=2 on a one-layer zoo mixtral (4 experts, top-2): this rank
keeps experts 0-1, the routed tokens go to their expert's rank and come back by all-to-alls."""

from __future__ import annotations

import fxpar
from fxpar import zoo


def test_experts_split_over_two_ranks(kit, golden):
    config = dict(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=8, vocab_size=16)
    model = zoo.build("mixtral", **config)
    program = fxpar.trace(model, example_kwargs=zoo.example_inputs("mixtral", model.config, batch=2, seq=4))
    ctx = kit.context("ep=2")
    before, program = kit.run_program_pass("expert_parallel", program, ctx)
    golden(kit.graph_text(program.gm), before)
