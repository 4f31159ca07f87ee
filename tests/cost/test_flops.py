"""Attention FLOPs for any value head dim (multi-head latent attention), and the cost model's fallback."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import flop_counter as fc
from torch.utils.flop_counter import FlopCounterMode

import fxpar
from fxpar import zoo
from fxpar.cost import flops as F
from fxpar.ir import meta

# (q, k, v) shapes: multi-head latent attention (d_v < d_qk and d_v > d_qk), grouped-query, 3-D
MLA = ((2, 4, 8, 24), (2, 4, 8, 24), (2, 4, 8, 16))
SHAPES = {
    "mla": MLA,
    "mla_wide_v": ((2, 4, 8, 16), (2, 4, 6, 16), (2, 4, 6, 40)),
    "gqa": ((2, 8, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)),
    "gqa_mla": ((1, 6, 5, 24), (1, 2, 7, 24), (1, 2, 7, 8)),
    "3d": ((3, 8, 24), (3, 6, 24), (3, 6, 16)),
}


def test_mla_by_hand():
    # 2 x 4 = 8 score matrices of 8 x 8; QK^T and PV: 2 * 64 * 24 and 2 * 64 * 16 each
    assert F.sdpa_flops(*MLA) == 8 * (2 * 8 * 8 * 24 + 2 * 8 * 8 * 16) == 40960
    # backward: S recomputed (d_qk), dP (d_v), dV (d_v), dQ (d_qk), dK (d_qk)
    assert F.sdpa_backward_flops(*MLA) == 8 * 2 * 8 * 8 * (24 + 16 + 16 + 24 + 24) == 106496
    q, k, v = SHAPES["gqa"]  # 2 x 8 query heads, each against its shared key/value head
    assert F.sdpa_flops(q, k, v) == 16 * 2 * 8 * 8 * 32
    q, k, v = SHAPES["3d"]
    assert F.sdpa_flops(q, k, v) == 3 * 2 * 8 * 6 * 40


@pytest.mark.parametrize("q,k,v", [
    ((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16)),
    ((2, 8, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)),
    ((1, 6, 5, 32), (1, 3, 9, 32), (1, 3, 9, 32)),
])
def test_equals_torch_where_dv_equals_dqk(q, k, v):
    assert F.sdpa_flops(q, k, v) == fc.sdpa_flop_count(q, k, v)
    grad_out = q[:-1] + (v[-1],)
    assert F.sdpa_backward_flops(q, k, v) == fc.sdpa_backward_flop_count(grad_out, q, k, v)


def test_incompatible_shapes_raise():
    with pytest.raises(ValueError, match="attention shapes"):
        F.sdpa_flops((2, 4, 8, 24), (2, 4, 8, 16), (2, 4, 8, 16))  # d of q and k differ


@pytest.mark.parametrize("name", list(SHAPES))
def test_matches_flop_counter_on_eager_tensors(name):
    """torch's FlopCounterMode counts the matmuls the eager (math) attention decomposes into; its backward
    has no recomputed S = Q K^T, which a flash kernel's (and ours) has."""
    q, k, v = (torch.randn(s, requires_grad=True) for s in SHAPES[name])
    gqa = q.dim() == 4 and k.shape[1] != q.shape[1]
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=gqa)
        with FlopCounterMode(display=False) as bwd:
            out.backward(torch.randn_like(out))
    assert out.shape[-1] == v.shape[-1]
    n, s_q, s_k, d_qk, _ = F._sdpa_dims(*SHAPES[name])
    recompute = 2 * n * s_q * s_k * d_qk
    assert fwd.get_total_flops() == F.sdpa_flops(*SHAPES[name])
    assert bwd.get_total_flops() + recompute == F.sdpa_backward_flops(*SHAPES[name])


def _tiny_deepseek_v2():
    cfg = transformers.DeepseekV2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, vocab_size=256, max_position_embeddings=64,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        attention_dropout=0.0, use_cache=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).train()


def _sdpa_nodes(program):
    return [n for n in program.nodes() if getattr(n.target, "overloadpacket", None) in F.SDPA_OPS]


def test_deepseek_v2_traces_with_exact_attention_costs():
    model = _tiny_deepseek_v2()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    kw = {"input_ids": ids, "labels": ids, "use_cache": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error", F.CostModelWarning)  # priced, not estimated
        program = fxpar.trace(model, example_kwargs=kw)
    nodes = _sdpa_nodes(program)
    assert len(nodes) == 2
    for node in nodes:
        q, k, v = (tuple(a.meta[meta.VAL].shape) for a in node.args[:3])
        assert q[-1] == 24 and v[-1] == 16  # d_qk = 16 nope + 8 rope, d_v = 16
        cost = node.meta[meta.COST]
        assert cost.flops == F.sdpa_flops(q, k, v) == 2 * 8 * 8 * 8 * (24 + 16)
        assert cost.bwd_flops == F.sdpa_backward_flops(q, k, v)
    costs = [n.meta[meta.COST] for n in program.nodes() if meta.COST in n.meta]
    assert sum(c.flops for c in costs) > 0 and sum(c.bwd_flops for c in costs) > 0
    assert torch.equal(program(**kw).loss, model(**kw).loss)


@pytest.fixture
def fresh_warned(monkeypatch):
    monkeypatch.setattr(F, "_WARNED", set())


def test_unpriceable_op_warns_once_and_is_counted_elementwise(monkeypatch, fresh_warned):
    def broken(*shapes):
        raise RuntimeError("no formula for these shapes")

    monkeypatch.setattr(F, "sdpa_flops", broken)
    model = zoo.build("llama")  # 2 layers: two attention nodes, one warning
    kw = zoo.example_inputs("llama", model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = fxpar.trace(model, example_kwargs=kw)
    ours = [w for w in caught if issubclass(w.category, F.CostModelWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    text = str(ours[0].message)
    assert "scaled_dot_product_attention" in text and "no formula for these shapes" in text
    nodes = _sdpa_nodes(program)
    assert len(nodes) == 2
    for node in nodes:
        out = node.meta[meta.VAL]
        assert node.meta[meta.COST].flops == out.numel()  # one FLOP per output element
        assert node.meta[meta.COST].bwd_flops == out.numel()
    assert torch.equal(program(**kw).loss, model(**kw).loss)


def test_fallback_when_even_the_output_is_unreadable(monkeypatch, fresh_warned):
    """A node whose pricing and output both fail costs nothing, and annotate_costs still finishes."""
    model = zoo.build("llama")
    program = fxpar.trace(model, example_kwargs=zoo.example_inputs("llama", model))
    node = _sdpa_nodes(program)[0]
    node.meta[meta.VAL] = object()  # neither a tensor nor anything with a shape
    monkeypatch.setattr(F, "sdpa_flops", lambda *a: 1 / 0)
    with pytest.warns(F.CostModelWarning, match="ZeroDivisionError"):
        total = F.annotate_costs(program)
    assert node.meta[meta.COST] == meta.ZERO_COST
    assert total.flops > 0


def test_grouped_expert_matmuls_are_priced_as_matmuls():
    """Mixtral's experts go through one grouped matmul op per projection (rows sorted by expert, 3-D
    weights): 2 * rows * K * N each, as the eager per-expert matmuls count them, not one per element."""
    model = zoo.build("mixtral", seed=0)
    kw = zoo.example_inputs("mixtral", model, batch=2, seq=8)
    program = fxpar.trace(model, example_kwargs=kw)
    grouped = [n for n in program.nodes() if n.op == "call_function" and F._grouped_mm_flops(
        [a.meta.get(meta.VAL) for a in n.args if isinstance(a, torch.fx.Node)], n.meta.get(meta.VAL))]
    assert grouped, "no grouped expert matmul in the mixtral trace"
    for node in grouped:
        x, w = (a.meta[meta.VAL] for a in node.args[:2])
        y = node.meta[meta.VAL]
        cost = node.meta[meta.COST]
        rows, k = x.shape
        assert w.dim() == 3 and k in w.shape[1:] and y.shape[1] in w.shape[1:]
        assert cost.flops == 2 * rows * k * y.shape[1]
        assert cost.bwd_flops == 2 * cost.flops


def test_reductions_and_the_loss_are_priced_on_what_they_read():
    """A mean over the hidden size and the cross-entropy over the logits do their work on their input: the
    loss's one scalar output would price a step's log-softmax over every logit as one FLOP. The loss also
    writes its log-softmax into a buffer the size of the logits (first touch of fresh memory)."""
    model = zoo.build("llama", seed=0)
    kw = zoo.example_inputs("llama", model, batch=2, seq=8)
    program = fxpar.trace(model, example_kwargs=kw)
    by = {}
    for n in program.nodes():
        if n.op == "call_function":
            by.setdefault(getattr(n.target, "overloadpacket", None), []).append(n)
    aten = torch.ops.aten
    (loss,) = by[aten.cross_entropy_loss]
    logits = loss.args[0].meta[meta.VAL]
    cost = loss.meta[meta.COST]
    assert cost.flops == logits.numel() and cost.bwd_flops == cost.flops
    assert cost.bytes_written >= logits.numel() * logits.element_size()
    for mean in by[aten.mean]:
        assert mean.meta[meta.COST].flops == mean.args[0].meta[meta.VAL].numel()
