"""collective_matmul before/after, rank 0 of tp=2 with sequence parallelism: the gather before each up
projection and the reduce-scatter after each down projection chunked in two, each chunk's matmul
overlapping the next chunk's transfer."""

from __future__ import annotations


def test_gather_and_reduce_scatter_chunk_around_the_linears(kit, golden):
    ctx = kit.context("tp=2,sequence_parallel=True,collective_matmul=2",
                      {"tp_plan": {"layers.*.up": "colwise", "layers.*.down": "rowwise"}})
    _, program = kit.run_program_pass("tensor_parallel", kit.tiny_program(), ctx)
    before, stage = kit.run_stage_pass("collective_matmul", program, ctx)
    golden(kit.graph_text(stage.gm), before)
