"""Optimizer parameter groups through ``fxpar.compile(..., param_groups=rule)``: AdamW with HF Trainer's
weight-decay groups (``fxpar.ir.optim.decay_rule``) under DDP, ZeRO-1/2/3, TP and PP against one process
stepping torch's AdamW on Trainer's own groups; every rank gets the same groups (empty ones included),
ZeRO buckets hold one group each, and a checkpoint's per-group hyperparameters load under another plan."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import transformers

import fxpar
from fxpar import checkpoint, zoo
from fxpar.ir.errors import PlanError
from fxpar.ir.optim import decay_rule
from fxpar.testing import multiproc

NAME = "gpt2"  # biases, nn.LayerNorm weights named ln_* (Trainer finds them by type) and a tied embedding
# eps 1e-4: GPT-2's key bias has a gradient of zero but for rounding (softmax ignores a shift of every
# key), which Adam's default eps (1e-8) would blow up into updates of 1e-4 that differ with the reduction order
LR, WD, EPS, STEPS, TOL = 1e-2, 0.1, 1e-4, 3, 1e-5
pool2 = multiproc.rank_pool(2)
pool4 = multiproc.rank_pool(4)


def trainer_decay_names(model: torch.nn.Module) -> list[str]:
    """What HF Trainer decays: its own ``get_decay_parameter_names`` (it reads nothing of the Trainer)."""
    from transformers import Trainer

    return Trainer.get_decay_parameter_names(None, model)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=WD)


def lr0_ln_f(fqn: str, param: torch.Tensor) -> dict:
    """Trainer's groups plus a third one only the last pipeline stage holds (the final norm, frozen by lr 0)."""
    return {"lr": 0.0} if fqn == "transformer.ln_f.weight" else decay_rule(WD)(fqn, param)


def _batch():
    return zoo.example_inputs(NAME, zoo.tiny_config(NAME), batch=4, seq=8)


def reference(decay: set[str], everything: bool = False, frozen_ln_f: bool = False) -> tuple[dict, list[float]]:
    """STEPS of torch AdamW on one process with Trainer's two groups (``everything``: one decayed group);
    ``frozen_ln_f``: the final norm in a third group with lr 0. The weights, and each step's gradient norm."""
    model, batch = zoo.build(NAME, seed=0), _batch()
    named = list(model.named_parameters())
    ln_f = [p for n, p in named if frozen_ln_f and n == "transformer.ln_f.weight"]
    rest = [(n, p) for n, p in named if not any(p is q for q in ln_f)]
    groups = [{"params": [p for n, p in rest if everything or n in decay], "weight_decay": WD},
              {"params": [p for n, p in rest if not everything and n not in decay], "weight_decay": 0.0}]
    groups += [{"params": ln_f, "lr": 0.0}] if ln_f else []
    opt, norms = torch.optim.AdamW(groups, lr=LR, eps=EPS), []
    for _ in range(STEPS):
        opt.zero_grad()
        model(**batch).loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        opt.step()
    return model.state_dict(), norms


def grouped_run(plan: str, decay: list[str], frozen_ln_f: bool = False) -> dict:
    """STEPS of ``plan`` with the groups; the worst weight and gradient-norm differences from the one-process
    reference, the gradient entries this rank counts in the norm, and its groups (options, tensors in each)."""
    batch = _batch()
    with warnings.catch_warnings():  # ZeRO-3 with pp warns that ZeRO-1 is the usual choice
        warnings.simplefilter("ignore", UserWarning)
        compiled = fxpar.compile(zoo.build(NAME, seed=0), plan, example_kwargs=batch, optimizer=adamw, timeout=120,
                                 param_groups=lr0_ln_f if frozen_ln_f else decay_rule(WD), max_grad_norm=float("inf"))
    norms = []
    for _ in range(STEPS):
        compiled.step(**batch)
        norms.append(compiled.last_grad_norm)
    state = compiled.full_state_dict()
    ref, ref_norms = reference(set(decay), frozen_ln_f=frozen_ln_f)
    groups = compiled.optimizer.param_groups
    buckets = compiled.engine.buckets if compiled.engine is not None else []
    diff = {k: (state[k] - v).abs().max().item() for k, v in ref.items()}
    return {"plan": plan, "weights": max(diff.values()), "worst": max(diff, key=diff.get),
            "norm": max(abs(a - b) for a, b in zip(norms, ref_norms)), "counted": compiled.clipper.counted(),
            "options": [(g["weight_decay"], g["lr"]) for g in groups],
            "sizes": [len(g["params"]) for g in groups], "buckets": len(buckets)}


def world2_cases(decay: list[str]) -> list[dict]:
    out = [grouped_run(f"dp=2,zero={z}", decay) for z in range(4)]
    out += [grouped_run(plan, decay) for plan in ("tp=2", "pp=2")]
    return out + [grouped_run("pp=2", decay, frozen_ln_f=True)]


def check(per_rank: list[dict], n_groups: int = 2) -> None:
    want = [(WD, LR), (0.0, LR), (WD, 0.0)][:n_groups]  # decayed first: the embedding comes first
    total = sum(p.numel() for p in zoo.build(NAME).parameters())  # the tied embedding once
    assert sum(r["counted"] for r in per_rank) == total, per_rank  # the norm counts every entry once
    for r in per_rank:
        assert r["weights"] <= TOL and r["norm"] <= TOL, r
        assert r["options"] == want, r  # every rank: the model's groups, in order
        assert len(r["sizes"]) == n_groups, r


@pytest.fixture(scope="module")
def decay():
    return trainer_decay_names(zoo.build(NAME, seed=0))


def test_decay_rule_agrees_with_trainer_on_every_zoo_model():
    kept = 0
    for name in zoo.ZOO_NAMES:
        if not zoo.is_available(name):
            continue
        model = zoo.build(name, seed=0)
        names = {n for n, _ in model.named_parameters()}  # Trainer's groups take these (tied weights once)
        trainer = set(trainer_decay_names(model)) & names
        rule = decay_rule(WD)
        ours = {n for n, p in model.named_parameters() if rule(n, p)["weight_decay"] == WD}
        assert ours == trainer, (name, sorted(ours ^ trainer))
        kept += len(names - ours)
    assert kept > 0  # the zoo has parameters Trainer leaves undecayed (norms, biases): the rule is tested


def test_a_wrong_grouping_shows(decay):
    """Decaying every parameter moves the weights by more than 1e-3 from Trainer's groups in STEPS steps,
    a hundred times the tolerance: the multi-rank comparisons can fail."""
    a, b = reference(set(decay))[0], reference(set(decay), everything=True)[0]
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-3


@pytest.mark.slow
def test_groups_match_one_process_dp_zero_tp_pp(pool2, decay):
    per_rank = pool2.run(world2_cases, decay, timeout=400)
    cases = list(zip(*per_rank))
    for rs in cases[:-1]:
        check(list(rs))
    check(list(cases[-1]), n_groups=3)
    assert 0 in cases[-1][0]["sizes"], cases[-1]  # pp rank 0 holds nothing of the final norm's group: empty
    zero1 = cases[1][0]
    assert zero1["buckets"] == 2, zero1  # the tiny model fits one bucket: ZeRO-1 makes one per group


@pytest.mark.slow
def test_groups_match_one_process_dp2_tp2_zero1(pool4, decay):
    check(pool4.run(grouped_run, "dp=2,tp=2,zero=1", decay, timeout=400))


def save_then_load(directory: str) -> dict:
    """dp=2 ZeRO-1 with Trainer's groups: a step, a save, a step (the uninterrupted run). Then tp=2 built with
    other weight decays (0.5) from the checkpoint, optimizer loaded, a step: its groups and weights."""
    batch = _batch()
    a = fxpar.compile(zoo.build(NAME, seed=0), "dp=2,zero=1", example_kwargs=batch, optimizer=adamw, timeout=120,
                      param_groups=decay_rule(WD))
    a.step(**batch)
    path = checkpoint.save(a, directory, 1)
    a.step(**batch)
    want = a.full_state_dict()
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(zoo.tiny_config(NAME)).train()
    b = fxpar.compile(meta, "tp=2", example_kwargs=batch, timeout=120,
                      optimizer=lambda groups: torch.optim.AdamW(groups, lr=LR, eps=EPS, weight_decay=0.5),
                      param_groups=decay_rule(0.5), weights=checkpoint.model_source(path))
    before = [g["weight_decay"] for g in b.optimizer.param_groups]
    checkpoint.load_optimizer(b, path)
    after = [g["weight_decay"] for g in b.optimizer.param_groups]
    b.step(**batch)
    got = b.full_state_dict()
    return {"before": before, "after": after, "weights": max((got[k] - v).abs().max().item() for k, v in want.items()),
            "rank": dist.get_rank()}


@pytest.mark.slow
def test_checkpoint_restores_each_groups_weight_decay_under_another_plan(pool2, tmp_path):
    for r in pool2.run(save_then_load, str(tmp_path), timeout=300):
        assert r["before"] == [0.5, 0.0] and r["after"] == [WD, 0.0], r
        assert r["weights"] <= TOL, r  # the states went into the right groups: the step continues the run


def test_plain_list_without_groups_and_bad_rules():
    """Without param_groups the factory still gets a plain list; a rule returning a non-dict, or groups
    without an optimizer, are PlanErrors naming the fix before anything runs."""
    batch, seen = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=2, seq=8), []

    def spy(params):
        seen.append([dict(g) if isinstance(g, dict) else g for g in params])  # before torch adds its defaults
        return torch.optim.SGD(params, lr=0.1)
    fxpar.compile(zoo.build("llama", seed=0), "dp=1", example_kwargs=batch, optimizer=spy)
    assert all(isinstance(p, torch.Tensor) for p in seen[-1])
    with pytest.raises(PlanError, match="must return a dict"):
        fxpar.compile(zoo.build("llama", seed=0), "dp=1", example_kwargs=batch, optimizer=spy,
                      param_groups=lambda fqn, p: 0.1)
    with pytest.raises(PlanError, match="no optimizer was given"):
        fxpar.compile(zoo.build("llama", seed=0), "dp=1", example_kwargs=batch, param_groups=decay_rule(0.1))
    fxpar.compile(zoo.build("llama", seed=0), "dp=1", example_kwargs=batch, optimizer=spy,
                  param_groups=lambda fqn, p: {})
    assert len(seen[-1]) == 1 and set(seen[-1][0]) == {"params"}  # {}: one group of the factory's defaults
