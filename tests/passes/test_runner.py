"""The pass runner: the pipeline reads as one list; every pass is named, timed, linted, dumpable,
can be disabled, and a failure names the pass and the passes before it."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar import passes, zoo
from fxpar.ir.errors import PassError, PlanError
from fxpar.ir.mesh import MeshSpec
from fxpar.passes.runner import Pass, PassContext, Runner


@pytest.fixture(scope="module")
def program():
    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=2, seq=8)
    return fxpar.trace(zoo.build("llama", seed=0), example_kwargs=batch)


def _ctx(plan="pp=2", **kw):
    plan = fxpar.Plan.parse(plan)
    return PassContext(plan, MeshSpec.for_plan(plan), cuts=[("model.layers.1", "beginning")], stage_to_rank=[0, 1],
                       **kw)


def test_the_pipeline_is_one_list_of_named_passes():
    names = [p.name for p in passes.PROGRAM_PASSES] + [passes.SPLIT.name] + [p.name for p in passes.STAGE_PASSES]
    assert names == ["fused_loss", "tensor_parallel", "expert_parallel", "context_parallel", "pipeline_split",
                     "materialize_weights", "retarget_device", "quantize_base", "param_updates", "zero3",
                     "drop_dtype_asserts", "collective_matmul", "recompute", "inductor"]


def test_run_times_every_pass_that_ran_and_dumps_before_and_after(program, tmp_path):
    ctx = _ctx("pp=2,zero=0,mixed_precision=bf16", dump_dir=tmp_path)
    local, pipeline = passes.run(program, ctx)
    assert [n for n, _ in ctx.out.timings] == ["pipeline_split", "drop_dtype_asserts"]
    assert all(t >= 0 for _, t in ctx.out.timings)
    assert len(pipeline.stages) == 2 and local is program
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["01-pipeline_split.after.txt", "01-pipeline_split.before.txt",
                     "02-drop_dtype_asserts.stage0.after.txt", "02-drop_dtype_asserts.stage0.before.txt"]
    before = (tmp_path / "02-drop_dtype_asserts.stage0.before.txt").read_text()
    after = (tmp_path / "02-drop_dtype_asserts.stage0.after.txt").read_text()
    assert "_assert_tensor_metadata" in before and "_assert_tensor_metadata" not in after


def test_a_disabled_pass_does_not_run(program):
    ctx = _ctx("pp=2,mixed_precision=bf16", disabled=frozenset({"drop_dtype_asserts"}))
    passes.run(program, ctx)
    assert [n for n, _ in ctx.out.timings] == ["pipeline_split"]


def test_a_failing_pass_is_named_with_the_passes_before_it(program):
    def broken(p, ctx):
        raise RuntimeError("boom")

    runner = Runner(_ctx())
    runner.run([Pass("first", lambda p, c: p)], program)
    with pytest.raises(PassError, match=r"'broken' pass after the passes \['first'\]: RuntimeError: boom"):
        runner.run([Pass("broken", broken)], program)


def test_plan_errors_from_a_pass_keep_their_own_text(program):
    def refuses(p, ctx):
        raise PlanError("3 heads do not divide over tp=2")

    with pytest.raises(PlanError, match="^3 heads do not divide over tp=2$"):
        Runner(_ctx()).run([Pass("refuses", refuses)], program)


def test_a_pass_that_breaks_the_graph_fails_lint(program):
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))

    def dangling(obj, ctx):
        g = gm.graph
        x = next(n for n in g.nodes if n.op == "placeholder")
        with g.inserting_before(x):  # reads x before x is defined: not a valid graph
            g.call_function(torch.relu, (x,))
        return gm

    with pytest.raises(PassError, match="'dangling' pass"):
        Runner(_ctx()).run([Pass("dangling", dangling)], gm)


def test_a_pass_precondition_runs_before_it_and_before_any_communication(program):
    """``Pass.check``: the runner calls it before the pass (which then never starts), and ``passes.check``
    runs the program passes' preconditions alone, only of passes the plan runs: the EP pass's on a model
    without experts names it, as compile does on its first trace before any process group exists."""
    ran = []

    def refuses(p, ctx):
        raise PlanError("no experts here")

    with pytest.raises(PlanError, match="^no experts here$"):
        Runner(_ctx()).run([Pass("guarded", lambda p, c: ran.append(p) or p, check=refuses)], program)
    assert ran == []
    passes.check(program, _ctx("dp=2"))  # ep=1: the EP pass does not run, nor does its check
    with pytest.raises(PlanError, match=r"Plan\(ep=2\): .* has no expert layers"):
        passes.check(program, _ctx("ep=2"))
