"""Two compiled models with different plans in one process run side by side: their collectives name
their own groups (``tp:0,1,2,3`` vs ``tp:0,1``), so neither borrows the other's."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar import zoo
from fxpar.testing import multiproc

pool4 = multiproc.rank_pool_fixture(4)
pytestmark = pytest.mark.slow


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def train_and_evaluate(name: str) -> dict:
    """A tp=4 training model and a dp=2 x tp=2 evaluation model, compiled in one process and used in
    turn; each against its own single-process reference."""
    cfg = zoo.tiny_config(name)
    batch = zoo.example_inputs(name, cfg, batch=4, seq=8)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    train = fxpar.compile(zoo.build(name, seed=0), "tp=4", example_kwargs=batch, optimizer=adamw, timeout=120)
    evaluate = fxpar.compile(zoo.build(name, seed=1), "dp=2,tp=2", example_kwargs=inputs, optimizer=adamw,
                             timeout=120)
    ref_train, ref_eval = zoo.build(name, seed=0), zoo.build(name, seed=1).eval()
    opt = adamw(ref_train.parameters())
    out = {"loss": 0.0, "logits": 0.0, "groups": sorted({n.args[1] for s in (train, evaluate)
                                                         for n in s.program.graph.nodes
                                                         if str(n.target).startswith("fxpar.all_reduce")})}
    with torch.no_grad():
        want = ref_eval(**inputs).logits
    for _ in range(3):
        loss = train.step(**batch)
        opt.zero_grad()
        ref = ref_train(**batch).loss
        ref.backward()
        opt.step()
        out["loss"] = max(out["loss"], abs(loss.item() - ref.item()))
        got = evaluate(**inputs).logits
        out["logits"] = max(out["logits"], (got - want).abs().max().item())
    return out


def test_tp4_training_and_dp2_tp2_evaluation_side_by_side(pool4):
    for rank, r in enumerate(pool4.run(train_and_evaluate, "llama", timeout=400)):
        assert r["loss"] <= 1e-5 and r["logits"] <= 1e-5, r
        mine = "0,1" if rank < 2 else "2,3"
        assert r["groups"] == sorted(["tp:0,1,2,3", f"tp:{mine}"]), r
