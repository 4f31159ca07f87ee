"""3-D expert weights under tensor parallelism (``passes/tensor_parallel/experts.py``): the layout each
expert weight is cut along, read from the graph for every way transformers applies experts (grouped mm,
batched mm after indexing by router output; ``[experts, out, in]`` with ``[gate; up]`` concatenated,
``[experts, in, out]`` with gate/up interleaved and biases), then two ranks against one process: loss
and every gradient slice by slice, and the collectives one MoE layer costs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

import fxpar
from fxpar import zoo
from fxpar.ir import meta
from fxpar.ir import ops as fxops
from fxpar.passes.tensor_parallel import tensor_parallel
from fxpar.passes.tensor_parallel.experts import expert_layouts
from fxpar.runtime import groups
from fxpar.testing import multiproc
from fxpar.testing.compare import grads_by_fqn

TOL = 1e-5
pool2 = multiproc.rank_pool(2)
E0 = "model.layers.0.mlp.experts."


def gpt_oss_like(impl: str = "grouped_mm", seed: int = 0):
    """A tiny gpt-oss: experts ``[E, in, out]``, gate/up interleaved, biases (no plan of its own)."""
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                    vocab_size=128, max_position_embeddings=64, sliding_window=8,
                                    layer_types=["full_attention"],
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, use_cache=False)
    cfg._experts_implementation = impl
    torch.manual_seed(seed)
    return transformers.GptOssForCausalLM(cfg).train()


def mixtral_like(impl: str = "grouped_mm", seed: int = 0):
    """The zoo's mixtral: experts ``[E, out, in]``, ``[gate; up]`` concatenated, its own plan."""
    model = zoo.build("mixtral", seed=seed)
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._experts_implementation = impl
    return model


def jetmoe_like(impl: str = "", seed: int = 0):
    """A tiny JetMoe: a loop over experts, each one's ``[out, in]`` slice of a 3-D weight applied to its
    tokens (split by sizes read from data with ``.tolist()``), ``[gate; up]`` concatenated."""
    cfg = transformers.JetMoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_key_value_heads=2,
                                    kv_channels=16, intermediate_size=64, max_position_embeddings=64,
                                    num_local_experts=4, num_experts_per_tok=2, use_cache=False)
    torch.manual_seed(seed)
    return transformers.JetMoeForCausalLM(cfg).train()


BUILD = {"gpt_oss": gpt_oss_like, "mixtral": mixtral_like, "jetmoe": jetmoe_like}


def batch(model) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def test_expert_layouts_are_read_from_the_graph():
    """Each expert weight's cut, from how its matmuls use it: the first one's output features (its bias
    with them; the [gate; up] concatenation piece by piece), the second one's input features (batched mm
    here; the two-rank test below runs grouped mm on both layouts and batched mm on one)."""
    model = gpt_oss_like("batched_mm")
    lay = expert_layouts(fxpar.trace(model, example_kwargs=batch(model)), {}, 2)
    gu, down = model.model.layers[0].mlp.experts.gate_up_proj, model.model.layers[0].mlp.experts.down_proj
    i2 = gu.shape[2]  # [E, H, 2I]: in, out
    assert (gu.shape[1], down.shape[1]) == (model.config.hidden_size, i2 // 2)
    assert lay.dims[E0 + "gate_up_proj"] == 2 and lay.dims[E0 + "gate_up_proj_bias"] == 1
    assert lay.dims[E0 + "down_proj"] == 1 and lay.dims[E0 + "down_proj_bias"] is None
    assert E0 + "gate_up_proj" not in lay.pieces  # interleaved: a contiguous cut keeps gate/up pairs
    assert len(lay.pairs) == model.config.num_hidden_layers

    model = mixtral_like("batched_mm")
    program = fxpar.trace(model, example_kwargs=batch(model))
    inter = model.config.intermediate_size
    for styles in ({}, {"model.layers.0.mlp.experts": "moe_tp_experts"}):
        lay = expert_layouts(program, styles, 2)
        assert lay.dims[E0 + "gate_up_proj"] == 1 and lay.dims[E0 + "down_proj"] == 2  # [E, 2I, H], [E, H, I]
        assert lay.pieces[E0 + "gate_up_proj"] == [inter, inter]
    assert E0 + "gate_up_proj" not in expert_layouts(program, {"model.layers.0.mlp.experts": "replicate"}, 2).dims
    assert E0 + "gate_up_proj" not in expert_layouts(program, {}, 3).dims  # 2 x 128 rows over 3: whole


def tp_experts_step(name: str, impl: str) -> dict:
    """One forward and backward at tp=2 with no plan (and mixtral's own on grouped mm) against one process."""
    groups.register_group("tp:0,1", dist.group.WORLD)
    rank = dist.get_rank()
    out = {}
    for label, styles in (("inferred", {}), ("own plan", None)):
        model = BUILD[name](impl)
        if styles is None and (not model.config.base_model_tp_plan or impl != "grouped_mm"):
            continue  # the model's own plan: once, on its default experts implementation
        kw = batch(model)
        program = fxpar.trace(model, example_kwargs=kw)
        local, info = tensor_parallel(program, 2, rank, styles=styles, keep_outputs={0})
        loss = local(**kw).loss
        loss.backward()
        ref = BUILD[name](impl)
        expected = ref(**kw).loss
        expected.backward()
        want = grads_by_fqn(ref)
        grad = max(float((p.grad - (want[f] if info.layout(f) is None else info.layout(f).slice(want[f], rank)))
                         .abs().max()) for f, p in local.named_parameters() if p.grad is not None)
        moe = {}  # collectives in layer 0's MoE block
        for kind, n in fxops.collective_nodes(local.gm):
            if (n.meta.get(meta.MODULE) or "").startswith("model.layers.0.mlp"):
                moe[kind] = moe.get(kind, 0) + 1
        mlp = {f: i for f, i in program.params.items() if ".mlp." in f}
        out[label] = {"loss": float((loss - expected).abs()), "grad": grad, "moe": moe,
                      "whole": sorted(f for f, i in mlp.items() if f not in info.sharded and (
                          len(i.shape) == 3 or f.endswith("gate_up_proj_bias"))),
                      "cut": sorted(f for f in mlp if f in info.sharded and f.endswith("down_proj_bias"))}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name,impl", [("gpt_oss", "grouped_mm"), ("mixtral", "grouped_mm"), ("mixtral", "batched_mm"),
                                       ("jetmoe", "loop")])
def test_experts_tp2_equal_one_process(name, impl, pool2):
    """Loss and gradients equal one process; every 3-D expert weight and first bias cut (a second matmul's
    bias whole); one MoE layer costs one all-reduce forward and, backward, the experts' input gradient
    (taken on the tokens before their gather) plus, where the routing weights meet a partial sum, the
    routing weights' gradient: nothing else gathered."""
    for label, r in pool2.run(tp_experts_step, name, impl, timeout=180)[0].items():
        assert r["loss"] <= TOL and r["grad"] <= TOL, (label, r)
        assert not r["whole"] and not r["cut"], (label, r)
        moe = r["moe"]
        assert moe.get("all_reduce") == 1 and set(moe) <= {"all_reduce", "identity_fwd_all_reduce_bwd"}, (label, moe)
        assert 1 <= moe.get("identity_fwd_all_reduce_bwd", 0) <= 2, (label, moe)
