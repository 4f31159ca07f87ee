"""The cost model prices a head ZeRO-3 leaves on its shards under the fused loss (passes/zero3.py) as the runtime
runs it: the head is not the bucket a rank gathers, and its gather's bytes become the hidden states'; where
the vocabulary does not divide by dp, or the loss is not fused, the head is gathered and priced as before."""

from __future__ import annotations

import pytest

from fxpar import zoo
from fxpar.cost.profiles import load_profile
from fxpar.ir.plan import Plan
from fxpar.planner.model_costs import model_costs
from fxpar.planner.price import price_plan

VOCAB, HIDDEN, SEQ, BATCH = 2048, 64, 8, 12  # the head (2048 x 64) is the model's largest bucket


@pytest.fixture(scope="module")
def costs():
    model = zoo.build("llama", seed=0, vocab_size=VOCAB, device="meta")
    assert model.config.hidden_size == HIDDEN
    return model_costs(model, SEQ, tp_degrees=(1, 2), sequence_parallel=(False,))


def _price(costs, plan: str):
    return price_plan(costs, Plan.parse(plan), load_profile(None), global_batch=BATCH)


def test_the_head_is_read_from_the_fused_program(costs):
    head = costs.fused.head
    assert (head.rows, head.cols, head.trained) == (VOCAB, HIDDEN, True)
    assert head.applies(2) and head.applies(4) and not head.applies(3) and not head.applies(1)


@pytest.mark.parametrize("dp", [2, 4])
def test_zero3_gathers_no_head_under_the_fused_loss(costs, dp):
    gathered, on_shards = _price(costs, f"dp={dp},zero=3"), _price(costs, f"dp={dp},zero=3,fused_loss=1")
    head = VOCAB * HIDDEN * 4
    assert head <= gathered.memory["buffers"] <= head + HIDDEN * 4  # the head's bucket (the model's end: with
    # the final norm), gathered whole
    assert 0 < on_shards.memory["buffers"] < head / 2  # a layer's bucket is what is gathered now
    # the same shards are held either way
    assert {k: gathered.memory[k] for k in ("params", "grads", "optimizer")} == \
        {k: on_shards.memory[k] for k in ("params", "grads", "optimizer")}
    # the head's gather (forward, backward) and reduce-scatter leave the dp bytes: 3 (dp-1)/dp of it, for the
    # hidden states' gather and reduce-scatter, far smaller
    saved = gathered.comm_bytes["dp"] - on_shards.comm_bytes["dp"]
    assert saved == 3 * head * (dp - 1) // dp, (saved, head)


def test_a_head_whose_rows_do_not_divide_is_gathered(costs):
    # 2048 rows over 3 ranks: the pass gathers the head, and the price says so
    assert _price(costs, "dp=3,zero=3,fused_loss=1").memory["buffers"] == _price(costs, "dp=3,zero=3").memory[
        "buffers"] >= VOCAB * HIDDEN * 4
    # tp splits the head by vocabulary instead: nothing to leave on ZeRO-3's shards
    assert _price(costs, "dp=2,tp=2,zero=3,fused_loss=1").memory["buffers"] == \
        _price(costs, "dp=2,tp=2,zero=3").memory["buffers"]
