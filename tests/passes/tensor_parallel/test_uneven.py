"""Dims the TP degree does not divide, on one process: ``torch.chunk``'s shares in the layout arithmetic
(slices, ranges, checkpoint boxes), each rank's graph (its parameter shapes, the whole logits, the same
collectives as an even cut), heads that cannot be cut (still an error under a plan, whole under
inference), the coverage report and the planner. Numerics on gloo ranks: ``tests/e2e/test_uneven.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar import zoo
from fxpar.ir.errors import PlanError
from fxpar.ir.ops import count_collectives
from fxpar.ir.placement import ShardLayout, chunk_fits, chunk_sizes, chunk_start
from fxpar.passes.tensor_parallel import styles_for, tensor_parallel
from fxpar.planner.model_costs import model_costs
from fxpar.report.tp_coverage import coverage
from fxpar.runtime.state import place_tp


def test_chunk_shares_are_torch_chunks():
    for n, k in [(32001, 2), (130, 4), (50257, 2), (7, 3), (8, 4), (5, 4)]:
        sizes = [len(c) for c in torch.arange(n).chunk(k)]
        assert chunk_sizes(n, k) == sizes + [0] * (k - len(sizes))
        assert [chunk_start(n, k, r) for r in range(len(sizes))] == [c[0].item() for c in torch.arange(n).chunk(k)]
        assert chunk_fits(n, k) == (len(sizes) == k and min(sizes) > 0)


@pytest.mark.parametrize("layout", [ShardLayout(0, None, 4, size=130), ShardLayout(1, None, 3, size=7),
                                    ShardLayout(0, [130, 130], 4), ShardLayout(0, [10, 3, 3], 4, whole=(1, 2))],
                         ids=["plain", "columns", "pieces", "whole pieces"])
def test_layout_slices_unshards_and_places_every_entry_once(layout):
    """Each rank's slice has its local shape, the full shape reads back from it, the slices unshard to the
    tensor, and the checkpoint boxes of every rank (whole pieces from rank 0 only) write each entry once."""
    size = sum(layout.pieces) if layout.pieces else layout.size
    shape = [5, 5]
    shape[layout.dim] = size
    full = torch.arange(size * 5, dtype=torch.float32).reshape(shape)
    parts = [layout.slice(full, r) for r in range(layout.parts)]
    assert [tuple(p.shape) for p in parts] == [layout.local_shape(full.shape, r) for r in range(layout.parts)]
    assert [p.shape[layout.dim] for p in parts] == layout.local_sizes(size)
    assert all(layout.full_shape(p.shape) == tuple(full.shape) for p in parts)
    assert torch.equal(layout.unshard(parts), full)
    written = torch.zeros_like(full)
    for r, p in enumerate(parts):
        for offsets, view in place_tp(layout, r, p.shape, (0, 0), p, whole_once=True):
            box = written[tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))]
            box += view + 1  # + 1: an entry written twice (or never) shows
    assert torch.equal(written, full + 1)


@pytest.fixture(scope="module")
def programs():
    """A tiny llama with a vocabulary of 257 and an MLP width of 130 (neither divides by 2 or 4), and the
    same model with 256 and 128."""
    out = {}
    for key, vocab, width in (("uneven", 257, 130), ("even", 256, 128)):
        model = zoo.build("llama", vocab_size=vocab, hidden_size=32, intermediate_size=width)
        out[key] = fxpar.trace(model, example_kwargs=zoo.example_inputs("llama", model))
    return out


def test_each_rank_holds_its_share_and_the_collectives_are_those_of_an_even_cut(programs):
    program = programs["uneven"]
    for tp in (2, 4):
        even, _ = tensor_parallel(programs["even"], tp, 0)
        for rank in range(tp):
            local, info = tensor_parallel(program, tp, rank)
            assert info.uneven()["model.embed_tokens.weight"] == chunk_sizes(257, tp)
            assert local.params["lm_head.weight"].shape == (chunk_sizes(257, tp)[rank], 32)
            assert local.params["model.layers.0.mlp.up_proj.weight"].shape == (chunk_sizes(130, tp)[rank], 32)
            assert local.params["model.layers.0.mlp.down_proj.weight"].shape == (32, chunk_sizes(130, tp)[rank])
            assert not info.fallbacks and not info.gathered
            logits = next(n for n in local.gm.graph.nodes if n.op == "output").args[0][1]
            assert logits.meta["val"].shape[-1] == 257  # gathered whole on every rank
            assert count_collectives(local.gm) == count_collectives(even.gm), (tp, rank)


class Heads(torch.nn.Module):
    """Attention over 3 heads of 6 (18 features) that no config names: at tp=4 the rows would cut, the
    heads cannot."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(12, 18) for _ in range(3))
        self.o = torch.nn.Linear(18, 12)

    def forward(self, x):
        q, k, v = (p(x).view(2, 4, 3, 6).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 4, 18))


def test_heads_that_do_not_divide_stay_an_error_or_whole():
    program = fxpar.trace(Heads(), example_args=(torch.randn(2, 4, 12),))
    plan = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
    with pytest.raises(PlanError, match=r"^q: its output reshaped by view from \(2, 4, 18\) into \(2, 4, 3, 6\) "
                                        r"splits dim 2 \(18\), which tp=4 does not divide, into groups \(heads\)"):
        tensor_parallel(program, 4, 0, plan)
    assert "does not divide by tp=4" in styles_for(program, None, 4).skipped["q"]
    _, info = tensor_parallel(program, 4, 0)
    assert info.replicated["q.weight"].startswith("not divisible") and "v.weight" not in info.sharded


def test_coverage_and_planner_take_uneven_degrees(programs):
    program = programs["uneven"]
    _, info = tensor_parallel(program, 4, 0)
    cov = coverage(program.params, info)
    text = cov.to_text()
    assert "model.embed_tokens.weight: Shard(0), 65 / 65 / 65 / 62" in text
    assert "model.layers.*.mlp.down_proj.weight: Shard(1), 33 / 33 / 33 / 31" in text
    assert cov.to_dict()["uneven"]["lm_head.weight"] == {"dim": 0, "sizes": [65, 65, 65, 62]}
    assert cov.shardable == 0 and cov.local == sum(  # rank 0's share, the largest
        p.numel if info.layout(f) is None else torch.Size(info.layout(f).local_shape(p.shape, 0)).numel()
        for f, p in program.params.items() if not p.is_buffer)
    costs = model_costs(zoo.build("llama", vocab_size=257, hidden_size=32, intermediate_size=130), 8,
                        tp_degrees=(2, 4, 8))
    assert costs.tp_allowed[2] is None and costs.tp_allowed[4] is None
    assert "4 attention heads" in costs.tp_allowed[8]  # heads, not the vocabulary, bound the degree
