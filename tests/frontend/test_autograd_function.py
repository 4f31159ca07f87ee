"""User ``torch.autograd.Function``s keep their own backward in a traced program.

Non-strict torch.export records only the ATen ops of a Function's forward; differentiating those is
not what the Function's backward does when the backward is hand-written to differ (a straight-through
estimator, phimoe's router gradient estimator). The export frontend routes such calls through one
``fxpar.autograd_function`` node whose kernels call the Function, so gradients equal eager's.
"""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.frontend.export import capture_export
from fxpar.ir.function_op import is_function_node
from fxpar.testing.compare import grads_by_fqn


class StraightThroughRound(torch.autograd.Function):
    """Round to a grid of ``1/scale``; backward passes the gradient through unchanged (autodiff of
    ``round`` is zero everywhere)."""

    @staticmethod
    def forward(ctx, x, scale: float):
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ClampedPair(torch.autograd.Function):
    """Two outputs, a non-tensor in the result, saved tensors; backward scales
    by a factor autodiff would not produce."""

    @staticmethod
    def forward(ctx, x, gate, bias):
        ctx.save_for_backward(gate)
        return (x.clamp(-0.1, 0.1) * gate, "tag", x + bias)

    @staticmethod
    def backward(ctx, g_clamped, _tag, g_shift):
        (gate,) = ctx.saved_tensors
        return 3.0 * g_clamped * gate + g_shift, None, g_shift.sum(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 8)
        self.bias = torch.nn.Parameter(torch.randn(8))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = StraightThroughRound.apply(self.a(x), 2.0)
        c, tag, shifted = ClampedPair.apply(self.b(h), torch.sigmoid(h), self.bias)
        assert tag == "tag"
        with torch.no_grad():  # no backward can follow: stays inlined
            StraightThroughRound.apply(h, 4.0)
        return self.head(c + shifted).square().mean()


def _grads(fn, model, *args, **kwargs):
    model.zero_grad(set_to_none=True)
    fn(*args, **kwargs).backward()
    return grads_by_fqn(model)


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_custom_backward_is_kept():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(5, 6)
    ref = _grads(model, model, x)
    program = fxpar.trace(model, (x,), frontend="export")
    got = _grads(program, model, x)
    assert _max_diff(got, ref) == 0.0
    assert float(ref["a.weight"].abs().max()) > 0  # reached only through the straight-through backward
    nodes = [n for n in program.gm.graph.nodes if is_function_node(n)]
    assert len(nodes) == 2, "one opaque node per differentiable Function call, none for the no_grad call"
    assert {n.meta["fxpar.module"] for n in nodes} == {""}


def test_plain_export_differentiates_the_forward_instead():
    """What the frontend guards against: torch.export alone loses the backward (this pins the
    difference the test above would see without the fix)."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(5, 6)
    ref = _grads(model, model, x)
    ep = torch.export.export(model, (x,), strict=False)
    got = _grads(ep.module(), model, x)
    assert float(got["a.weight"].abs().max()) == 0.0
    assert _max_diff(got, ref) > 1e-3


def test_dynamic_shapes_and_meta_models():
    torch.manual_seed(0)
    model = Net()
    program = fxpar.trace(model, (torch.randn(5, 6),), frontend="export", dynamic=True)
    x = torch.randn(7, 6)  # another batch size through the same graph
    assert _max_diff(_grads(program, model, x), _grads(model, model, x)) == 0.0
    with torch.device("meta"):
        meta_model = Net()
    ep = capture_export(meta_model, (torch.randn(5, 6, device="meta"),))
    assert sum(is_function_node(n) for n in ep.graph.nodes) == 2


def _tiny_phimoe():
    transformers = pytest.importorskip("transformers")
    # router_jitter_noise 0.5 keeps more than the best expert unmasked, so the router samples others
    # and its estimator's backward differs from autodiff (by 6.7e-4 here; at the default 0.01, by 0)
    cfg = transformers.PhimoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.5, attention_dropout=0.0, use_cache=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).train(), cfg.vocab_size


def test_tiny_phimoe_gradients_match_eager_over_the_whole_vocabulary():
    model, vocab = _tiny_phimoe()
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    kw = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}

    def step(fn):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the router samples experts (Gumbel noise, Heun's mask) in train mode
        out = fn(**kw)
        out.loss.backward()
        return out.loss.detach(), grads_by_fqn(model)

    ref_loss, ref = step(model)
    program = fxpar.trace(model, example_kwargs=kw, frontend="export")
    loss, got = step(program)
    assert torch.equal(loss, ref_loss)
    assert _max_diff(got, ref) <= 1e-5
    assert sum(is_function_node(n) for n in program.gm.graph.nodes) == 4  # 2 layers x top-2


def test_tiny_phimoe_tensor_parallel_plan_builds():
    """The TP and pipeline passes take the opaque node (priced on one process, rank 0 of tp=2 x pp=2)."""
    model, vocab = _tiny_phimoe()
    ids = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(1))
    compiled = fxpar.api.price(model, "tp=2,pp=2", example_kwargs={"input_ids": ids, "labels": ids.clone(),
                                                                   "use_cache": False}, frontend="export")
    assert compiled is not None


class RowSoftmax(torch.autograd.Function):
    """Not elementwise: each output reads its whole row."""

    @staticmethod
    def forward(ctx, x):
        y = x.softmax(-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return y * (g - (g * y).sum(-1, keepdim=True))


class TwoFunctions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)

    def forward(self, x):
        return RowSoftmax.apply(StraightThroughRound.apply(self.a(x), 4.0))


def test_elementwise_functions_are_told_apart_from_others():
    """An elementwise Function (forward and backward) may keep a tensor-parallel shard; one that mixes
    elements may not: the probe tells them apart, and leaves the global RNG alone."""
    from fxpar.ir.function_op import call_of
    from fxpar.ir.op_classes import is_pointwise

    program = fxpar.trace(TwoFunctions(), (torch.randn(4, 6),))
    nodes = [n for n in program.graph.nodes if is_function_node(n)]
    state = torch.get_rng_state()
    assert [call_of(n.args[1]).cls for n in nodes] == [StraightThroughRound, RowSoftmax]
    assert [is_pointwise(n) for n in nodes] == [True, False]
    assert torch.equal(state, torch.get_rng_state())
