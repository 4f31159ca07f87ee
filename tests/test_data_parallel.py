"""Data parallelism and ZeRO 1-3 on gloo: parameters after every AdamW step equal one process trained
on the same global batch; communication counted from the graph; memory per rank measured."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxpar
from fxpar.runtime import ops as fxops
from fxpar.testing import multiproc, zoo

TOL = 1e-5
STEPS = 5
pool2 = multiproc.rank_pool(2)
pool4 = multiproc.rank_pool(4)
MODELS = ["llama", "gpt2", "qwen2", "mixtral", "bert", "t5"]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def dp_training(name: str, dp: int, zeros: tuple = (0, 1, 2, 3), plan_extra: str = "") -> dict:
    """For each ZeRO stage: STEPS AdamW steps under Plan(dp, zero) against one process on the same
    global batch; the worst loss and parameter differences over all steps."""
    out = {}
    batch = zoo.example_inputs(name, zoo.tiny_config(name), batch=2 * dp, seq=8)
    for zero in zeros:
        compiled = fxpar.compile(zoo.build(name, seed=0), f"dp={dp},zero={zero}{plan_extra}", example_kwargs=batch,
                                 optimizer=adamw, timeout=60)
        ref = zoo.build(name, seed=0)
        ref_opt = adamw(ref.parameters())
        loss_diff = weight_diff = 0.0
        for _ in range(STEPS):
            loss = compiled.step(**batch)
            ref_opt.zero_grad()
            ref_loss = ref(**batch).loss
            ref_loss.backward()
            ref_opt.step()
            loss_diff = max(loss_diff, abs(loss.item() - ref_loss.item()))
            state = compiled.full_state_dict()
            weight_diff = max(weight_diff, max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items()))
        out[zero] = {"loss": loss_diff, "weights": weight_diff, "memory": compiled.memory()}
    dist.barrier()
    return out


@pytest.mark.parametrize("name", MODELS)
def test_dp2_zero_0_to_3(name, pool2):
    for r in pool2.run(dp_training, name, 2, timeout=300):
        for zero, x in r.items():
            assert x["loss"] <= TOL and x["weights"] <= TOL, (zero, x)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_dp4_zero_0_to_3(name, pool4):
    for r in pool4.run(dp_training, name, 4, timeout=300):
        for zero, x in r.items():
            assert x["loss"] <= TOL and x["weights"] <= TOL, (zero, x)
