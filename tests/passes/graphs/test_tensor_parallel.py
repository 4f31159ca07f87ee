"""tensor_parallel before/after, rank 0 of tp=2: each block's up projection cut by columns and its down
projection by rows (an all-reduce after it, an all-reduce of the input's gradient before the block);
what the plan does not name stays whole."""

from __future__ import annotations


def test_megatron_blocks_on_tp_rank_0(kit, golden):
    ctx = kit.context("tp=2", {"tp_plan": {"layers.*.up": "colwise", "layers.*.down": "rowwise"}})
    before, program = kit.run_program_pass("tensor_parallel", kit.tiny_program(), ctx)
    golden(kit.graph_text(program.gm), before)
