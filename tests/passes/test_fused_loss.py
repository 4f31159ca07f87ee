"""``Plan(fused_loss=True)``: the LM head and its cross-entropy as one chunked op (passes/fused_loss.py),
split over the vocabulary by the TP rule or, under ZeRO-3, computed on the head's shards over the dp group
(passes/zero3.py), against one process (loss and every gradient) and against the unfused graph's structure."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxpar
from fxpar import zoo
from fxpar.ir.fused_ops import FUSED_OPS
from fxpar.ir.ops import count_collectives
from fxpar.ir.plan import Plan
from fxpar.passes.fused_loss import fuse_loss
from fxpar.testing import multiproc
from fxpar.testing.compare import train_against_reference

TOL = 1e-5
FUSED = FUSED_OPS["linear_cross_entropy"]
pool2 = multiproc.rank_pool_fixture(2)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _traced(name: str, **overrides):
    model = zoo.build(name, seed=0, **overrides)
    batch = zoo.example_inputs(name, model, batch=2, seq=8)
    return fxpar.trace(model, (), batch), model, batch


@pytest.mark.parametrize("name", ["llama", "gpt2"])  # an untied head, and one tied to the embedding
def test_fused_graph_has_no_logits(name):
    program, model, batch = _traced(name)
    fused, names = fuse_loss(program)
    assert names == ["cross_entropy_loss"]
    ops = [n.target for n in fused.graph.nodes if n.op == "call_function"]
    assert ops.count(FUSED) == 1 and torch.ops.aten.cross_entropy_loss.default not in ops
    vocab = model.config.vocab_size
    big = [n.name for n in fused.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
           and n.meta["val"].shape[-1:] == (vocab,) and n.meta["val"].numel() > vocab * 64]
    assert big == [], f"a [tokens, vocab] value is still in the fused graph: {big}"
    output = next(n for n in fused.graph.nodes if n.op == "output")
    assert output.args[0][1] is None  # the logits output is dropped, the loss kept
    assert FUSED not in [n.target for n in program.graph.nodes]  # the traced program is left alone
    import fxpar.runtime.kernels.cross_entropy  # noqa: F401  (the op's kernels)
    torch.testing.assert_close(fused(**batch).loss, model(**batch).loss, rtol=0, atol=1e-5)


def test_soft_capped_logits_stay_unfused():
    """Gemma-2 soft-caps its logits (tanh) before the loss: the fused kernel would compute another
    function, so the loss keeps its unfused form and the plan says so once."""
    program, _, _ = _traced("gemma2")
    assert fuse_loss(program) == (program, [])
    model = zoo.build("gemma2", seed=0)
    batch = zoo.example_inputs("gemma2", model, batch=2, seq=8)
    with pytest.warns(UserWarning, match="fused_loss.*unfused"):
        compiled = fxpar.compile(model, Plan(fused_loss=True), (), batch, optimizer=_sgd)
    assert FUSED not in [n.target for n in compiled.program.graph.nodes]


def test_one_process_matches_unfused():
    model = zoo.build("llama", seed=0)
    batch = zoo.example_inputs("llama", model, batch=2, seq=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model whose loss fuses gets no warning
        compiled = fxpar.compile(model, Plan(fused_loss=True), (), batch, optimizer=_sgd)
    diffs = train_against_reference(compiled, zoo.build("llama", seed=0), _sgd, batch, 3, grads=True)
    assert max(diffs.values()) <= TOL, diffs
    kernels = fxpar.inspect(compiled, quiet=True).kernels()  # inspection names the kernel and its path
    assert [(k["kernel"], k["path"], k["sites"]) for k in kernels] == [("linear_cross_entropy", "torch", 1)]
    assert "linear_cross_entropy [torch] in stage 0" in fxpar.inspect(compiled, quiet=True).to_text()


def test_bf16_autocast_matches_unfused():
    """Under bf16 mixed precision the fused op multiplies in bf16, as the unfused head does."""
    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=2, seq=16)
    losses = []
    for fused in (False, True):
        compiled = fxpar.compile(zoo.build("llama", seed=0), Plan(mixed_precision="bf16", fused_loss=fused), (),
                                 batch, optimizer=_sgd)
        losses.append([compiled.step(**batch).item() for _ in range(3)])
    assert max(abs(a - b) for a, b in zip(*losses)) <= TOL, losses


def _tp_case(name: str, plan: str) -> dict:
    batch = zoo.example_inputs(name, zoo.tiny_config(name), batch=2, seq=8)
    compiled = fxpar.compile(zoo.build(name, seed=0), plan, example_kwargs=batch, optimizer=_sgd, timeout=120)
    diffs = train_against_reference(compiled, zoo.build(name, seed=0), _sgd, batch, 3, grads=True)
    program = compiled.program
    return {**diffs, "fused": sum(n.target == FUSED for n in program.graph.nodes),
            "counts": count_collectives(program.gm)}


@pytest.mark.slow
@pytest.mark.parametrize("name,plan,fewer", [("llama", "tp=2", 3), ("llama", "tp=2,sequence_parallel=1", 3),
                                              ("gpt2", "tp=2", 3), ("llama", "pp=2", 0)])
def test_fused_loss_matches_one_process(pool2, name, plan, fewer):
    """Loss and every gradient within 1e-5 of one unfused process. Where TP splits the head by
    vocabulary rows (llama), the unfused vocabulary-parallel loss's three all-reduces move into the op
    (two per call, inside the kernel); GPT-2's head is its (replicated) token embedding, so both forms
    run the loss on the whole vocabulary."""
    fused = pool2.run(_tp_case, name, plan + ",fused_loss=1", timeout=300)
    unfused = pool2.run(_tp_case, name, plan, timeout=300)
    for f, u in zip(fused, unfused):
        assert f["loss"] <= TOL and f["grad"] <= TOL and f["weights"] <= TOL, f
        assert f["fused"] == 1 and u["fused"] == 0
        assert f["counts"]["all_reduce"] == u["counts"]["all_reduce"] - fewer, (f["counts"], u["counts"])


def _zero3_case(name: str, plan: str) -> dict:
    batch = zoo.example_inputs(name, zoo.tiny_config(name), batch=2, seq=8)
    compiled = fxpar.compile(zoo.build(name, seed=0), plan, example_kwargs=batch, optimizer=_sgd, timeout=120)
    ref = zoo.build(name, seed=0)
    out = train_against_reference(compiled, ref, _sgd, batch, 3, grads=True)
    # after the steps (both trained alike): the loss of a forward without grad, and the logits of one without
    # labels (no fused loss there: the head's single bucket, shared with the training signature, is gathered)
    plain = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        want_loss, want_logits = ref(**batch).loss, ref(**plain).logits
    out["eval_loss"] = (compiled(**batch).loss - want_loss).abs().item()
    out["logits"] = (compiled(**plain).logits - want_logits).abs().max().item()
    fx = torch.ops.fxpar
    targets = [n.target for s in compiled.pipeline.stages_of(compiled.pp_rank) for n in s.gm.graph.nodes
               if n.op == "call_function"]
    buckets = [b for bs in compiled.zero3_buckets.values() for b in bs]
    head = [b for b in buckets if b.names == ["lm_head.weight"]]
    return {**out, "gathers": targets.count(fx.gather_params.default), "buckets": len(buckets),
            "hidden_gathers": targets.count(fx.all_gather_rs_bwd.default),
            "own_slices": targets.count(fx.scatter_slice.default),
            "head_shard": tuple(head[0].shard.shape) if head else None,
            "vocab": zoo.tiny_config(name).vocab_size, "hidden": zoo.tiny_config(name).hidden_size}


@pytest.mark.slow
def test_zero3_computes_an_untied_head_on_its_shards(pool2):
    """Under ZeRO-3 the fused loss runs on each rank's rows of an untied head (passes/zero3.py): nothing
    gathers the head (one gather fewer than buckets), the hidden states and labels are gathered instead, and
    loss, every gradient and the weights after 3 SGD steps equal one process. A head tied to the embedding
    (GPT-2) is read by the embedding too: it is gathered as before."""
    for r in pool2.run(_zero3_case, "llama", "dp=2,zero=3,fused_loss=1", timeout=300):
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["weights"] <= TOL, r
        assert r["eval_loss"] <= TOL and r["logits"] <= TOL, r
        assert r["head_shard"] == (r["vocab"] // 2 * r["hidden"],), r
        assert r["gathers"] == r["buckets"] - 1 and r["hidden_gathers"] == 1 and r["own_slices"] == 1, r
    for r in pool2.run(_zero3_case, "gpt2", "dp=2,zero=3,fused_loss=1", timeout=300):
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["weights"] <= TOL, r
        assert r["gathers"] == r["buckets"] and r["hidden_gathers"] == 0, r


pool4 = multiproc.rank_pool_fixture(4)


def _composed_case(plan: str) -> dict:
    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=4, seq=16)
    batch["labels"][0, :3] = -100  # ignored targets on one rank only: each keeps its own count
    compiled = fxpar.compile(zoo.build("llama", seed=0), plan, example_kwargs=batch, optimizer=_sgd, timeout=120)
    diffs = train_against_reference(compiled, zoo.build("llama", seed=0), _sgd, batch, 3, grads=True)
    losses = [n for s in compiled.pipeline.stages_of(compiled.pp_rank) for n in s.gm.graph.nodes if n.target == FUSED]
    # the fused loss reading its weight from a ZeRO-3 shard (a view of the flat shard parameter)
    on_shards = [n for n in losses if n.args[1].op == "call_function" and n.args[1].args[0].op == "get_attr" and
                 n.args[1].args[0].target.startswith("_zero3")]
    return {**diffs, "on_shards": len(on_shards), "last_stage": compiled.pp_rank == compiled.plan.pp - 1}


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp=2,pp=2,zero=3", "dp=4,dp_replicate=2,zero=3", "dp=2,cp=2,zero=3",
                                  "dp=2,tp=2,zero=3"])
def test_zero3_head_on_its_shards_composes(pool4, plan):
    """The head on its shards with pipeline stages (the last stage's dp group), HSDP (the shard group of 2, the
    head's gradient then all-reduced over the replicas), context parallelism (the shard group spans dp x cp, each
    rank its own chunk of the sequence) and TP (which splits the head by vocabulary itself: the rule stands
    aside): loss, every gradient and the weights after 3 SGD steps equal one process."""
    for r in pool4.run(_composed_case, plan + ",fused_loss=1", timeout=600):
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["weights"] <= TOL, r
        on_shards = "tp=" not in plan and r["last_stage"]
        assert r["on_shards"] == (1 if on_shards else 0), (plan, r)
