"""inductor before/after: the last pass hands each stage to ``ctx.compile_stage`` (here a stand-in that
records what it was given; the real one is ``fxpar.runtime.compile.compile_stage``) with fxpar's
collective lowering; the graph itself is left as the passes before it made it."""

from __future__ import annotations

from fxpar.passes.lower_collectives import lower_collectives


def test_the_stage_goes_to_compile_stage_unchanged(kit, golden):
    given = []

    def compile_stage(gm, *, stage, lower):
        given.append((gm, stage, lower))
        return gm.forward

    ctx = kit.context("compile=True", compile_stage=compile_stage)
    before, stage = kit.run_stage_pass("inductor", kit.tiny_program(), ctx)
    assert given == [(stage.gm, 0, lower_collectives)] and ctx.out.stage_fns == {0: stage.gm.forward}
    golden(kit.graph_text(stage.gm), before)
