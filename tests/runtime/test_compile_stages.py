"""``Plan(compile=True)``: stage graphs through Inductor, fxpar's collectives lowered to functional ones.

Compiling costs seconds per graph on these CPUs, so the multi-rank cases use 2 gloo ranks, a 2-layer
tiny llama and 3 steps, and are marked slow. The lowering itself is checked on small graphs: where the
waits go, and that the lowered graph computes what the fxpar ops compute.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.fx
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

import fxpar
from fxpar import zoo
from fxpar.ir.ops import count_collectives
from fxpar.ir.plan import Plan
from fxpar.passes.lower_collectives import lower_collectives
from fxpar.runtime import compile as stage_compile
from fxpar.runtime.compile import compile_enabled, compile_stage
from fxpar.testing import multiproc

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


def _lowered_equals_eager(fn_name: str) -> float:
    """On each rank: an fxpar graph run as it is and lowered to functional collectives; the largest
    difference between the two."""
    from fxpar.runtime.compile import funcol_group
    from fxpar.runtime.groups import new_group

    new_group("tp:0,1", [0, 1])
    fn = globals()[fn_name]
    torch.manual_seed(dist.get_rank())  # different inputs per rank: the collectives matter
    args = [torch.randn(4, 6), torch.randn(8)] if fn is _gathers else _args()
    gm = _traced(fn, args)
    want = gm(*args)
    assert lower_collectives(gm.graph, funcol_group) > 0
    gm.recompile()
    got = gm(*args)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    return max((g.double() - w.double()).abs().max().item() for g, w in zip(got, want))


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["_mlp", "_gathers"])
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


# ---------------------------------------------------------------------------------------------------
# Whole plans, compiled against eager fxpar


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


_STARTS = re.compile(r"_c10d_functional\.(all_reduce_|all_gather_into_tensor|reduce_scatter_tensor)\.default\(")
_COMPUTE = ("extern_kernels.", "cpp_fused_")


def overlapped(code: str) -> int:
    """How many collectives of a compiled wrapper have compute between their start and their wait."""
    lines = code.splitlines()
    count = 0
    for i, line in enumerate(lines):
        if not _STARTS.search(line):
            continue
        buf = re.match(r"\s*(buf\d+) =", line) or re.search(r"\((?:reinterpret_tensor\()?(buf\d+)", line)
        name = buf.group(1)
        wait = next((j for j in range(i + 1, len(lines)) if "wait_tensor" in lines[j]
                     and re.search(rf"\b{name}\b", lines[j])), None)
        assert wait is not None, f"no wait for {name}"
        count += any(c in ln for ln in lines[i + 1:wait] for c in _COMPUTE)
    return count


def compiled_vs_eager(plan: str, steps: int) -> dict:
    """Train the same tiny llama ``steps`` steps under ``plan`` eagerly and compiled: the largest loss
    and gradient differences, what the compiled code calls, and the fxpar ops left in the IR."""
    name = "llama"
    cfg = dict(num_hidden_layers=2)
    batch = zoo.example_inputs(name, zoo.tiny_config(name, **cfg), batch=2, seq=8)
    runs, codes = {}, []
    for flag in (False, True):
        model = fxpar.compile(zoo.build(name, seed=0, **cfg), Plan.parse(plan + f",compile={flag}"),
                              example_kwargs=batch, optimizer=_sgd, timeout=120)
        with warnings.catch_warnings():
            # a fallback to eager would be a failure here (only fxpar's warning: torch may warn on its own)
            warnings.filterwarnings("error", message="fxpar: stage", category=RuntimeWarning)
            losses = []
            for i in range(steps):
                if flag and i == 0:
                    loss, codes = run_and_get_code(model.step, **batch)
                else:
                    loss = model.step(**batch)
                losses.append(loss.item())
        runs[flag] = (losses, model.full_state_dict(grads=True), model)
    (l0, g0, _), (l1, g1, compiled) = runs[False], runs[True]
    ir = sum(sum(count_collectives(s.gm).values()) for s in compiled.pipeline.stages_of(compiled.pp_rank))
    return {"loss": max(abs(a - b) for a, b in zip(l0, l1)),
            "grads": max((g0[k] - g1[k]).abs().max().item() for k in g0),
            "same_keys": sorted(g0) == sorted(g1), "ir_collectives": ir, "losses": l1,
            "codes": len(codes), "fxpar_calls": sum(c.count("torch.ops.fxpar.") for c in codes),
            "funcol_calls": sum(len(_STARTS.findall(c)) for c in codes),
            "overlapped": sum(overlapped(c) for c in codes)}


@pytest.mark.slow
def test_tp2_compiled_matches_eager(pool2):
    for r in pool2.run(compiled_vs_eager, "tp=2", 3, timeout=600):
        assert r["same_keys"] and r["loss"] <= TOL and r["grads"] <= TOL, r
        assert r["ir_collectives"] > 0  # the IR keeps fxpar's ops: only the compiled code is lowered
        # forward and backward compiled; every collective lowered; some waits after independent compute
        assert r["codes"] == 2 and r["fxpar_calls"] == 0 and r["funcol_calls"] >= 10, r
        assert r["overlapped"] >= 1, r


@pytest.mark.slow
def test_dp2_zero3_compiled_matches_eager(pool2):
    for r in pool2.run(compiled_vs_eager, "dp=2,zero=3", 3, timeout=600):
        assert r["same_keys"] and r["loss"] <= TOL and r["grads"] <= TOL, r
        assert r["codes"] == 2 and r["fxpar_calls"] == 0 and r["funcol_calls"] > 0, r


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["pp=2", "pp=2,schedule=zbv,microbatches=2", "tp=2,sequence_parallel=true"])
def test_pp2_and_sequence_parallel_compiled_match_eager(pool2, plan):
    # zbv: a compiled stage's backward is one autograd node, so its I action runs it whole
    for r in pool2.run(compiled_vs_eager, plan, 3, timeout=600):
        assert r["same_keys"] and r["loss"] <= TOL and r["grads"] <= TOL, r
        assert r["codes"] >= 2 and r["fxpar_calls"] == 0, r
