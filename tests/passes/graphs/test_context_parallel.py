"""context_parallel before/after, rank 0 of cp=2: the token ids cut to this rank's head and tail chunks,
the positions' table cut to the same rows, each attention's keys and values all-gathered and put back in
sequence order, ``is_causal`` an explicit mask of this rank's positions, the labels cut to match the logits
and the mean loss this rank's sum over the whole count, all-reduced."""

from __future__ import annotations


def test_sequence_chunks_on_cp_rank_0(kit, golden):
    before, program = kit.run_program_pass("context_parallel", kit.tiny_program(), kit.context("cp=2"))
    golden(kit.graph_text(program.gm), before)
