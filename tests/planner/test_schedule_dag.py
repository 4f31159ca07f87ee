"""The schedule DAG's critical path against fxpar's event simulator, networkx's own longest path, and the
closed form; the per-rank activation peaks against fxpar.cost.predict.peak_activations."""

import random

import networkx as nx
import pytest

from fxpar.cost.predict import peak_activations
from fxpar.cost.schedule import closed_form, critical_path, peak_activation, schedule_dag
from fxpar.ir.schedule import SCHEDULES, build_schedule, simulate, stage_to_rank, stages_per_rank

CASES = [(2, 4), (4, 8), (4, 6), (3, 9)]


def _costs(rng, n):
    f = [rng.uniform(0.5, 1.5) for _ in range(n)]
    b = [2 * x * rng.uniform(0.8, 1.2) for x in f]
    w = [x * rng.uniform(0.3, 0.6) for x in b]
    return f, b, w


@pytest.mark.parametrize("name", SCHEDULES)
def test_critical_path_equals_simulate(name):
    rng = random.Random(0)
    v = stages_per_rank(name, None)
    for pp, m in CASES:
        n = pp * v
        f, b, w = _costs(rng, n)
        comm = rng.uniform(0, 0.3)
        order = build_schedule(name, pp, m, n)
        ref = simulate(order, stage_to_rank(name, pp, n),
                       {"F": f, "B": b, "I": [x - y for x, y in zip(b, w)], "W": w}, comm=comm)
        got = critical_path(name, pp, m, v, f, b, w, comm, exact=True)
        assert got[0] == pytest.approx(ref.makespan, rel=1e-9)
        assert got[1] == pytest.approx(ref.bubble, rel=1e-6, abs=1e-9)


def test_critical_path_is_networkx_longest_path():
    rng = random.Random(1)
    name, pp, m, v = "interleaved_zb", 4, 8, 2
    f, b, w = _costs(rng, pp * v)
    comm = 0.2
    g, order, place = schedule_dag(name, pp, m, v)
    dur = {"F": f, "B": b, "W": w, "I": [x - y for x, y in zip(b, w)]}
    h = nx.DiGraph()
    for u, x, cross in g.edges(data="cross"):
        h.add_edge(u, x, w=dur[u.kind][u.stage] + (comm if cross else 0.0))
    for acts in order.values():
        h.add_edge(acts[-1], "end", w=dur[acts[-1].kind][acts[-1].stage])
    assert critical_path(name, pp, m, v, f, b, w, comm, exact=True)[0] == pytest.approx(
        nx.dag_longest_path_length(h, weight="w"), rel=1e-9)


@pytest.mark.parametrize("name,tol", [("gpipe", 1e-9), ("1f1b", 0.01), ("interleaved_1f1b", 1e-9),
                                      ("zbv", 0.02), ("interleaved_zb", 0.02), ("looped_bfs", 0.03)])
def test_closed_form_matches_the_dag_on_equal_stages(name, tol):
    v = stages_per_rank(name, None)
    for pp, m, comm in ((4, 16, 0.0), (8, 16, 0.1), (4, 32, 0.2)):
        n = pp * v
        f, b, w = [1.0 / v] * n, [2.0 / v] * n, [1.0 / v] * n
        exact = critical_path(name, pp, m, v, f, b, w, comm, exact=True)[0]
        assert closed_form(name, pp, m, v, f, b, w, comm)[0] == pytest.approx(exact, rel=tol)


def test_gpipe_bubble_formula():
    for pp, m in ((2, 2), (4, 8), (8, 3)):
        _, bubble = critical_path("gpipe", pp, m, 1, 1.0, 2.0)
        assert bubble == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("name", SCHEDULES)
def test_peak_activation_matches_predict(name):
    rng = random.Random(2)
    v = stages_per_rank(name, None)
    for pp, m in CASES:
        n = pp * v
        kept = [rng.randint(1, 100) for _ in range(n)]
        trans = [rng.randint(0, 50) for _ in range(n)]
        order = build_schedule(name, pp, m, n)
        place = stage_to_rank(name, pp, n)
        mine = [[s for s in range(n) if place[s] == r] for r in range(pp)]
        got = peak_activation(name, pp, m, v, [[kept[s] for s in st] for st in mine],
                              [[trans[s] for s in st] for st in mine], exact=True)
        for r in range(pp):
            ref = peak_activations({s: (kept[s], trans[s]) for s in mine[r]}, order[r])
            assert got[r] == ref


@pytest.mark.parametrize("name", SCHEDULES)
def test_closed_form_activation_peak_on_equal_stages(name):
    v = stages_per_rank(name, None)
    for pp, m in ((4, 16), (8, 32)):
        kept = [[3.0] * v for _ in range(pp)]
        trans = [[2.0] * v for _ in range(pp)]
        exact = peak_activation(name, pp, m, v, kept, trans, exact=True)
        closed = peak_activation(name, pp, m, v, kept, trans, exact=False)
        assert closed == pytest.approx(exact, abs=2.0)  # the transient: at most one stage's
