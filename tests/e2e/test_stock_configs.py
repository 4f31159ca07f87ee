"""Stock configs just work: zoo models with ``use_cache`` left at the transformers default (True, as
``from_pretrained`` gives it), compiled and trained with the batch a user has (no ``use_cache`` in it,
at trace time or at any step), at tp=2 and at pp=2 against one process; evaluation logits come back
without a cache; generation still runs its KV-cache programs (``fxpar.frontend.kv_cache``).

Every zoo model trains with its stock config in the zoo-wide sweeps at tp=2
(``tests/passes/tensor_parallel/test_tensor_parallel.py::test_compile_tp2``) and at pp=2 under four
schedules (``tests/runtime/test_pipeline.py::test_zoo_pp2_matches_single_process``, the causal LMs); here
the models that sweep leaves out (encoder-decoder, masked LM) and two causal LMs run both plans with the
stock-specific checks (the config restored, no cache among the outputs, the programs traced)."""

from __future__ import annotations

import pytest
import torch
import transformers

import fxpar
from fxpar import zoo
from fxpar.testing import multiproc
from fxpar.testing.compare import train_against_reference

TOL = 1e-5
pool2 = multiproc.rank_pool(2)
PLANS = ("tp=2", "pp=2")


def sgd(params):
    # SGD: Adam's normalisation would turn 1e-7 reduction-order differences on near-zero gradients into
    # 1e-5 weight differences (tests/passes/tensor_parallel/test_tensor_parallel.py)
    return torch.optim.SGD(params, lr=0.1)


def stock_training(name: str) -> dict:
    """Per plan: one SGD step next to one process (loss, every parameter), then the evaluation logits of
    a call without labels, and what the config's ``use_cache`` reads after it all."""
    out = {}
    for plan in PLANS:
        model = zoo.build(name, seed=0, stock=True)
        batch = zoo.example_inputs(name, model, batch=4, seq=8, stock=True)
        compiled = fxpar.compile(model, plan, example_kwargs=batch, optimizer=sgd, timeout=60)
        ref = zoo.build(name, seed=0, stock=True)
        diffs = train_against_reference(compiled, ref, sgd, batch, 1)
        infer = {k: v for k, v in batch.items() if k != "labels"}
        model.eval()
        ref.eval()
        got = compiled(**infer)
        with torch.no_grad():
            want = ref(**infer)
        out[plan] = {**diffs, "logits": (got["logits"] - want["logits"]).abs().max().item(),
                     "outputs": sorted(got.keys()), "ref_cache": want.get("past_key_values") is not None,
                     "use_cache": (model.config.use_cache, ref.config.use_cache), "batch": sorted(batch),
                     "programs": len(compiled.programs.entries)}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(zoo.ZOO_NAMES) - set(zoo.CAUSAL_LM_NAMES)) + ["llama", "gpt2"])
def test_stock_config_trains_at_tp2_and_pp2(name, pool2):
    if not zoo.is_available(name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    assert zoo.tiny_config(name, stock=True).use_cache is True  # the transformers default of every zoo class
    for rank, r in enumerate(pool2.run(stock_training, name, timeout=300)):
        for plan in PLANS:
            got = r[plan]
            if rank == 0:
                print(f"{name} {plan}: |dloss| {got['loss']:.1e} |dweights| {got['weights']:.1e} "
                      f"|dlogits| {got['logits']:.1e}")
            assert "use_cache" not in got["batch"], got
            # the eager stock model does build a cache: the configs really are stock
            assert got["ref_cache"] == (name not in zoo.MASKED_LM_NAMES), (plan, got)
            assert max(got["loss"], got["weights"], got["logits"]) <= TOL, (plan, got)
            assert "past_key_values" not in got["outputs"], (plan, got)  # a program's outputs: no cache
            assert got["use_cache"] == (True, True), (plan, got)  # restored after every trace
            assert got["programs"] == 2, (plan, got)  # the training program and the evaluation one


def greedy(compiled, model, ids: torch.Tensor, new: int) -> dict:
    """fxpar's greedy tokens with its KV cache and without, HF's, and the programs the cache path traced."""
    cached = compiled.generate(ids, new)
    programs = len(compiled.programs.entries)
    kv = [r.program for r, _, _ in compiled.programs.entries.values()
          if any(n.op == "placeholder" and n.name.startswith("past_key_values") for n in r.program.graph.nodes)]
    window = compiled.generate(ids, new, cache=False)
    with torch.no_grad():
        hf = model.eval().generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
    widths = sorted(next(n for n in p.graph.nodes if n.name == "input_ids").meta["val"].shape[1] for p in kv)
    return {"cached": cached, "window": window, "hf": hf, "kv_input_widths": widths, "programs": programs}


def test_generation_keeps_the_kv_cache_with_a_stock_config():
    """A stock llama compiled with ``{"input_ids", "labels"}``: ``generate`` traces a prefill program and a
    one-token decode program, both taking the static cache as ``past_key_values`` inputs, and gives HF's
    greedy tokens (with and without the cache); the config still says ``use_cache=True``."""
    model = zoo.build("llama", seed=0, stock=True)
    batch = zoo.example_inputs("llama", model, batch=2, seq=8, stock=True)
    compiled = fxpar.compile(model, "dp=1", example_kwargs=batch, optimizer=sgd)
    compiled.step(**batch)
    ref = zoo.build("llama", seed=0, stock=True)
    ref.load_state_dict(compiled.full_state_dict())
    prompt = batch["input_ids"][:, :5]
    r = greedy(compiled, ref, prompt, 4)
    # the training program, then a prefill taking the prompt and a decode program taking one token, both
    # with the cache as inputs (the window path would have traced one program without a cache instead)
    assert r["programs"] == 3 and r["kv_input_widths"] == [1, 5], r
    assert torch.equal(r["cached"], r["hf"]) and torch.equal(r["window"], r["hf"]), r
    assert model.config.use_cache is True


def test_zoo_stock_option():
    """``stock=True`` leaves use_cache at the config class's default and passes none; the default zoo
    keeps both off, as its existing callers expect."""
    for name in ("llama", "bert", "t5"):
        default = getattr(zoo._config_class(name)(), "use_cache")
        assert zoo.tiny_config(name, stock=True).use_cache == default is True
        assert zoo.tiny_config(name).use_cache is False
        model = zoo.build(name, stock=True)
        assert "use_cache" not in zoo.example_inputs(name, model, stock=True)
    assert zoo.example_inputs("llama", zoo.build("llama"))["use_cache"] is False
