"""pipeline_split before/after: the tiny LM cut before its second layer into two stages; each stage's
graph (the boundary tensors as its outputs and the next stage's placeholders)."""

from __future__ import annotations


def test_two_stages_cut_before_the_second_layer(kit, golden):
    program, ctx = kit.tiny_program(), kit.context("pp=2", cuts=[("layers.1", "beginning")])
    before = kit.graph_text(program.gm)
    pipeline = kit.split(program, ctx)
    golden("\n\n".join(f"## stage {s.index} (pp rank {s.rank})\n{kit.graph_text(s.gm)}" for s in pipeline.stages),
           before)
