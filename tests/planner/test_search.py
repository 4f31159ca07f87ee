"""The search on hand-built ModelCosts: a Llama-3-70B-shaped model on 1024 H100-like ranks in seconds, TP
kept inside a node when the network is slow, the hand-made baseline always priced, and the errors for
requests nothing can run."""

import json
import re
import time

import pytest

from fxpar.cost.profiles import DeviceProfile, Link
from fxpar.ir.errors import PlanError
from fxpar.ir.plan import Plan
from fxpar.planner.model_costs import ModelCosts, RankPart
from fxpar.planner.price import Pricer
from fxpar.planner.search import search
from fxpar.planner.space import candidates


def h100(rpn=8, inter=4.5e10, memory=80 * 10**9):
    # published H100 SXM figures with ~70% sustained (bf16 989 TFLOP/s dense, 3.35 TB/s HBM, NVLink, 400 Gb/s IB)
    return DeviceProfile("h100-test", flops={"bf16": 7e14, "fp32": 3.5e14}, mem_bw=2.8e12, memory=memory,
                         ranks_per_node=rpn, intra=Link(3.6e11, 5e-6), inter=Link(inter, 1e-5),
                         op_overhead=4e-6, peak_flops={"bf16": 9.89e14})


def llama_costs(layers=80, h=8192, ffn=28672, heads=64, kv=8, vocab=128256, seq=8192, tps=(1, 2, 4, 8), nbytes=2):
    """A Llama-shaped ModelCosts built from the shape alone (numbers in the form model_costs gives)."""
    d = h // heads
    mats = [(h, h), (h, kv * d), (h, kv * d), (h, h), (h, ffn), (h, ffn), (ffn, h)]
    parts = {"pre": {}, "layer": {}, "post": {}}
    for tp in tps:
        for sp in (False, True) if tp > 1 else (False,):
            nodes, params = [], 2 * h
            for i, (a, o) in enumerate(mats):
                o_, a_ = (o // tp, a) if i not in (3, 6) else (o, a // tp)
                f = 2 * seq * a_ * o_
                nodes.append((f, 2 * f, seq * (a_ + o_) * nbytes, a_ * o_ * nbytes))
                params += a_ * o_
            att = 2 * seq * seq * h // tp
            nodes.append((att, 2.5 * att, 4 * seq * h // tp * nbytes, 0))
            for _ in range(12):
                nodes.append((5 * seq * h, 5 * seq * h, 3 * seq * h * nbytes // (tp if sp else 1), 0))
            comm = [] if tp == 1 else (
                [("reduce_scatter", seq * h * nbytes, "fwd"), ("all_gather", seq * h * nbytes, "fwd")] * 2
                + [("reduce_scatter", seq * h * nbytes, "bwd"), ("all_gather", seq * h * nbytes, "bwd")] * 2
                if sp else
                [("all_reduce", seq * h * nbytes, "fwd")] * 2 + [("all_reduce", seq * h * nbytes, "bwd")] * 2)
            kept = seq * h * (34 // tp if sp else 10 + 24 // tp)
            act = {"none": (kept, 0), "selective": (kept // 2, kept // 2), "layer": (seq * h * nbytes, kept)}
            parts["layer"][(tp, sp)] = RankPart(nodes, params, comm, act, seq * h * nbytes)
            parts["pre"][(tp, sp)] = RankPart([(0, 0, 2 * seq * h * nbytes, 0)], vocab * h // tp, [],
                                              {k: (0, 0) for k in act}, seq * h * nbytes)
            head = 2 * seq * h * vocab // tp
            post_nodes = [(5 * seq * h, 5 * seq * h, 2 * seq * h * nbytes, 0),
                          (head, 2 * head, seq * (h + vocab // tp) * nbytes, h * vocab // tp * nbytes),
                          (5 * seq * vocab // tp, 5 * seq * vocab // tp, 2 * seq * vocab // tp * 4, 0)]
            lk = seq * vocab // tp * 4 + seq * h * nbytes
            parts["post"][(tp, sp)] = RankPart(post_nodes, h * vocab // tp + h, [], {k: (lk, 0) for k in act}, 0)
    lp = parts["layer"][(1, False)].params
    total = layers * lp + 2 * vocab * h + h
    fpt = 6 * (total - vocab * h) + 6 * seq * h * layers
    return ModelCosts(seq, "bf16" if nbytes == 2 else "fp32", ["layer"] * layers, parts, total,
                      {t: None for t in tps}, fpt, 2)


@pytest.mark.serial  # a CPU-time bound
def test_llama70b_on_1024_ranks_in_seconds():
    costs = llama_costs()
    t, cpu = time.perf_counter(), time.process_time()
    auto = search(costs, 1024, h100(), global_batch=1024)
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    print(f"70B-shaped search over world 1024: {seconds:.2f} s wall, {cpu:.2f} s cpu, "
          f"{len(auto.ranked) + len(auto.rejected)} plans")
    # under 3 s of CPU on the quiet 2-core dev host, 3-4 s when it is loaded (its CPU seconds vary 2x from hour
    # to hour, and the CI host is slower still): the bound catches a search that prices 2-3x more than it does
    assert cpu < 6, cpu
    best = auto.estimate
    assert best.fits and best.plan.world_size == 1024 and auto.best == best.plan
    times = [e.step_time for e in auto.ranked]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(times, times[1:]))
    assert all(not e.fits and e.why_not.startswith("memory") for e in auto.rejected)
    assert auto.reasons["memory"] == len(auto.rejected) and auto.reasons["time"] == len(auto.ranked) - 1
    assert 0.05 < best.mfu < 0.8
    base = auto.baseline
    assert (base.plan.tp, base.plan.zero, base.plan.schedule) == (8, 1, "1f1b") and base.plan.pp > 1
    assert base.plan.microbatches % base.plan.pp == 0 and base.fits
    assert base.step_time >= best.step_time
    text = auto.to_text()
    for needle in ("chosen plan", "MFU", "base", "x the chosen step time", "why the others lost", "memory:"):
        assert needle in text
    assert auto.to_dict()["best"]["plan"]["dp"] == auto.best.dp


def test_tp_stays_inside_a_node_when_the_network_is_slow():
    costs = llama_costs(layers=8, h=2048, ffn=8192, heads=16, kv=4, vocab=32000, seq=2048)
    slow = search(costs, 16, h100(rpn=4, inter=1e9), global_batch=64)
    assert slow.best.tp <= 4
    assert all(e.plan.tp <= 4 for e in slow.ranked)
    assert any(why.startswith("topology") for _, why in slow.excluded)
    # the space itself: every plan prices, every rejection says why
    plans, rejected = candidates(costs, 16, 64, ranks_per_node=4)
    pricer = Pricer(costs, h100(rpn=4), global_batch=64)
    assert plans and all(pricer.price(p, exact=False).plan == p for p in plans[::50])
    assert {p.tp for p in plans} == {1, 2, 4} and all(p.dp * p.pp * p.tp == 16 for p in plans)
    assert all(why.split(":")[0] in ("divisibility", "topology", "schedule") for _, why in rejected)
    wide, _ = candidates(costs, 16, 64, ranks_per_node=4, cross_node_tp=True)
    assert {p.tp for p in wide} == {1, 2, 4, 8}


def test_deterministic_and_plans_argument():
    costs = llama_costs(layers=8, h=2048, ffn=8192, heads=16, kv=4, vocab=32000, seq=2048)
    a = search(costs, 8, h100(), global_batch=32)
    b = search(costs, 8, h100(), global_batch=32)
    assert a.best == b.best
    assert json.loads(json.dumps(a.to_dict()))["best"]["plan"] == {k: v for k, v in a.best.to_dict().items()
                                                                   if k != "tp_plan"}
    plans = [Plan(dp=8, zero=1), Plan(tp=8), Plan(dp=2, pp=4, microbatches=8)]
    c = search(costs, 8, h100(), global_batch=32, plans=plans)
    assert {e.plan for e in c.ranked + c.rejected} <= set(plans) | {c.baseline.plan}
    assert c.best in plans


def test_no_factorisation_names_the_degrees():
    costs = llama_costs(layers=2, h=512, ffn=1024, heads=4, kv=4, vocab=1000, seq=128, tps=(1, 2))
    costs.tp_allowed[3] = "4 heads are not divisible by 3"
    with pytest.raises(PlanError, match=r"world 6.*tp can be 1, 2.*heads are not divisible by 3"):
        search(costs, 6, h100(), global_batch=4)


def test_model_that_does_not_fit_says_how_many_ranks_would():
    costs = llama_costs(layers=8, h=4096, ffn=14336, heads=32, kv=8, vocab=32000, seq=1024, tps=(1, 2))
    with pytest.raises(PlanError, match=r"needs .* GB per rank even at zero=.*has 3.0 GB: use >= \d+ ranks") as e:
        search(costs, 4, h100(memory=3 * 10**9), global_batch=4)
    need = int(re.search(r"use >= (\d+) ranks", str(e.value)).group(1))
    assert search(costs, need, h100(memory=3 * 10**9), global_batch=need).estimate.fits
