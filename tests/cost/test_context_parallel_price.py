"""Plan(cp=N) priced (fxpar.cost.context_parallel): each rank's work on S / cp tokens, the keys and values
attention reads and keeps whole, the KV gathers' bytes against a hand count from a tiny GQA Llama's config,
gradients and ZeRO over dp x cp, and memory per rank at a long sequence."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from fxpar import zoo
from fxpar.cost.comm import sent_bytes
from fxpar.cost.context_parallel import LOSS_BYTES, Attention, cp_part, ulysses_at
from fxpar.cost.estimate import Pricer
from fxpar.ir.errors import PlanError
from fxpar.ir.plan import Plan
from fxpar.planner.auto import device_profile
from fxpar.planner.model_costs import model_costs

SEQ, LONG = 16, 4096


def _costs(seq):
    model = zoo.build("llama", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, model_costs(model, seq, tp_degrees=(1, 2) if seq == SEQ else (1,), sequence_parallel=(False,))


@pytest.fixture(scope="module")
def llama():
    return _costs(SEQ)


def _head_dim(cfg):
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def test_cp2_halves_each_ranks_work_and_activations_but_the_whole_keys_and_values(llama):
    model, costs = llama
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query: the expansion is after the gather
    part = costs.part(costs.layers[0], 1)
    att = part.attention
    half = cp_part(part, 2)
    whole = set(att.whole)
    assert whole and att.layers == 1 and att.gathers == 2  # one attention, its keys and its values
    for i, (a, b) in enumerate(zip(part.nodes, half.nodes)):
        if i in whole:  # the grouped-query expansion of the gathered keys and values: the whole sequence
            assert b == a
        else:
            assert (b[0], b[1], b[3]) == (a[0] / 2, a[1] / 2, a[3])
    # what attention reads and keeps of them, expanded to every query head, stays the whole sequence's
    expanded = 2 * SEQ * cfg.num_attention_heads * _head_dim(cfg) * 4
    (row, operands), = att.rows
    assert operands == expanded and att.act["none"] == (expanded, 0)
    assert half.nodes[row][2] == pytest.approx((part.nodes[row][2] - expanded) / 2 + expanded)
    kept = part.act["none"][0]
    assert half.act["none"][0] == (kept - expanded) // 2 + expanded < kept
    for name in ("pre", "post"):  # no attention: everything halves
        p = costs.part(name, 1)
        assert cp_part(p, 2).flops == (p.flops[0] / 2, p.flops[1] / 2)
        assert cp_part(p, 2).act["none"][0] == p.act["none"][0] // 2


@pytest.mark.parametrize("cp", [2, 4])
def test_kv_bytes_per_attention_layer_are_the_other_ranks_share_of_the_kv_heads(llama, cp):
    model, costs = llama
    cfg = model.config
    batch = 2
    kv = 2 * batch * SEQ * cfg.num_key_value_heads * _head_dim(cfg) * 4  # a layer's K and V, fp32, KV heads only
    assert costs.part(costs.layers[0], 1).attention.kv * batch == kv
    pricer = Pricer(costs, device_profile("h100-80gb")[0], global_batch=batch)
    e = pricer.price(Plan(cp=cp))
    per_layer = (cp - 1) / cp * kv  # each rank receives the others' chunks; as much sent
    # forward all-gather and backward reduce-scatter per layer, and the loss's scalar all-reduce
    hand = cfg.num_hidden_layers * 2 * per_layer + sent_bytes("all_reduce", LOSS_BYTES, cp)
    assert e.comm_bytes["cp"] == int(hand)
    assert e.parts["cp_comm"] > 0 and "cp" not in pricer.price(Plan()).comm_bytes
    # gradients reduce over the cp ranks (dp=1): an all-reduce of every fp32 gradient
    assert e.comm_bytes["dp"] == pytest.approx(sent_bytes("all_reduce", 4 * costs.params, cp), rel=1e-9)
    # with tp=2 each rank gathers its half of the KV heads
    assert costs.part(costs.layers[0], 2).attention.kv * batch == kv // 2
    layers = cfg.num_hidden_layers * 2 * per_layer / 2
    assert pricer.price(Plan(cp=cp, tp=2)).comm_bytes["cp"] == int(layers + sent_bytes("all_reduce", LOSS_BYTES, cp))


def test_zero_shards_over_dp_x_cp_and_cp_must_cut_the_sequence_evenly(llama):
    _, costs = llama
    pricer = Pricer(costs, device_profile("h100-80gb")[0], global_batch=2)
    e = pricer.price(Plan(dp=2, cp=2, zero=1))
    assert e.memory["optimizer"] == 8 * costs.params // 4  # AdamW's two fp32 states over 4 ranks
    with pytest.raises(PlanError, match="cp=3"):
        pricer.price(Plan(cp=3))  # 6 chunks do not divide 16 tokens


def test_cp2_prices_a_long_sequence_in_less_memory_per_rank():
    _, costs = _costs(LONG)
    pricer = Pricer(costs, device_profile("h100-80gb")[0], global_batch=1)
    one, two = pricer.price(Plan()), pricer.price(Plan(cp=2))
    assert two.memory["total"] < one.memory["total"]
    assert two.memory["activations"] < 0.6 * one.memory["activations"]  # half, plus the whole keys and values
    assert two.parts["compute"] < one.parts["compute"]  # (not half: each op's launch cost stays)


def test_ulysses_bytes_are_the_other_ranks_share_of_queries_keys_values_and_output(llama):
    """``cp_attention="ulysses"``: per layer, forward and backward, each rank sends (cp - 1) / cp of its S / cp
    rows of the queries, keys and values (KV heads) and the output; where cp does not divide the heads (2 KV
    heads at cp=4, or 1 per TP rank at tp=2) the attention keeps the all-gather and its price; attention keeps
    1 / cp of the heads, not the whole sequence's expanded keys and values."""
    model, costs = llama
    cfg = model.config
    batch, cp = 2, 2
    pricer = Pricer(costs, device_profile("h100-80gb")[0], global_batch=batch)
    local = batch * SEQ // cp * 2 * (cfg.num_attention_heads + cfg.num_key_value_heads) * _head_dim(cfg) * 4
    hand = cfg.num_hidden_layers * 2 * (cp - 1) / cp * local + sent_bytes("all_reduce", LOSS_BYTES, cp)
    e = pricer.price(Plan(cp=cp, cp_attention="ulysses"))
    assert e.comm_bytes["cp"] == int(hand) and e.parts["cp_comm"] > 0
    gathered = pricer.price(Plan(cp=cp))
    assert e.memory["activations"] < gathered.memory["activations"]
    for plan in (Plan(cp=4), Plan(cp=2, tp=2)):
        kept = pricer.price(replace(plan, cp_attention="ulysses"))
        assert kept.comm_bytes["cp"] == pricer.price(plan).comm_bytes["cp"], plan
    # "auto" as the pass chooses: the all-gather here (4 query heads per 2 KV heads at cp=2 send 3/2 as much)
    assert hand > gathered.comm_bytes["cp"] == pricer.price(Plan(cp=cp, cp_attention="auto")).comm_bytes["cp"]
    # as many KV heads as query heads: Ulysses sends 2 / cp of the gather's bytes, so "auto" takes it from cp=3
    row = SEQ * _head_dim(cfg) * 4
    mha = Attention(kv=8 * row, gathers=2, layers=1, ulysses=((4, 4, 8 * row, 8 * row),))
    assert [ulysses_at(mha, n, "auto")[0] for n in (2, 4)] == [0, 1] and ulysses_at(mha, 2)[0] == 1
    assert cp_part(costs.part(costs.layers[0], 1), cp, "ulysses").act["none"][0] == \
        costs.part(costs.layers[0], 1).act["none"][0] // cp
