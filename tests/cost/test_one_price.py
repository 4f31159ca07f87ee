"""One price for one plan: ``fxpar.price`` gives, for every plan of ``fxpar.autoplan``'s table, the numbers the
planner ranked it by (step time and its parts, memory by part, bytes by axis, bubble, MFU), on three zoo
models. The first plan's price traces the model again (its own costs, as a caller's would); the others read
the table's costs, to keep the test fast."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxpar
from fxpar import zoo
from fxpar.cost.estimate import Estimate
from fxpar.ir.errors import PlanError
from fxpar.planner.model_costs import model_costs

CASES = [("llama", 4, "cpu"), ("mixtral", 2, "h100-80gb"), ("gpt2", 2, "cpu")]


def _numbers(e: Estimate) -> dict:
    return {"step": e.step_time, "parts": e.parts, "memory": e.memory, "bytes": e.comm_bytes, "bubble": e.bubble,
            "mfu": e.mfu, "fits": e.fits}


@pytest.mark.parametrize("name,world,device", CASES, ids=[c[0] for c in CASES])
def test_price_equals_the_planners_estimate_for_every_plan_of_the_table(name, world, device):
    model = zoo.build(name, seed=0)
    costs = model_costs(model, 16, tp_degrees=(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = fxpar.autoplan(model, world, device=device, global_batch=8, seq=16, top=5, costs=costs)
    table = auto.ranked[:5]  # the table fxpar plan --auto prints
    assert len(table) == 5, f"{name}: the auto table has {len(table)} plans"
    for i, e in enumerate(table):
        got = fxpar.price(model, e.plan, world=world, device=device, global_batch=8, seq=16,
                          costs=None if i == 0 else costs)
        assert isinstance(got, Estimate) and got.plan == e.plan
        assert _numbers(got) == _numbers(e), f"{name} {e.plan}"


def test_price_refuses_a_world_the_plan_does_not_make():
    with pytest.raises(PlanError, match="world=8 but the plan's degrees make 4"):
        fxpar.price(zoo.build("llama"), "dp=2,tp=2", world=8, device="cpu", global_batch=8, seq=16)


def test_compiled_predicted_is_the_plans_price_priced_only_when_read(monkeypatch):
    """A built plan's ``predicted`` is ``fxpar.price`` of that plan for the example batch (its global batch
    and length) on the profile compile was given; building it prices nothing, reading it prices once."""
    from fxpar.api import price as build
    from fxpar.planner import auto

    calls = []
    real = auto.price
    monkeypatch.setattr(auto, "price", lambda *a, **k: calls.append(k) or real(*a, **k))
    model = zoo.build("llama", seed=0)
    plan = "dp=2,pp=2,zero=1"
    built = build(model, plan, example_kwargs=zoo.example_inputs("llama", model, batch=8, seq=8),
                  profile="h100-80gb", optimizer=lambda ps: torch.optim.AdamW(ps))
    assert calls == []  # compile itself does not pay for the price
    got = built.predicted
    assert isinstance(got, Estimate) and built.predicted is got and len(calls) == 1
    want = real(model, plan, device="h100-80gb", global_batch=8, seq=8)
    assert got == want and _numbers(got) == _numbers(want)
    assert f"microbatches on h100-80gb: {want.step_time * 1e3:.2f}ms" in fxpar.inspect(built, quiet=True).to_text()
