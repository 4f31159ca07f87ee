"""Context parallelism's op rules on tiny hand-written models (``fxpar.passes.cp_ops`` / ``cp_rules``), each on 2
gloo ranks against one process: the loss and every parameter's gradient (summed over the ranks, as the data-
parallel engine sums it over dp x cp) within 1e-5, and the pass split what the rule promises (attention on this
rank's rows, nothing gathered by a fallback). A buffer written in place through a view of a split value is
refused, not silently wrong."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpar
from fxpar.ir.errors import PlanError
from fxpar.testing import multiproc

TOL = 1e-5
B, S, D, H, V = 2, 8, 16, 2, 32
GROUP = "cp:0,1"
pool2 = multiproc.rank_pool(2, shared=True)
pytestmark = pytest.mark.slow


class Gelu(torch.autograd.Function):  # a user autograd.Function fxpar captures as one elementwise op
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return g * (s + 1.702 * x * s * (1 - s))


class Tiny(nn.Module):
    """An embedding, one attention block of the kind ``case`` names, a head and the mean loss.

    ids: ``where`` placeholder tokens replaced by ``where(ids == V - 1, 0, ids)`` (of ``ids[:, -S:]``);
    ``index_put`` the same by ``ids[mask] = 0``; ``codebooks`` ``[B * 2, S]`` ids, one embedding per row
    picked by ``select``. attention: ``fused`` one ``addmm`` (a Conv1D) for q, k, v, ``split`` into three,
    SDPA; ``eager`` ``baddbmm`` from zero scores, ``masked_fill_``, softmax, ``bmm``; ``stack`` rotary-like
    pairs interleaved by ``stack`` + ``flatten``. ``gelu``: the MLP's activation an autograd.Function."""

    def __init__(self, ids="plain", attention="fused", gelu=False):
        super().__init__()
        self.ids, self.attention, self.gelu = ids, attention, gelu
        self.emb = nn.Embedding(V, D)
        self.emb2 = nn.Embedding(V, D)
        self.qkv_w = nn.Parameter(torch.randn(D, 3 * D) / 4)
        self.qkv_b = nn.Parameter(torch.randn(3 * D) / 4)
        self.up, self.down, self.head = nn.Linear(D, 2 * D), nn.Linear(2 * D, D), nn.Linear(D, V)

    def embed(self, input_ids):
        if self.ids == "where":
            ids = input_ids[:, -S:]  # a slice keeping every id
            return self.emb(torch.where(ids == V - 1, 0, ids))
        if self.ids == "index_put":
            ids = input_ids.clone()
            ids[input_ids == V - 1] = 0
            return self.emb(ids)
        if self.ids == "codebooks":
            rows = input_ids.reshape(-1, 2, input_ids.shape[-1])
            return self.emb(rows[:, 0]) + self.emb2(rows[:, 1])
        return self.emb(input_ids)

    def attend(self, x):
        b, s, _ = x.shape
        qkv = torch.addmm(self.qkv_b, x.reshape(-1, D), self.qkv_w).view(b, s, 3 * D)
        q, k, v = (t.view(b, s, H, D // H).transpose(1, 2) for t in qkv.split(D, dim=2))
        if self.attention == "stack":  # rotate pairs (x1, x2) -> (-x2, x1), interleaved back
            q = q + torch.stack([-q[..., 1::2], q[..., ::2]], dim=-1).flatten(-2)
        if self.attention == "eager":
            q, k, v = (t.reshape(b * H, s, D // H) for t in (q, k, v))
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            scores = torch.baddbmm(torch.zeros(b * H, s, s), q, k.transpose(1, 2), alpha=(D // H) ** -0.5)
            scores.masked_fill_(mask, float("-inf"))  # in place, on this rank's rows
            out = torch.bmm(torch.softmax(scores, dim=-1), v).view(b, H, s, D // H)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, s, D)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        x = x + self.attend(x)
        h = self.up(x)
        x = x + self.down(Gelu.apply(h) if self.gelu else F.gelu(h))
        logits = self.head(x)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


class Filled(nn.Module):
    """A buffer the size of the sequence filled one position at a time (a recurrence written in place)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        out = torch.zeros_like(x)
        state = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            state = 0.5 * state + x[:, t]
            out[:, t] = state
        loss = F.cross_entropy(self.head(out).flatten(0, 1), labels.flatten())
        return {"loss": loss}


class Sorted(nn.Module):
    """The token rows sorted by a per-token score, picked in that order (``h[order]``), scaled, and put back by
    the inverse permutation (``inv[order] = arange(n)``, ``y[inv]``): token-local as a MoE's dispatch is.
    ``escape``: a cumsum across the sorted rows, which is not (the pass must fall back to the whole sequence)."""

    def __init__(self, escape=False):
        super().__init__()
        self.escape = escape
        self.emb, self.scale, self.head = nn.Embedding(V, D), nn.Parameter(torch.randn(D)), nn.Linear(D, V)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        h = x.reshape(-1, D)
        order = h.sum(-1).sort()[1]
        picked = h[order] * self.scale
        y = picked.cumsum(0) / 4 if self.escape else picked
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.shape[0])
        x = x + y[inv].view(x.shape)
        return {"loss": F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())}


def _batch(ids: str) -> dict:
    rows = B * 2 if ids == "codebooks" else B
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, V, (rows, S), generator=g)
    input_ids[:, 1] = V - 1  # a placeholder token in every row
    return {"input_ids": input_ids, "labels": torch.randint(0, V, (B, S), generator=g)}


def cp_against_one_process(case: dict) -> dict:
    """On each rank: the traced model through the pass for this rank, forward and backward; the loss and the
    gradients summed over the ranks against the eager model's."""
    import torch.distributed as dist

    from fxpar.passes.context_parallel import context_parallel
    from fxpar.runtime import groups

    groups.register_group(GROUP, dist.group.WORLD)
    torch.manual_seed(0)
    case = dict(case)
    model = Sorted(case["escape"]) if "escape" in case else Tiny(**case)
    kw = _batch(case.get("ids", "plain"))
    program = fxpar.trace(model, example_kwargs=kw)
    local, res = context_parallel(program, 2, dist.get_rank(), GROUP, keep_outputs={0})
    loss = local(**kw)["loss"]
    loss.backward()
    got = {}
    for fqn, p in sorted(local.named_parameters()):
        g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()  # (emb2: codebooks only)
        dist.all_reduce(g)
        got[fqn] = g
    model.zero_grad(set_to_none=True)
    ref = model(**kw)["loss"]
    ref.backward()
    grad = max(float((got[fqn] - (0 if p.grad is None else p.grad)).abs().max()) for fqn, p in model.named_parameters())
    return {"loss": abs(float(loss - ref)), "grad": grad, "gathered": res.gathered, "attention": res.attention,
            "kv_gathers": res.kv_gathers, "token_local": res.token_local}


@pytest.mark.parametrize("case", [
    {"ids": "where"}, {"ids": "index_put"}, {"ids": "codebooks"},
    {"attention": "fused", "gelu": True}, {"attention": "eager"}, {"attention": "stack"},
], ids=lambda c: "-".join(map(str, c.values())))
def test_rule_equals_one_process(pool2, case):
    for r in pool2.run(cp_against_one_process, case, timeout=120):
        assert r["loss"] <= TOL and r["grad"] <= TOL, r
        assert r["gathered"] == [], r  # every op had a rule: nothing gathered by a fallback
        assert len(r["kv_gathers"]) == 2, r  # the keys and the values, not the queries
        assert len(r["attention"]) == (case.get("attention") != "eager"), r


@pytest.mark.parametrize("escape", [False, True])
def test_sorted_rows_stay_local_unless_they_escape(pool2, escape):
    """Rows sorted along the sequence, picked and put back by the sort's inverse run on this rank's rows with
    nothing gathered; a cumsum across the sorted rows (an order only this rank knows) makes the pass run again
    with the sort falling back: the whole sequence sorted, as one process sorts it. Both equal one process."""
    for r in pool2.run(cp_against_one_process, {"escape": escape}, timeout=120):
        assert r["loss"] <= TOL and r["grad"] <= TOL, r
        if escape:
            assert "sort" in r["gathered"] and r["token_local"] == [], r
        else:
            assert r["gathered"] == [] and {"sort", "index", "index_put_"} <= set(r["token_local"]), r


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_router_and_experts_run_on_this_ranks_tokens(name):
    """Rank 0 of cp=2 on the zoo's Mixtral and Qwen2-MoE (top-2 of 4 experts: the (token, k) pairs sorted by
    expert, grouped matmuls with offsets from a histc of the sorted ids, the rows put back by the sort's
    inverse; Qwen2-MoE's gated shared expert beside): no op gathered by the fallback, and each grouped matmul
    reads this rank's half of the routed rows."""
    from fxpar import zoo
    from fxpar.ir.op_classes import is_grouped_mm
    from fxpar.passes.context_parallel import context_parallel
    from fxpar.runtime import groups

    kw = zoo.example_inputs(name, zoo.tiny_config(name), batch=2, seq=16)
    program = fxpar.trace(zoo.build(name, seed=0), example_kwargs=kw)
    groups.register_group(GROUP, size=2)
    try:
        local, res = context_parallel(program, 2, 0, GROUP, keep_outputs={0})
    finally:
        groups.unregister_group(GROUP)
    assert res.gathered == [], res.gathered
    whole = [n.args[0].meta["val"].shape[0] for n in program.gm.graph.nodes if is_grouped_mm(n)]
    mine = [n.args[0].meta["val"].shape[0] for n in local.gm.graph.nodes if is_grouped_mm(n)]
    assert len(whole) == 4 and whole == [2 * 16 * 2] * 4 and mine == [w // 2 for w in whole], (whole, mine)
    assert {"sort", "histc", "grouped_mm_fallback", "index_put_"} <= set(res.token_local), res.token_local


def test_written_through_buffer_is_refused():
    from fxpar.passes.context_parallel import context_parallel
    from fxpar.runtime import groups

    groups.register_group(GROUP, size=2)
    try:
        program = fxpar.trace(Filled(), example_kwargs=_batch("plain"))
        with pytest.raises(PlanError, match="written in place"):
            context_parallel(program, 2, 0, GROUP, keep_outputs={0})
    finally:
        groups.unregister_group(GROUP)


def test_ulysses_takes_sdpa_where_heads_divide_else_keeps_the_gather():
    """``attention="ulysses"`` on a grouped-query Llama (4 query heads, 2 KV heads), traced for rank 0 of a
    named cp group: at cp=2 each layer's queries, keys, values and output go by all-to-all (4 per layer) and
    nothing is gathered; at cp=4 the 2 KV heads do not divide, so each layer keeps the all-gather of its keys
    and values, and the report ``fxpar inspect`` prints names the head counts and the fix; ``"auto"`` keeps the
    all-gather where it sends fewer bytes."""
    from fxpar import zoo
    from fxpar.ir.mesh import MeshSpec
    from fxpar.ir.ops import count_collectives
    from fxpar.passes.context_parallel import context_parallel
    from fxpar.report.context_parallel import cp_rows, cp_table

    cfg = zoo.tiny_config("llama")
    kw = zoo.example_inputs("llama", cfg, batch=1, seq=16)
    program = fxpar.trace(zoo.build("llama", seed=0), example_kwargs=kw)
    local, res = context_parallel(program, 2, 0, "cp:0,1", keep_outputs={0}, attention="ulysses")
    counts = count_collectives(local.gm)
    assert len(res.ulysses) == cfg.num_hidden_layers and not res.kept and res.gathered == [], res
    assert counts["all_to_all"] == 4 * cfg.num_hidden_layers and counts["all_gather_rs_bwd"] == 0, counts
    local, res = context_parallel(program, 4, 0, "cp:0,1,2,3", keep_outputs={0}, attention="ulysses")
    plan = fxpar.Plan(cp=4, cp_attention="ulysses")  # the report reads this rank's stage graphs
    view = SimpleNamespace(plan=plan, mesh=MeshSpec.for_plan(plan, 0),
                           my_stages=lambda: [SimpleNamespace(index=0, gm=local.gm)])
    kinds = [row["kind"] for row in cp_rows(view)]
    assert kinds == ["all-gather"] * 2 * cfg.num_hidden_layers, kinds  # each layer's keys and values
    assert res.ulysses == [] and len(res.kept) == cfg.num_hidden_layers, res
    kept = [line for line in cp_table(view).splitlines() if line.startswith("kept the all-gather: ")]
    assert len(kept) == cfg.num_hidden_layers and all(
        "4 query heads and 2 key/value heads" in line and "cp=4" in line for line in kept), kept
    # "auto": Ulysses where it sends fewer bytes per rank than the all-gather, (4 + 2) / cp against 2 heads' worth
    # here: at cp=2, 3 against 2, so every layer keeps the gather and says so
    _, res = context_parallel(program, 2, 0, "cp:0,1", keep_outputs={0}, attention="auto")
    row = 16 * cfg.head_dim * 4  # one head's 16 tokens, fp32
    kv, qo = 2 * cfg.num_key_value_heads * row, 2 * cfg.num_attention_heads * row  # whole-sequence bytes
    want = f"no more bytes per rank ({kv // 2} against Ulysses' {(qo + kv) // 2 // 2})"  # (cp - 1) / cp of each
    assert res.ulysses == [] and len(res.kept) == cfg.num_hidden_layers, res
    assert all(want in why for why in res.kept.values()), (want, res.kept)
