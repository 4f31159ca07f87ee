"""The tensor-parallel rule table, single process: placements and collectives of a few rule families
on tiny zoo models at tp=2, rank 0 (no process group: the group name carries its size)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Shard

import fxpar
from fxpar import zoo
from fxpar.ir import meta
from fxpar.ir.ops import count_collectives
from fxpar.ir.placement import ShardLayout
from fxpar.passes.tensor_parallel import tensor_parallel
from fxpar.passes.tensor_parallel.rules import RULES, rule_for

aten = torch.ops.aten


@pytest.fixture(scope="module")
def llama():
    model = zoo.build("llama", seed=0)
    program = fxpar.trace(model, example_kwargs=zoo.example_inputs("llama", model, batch=2, seq=8))
    return tensor_parallel(program, 2, 0)


def _placements(local, target, module_suffix):
    return [n.meta[meta.PLACEMENT] for n in local.gm.graph.nodes
            if getattr(n.target, "overloadpacket", None) is target
            and n.meta.get(meta.MODULE, "").endswith(module_suffix)]


def test_every_rule_says_what_it_does():
    assert RULES[aten.view] is RULES[aten.reshape] is RULES[aten._unsafe_view]
    assert all(fn.__doc__ for fn in RULES.values())


def test_linear_column_then_row(llama):
    local, info = llama
    assert _placements(local, aten.linear, "mlp.up_proj") == [(Shard(2),)] * 2  # column-parallel
    assert _placements(local, aten.linear, "mlp.down_proj") == [(Partial(),)] * 2  # row-parallel: a partial sum
    assert info.sharded["model.layers.0.mlp.up_proj.weight"] == 0
    assert info.sharded["model.layers.0.mlp.down_proj.weight"] == 1


def test_attention_keeps_the_heads_shard(llama):
    local, _ = llama
    assert _placements(local, aten.scaled_dot_product_attention, "self_attn") == [(Shard(1),)] * 2


def test_collectives_carry_the_default_group_and_the_megatron_counts(llama):
    local, info = llama
    layers = zoo.tiny_config("llama").num_hidden_layers
    counts = count_collectives(local.gm)
    assert counts["all_reduce"] == 2 * layers + 1 + 3  # blocks, vocab-parallel embedding, parallel loss
    assert counts["identity_fwd_all_reduce_bwd"] == 2 * layers + 1
    groups = {n.args[1] for n in local.gm.graph.nodes if str(n.target).startswith("fxpar.")}
    assert groups == {"tp:0,1"}
    assert not info.fallbacks


def test_fallback_is_the_pointwise_rule():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    odd = graph.call_function(aten.flip.default, (x, [0]))
    assert rule_for(odd).__name__ == "pointwise_or_gather"
    assert rule_for(graph.call_function(aten.view.default, (x, [4]))).__name__ == "view"


@pytest.mark.parametrize("pieces", [None, [4, 2, 2]])
def test_shard_layout_slices_and_unshards(pieces):
    full = torch.arange(8 * 3).reshape(8, 3)
    layout = ShardLayout(0, pieces, 2)
    parts = [layout.slice(full, r) for r in range(2)]
    assert all(p.shape == layout.local_shape(full.shape) for p in parts)
    assert torch.equal(layout.unshard(parts), full)
