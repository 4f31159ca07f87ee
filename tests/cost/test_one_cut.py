"""One cut algorithm: for the same plan and device profile, the pipeline stages ``fxpar.compile`` builds
(a dry build, no ranks) begin at the modules the planner prices (:meth:`fxpar.cost.estimate.Pricer.plan_cuts`),
on three zoo models: 4-layer Llama on the H100 profile, 4-layer GPT-2 on the H100 profile (its stages
bounded by transfers: equal stages in different layers, a tie the two sums must break alike) and Gemma
(tied embeddings) on the CPU profile, each at two pipeline sizes and microbatch sizes."""

from __future__ import annotations

import warnings

import pytest

from fxpar import zoo
from fxpar.api import price as dry_build
from fxpar.cost.estimate import Pricer
from fxpar.cost.profiles import PROFILES
from fxpar.ir.plan import Plan
from fxpar.planner.model_costs import model_costs

SEQ, BATCH = 16, 12
CASES = [("llama", {"num_hidden_layers": 4}, "h100-80gb", ("pp=2", "pp=3")),
         ("gpt2", {"n_layer": 4}, "h100-80gb", ("pp=2", "pp=4,microbatches=6")),
         ("gemma", {}, "cpu", ("pp=2", "pp=4,microbatches=6"))]


@pytest.mark.parametrize("name,config,device,plans", CASES, ids=[c[0] for c in CASES])
def test_compile_cuts_where_the_planner_prices_its_stages(name, config, device, plans):
    model = zoo.build(name, seed=0, **config)
    batch = zoo.example_inputs(name, model, batch=BATCH, seq=SEQ)
    pricer = Pricer(model_costs(model, SEQ, tp_degrees=(1,), sequence_parallel=(False,)), PROFILES[device],
                    global_batch=BATCH)
    for text in plans:
        plan = Plan.parse(text)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # stages nearly empty: the tiny model's pipeline warning
            built = dry_build(model, plan, example_kwargs=batch, profile=device)
        cuts = [m for m, where in built.cuts if where == "beginning"]
        assert len(cuts) == plan.pp - 1
        assert pricer.plan_cuts(plan) == cuts, f"{name} {text} on {device}"
