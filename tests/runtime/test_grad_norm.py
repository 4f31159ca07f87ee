"""Global gradient-norm clipping (``fxpar.compile(..., max_grad_norm=)``) against one process calling
``torch.nn.utils.clip_grad_norm_`` before its optimizer step: the reported norm of every step and the
weights after clipped SGD steps, under TP, PP (a tied embedding across stages), DDP, ZeRO-1/2/3 and
the 8-rank dp x pp x tp plan; each rank counts a disjoint part of the gradient, together all of it."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import fxpar
from fxpar import zoo
from fxpar.testing import multiproc

TOL = 1e-5
STEPS = 2
pool2 = multiproc.rank_pool(2)
pool8 = multiproc.rank_pool(8)


def sgd(params):
    """Plain SGD: its update is the gradient itself, so a wrong clipping factor shows in the weights
    (Adam's update is nearly the same for any scale of the gradient and would hide one)."""
    return torch.optim.SGD(params, lr=0.5)


def clipped_run(name: str, plan: str, batch_size: int, max_norm: float) -> dict:
    """STEPS clipped SGD steps of ``plan`` next to one process; per step |norm - torch's norm|, the worst
    weight difference after the last step, torch's norms, and how many gradient entries this rank counts."""
    batch = zoo.example_inputs(name, zoo.tiny_config(name), batch=batch_size, seq=8)
    compiled = fxpar.compile(zoo.build(name, seed=0), plan, example_kwargs=batch, optimizer=sgd, timeout=120,
                             max_grad_norm=max_norm)
    reference = zoo.build(name, seed=0)
    ref_opt = sgd(reference.parameters())
    norms, ref_norms = [], []
    for _ in range(STEPS):
        compiled.step(**batch)
        norms.append(compiled.last_grad_norm)
        ref_opt.zero_grad()
        reference(**batch).loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm).item())
        ref_opt.step()
    state = compiled.full_state_dict()
    weights = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return {"name": name, "plan": plan, "norm": max(abs(a - b) for a, b in zip(norms, ref_norms)),
            "weights": weights, "norms": norms, "ref_norms": ref_norms, "counted": compiled.clipper.counted()}


def check(results: list[dict], max_norm: float) -> None:
    total = sum(p.numel() for p in zoo.build(results[0]["name"]).parameters())  # tied weights once
    assert sum(r["counted"] for r in results) == total, [r["counted"] for r in results]
    for r in results:
        assert r["norm"] <= TOL and r["weights"] <= TOL, r
        assert min(r["ref_norms"]) > 2 * max_norm, r  # the clip really cut the gradients
        assert len(set(r["norms"])) == len(r["norms"]), r  # each step measured anew
    assert len({tuple(r["norms"]) for r in results}) == 1, results  # the same number on every rank


def two_rank_cases() -> list[dict]:
    """tp=2 and pp=2 on gpt2 (its embedding is tied to the LM head, which sits on the other pipeline
    rank), then dp=2 with ZeRO 0-3 on llama."""
    out = [clipped_run("gpt2", plan, 4, 0.05) for plan in ("tp=2", "pp=2")]
    return out + [clipped_run("llama", f"dp=2,zero={z}", 4, 0.05) for z in range(4)]


def three_d_cases() -> list[dict]:
    with warnings.catch_warnings():  # ZeRO-3 with pp > 1 warns that ZeRO-1 is the usual choice
        warnings.simplefilter("ignore", UserWarning)
        return [clipped_run("gpt2", "dp=2,pp=2,tp=2,zero=1", 4, 0.05),
                clipped_run("llama", "dp=2,pp=2,tp=2,zero=3", 4, 0.05)]


@pytest.mark.slow  # seconds: a subprocess, several ranks or a large meta model; ./dev test runs it
def test_norm_and_clipping_match_one_process_tp_pp_dp_zero(pool2):
    per_rank = pool2.run(two_rank_cases, timeout=300)
    for case in range(len(per_rank[0])):
        check([r[case] for r in per_rank], 0.05)


@pytest.mark.slow
def test_norm_and_clipping_match_one_process_dp2_pp2_tp2(pool8):
    """The 3-D plan on 8 ranks: with ZeRO-1 on gpt2 (TP shards, TP-replicated norms and biases, the tied
    embedding on both pipeline ranks inside ZeRO-1's flat shards) and with ZeRO-3 on llama."""
    per_rank = pool8.run(three_d_cases, timeout=400)
    for case in range(len(per_rank[0])):
        check([r[case] for r in per_rank], 0.05)


def test_measure_only_and_bad_values():
    """One process: ``inf`` measures without touching the gradients (the weights follow unclipped SGD);
    a bad ``max_grad_norm`` is a ValueError naming the fix; without it nothing is measured."""
    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=2, seq=8)
    r = clipped_run("llama", "dp=1", 2, math.inf)
    assert r["norm"] <= TOL and r["weights"] <= TOL, r
    assert r["counted"] == sum(p.numel() for p in zoo.build("llama").parameters())
    plain = fxpar.compile(zoo.build("llama", seed=0), "dp=1", example_kwargs=batch, optimizer=sgd)
    plain.step(**batch)
    assert plain.last_grad_norm is None and plain.clipper is None
    for bad in (0, -1.0, float("nan"), "1.0", True):
        with pytest.raises(ValueError, match="max_grad_norm=.*give a number > 0"):
            fxpar.compile(zoo.build("llama", seed=0), "dp=1", example_kwargs=batch, optimizer=sgd,
                          max_grad_norm=bad)
