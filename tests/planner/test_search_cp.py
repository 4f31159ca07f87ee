"""The search offers context parallelism for long sequences (and where nothing fits without it), with Plan's
rules: no ep, HSDP or sequence parallelism with cp, and 2 x cp chunks dividing the sequence."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

import fxpar
from fxpar import zoo
from fxpar.planner.auto import device_profile
from fxpar.planner.model_costs import model_costs
from fxpar.planner.search import describe, search
from fxpar.planner.space import CP_MIN_SEQ, cp_options


def _costs(seq, sp=(False, True)):
    model = zoo.build("llama", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_costs(model, seq, tp_degrees=(1, 2), sequence_parallel=sp)


@pytest.fixture(scope="module")
def short():
    return _costs(16)


def _plans(auto):
    return [e.plan for e in auto.ranked + auto.rejected]


def test_the_search_offers_cp_at_a_long_sequence():
    costs = _costs(CP_MIN_SEQ, sp=(False,))
    auto = search(costs, 4, device_profile("h100-80gb")[0], global_batch=4)
    plans = _plans(auto)
    assert {p.cp for p in plans} == {1, 2, 4}
    with_cp = [p for p in plans if p.cp > 1]
    assert all(p.world_size == 4 for p in plans)
    assert all(not p.sequence_parallel and p.ep == 1 and p.dp_replicate == 1 for p in with_cp)
    assert any(p.tp == 2 for p in with_cp) and any(p.zero == 3 for p in with_cp)
    assert "cp=2" in describe(next(p for p in with_cp if p.cp == 2))
    # Ulysses where cp divides the heads per TP rank (the zoo Llama: 4 query, 2 key/value heads), priced beside
    # the all-gather; where it divides none ("ulysses" would only repeat the all-gather) not searched
    heads = {(p.cp, p.tp): set() for p in with_cp}
    for p in with_cp:
        heads[(p.cp, p.tp)].add(p.cp_attention)
    assert heads[(2, 1)] == {"allgather", "ulysses"} and heads[(4, 1)] == {"allgather"}
    assert heads[(2, 2)] == {"allgather"}
    ulysses = next(e for e in auto.ranked + auto.rejected if e.plan.cp_attention == "ulysses")
    allgather = next(e for e in auto.ranked + auto.rejected
                     if e.plan == replace(ulysses.plan, cp_attention="allgather"))
    assert ulysses.comm_bytes["cp"] != allgather.comm_bytes["cp"]
    assert "cp_attention=ulysses" in describe(ulysses.plan)


def test_the_search_leaves_cp_out_at_a_short_sequence_where_plans_fit(short):
    auto = search(short, 4, device_profile("h100-80gb")[0], global_batch=4)
    assert {p.cp for p in _plans(auto)} == {1}
    assert cp_options(short, 4, 8) == [] and cp_options(short, 4, 8, needed=True) == [2, 4]


def test_the_search_takes_cp_where_nothing_else_fits(short):
    # one sequence on 2 ranks of a model tp cannot cut: no dp (the batch), no pp (not 2 microbatches), no tp
    refused = replace(short, tp_allowed={1: None, 2: "the heads do not divide"})
    auto = search(refused, 2, device_profile("h100-80gb")[0], global_batch=1)
    assert auto.best.cp == 2 and auto.best.world_size == 2
    assert auto.estimate.comm_bytes["cp"] > 0
    # fxpar.price of the chosen plan, on its own trace, is the estimate the search ranked it by
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = fxpar.price(zoo.build("llama", seed=0), auto.best, device="h100-80gb", global_batch=1, seq=16)
    e = auto.estimate
    assert (got.step_time, got.parts, got.memory, got.comm_bytes) == (e.step_time, e.parts, e.memory, e.comm_bytes)
