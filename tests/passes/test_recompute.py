"""Activation recompute (``passes/recompute.py``): layers are found from owner FQNs, each layer's forward
really runs again in backward (``layer``: matmuls included; ``selective``: the cheap ops only), and the
gradients equal those without recompute under tp=2, pp=2 and dp=2 zero=3 (bf16 too)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fxpar
from fxpar import zoo
from fxpar.ir.ops import gather_params_op
from fxpar.passes.recompute import Recomputed, layer_units, saved_op, unit_of
from fxpar.testing import multiproc

TOL = 1e-6
MODES = ("none", "layer", "selective")
pool2 = multiproc.rank_pool(2)
aten = torch.ops.aten


def _batch(batch: int = 2):
    return zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=batch, seq=8)


def test_layers_are_the_repeated_indexed_modules_outermost_first():
    owners = ["model.embed_tokens", "model.layers.0.self_attn", "model.layers.1.mlp.experts.0",
              "model.layers.1.mlp.experts.1", "encoder.block.0", "decoder.block.0", "decoder.block.1", ""]
    containers = layer_units(owners)
    assert containers == {"model.layers", "model.layers.1.mlp.experts", "decoder.block"}
    assert unit_of("model.layers.1.mlp.experts.1.w1", containers) == "model.layers.1"
    assert unit_of("encoder.block.0.layer", containers) is None  # one block: nothing repeats
    assert unit_of("model.norm", containers) is None and unit_of("", containers) is None


def test_selective_saves_matmuls_attention_and_tp_collectives_not_zero3_gathers():
    assert saved_op(aten.mm.default) and saved_op(aten.addmm.default) and saved_op(aten.bmm.default)
    assert saved_op(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert saved_op(torch.ops.fxpar.all_reduce.default)
    assert not saved_op(gather_params_op())
    assert not any(saved_op(op) for op in (aten.silu.default, aten.mul.Tensor, aten.rsqrt.default, aten.add.Tensor))


def test_selective_outlines_layers_whose_products_are_traced_as_linear_and_matmul():
    """A layer's matmuls appear in the trace as ``aten.linear`` / ``aten.matmul`` (dispatch turns them into mm):
    with eager attention (no SDPA kernel in the graph) selective recompute still outlines every layer."""
    batch = _batch()
    config = zoo.tiny_config("llama")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = type(zoo.build("llama", seed=0))(config)
    c = fxpar.compile(model, "recompute=selective", example_kwargs=batch)
    gm = c._train.pipeline.stages[0].gm
    assert not any("scaled_dot_product" in str(n.target) for n in gm.graph.nodes)
    assert sum(isinstance(m, Recomputed) for m in gm.modules()) == config.num_hidden_layers >= 2
    assert saved_op(aten.linear.default) and saved_op(aten.matmul.default)


class _BackwardOps(TorchDispatchMode):
    """Counts ops by overload packet, separately for those run inside autograd's backward."""

    def __init__(self):
        super().__init__()
        self.fwd: dict = {}
        self.bwd: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        counts = self.bwd if torch._C._current_autograd_node() is not None else self.fwd
        counts[func.overloadpacket] = counts.get(func.overloadpacket, 0) + 1
        return func(*args, **(kwargs or {}))


def _single(mode: str, program, batch, mp=None):
    compiled = fxpar.compile(program.root, fxpar.Plan(recompute=mode, mixed_precision=mp),
                             example_kwargs=batch, program=program)
    with _BackwardOps() as ops:
        loss = compiled.step(**batch)
    return compiled, loss, compiled.full_state_dict(grads=True), ops


@pytest.fixture(scope="module")
def traced():
    batch = _batch()
    return fxpar.trace(zoo.build("llama", seed=0), example_kwargs=batch), batch


def test_recompute_runs_forward_ops_again_in_backward_with_equal_gradients(traced):
    program, batch = traced
    runs = {mode: _single(mode, program, batch) for mode in MODES}
    compiled, loss0, g0, none = runs["none"]
    layers = zoo.tiny_config("llama").num_hidden_layers
    mm = (aten.mm, aten.addmm)
    for mode in ("layer", "selective"):
        c, loss, g, ops = runs[mode]
        stage = c._train.pipeline.stages[0].gm
        assert sum(isinstance(m, Recomputed) for m in stage.modules()) == layers >= 2
        assert loss.item() == loss0.item()
        assert max((g[k] - g0[k]).abs().max().item() for k in g0) <= TOL
        plain = {aten.detach, aten.alias}  # what checkpointing adds to hold its own references
        assert {k: v for k, v in ops.fwd.items() if k not in plain} == \
            {k: v for k, v in none.fwd.items() if k not in plain}  # the forward itself is unchanged
    assert none.bwd.get(aten.silu, 0) == 0  # without recompute no forward activation runs in backward
    # layer: the matmuls of every layer run again: 6 of a Llama layer's 7 projections (nothing saved is
    # computed after down_proj, so recomputation stops before it); selective: none runs again
    assert sum(runs["layer"][3].bwd.get(p, 0) for p in mm) == sum(none.bwd.get(p, 0) for p in mm) + 6 * layers
    assert sum(runs["selective"][3].bwd.get(p, 0) for p in mm) == sum(none.bwd.get(p, 0) for p in mm)
    attention = [p for p in none.fwd if "scaled_dot_product" in str(p)]  # the fused kernel under sdpa
    assert attention and sum(runs["selective"][3].bwd.get(p, 0) for p in attention) == \
        sum(none.bwd.get(p, 0) for p in attention) < sum(runs["layer"][3].bwd.get(p, 0) for p in attention)
    for mode in ("layer", "selective"):  # the cheap ops run again in both
        assert runs[mode][3].bwd.get(aten.silu, 0) == layers
        assert runs[mode][3].bwd.get(aten.rsqrt, 0) >= 2 * layers


def test_bf16_autocast_and_inference_through_recomputed_layers(traced):
    program, batch = traced
    _, l0, g0, _ = _single("none", program, batch, "bf16")
    c, l1, g1, _ = _single("layer", program, batch, "bf16")
    assert l1.item() == l0.item() and max((g1[k] - g0[k]).abs().max().item() for k in g0) <= TOL
    infer = {k: v for k, v in batch.items() if k != "labels"}
    expected = zoo.build("llama", seed=0)(**infer).logits
    torch.testing.assert_close(fxpar.compile(zoo.build("llama", seed=0), "recompute=selective",
                                             example_kwargs=batch)(**infer).logits, expected)


def test_zero3_gathers_move_into_the_layer_that_reads_them():
    batch = _batch(4)
    compiled = fxpar.api.price(zoo.build("llama", seed=0), "dp=2,zero=3,recompute=layer", example_kwargs=batch,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    gm = compiled._train.pipeline.stages[0].gm
    gather = gather_params_op()
    outside = [n for n in gm.graph.nodes if n.target is gather]
    inside = [n for m in gm.modules() if isinstance(m, Recomputed) for n in m.body.graph.nodes
              if n.target is gather]
    assert len(inside) == zoo.tiny_config("llama").num_hidden_layers  # a bucket per layer, gathered inside it
    assert len(outside) >= 1  # the embedding / head buckets stay outside any layer

    def gathered(n):  # a gathered bucket or a parameter sliced out of one
        return n.target is gather or (n.target in (aten.slice.Tensor, aten.view.default) and gathered(n.args[0]))

    calls = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Recomputed)]
    assert calls and not any(gathered(a) for n in calls for a in n.all_input_nodes)


def _grads_by_mode(plan: str, modes=MODES) -> dict:
    """One SGD(lr=0) step per recompute mode under ``plan`` on the same traced program; each mode's worst
    gradient difference from ``none``, and ``none``'s from one eager process."""
    batch = _batch(4)
    parsed = fxpar.Plan.parse(plan)
    per = 4 // ((parsed.microbatches or parsed.pp) * parsed.dp)
    grads, losses = {}, {}
    for mode in modes:
        # the same weights and graph for every mode; a model and its trace each time, as ZeRO-3 takes the
        # model's tensors (fxpar.weights.WeightSource.taking)
        model = zoo.build("llama", seed=0)
        program = fxpar.trace(model, example_kwargs={k: v[:per] if isinstance(v, torch.Tensor) else v
                                                     for k, v in batch.items()})
        compiled = fxpar.compile(model, f"{plan},recompute={mode}", example_kwargs=batch,
                                 optimizer=lambda p: torch.optim.SGD(p, lr=0.0), program=program, timeout=120)
        losses[mode] = compiled.step(**batch).item()
        grads[mode] = compiled.full_state_dict(grads=True)
        outlined = [m for s in compiled._train.pipeline.stages_of(compiled.pp_rank) for m in s.gm.modules()
                    if isinstance(m, Recomputed)]
        assert (len(outlined) > 0) == (mode != "none")
    ref = zoo.build("llama", seed=0)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    g0 = grads["none"]
    out = {mode: max((grads[mode][k] - g0[k]).abs().max().item() for k in g0) for mode in modes}
    out["loss"] = max(abs(v - losses["none"]) for v in losses.values())
    out["reference"] = max((g0[k] - p.grad).abs().max().item() for k, p in ref.named_parameters())
    return out


def test_selective_is_refused_with_a_split_backward_schedule():
    with pytest.raises(fxpar.PlanError, match="recompute='layer' with this schedule"):
        fxpar.api.price(zoo.build("llama", seed=0), "pp=2,schedule=zbv,recompute=selective",
                        example_kwargs=_batch(4))


@pytest.mark.slow
@pytest.mark.parametrize("plan,modes", [("tp=2", MODES), ("pp=2", MODES), ("dp=2,zero=3", MODES),
                                        ("dp=2,zero=3,mixed_precision=bf16", MODES),
                                        ("pp=2,schedule=zbv,microbatches=2", ("none", "layer"))])
def test_gradients_equal_no_recompute_on_two_ranks(plan, modes, pool2):
    for r in pool2.run(_grads_by_mode, plan, modes, timeout=300):
        assert all(r[m] <= TOL for m in modes) and r["loss"] <= TOL, r
        if "bf16" not in plan:
            assert r["reference"] <= 1e-5, r
