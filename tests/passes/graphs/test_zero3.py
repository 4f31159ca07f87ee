"""zero3 before/after, rank 0 of dp=2: the stage's trainable weights become flat shards gathered by
collectives in the graph (one bucket here: the whole tiny model fits the bucket size)."""

from __future__ import annotations


def test_weights_become_gathered_shards(kit, golden):
    before, stage = kit.run_stage_pass("zero3", kit.tiny_program(), kit.context("dp=2,zero=3"))
    golden(kit.graph_text(stage.gm), before)
