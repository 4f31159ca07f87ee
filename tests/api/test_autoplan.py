"""``fxpar.autoplan``: the wiring of the public entry point to the planner (one trace's costs, the device
profile, the search), checked against the planner's own pieces called directly, and its errors."""

from __future__ import annotations

import pytest

import fxpar
from fxpar import launch, zoo
from fxpar.ir.plan import Plan
from fxpar.ir.units import parse_size
from fxpar.planner import auto, feasibility

BATCH, SEQ = 8, 16


@pytest.fixture(scope="module")
def llama():
    return zoo.build("llama", seed=0)


@pytest.fixture(scope="module")
def planned(llama):
    return fxpar.autoplan(llama, 4, device="h100-80gb", global_batch=BATCH, seq=SEQ)


def test_autoplan_world4_returns_the_first_of_its_ranking(planned):
    best = planned.best
    assert isinstance(best, Plan) and best.dp * best.pp * best.tp == 4 == best.world_size
    assert planned.world == 4 and planned.profile.name == "h100-80gb"
    assert planned.ranked and planned.ranked[0].plan == best and planned.estimate.plan == best
    times = [e.step_time for e in planned.ranked]
    assert times[0] > 0 and all(a <= b + 1e-9 for a, b in zip(times, times[1:]))  # ties: the search's fixed key
    assert all(e.fits for e in planned.ranked) and all(e.why_not for e in planned.rejected)
    for e in planned.ranked:  # every candidate is a valid split of this batch over 4 ranks
        assert e.plan.world_size == 4
        assert BATCH % (e.plan.dp * (e.plan.microbatches or e.plan.pp)) == 0, e.plan


def test_autoplan_prices_the_best_as_the_planner_does(llama, planned):
    """The estimate autoplan returns is the one price_plan gives for its plan on the same costs and profile,
    and handing autoplan those costs (no trace) chooses the same plan."""
    from fxpar.cost.profiles import load_profile
    from fxpar.planner.model_costs import model_costs
    from fxpar.planner.price import price_plan

    profile = load_profile("h100-80gb")
    costs = model_costs(llama, SEQ, tp_degrees=auto.tp_degrees(4, profile.ranks_per_node))
    again = price_plan(costs, planned.best, profile, global_batch=BATCH)
    assert again.step_time == pytest.approx(planned.estimate.step_time, rel=1e-9)
    assert again.memory["total"] == planned.estimate.memory["total"]
    reused = fxpar.autoplan(llama, 4, device=profile, global_batch=BATCH, seq=SEQ, costs=costs)
    assert reused.best == planned.best
    text = reused.to_text(top=3)
    assert planned.best.to_text().split(",")[0] in text.replace(" ", "")  # the chosen plan is named


def test_memory_per_rank_limits_the_choice(llama, planned):
    """A memory limit just below the best plan's peak rules it out (the new best fits under it), and a
    limit no plan meets is an error naming the bytes."""
    peak = planned.estimate.memory["total"]
    tight = fxpar.autoplan(llama, 4, device="h100-80gb", memory_per_rank=peak - 1, global_batch=BATCH, seq=SEQ)
    assert tight.best != planned.best and tight.estimate.memory["total"] <= peak - 1
    with pytest.raises(fxpar.PlanError, match=r"(?i)GB|MB|KB|bytes"):
        fxpar.autoplan(llama, 4, device="h100-80gb", memory_per_rank="1KB", global_batch=BATCH, seq=SEQ)


def test_no_factorisation_is_an_error_naming_the_numbers(llama):
    """World 5 for a 2-layer model with 4 heads and a batch of 4: dp 5 does not divide the batch, tp 5 not the
    heads, pp 5 exceeds the layers."""
    with pytest.raises(fxpar.PlanError, match="5"):
        fxpar.autoplan(llama, 5, device="h100-80gb", global_batch=4, seq=SEQ)


def test_argument_errors(monkeypatch):
    with pytest.raises(fxpar.PlanError, match="80GB"):
        parse_size("eighty gigs")
    assert parse_size("80GB") == 80 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size(" 512 mb") == 512 * 10**6 and parse_size(1e9) == 10**9
    with pytest.raises(fxpar.PlanError, match="world_size"):
        fxpar.autoplan(None, 0, global_batch=BATCH, seq=SEQ)
    assert auto.tp_degrees(1024, 8) == (1, 2, 4, 8) and auto.tp_degrees(6, 8) == (1, 2, 3, 6)
    monkeypatch.setenv("WORLD_SIZE", "4")  # under torchrun, before compile joins the group: planned for 4
    assert launch.world_size() == 4


def test_plan_mismatch_across_ranks_names_both_plans():
    a, b = Plan(dp=4, zero=1), Plan(dp=2, pp=2)
    message = auto.plan_mismatch([auto.plan_key(a), auto.plan_key(a), auto.plan_key(b), auto.plan_key(a)])
    assert "rank 0 dp=4" in message and "rank 2 dp=2,pp=2" in message
    assert auto.plan_mismatch([auto.plan_key(a)] * 3) is None
    assert Plan.parse(Plan(dp=2, pp=2, zero=1, sequence_parallel=True, microbatches=4).to_text()) == \
        Plan(dp=2, pp=2, zero=1, sequence_parallel=True, microbatches=4)


def test_example_shape_reads_batch_and_length():
    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=6, seq=12)
    assert auto.example_shape((), batch) == (6, 12)


def test_compile_auto_needs_an_optimizer(llama):
    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=2, seq=8)
    with pytest.raises(fxpar.PlanError, match="optimizer"):
        fxpar.compile(llama, "auto", example_kwargs=batch)


def test_plans_compile_refuses_are_never_chosen():
    """gpt2 ties its embedding to its LM head: compile refuses ZeRO-3 with pp > 1 for it, so autoplan never
    ranks such a plan (they are priced and rejected with the reason); llama has no tie and no such rule.
    Selective recompute under a zero-bubble schedule is refused for every model."""
    gpt2 = zoo.build("gpt2", seed=0)
    assert feasibility.tied_parameters(gpt2) and not feasibility.tied_parameters(zoo.build("llama"))
    rule = feasibility.compile_rule(zoo.build("llama"))
    assert rule(Plan(dp=2, pp=2, zero=3)) is None and rule(Plan(pp=2, schedule="zbv", recompute="selective"))
    planned = fxpar.autoplan(gpt2, 4, device="h100-80gb", global_batch=BATCH, seq=SEQ)
    assert not any(e.plan.zero == 3 and e.plan.pp > 1 for e in planned.ranked)
    refused = [e for e in planned.rejected if "tied weights" in (e.why_not or "")]
    assert refused and all(e.plan.zero == 3 and e.plan.pp > 1 for e in refused), refused[:3]
    assert not any(e.plan.recompute == "selective" and e.plan.schedule in ("zbv", "interleaved_zb")
                   for e in planned.ranked)  # the recompute pass refuses those
