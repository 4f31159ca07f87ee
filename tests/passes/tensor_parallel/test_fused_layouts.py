"""Fused attention projections of every layout, cut part by part from the graph (issue 14).

Small hand-built attention blocks, one per layout of a fused QKV projection: ``[all q | all k | all v]``,
per-head ``[q k v]`` groups (picked by ``select`` or by slices of ``[.., H, 3*D]``), ``mp_num`` blocks,
and multi-query attention (one K/V head, split off the features or taken by head from a view to
``[.., H + 2, D]``). On one process: the pieces and whole pieces the pass finds and that nothing is
gathered; on two ranks: loss, output and every gradient against the same block on one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxpar
from fxpar import zoo
from fxpar.ir.placement import ShardLayout
from fxpar.passes.tensor_parallel import tensor_parallel
from fxpar.runtime import groups
from fxpar.testing import multiproc

B, S, E, H, D = 2, 4, 32, 4, 8  # batch, sequence, hidden, heads, head dim
TOL = 1e-5
pool2 = multiproc.rank_pool(2)


class _Block(torch.nn.Module):
    """An attention block: ``qkv`` (fused, ``n_out`` features), ``q, k, v`` from :meth:`heads`, ``o``."""

    def __init__(self, n_out: int):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(E, n_out), torch.nn.Linear(E, E)

    def forward(self, x):
        q, k, v = self.heads(self.qkv(x))  # [B, heads, S, D]; k, v may have one head
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, S, E))


class AllQKV(_Block):
    """``[all q | all k | all v]`` split on the features (gpt2, mpt)."""

    def __init__(self):
        super().__init__(3 * E)

    def heads(self, t):
        return [p.view(B, S, H, D).transpose(1, 2) for p in t.split(E, dim=-1)]


class PerHeadSelect(_Block):
    """``[q k v]`` per head, viewed as ``[.., H, 3, D]`` and picked by ``select`` (bloom, persimmon)."""

    def __init__(self):
        super().__init__(3 * E)

    def heads(self, t):
        t = t.view(B, S, H, 3, D)
        return [t[..., i, :].transpose(1, 2) for i in range(3)]


class PerHeadSlices(_Block):
    """``[q k v]`` per head, viewed as ``[.., H, 3*D]`` and sliced (gpt_neox, gpt_neox_japanese)."""

    def __init__(self):
        super().__init__(3 * E)

    def heads(self, t):
        t = t.view(B, S, H, 3 * D)
        return [t[..., i * D:(i + 1) * D].permute(0, 2, 1, 3) for i in range(3)]


class MpBlocks(_Block):
    """``mp_num`` blocks of ``[q v k]`` over H/mp_num heads each (codegen)."""

    MP = 2

    def __init__(self):
        super().__init__(3 * E)

    def heads(self, t):
        q, v, k = t.reshape(B, S, self.MP, -1).split(E // self.MP, dim=-1)
        return [p.reshape(B, S, H, D).transpose(1, 2) for p in (q, k, v)]


class MultiQuerySplit(_Block):
    """Multi-query: ``[all q | k | v]`` with one K/V head, split on the features and expanded over the
    heads (gpt_bigcode)."""

    def __init__(self):
        super().__init__(E + 2 * D)

    def heads(self, t):
        q, k, v = t.split([E, D, D], dim=-1)
        return [q.view(B, S, H, D).transpose(1, 2)] + [p.unsqueeze(1).expand(B, H, S, D) for p in (k, v)]


class MultiQueryHeads(_Block):
    """Multi-query: viewed as ``[.., H + 2, D]``, q sliced and k, v indexed by head, one K/V head
    broadcast by attention (falcon)."""

    def __init__(self):
        super().__init__(E + 2 * D)

    def heads(self, t):
        t = t.view(B, S, H + 2, D)
        return [p.transpose(1, 2) for p in (t[:, :, :-2], t[:, :, [H]], t[:, :, [H + 1]])]


class GroupedQuery(_Block):
    """Grouped-query: ``[all q | k | v]`` with G = 2 K/V heads repeated over the heads as transformers'
    repeat_kv does; at more ranks than K/V heads, k and v are whole and attention takes each rank's."""

    G = 2

    def __init__(self):
        super().__init__(E + 2 * self.G * D)

    def heads(self, t):
        q, k, v = t.split([E, self.G * D, self.G * D], dim=-1)
        kv = [p.view(B, S, self.G, D).transpose(1, 2)[:, :, None].expand(B, self.G, H // self.G, S, D)
              .reshape(B, H, S, D) for p in (k, v)]
        return [q.view(B, S, H, D).transpose(1, 2), *kv]


PLAN = {"qkv": "colwise", "o": "rowwise"}
# layout -> (pieces of qkv.weight, whole pieces); None: a plain shard (the cut is inside the heads)
LAYOUTS = {AllQKV: ([E, E, E], ()), PerHeadSelect: None, PerHeadSlices: None, MpBlocks: None,
           MultiQuerySplit: ([E, D, D], (1, 2)), MultiQueryHeads: ([E, D, D], (1, 2)),
           GroupedQuery: ([E, 2 * D, 2 * D], ())}


def _build(cls):
    torch.manual_seed(0)
    return cls(), torch.randn(B, S, E)


def test_shard_layout_whole_pieces():
    full = torch.arange(12.0).view(6, 2)
    mqa = ShardLayout(0, [4, 1, 1], 2, whole=(1, 2))
    shards = [mqa.slice(full, r) for r in range(2)]
    assert [s[:, 0].tolist() for s in shards] == [[0, 2, 8, 10], [4, 6, 8, 10]]
    assert mqa.local_shape((6, 2)) == (4, 2) and mqa.full_shape((4, 2)) == (6, 2)
    assert mqa.local_pieces() == [2, 1, 1]
    assert mqa.ranges(6, 1) == [(2, 4), (4, 5), (5, 6)]
    assert torch.equal(mqa.unshard(shards), full)
    plain = ShardLayout(1, [2], 2)  # no whole piece: as before
    assert plain.slice(full, 1).tolist() == full[:, 1:].tolist()


@pytest.mark.parametrize("cls", list(LAYOUTS), ids=lambda c: c.__name__)
def test_fused_layout_found_and_kept_sharded(cls):
    model, x = _build(cls)
    program = fxpar.trace(model, example_kwargs={"x": x})
    local, info = tensor_parallel(program, 2, 0, styles=PLAN)
    assert info.sharded.get("qkv.weight") == 0 and info.sharded.get("o.weight") == 1
    want = LAYOUTS[cls]
    assert info.pieces.get("qkv.weight") == (want[0] if want else None)
    assert info.whole.get("qkv.weight", ()) == (want[1] if want else ())
    assert info.fallbacks == []  # q, k, v and attention stay on this rank's heads: nothing gathered
    layout = info.layout("qkv.weight")
    assert tuple(local.params["qkv.weight"].shape) == layout.local_shape(program.params["qkv.weight"].shape)


def test_grouped_query_kv_whole_where_its_heads_do_not_divide():
    model, x = _build(GroupedQuery)
    program = fxpar.trace(model, example_kwargs={"x": x})
    _, info = tensor_parallel(program, 4, 1, styles=PLAN)  # 2 K/V heads over 4 ranks: a copy each
    assert info.pieces["qkv.weight"] == [E, 2 * D, 2 * D] and info.whole["qkv.weight"] == (1, 2)
    assert info.fallbacks == []


def _two_rank_all_layouts() -> dict:
    groups.register_group("tp:0,1", dist.group.WORLD)
    rank, out = dist.get_rank(), {}
    for cls in LAYOUTS:
        model, x = _build(cls)
        program = fxpar.trace(model, example_kwargs={"x": x})
        local, info = tensor_parallel(program, 2, rank, styles=PLAN)
        y = local(x=x)
        y.square().mean().backward()
        ref = model(x)
        ref.square().mean().backward()
        grad = 0.0
        for fqn, p in local.named_parameters():
            want = dict(model.named_parameters())[fqn].grad
            layout = info.layout(fqn)
            want = want if layout is None else layout.slice(want, rank)
            grad = max(grad, (p.grad - want).abs().max().item())
        out[cls.__name__] = {"out": (y - ref).abs().max().item(), "grad": grad}
    return out


@pytest.mark.slow
def test_fused_layouts_two_ranks_match_one_process(pool2):
    for per_rank in pool2.run(_two_rank_all_layouts, timeout=120):
        for name, r in per_rank.items():
            assert r["out"] <= TOL and r["grad"] <= TOL, (name, r)


def _multi_query_falcon():
    """The zoo's falcon with the original multi-query attention (one K/V head for all heads)."""
    import transformers

    cfg = zoo.tiny_config("falcon")
    cfg.new_decoder_architecture, cfg.multi_query = False, True
    torch.manual_seed(0)
    return transformers.FalconForCausalLM(cfg)


def _multi_query_clipped(directory: str) -> dict:
    """One clipped SGD step of a multi-query falcon at tp=2: its fused K/V head is whole on both ranks,
    counted once in the global gradient norm and written once to a checkpoint."""
    from fxpar import checkpoint

    model, ref = _multi_query_falcon(), _multi_query_falcon()
    batch = zoo.example_inputs("falcon", model, batch=2, seq=8)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    compiled = fxpar.compile(model, "tp=2", example_kwargs=batch, optimizer=sgd, timeout=120, max_grad_norm=0.05)
    compiled.step(**batch)
    ref(**batch).loss.backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
    saved = checkpoint.load_model_state(checkpoint.save(compiled, directory, 1))
    full = compiled.full_state_dict()
    return {"norm": abs(compiled.last_grad_norm - want), "counted": compiled.clipper.counted(),
            "saved": max((saved[k] - v).abs().max().item() for k, v in full.items()),
            "whole": dict(compiled.tp_info.whole), "total": sum(p.numel() for p in ref.parameters())}


@pytest.mark.slow
def test_whole_pieces_counted_once_in_the_gradient_norm_and_checkpoint(pool2, tmp_path):
    results = pool2.run(_multi_query_clipped, str(tmp_path), timeout=200)
    assert results[0]["whole"], "falcon's fused query_key_value has no whole K/V piece"
    assert sum(r["counted"] for r in results) == results[0]["total"]
    assert all(r["norm"] <= TOL and r["saved"] == 0 for r in results), results
