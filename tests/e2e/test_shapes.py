"""Inputs whose shapes change from step to step, as real loops give them (dynamic padding, a short last
batch): every plan against one process, and no program ever run on shapes it was not built for."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar import zoo
from fxpar.ir.batch import check_shapes, split_batch
from fxpar.ir.errors import PlanError
from fxpar.testing import multiproc

TOL = 1e-5
pool2 = multiproc.rank_pool(2)
pool8 = multiproc.rank_pool(8)

SEQS = (16, 32, 24, 16)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _batches(name: str, batch_sizes: tuple[int, ...]) -> list[dict]:
    """Sequence lengths 16, 32, 24, 16 at the first batch size, then each other batch size at 24."""
    cfg = zoo.tiny_config(name)
    first, *others = batch_sizes
    shapes = [(first, s) for s in SEQS] + [(b, 24) for b in others]
    return [zoo.example_inputs(name, cfg, batch=b, seq=s, seed=i) for i, (b, s) in enumerate(shapes)]


def changing_shapes(name: str, plan: str, batch_sizes: tuple[int, ...]) -> dict:
    """Train on batches of changing shapes next to one process; worst loss and parameter differences."""
    batches = _batches(name, batch_sizes)
    compiled = fxpar.compile(zoo.build(name, seed=0), plan, example_kwargs=batches[0], optimizer=adamw,
                             timeout=120)
    reference = zoo.build(name, seed=0)
    opt = adamw(reference.parameters())
    out = {"loss": 0.0, "weights": 0.0, "programs": 0}
    for batch in batches:
        loss = compiled.step(**batch)
        opt.zero_grad()
        ref = reference(**batch).loss
        ref.backward()
        opt.step()
        out["loss"] = max(out["loss"], abs(loss.item() - ref.item()))
        state = compiled.full_state_dict()
        out["weights"] = max(out["weights"], max((state[k] - v).abs().max().item()
                                                 for k, v in reference.state_dict().items()))
    out["programs"] = compiled.programs.compiled
    return out


@pytest.mark.slow
@pytest.mark.parametrize("plan,batch_sizes", [("pp=2", (4, 8)), ("tp=2", (4, 2)), ("dp=2,zero=3", (4, 6))])
def test_two_ranks_follow_changing_shapes(plan, batch_sizes, pool2):
    for r in pool2.run(changing_shapes, "llama", plan, batch_sizes, timeout=400):
        assert r["loss"] <= TOL and r["weights"] <= TOL, r
        assert r["programs"] == len(set(SEQS)) + len(batch_sizes) - 1, r  # one per distinct shape


@pytest.mark.slow
def test_eight_ranks_3d_follow_changing_shapes(pool8):
    for r in pool8.run(changing_shapes, "llama", "dp=2,pp=2,tp=2,zero=1", (4, 8), timeout=500):
        assert r["loss"] <= TOL and r["weights"] <= TOL, r


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-2)


def test_a_program_refuses_shapes_it_was_not_traced_for():
    cfg = zoo.tiny_config("llama")
    short = zoo.example_inputs("llama", cfg, batch=4, seq=16)
    compiled = fxpar.compile(zoo.build("llama", seed=0), fxpar.Plan(), example_kwargs=short, optimizer=_sgd)
    long = zoo.example_inputs("llama", cfg, batch=4, seq=32)
    result = compiled.result
    flat = result.program.flatten_inputs((), long)
    with pytest.raises(PlanError, match=r"input 'input_ids' of shape \(4, 32\).*traced for \(4, 16\)"):
        check_shapes(result.traced, split_batch(flat, 4, 1)[0])
    check_shapes(result.traced, split_batch(result.program.flatten_inputs((), short), 4, 1)[0])  # its own: fine
    compiled.step(**long)  # the model itself compiles a second program instead
    assert compiled.programs.compiled == 2


def test_the_cache_is_bounded_and_keeps_the_training_program(monkeypatch, caplog):
    cfg = zoo.tiny_config("llama")
    compiled = fxpar.compile(zoo.build("llama", seed=0), fxpar.Plan(), optimizer=_sgd,
                             example_kwargs=zoo.example_inputs("llama", cfg, batch=2, seq=8))
    compiled.programs.max_programs = 2
    train = compiled.result
    with caplog.at_level("INFO", logger="fxpar"):
        caplog.clear()
        for seq in (9, 10, 11, 9):
            compiled.step(**zoo.example_inputs("llama", cfg, batch=2, seq=seq))
    assert len(compiled.programs.entries) == 2 and compiled.result is train
    assert compiled.programs.compiled == 5  # seq 9 was dropped by seq 11 and compiled again
    new = [r.getMessage() for r in caplog.records if "compiling program" in r.getMessage()]
    assert len(new) == 4 and "(2, 11)" in new[2], new


def test_a_batch_the_plan_cannot_divide_is_refused_before_running():
    cfg = zoo.tiny_config("llama")
    compiled = fxpar.compile(zoo.build("llama", seed=0), fxpar.Plan(microbatches=2), optimizer=_sgd,
                             example_kwargs=zoo.example_inputs("llama", cfg, batch=4, seq=8))
    with pytest.raises(PlanError, match="batch of 3 does not divide into 2 microbatches x dp=1.*drop_last"):
        compiled.step(**zoo.example_inputs("llama", cfg, batch=3, seq=8))
