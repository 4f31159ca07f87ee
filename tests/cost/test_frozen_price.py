"""What freezing buys in the cost model: a PEFT LoRA model's frozen base holds its weights alone, no gradient,
no AdamW state, no gradient reduction (issue 28), against a full fine-tune of the same wrapped model, with the
difference computed by hand from the parameter counts."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import fxpar
from fxpar import zoo
from fxpar.cost.profiles import load_profile
from fxpar.ir.plan import Plan
from fxpar.planner.model_costs import model_costs
from fxpar.planner.price import price_plan

STATE = ("params", "grads", "optimizer", "frozen")


@pytest.fixture(scope="module")
def lora():
    model = get_peft_model(zoo.build("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trained < frozen
    return model, trained, frozen


def test_compiled_memory_prices_no_gradient_nor_adamw_state_for_frozen_weights(lora):
    model, trained, frozen = lora
    batch = zoo.example_inputs("llama", model, batch=4, seq=8)
    priced = fxpar.api.price(model, "dp=2,zero=3", example_kwargs=batch,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    # ZeRO-3 over 2 ranks: half of every weight; only the adapters' half has a gradient and 2 AdamW moments
    assert priced.memory()["predicted"] == {"params": 4 * trained // 2, "grads": 4 * trained // 2,
                                            "optimizer": 2 * 4 * trained // 2, "frozen": 4 * frozen // 2}


def test_estimate_prices_frozen_weights_without_their_gradients_state_or_reduction(lora):
    model, _, frozen = lora
    costs = model_costs(model, 8, tp_degrees=(1,), sequence_parallel=(False,))
    plans, profile = [Plan.parse("dp=2"), Plan.parse("dp=2,zero=3")], load_profile(None)
    got = [price_plan(costs, p, profile, global_batch=4) for p in plans]
    for part in (x for by in costs.parts.values() for x in by.values()):
        part.frozen = 0  # the same parts, every weight trainable: full fine-tuning of the same model
    full = [price_plan(costs, p, profile, global_batch=4) for p in plans]
    for p, g, f in zip(plans, got, full):
        shard = 2 if p.zero == 3 else 1
        # the frozen entries' fp32 gradient and AdamW's 2 fp32 moments, per rank
        assert sum(f.memory[k] for k in STATE) - sum(g.memory[k] for k in STATE) == 12 * frozen // shard, p
        assert g.memory["frozen"] == 4 * frozen // shard and f.memory["frozen"] == 0
        assert g.memory["total"] < f.memory["total"]
        # their gradient reduction per rank: the ring all-reduce sends 2 (n-1)/n of the buffer, ZeRO-3's
        # reduce-scatter (n-1)/n; none for frozen weights, which ZeRO-3 still gathers
        assert f.comm_bytes["dp"] - g.comm_bytes["dp"] == (4 * frozen if p.zero == 0 else 4 * frozen // 2), p


def test_zero3_prices_the_backend_scratch_of_the_last_forward_gather(lora):
    """With a frozen base the step's peak can be where the forward gathers its last, largest bucket (an LM
    head's): a backend that gathers into a flat buffer as large as the bucket and copies it out (the profile's
    ``gather_scratch``: 1.0 for gloo's own all-gather) holds the bucket twice on top of the forward's
    activations; one that writes in place (NCCL, and fxpar's gloo gathers by broadcasts: the CPU profile's 0),
    once."""
    from dataclasses import replace

    model, _, _ = lora
    costs = model_costs(model, 8, tp_degrees=(1,), sequence_parallel=(False,))
    plan, profile = Plan.parse("dp=2,zero=3"), load_profile("cpu")
    assert profile.gather_scratch == 0.0
    got = price_plan(costs, plan, replace(profile, gather_scratch=1.0), global_batch=4)
    none = price_plan(costs, plan, profile, global_batch=4)
    bucket = got.memory["buffers"]
    assert bucket > 0 and none.memory["buffers"] == bucket
    held = sum(got.memory[k] for k in STATE) - got.memory["grads"]
    assert got.memory["total"] >= held + 2 * bucket  # (and the forward's activations)
    assert got.memory["total"] > none.memory["total"]
