"""The search covers what the runtime has: expert parallelism for a MoE model, ZeRO-3's int8 gathers and the
fused loss, each priced (against hand counts from the tiny models' configs) and searched."""

from __future__ import annotations

import warnings

import pytest

from fxpar import zoo
from fxpar.cost.comm import sent_bytes
from fxpar.cost.estimate import Pricer
from fxpar.ir.plan import Plan
from fxpar.ir.wire import int8_wire_bytes
from fxpar.planner.auto import device_profile
from fxpar.planner.model_costs import model_costs
from fxpar.planner.search import search

SEQ, BATCH = 16, 8


@pytest.fixture(scope="module")
def mixtral():
    model = zoo.build("mixtral", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, model_costs(model, SEQ, tp_degrees=(1,))


def _pricer(costs, device="h100-80gb", **kw):
    return Pricer(costs, device_profile(device)[0], global_batch=BATCH, **kw)


def test_ep_prices_each_ranks_experts_and_the_all_to_alls(mixtral):
    model, costs = mixtral
    cfg = model.config
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts > 0
    pricer = _pricer(costs)
    dp, ep = pricer.price(Plan(dp=2)), pricer.price(Plan(ep=2))
    # each ep rank holds half of every MoE layer's experts, and all of the rest
    assert ep.memory["params"] == 4 * (costs.params - experts // 2)
    assert dp.memory["params"] == 4 * costs.params
    # per MoE layer and microbatch: dispatch and combine forward, the same two in backward, each sending the
    # half of its seq x top-k rows of hidden fp32 entries that other rank's experts take; and the counts' all-gather
    b = BATCH // 2
    rows = b * SEQ * cfg.num_experts_per_tok * cfg.hidden_size * 4
    hand = cfg.num_hidden_layers * (4 * sent_bytes("all_to_all", rows, 2) + 8 * cfg.num_local_experts)
    assert ep.comm_bytes["ep"] == hand
    assert ep.parts["ep_comm"] > 0 and "ep" not in dp.comm_bytes
    # the dense parameters reduce over both replicas, the expert halves over dp=1: nothing
    assert ep.comm_bytes["dp"] == pytest.approx(4 * (costs.params - experts), rel=1e-9)


def test_the_search_table_has_ep_plans_for_a_moe_model(mixtral):
    _, costs = mixtral
    auto = search(costs, 4, device_profile("cpu")[0], global_batch=BATCH)
    plans = [e.plan for e in auto.ranked + auto.rejected]
    assert {p.ep for p in plans} == {1, 2, 4}
    assert all(p.tp == 1 and p.zero != 3 for p in plans if p.ep > 1)


def test_int8_gathers_quarter_zero3s_fp32_gather_bytes_and_are_searched_when_asked(mixtral):
    _, costs = mixtral
    pricer = _pricer(costs)
    n, shard = costs.params, 2
    rs = sent_bytes("reduce_scatter", 4 * n, shard)  # the gradients' reduce-scatter stays fp32
    gathers = {dtype: pricer.price(Plan(dp=2, zero=3, **kw)).comm_bytes["dp"] - rs
               for dtype, kw in (("fp32", {}), ("bf16", {"mixed_precision": "bf16"}), ("int8", {"comm_dtype": "int8"}))}
    # forward and backward gather every parameter once per microbatch
    assert gathers["fp32"] == pytest.approx(2 * sent_bytes("all_gather", 4 * n, shard), rel=1e-9)
    assert gathers["bf16"] == pytest.approx(2 * sent_bytes("all_gather", 2 * n, shard), rel=1e-9)
    assert gathers["int8"] == pytest.approx(2 * sent_bytes("all_gather", int8_wire_bytes(n, shard), shard), rel=1e-4)
    profile = device_profile("cpu")[0]
    assert not any(e.plan.comm_dtype for e in search(costs, 2, profile, global_batch=BATCH).ranked)
    asked = search(costs, 2, profile, global_batch=BATCH, int8=True)
    assert {e.plan.comm_dtype for e in asked.ranked + asked.rejected if e.plan.zero == 3} == {None, "int8"}


def test_fused_loss_drops_the_logits_and_is_chosen_where_only_it_fits():
    model = zoo.build("llama", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        costs = model_costs(model, SEQ, tp_degrees=(1,))
    pricer = _pricer(costs, "cpu")
    plain, fused = pricer.price(Plan()), pricer.price(Plan(fused_loss=True))
    logits = BATCH * SEQ * model.config.vocab_size * 4  # [batch, seq, vocab] fp32, never made whole
    assert plain.memory["activations"] - fused.memory["activations"] >= logits
    assert fused.parts["compute"] > plain.parts["compute"]  # the head's matmul again in backward
    # a rank too small for every plan without the fused loss, recompute included, as the search prices them:
    # it finds a fused one
    everything = search(costs, 1, device_profile("cpu")[0], global_batch=BATCH, memory_per_rank=1 << 40, top=1000)
    priced = everything.ranked + everything.rejected
    room = min(e.memory["total"] for e in priced if not e.plan.fused_loss) - 1
    auto = search(costs, 1, device_profile("cpu")[0], global_batch=BATCH, memory_per_rank=room)
    assert auto.best.fused_loss and auto.estimate.memory["total"] <= room
