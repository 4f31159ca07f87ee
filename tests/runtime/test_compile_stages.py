"""``Plan(compile=True)``: stage graphs through Inductor, fxpar's collectives lowered to functional ones.

Compiling costs seconds per graph on these CPUs, so the multi-rank cases use 2 gloo ranks, a 2-layer
tiny llama and 3 steps, and are marked slow (:func:`fxpar.testing.compiled.compiled_vs_eager`; the 8-rank
3-D plan is in ``test_compile_3d.py``). Besides numerics they read the compiled graphs: ZeRO-3 buckets
regathered in backward and not saved, gathers merged by Inductor, waits after independent compute. The
lowering and the ZeRO-3 marking are checked on small graphs: where the waits go, which nodes are marked,
and that the lowered graph computes what the fxpar ops compute.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from fxpar.ir.ops import count_collectives
from fxpar.ir.plan import Plan
from fxpar.passes.lower_collectives import lower_collectives
from fxpar.runtime import compile as stage_compile
from fxpar.runtime.compile import compile_enabled, compile_stage
from fxpar.testing import multiproc
from fxpar.testing.compiled import compiled_vs_eager

pool2 = multiproc.rank_pool_fixture(2)
TOL = 1e-5
funcol = torch.ops._c10d_functional


# ---------------------------------------------------------------------------------------------------
# The lowering on small graphs


def _mlp(x, w1, w2, w3):
    """A row-parallel output whose all-reduce is independent of the next two matmuls."""
    y = torch.ops.fxpar.all_reduce(x @ w1, "tp:0,1", "sum")
    z = torch.tanh(x @ w2) @ w3  # independent of y: may run while the all-reduce is in flight
    return y * 2 + z.sum()


def _gathers(x, b):
    g = torch.ops.fxpar.all_gather(x, "tp:0,1", 1)
    s = torch.ops.fxpar.reduce_scatter(x * 3, "tp:0,1", 1)
    a = torch.ops.fxpar.all_reduce(x, "tp:0,1", "avg")
    p = torch.ops.fxpar.gather_params(b, "tp:0,1", 0, torch.float64)
    i = torch.ops.fxpar.identity_fwd_all_reduce_bwd(x, "tp:0,1")
    sl = torch.ops.fxpar.scatter_slice(x, "tp:0,1", 1)
    return g, s, a, p, i + 1, sl


def _all_to_all(x):
    return torch.ops.fxpar.all_to_all(torch.tanh(x), "tp:0,1") * 2


def _args(n=4):
    torch.manual_seed(0)
    return [torch.randn(n, n, dtype=torch.float32) for _ in range(4)]


def _traced(fn, args) -> torch.fx.GraphModule:
    import fxpar.runtime.collectives  # noqa: F401  (kernels for the real tensors make_fx runs on)

    return make_fx(fn, tracing_mode="fake")(*args)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_lowering_sinks_the_wait_past_independent_compute():
    gm = _traced(_mlp, _args())
    assert count_collectives(gm)["all_reduce"] == 1
    assert lower_collectives(gm.graph, lambda name: ("7", 2, 0)) == 1
    gm.recompile()
    targets = _targets(gm)
    assert count_collectives(gm)["all_reduce"] == 0
    start, wait = targets.index(funcol.all_reduce.default), targets.index(funcol.wait_tensor.default)
    mms = [i for i, t in enumerate(targets) if t in (torch.ops.aten.mm.default,)]
    # issued right after its input matmul, waited for after both independent matmuls and the tanh
    assert mms[0] < start and sum(start < i < wait for i in mms) == 2, targets
    assert any(start < i < wait for i, t in enumerate(targets) if t == torch.ops.aten.tanh.default)
    node = next(n for n in gm.graph.nodes if n.target == funcol.all_reduce.default)
    assert node.args[1:] == ("sum", "7") and node.meta["val"].shape == (4, 4)


def test_lowering_of_every_op_kind():
    x, b = torch.randn(4, 6), torch.randn(8)
    gm = _traced(_gathers, [x, b])
    lower_collectives(gm.graph, lambda name: ("7", 2, 1))
    gm.recompile()
    assert sum(count_collectives(gm).values()) == 0
    targets = _targets(gm)
    assert targets.count(funcol.all_gather_into_tensor.default) == 2  # all_gather, gather_params
    assert targets.count(funcol.reduce_scatter_tensor.default) == 1
    assert targets.count(funcol.all_reduce.default) == 1
    assert targets.count(funcol.wait_tensor.default) == 4
    assert torch.ops.aten.div.Tensor in targets  # "avg": a sum, then / group size
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert [tuple(o.meta["val"].shape) for o in outs] == [(4, 12), (4, 3), (4, 6), (16,), (4, 6), (4, 3)]
    assert outs[3].meta["val"].dtype == torch.float64
    # one-rank groups communicate nothing
    gm1 = _traced(_gathers, [x, b])
    lower_collectives(gm1.graph, lambda name: None)
    gm1.recompile()
    assert not any(str(t).startswith("_c10d_functional") for t in _targets(gm1))
    out = gm1(x, b)
    torch.testing.assert_close(out[1], x * 3)
    torch.testing.assert_close(out[3], b.double())
    torch.testing.assert_close(out[5], x)


def test_all_to_all_lowers_to_equal_blocks():
    gm = _traced(_all_to_all, [torch.randn(4, 6)])
    assert lower_collectives(gm.graph, lambda name: ("7", 2, 1)) == 1
    gm.recompile()
    node = next(n for n in gm.graph.nodes if n.target == funcol.all_to_all_single.default)
    assert node.args[1:] == ([2, 2], [2, 2], "7") and _targets(gm).count(funcol.wait_tensor.default) == 1
    assert sum(count_collectives(gm).values()) == 0


def _quantized_gathers(x):
    plain = torch.ops.fxpar.gather_params(x, "tp:0,1", 0, None)
    positional = torch.ops.fxpar.gather_params(x, "tp:0,1", 0, None, "int8")
    keyword = torch.ops.fxpar.gather_params(x, "tp:0,1", 0, comm_dtype="int8")
    return plain, positional, keyword


def test_quantized_param_gathers_stay_opaque():
    # int8 gathers run their own kernel (quantise, gather, dequantise): the lowering leaves them alone
    gm = _traced(_quantized_gathers, [torch.randn(8)])
    assert lower_collectives(gm.graph, lambda name: ("7", 2, 0)) == 1
    left = [n for n in gm.graph.nodes if n.target == torch.ops.fxpar.gather_params.default]
    assert len(left) == 2 and _targets(gm).count(funcol.all_gather_into_tensor.default) == 1


def test_waits_go_below_the_views_of_a_gathered_bucket():
    def fn(shard, x):
        full = torch.ops.fxpar.gather_params(shard, "tp:0,1", 0, None)
        w = full[:16].view(4, 4)  # views of the bucket, right after the gather as ZeRO-3 places them
        y = torch.tanh(x @ x)  # independent compute
        return y @ w.t()

    gm = _traced(fn, [torch.randn(8), torch.randn(4, 4)])
    lower_collectives(gm.graph, lambda name: ("7", 2, 0))
    gm.graph.lint()
    targets = _targets(gm)
    start, wait = targets.index(funcol.all_gather_into_tensor.default), targets.index(funcol.wait_tensor.default)
    assert start < targets.index(torch.ops.aten.tanh.default) < wait, targets
    assert wait < targets.index(torch.ops.aten.slice.Tensor), targets


def test_zero3_gathers_and_their_views_are_marked_for_recompute():
    from torch.utils.checkpoint import CheckpointPolicy

    def fn(shard, x):
        w = torch.ops.fxpar.gather_params(shard, "dp:0,1", 0, None)[:16].view(4, 4)
        return x @ w.t()

    gm = _traced(fn, [torch.randn(8), torch.randn(4, 4)])
    next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default).meta["ac_graph_id"] = 7  # a layer
    assert stage_compile.mark_regather(gm.graph) == 1
    marked = {n.target: n.meta.get("ac_graph_id") for n in gm.graph.nodes
              if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}
    assert set(marked) == {torch.ops.fxpar.gather_params.default, torch.ops.aten.slice.Tensor,
                           torch.ops.aten.view.default, torch.ops.aten.t.default}, marked
    assert set(marked.values()) == {8}  # above the layer's region: its matmul does not make the view saved


def test_async_tp_stays_off_on_cpu():
    gm = _traced(_gathers, [torch.randn(4, 6), torch.randn(8)])
    assert not stage_compile.enable_async_tp(gm, torch.device("cpu"))
    assert not stage_compile.enable_async_tp(gm, None)
    assert "_micro_pipeline_tp" not in stage_compile.inductor_profile(lower_collectives)
    assert stage_compile.inductor_profile(lower_collectives, async_tp=True)["_micro_pipeline_tp"] is True


def _lowered_equals_eager(fn_name: str) -> float:
    """On each rank: an fxpar graph run as it is and lowered to functional collectives; the largest
    difference between the two."""
    from fxpar.runtime.compile import funcol_group
    from fxpar.runtime.groups import new_group

    new_group("tp:0,1", [0, 1])
    fn = globals()[fn_name]
    torch.manual_seed(dist.get_rank())  # different inputs per rank: the collectives matter
    args = [torch.randn(4, 6), torch.randn(8)] if fn is _gathers else [torch.randn(4, 6)] if fn is _all_to_all \
        else _args()
    gm = _traced(fn, args)
    want = gm(*args)
    assert lower_collectives(gm.graph, funcol_group) > 0
    gm.recompile()
    got = gm(*args)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    return max((g.double() - w.double()).abs().max().item() for g, w in zip(got, want))


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["_mlp", "_gathers", "_all_to_all"])
def test_lowered_graph_computes_what_fxpar_ops_compute(pool2, fn):
    assert all(d <= 1e-6 for d in pool2.run(_lowered_equals_eager, fn, timeout=120))


# ---------------------------------------------------------------------------------------------------
# Compiling a stage: the switch and the fallback


def test_plan_compile_switch():
    assert Plan.parse("compile=true").compile is True and Plan.parse("compile=false").compile is False
    assert Plan().compile is None
    assert compile_enabled(None, torch.device("cuda", 0)) and not compile_enabled(None, torch.device("cpu"))
    assert compile_enabled(True, torch.device("cpu")) and not compile_enabled(False, torch.device("cuda"))


def test_a_stage_that_fails_to_compile_runs_eagerly_with_one_warning(monkeypatch):
    def broken(profile):
        def backend(gm, example_inputs):
            raise RuntimeError("no C++ compiler here")
        return backend

    monkeypatch.setattr(stage_compile, "_inductor", broken)
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh()))
    stage = compile_stage(gm, stage=5, lower=lower_collectives)
    x = torch.randn(4, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = stage(x), stage(x)
    messages = [str(w.message) for w in caught if "fxpar" in str(w.message)]
    assert len(messages) == 1, messages
    assert "stage 5" in messages[0] and "no C++ compiler here" in messages[0]
    torch.testing.assert_close(first, gm(x))
    torch.testing.assert_close(second, gm(x))


def test_the_aot_eager_backend_captures_without_inductor(monkeypatch):
    monkeypatch.setenv("FXPAR_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(stage_compile, "_inductor", lambda profile: pytest.fail("Inductor was asked for"))
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh()))
    stage = compile_stage(gm, stage=0, lower=lower_collectives)
    x = torch.randn(4, 3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fxpar: stage", category=RuntimeWarning)  # no eager fallback
        out = stage(x)
    torch.testing.assert_close(out, gm(x))
    out.sum().backward()
    assert x.grad is not None and stage.failed is None


# ---------------------------------------------------------------------------------------------------
# Whole plans, compiled against eager fxpar


@pytest.mark.slow
def test_bf16_compiled_matches_eager_autocast():
    """One process, mixed_precision="bf16": Inductor rounds the bf16 intermediates of its fused kernels as
    eager autocast does (``emulate_precision_casts``), so compiled and eager agree as closely as in fp32
    (without it, 1.1e-3 in loss and 3e-3 in gradients after 3 steps)."""
    r = compiled_vs_eager("mixed_precision=bf16", 3, layers=1)
    assert r["same_keys"] and r["codes"] == 2 and r["loss"] <= TOL and r["grads"] <= TOL, r


@pytest.mark.slow
def test_tp2_compiled_matches_eager(pool2):
    for r in pool2.run(compiled_vs_eager, "tp=2", 3, timeout=600):
        assert r["same_keys"] and r["loss"] <= TOL and r["grads"] <= TOL, r
        assert r["ir_collectives"] > 0  # the IR keeps fxpar's ops: only the compiled code is lowered
        # forward and backward compiled; every collective lowered; some waits after independent compute
        assert r["codes"] == 2 and r["fxpar_calls"] == 0 and r["funcol_calls"] >= 10, r
        assert sum(r["overlapped"]) >= 1, r


@pytest.mark.slow
def test_dp2_zero3_compiled_regathers_in_backward_and_buckets_gathers(pool2):
    # one bucket per layer (bucket_mb=0): embedding, 2 layers, final norm, head. Recorded graphs bypass
    # Inductor's caches (this case compiles cold each time)
    for r in pool2.run(compiled_vs_eager, "dp=2,zero=3,bucket_mb=0", 3, record=True, timeout=600):
        assert r["same_keys"] and r["loss"] <= TOL and r["grads"] <= TOL, r
        assert r["codes"] == 2 and r["fxpar_calls"] == 0 and r["funcol_calls"] > 0, r
        buckets = r["ir_param_gathers"]
        assert buckets == 5, r
        fwd, bwd = r["graphs"]
        assert not fwd["backward"] and bwd["backward"], r["graphs"]
        # the forward gathers every bucket and saves none of them (nor a view of one) for backward ...
        assert len(fwd["input_gathers"]) == buckets and fwd["saved_gathered"] == 0, fwd
        # ... backward gathers them again from the shards: all but the embedding's (its backward needs
        # only the token ids), each the size of a forward gather
        assert len(bwd["input_gathers"]) == buckets - 1 and set(bwd["input_gathers"]) <= set(fwd["input_gathers"])
        # Inductor merged the gathers (5 -> 1 launch forward, 4 -> 1 backward)
        assert r["code_gathers"] == [1, 1], r
        # overlap: in the forward graph as lowered (waits after independent compute), and in the
        # scheduled code of both graphs (the merged gather in flight while compute runs)
        assert fwd["overlapped"] >= 1 and min(r["overlapped"]) >= 1, r


@pytest.mark.slow
def test_dp2_zero3_int8_gathers_compiled_match_eager(pool2):
    # quantised gathers stay fxpar's own (opaque) op inside the compiled graphs, regathered in backward
    for r in pool2.run(compiled_vs_eager, "dp=2,zero=3,comm_dtype=int8", 3, timeout=600):
        assert r["same_keys"] and r["loss"] <= TOL and r["grads"] <= TOL, r
        fwd, bwd = r["opaque_param_gathers"]
        assert fwd == r["ir_param_gathers"] and 1 <= bwd < fwd and r["code_gathers"] == [0, 0], r


@pytest.mark.slow
def test_zero_bubble_schedule_compiled_matches_eager(pool2):
    # a compiled stage's backward is one autograd node, so zbv's I action runs it whole. pp=2 under its
    # default schedule and tp=2 with sequence parallelism compile in the 3-D plan (test_compile_3d.py)
    for r in pool2.run(compiled_vs_eager, "pp=2,schedule=zbv,microbatches=2", 3, timeout=600):
        assert r["same_keys"] and r["loss"] <= TOL and r["grads"] <= TOL, r
        assert r["codes"] >= 2 and r["fxpar_calls"] == 0, r
