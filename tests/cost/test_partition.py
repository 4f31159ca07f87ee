"""Cut candidates, the balanced dynamic program (checked against brute force), explicit split points."""

from __future__ import annotations

import itertools

import pytest

import fxpar
from fxpar import zoo
from fxpar.cost import partition as P
from fxpar.cost.profiles import PROFILES
from fxpar.ir.errors import PlanError

CPU_P = PROFILES["cpu"]


@pytest.fixture(scope="module")
def llama():
    model = zoo.build("llama", num_hidden_layers=4)
    return fxpar.trace(model, example_kwargs=zoo.example_inputs("llama", model, batch=2, seq=16))


def test_candidates_follow_the_pp_plan_and_block_children(llama):
    names = P.candidate_modules(llama)
    assert "model.embed_tokens" in names and "lm_head" in names and "model.norm" in names
    assert "model.layers.2" in names and "model.layers.2.mlp" in names
    positions = P.cut_positions(llama, names)
    assert list(positions) == sorted(positions) and 0 not in positions


@pytest.mark.parametrize("n_stages", [2, 3, 4])
@pytest.mark.parametrize("device", [("cpu", "fp32"), ("h100-80gb", "bf16")], ids=["cpu", "h100"])
def test_dynamic_program_matches_brute_force(llama, n_stages, device):
    profile, dtype = PROFILES[device[0]], device[1]
    cands = list(P.cut_positions(llama, P.candidate_modules(llama)).values())
    best = min(max(c.total for c in P.stage_costs(llama, [(m, "beginning") for m in combo], profile, dtype))
               for combo in itertools.combinations(cands, n_stages - 1))
    cuts = P.balanced_cuts(llama, n_stages, profile, dtype)
    got = max(c.total for c in P.stage_costs(llama, cuts, profile, dtype))
    assert got == pytest.approx(best, rel=1e-9)


def test_stage_costs_add_up(llama):
    cuts = P.balanced_cuts(llama, 3, CPU_P)
    costs = P.stage_costs(llama, cuts, CPU_P)
    whole = P.stage_costs(llama, [], CPU_P)[0]
    assert sum(c.fwd for c in costs) == pytest.approx(whole.fwd)
    assert sum(c.params for c in costs) == whole.params
    assert costs[0].recv_bytes == 0 and costs[-1].send_bytes == 0


def test_explicit_split_points(llama):
    cuts = P.resolve_split_points(llama, {"model.layers.2": "beginning", "model.layers.0": "end"})
    assert cuts == [("model.layers.0", "end"), ("model.layers.2", "beginning")]
    with pytest.raises(PlanError, match="owns no node"):
        P.resolve_split_points(llama, {"model.layers.7": "beginning"})
    with pytest.raises(PlanError, match="empty"):
        P.resolve_split_points(llama, {"model.embed_tokens": "beginning"})


def test_too_many_stages_is_a_clear_error(llama):
    n = len(P.cut_positions(llama, P.candidate_modules(llama)))
    with pytest.raises(PlanError, match=f"need {n + 1} cuts, but LlamaForCausalLM offers only {n}"):
        P.balanced_cuts(llama, n + 2)


def test_boundary_bytes_are_the_hidden_state_at_every_block(llama):
    """The mask and rotary tables are recomputed by each stage: at the start of any block only the
    residual stream (batch x seq x hidden, fp32) crosses, and its gradient comes back."""
    hidden = 2 * 16 * llama.root.config.hidden_size * 4
    cross, gcross = P.crossing_bytes(llama)
    spans = P.module_positions(llama)
    for i in range(1, 4):
        pos = spans[f"model.layers.{i}"][0]
        assert cross[pos] == gcross[pos] == hidden
    costs = P.stage_costs(llama, [("model.layers.2", "beginning")])
    assert (costs[0].send_bytes, costs[1].recv_bytes, costs[1].grad_send_bytes) == (hidden, hidden, hidden)
