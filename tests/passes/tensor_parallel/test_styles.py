"""Which modules the tensor-parallel pass cuts: a model's own plan completed by inference from the graph.

Single-process checks of the resolved styles and of the share of parameter elements rank 0 holds at
tp=2 on small models built here (no plan, a plan naming only the LM head, sub-norms between a column and
its row, several columns feeding one row), the fallbacks of inferred styles that do not divide, and
one 2-rank run per changed coverage against the single-process model (loss and every gradient slice).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import transformers

import fxpar
from fxpar import zoo
from fxpar.ir.errors import PlanError
from fxpar.passes.tensor_parallel import tensor_parallel
from fxpar.passes.tensor_parallel.styles import STYLES, styles_for
from fxpar.runtime import groups
from fxpar.testing import multiproc
from fxpar.testing.compare import grads_by_fqn
from fxpar.testing.reference import shard_grad_diff

TOL = 1e-5
pool2 = multiproc.rank_pool(2)
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
# transformers' causal LMs with tiny configs: (config class, overrides); pad_token_id 200 lies in the
# second rank's half of the vocabulary (its padding row gets no gradient there either)
TINY = {
    "bitnet": (transformers.BitNetConfig, dict(SMALL, pad_token_id=200)),  # no plan; sub-norms inside blocks
    "hunyuan_v1_dense": (transformers.HunYuanDenseV1Config, dict(SMALL, head_dim=16)),  # a plan for lm_head only
}


def build(name: str, seed: int = 0):
    if name in TINY:
        cls, kw = TINY[name]
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cls(**kw), attn_implementation="sdpa")
    else:
        model = zoo.build(name, seed=seed)
        return model, zoo.example_inputs(name, model)
    ids = torch.randint(0, 255, (2, 8), generator=torch.Generator().manual_seed(0))
    ids[0, :2] = 200
    return model.train(), {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def share(program, local) -> float:
    full = sum(math.prod(i.shape) for i in program.params.values() if not i.is_buffer)
    return sum(math.prod(i.shape) for i in local.params.values() if not i.is_buffer) / full


def test_every_style_transformers_registers_is_known():
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    assert set(ALL_PARALLEL_STYLES.valid_keys()) <= set(STYLES)


def test_a_plan_naming_only_the_head_is_completed_by_inference():
    """hunyuan_v1_dense's own plan names lm_head only: attention, MLP and the embedding are inferred."""
    model, batch = build("hunyuan_v1_dense")
    program = fxpar.trace(model, example_kwargs=batch)
    assert set(program.info.tp_plan) == {"lm_head"}
    styles = styles_for(program, program.info.tp_plan, 2)
    assert styles["lm_head"] == "colwise_gather_output" and "lm_head" not in styles.inferred
    for m in ("q_proj", "k_proj", "v_proj", "mlp.gate_proj", "mlp.up_proj"):
        name = f"model.layers.0.{'self_attn.' if 'mlp' not in m else ''}{m}"
        assert styles[name] == "colwise" and name in styles.inferred, name
    assert styles["model.layers.1.self_attn.o_proj"] == styles["model.layers.1.mlp.down_proj"] == "rowwise"
    assert styles["model.embed_tokens.weight"] == "embedding_rowwise"
    local, info = tensor_parallel(program, 2, 0)
    assert share(program, local) < 0.51


@pytest.mark.parametrize("name,most", [("bitnet", 0.51), ("opt", 0.55), ("bert", 0.56)])
def test_inferred_coverage(name, most):
    """Pairs across a sub-norm (bitnet), several columns for one row (q, k, v -> out), the token
    embedding vocabulary-parallel and the head column-parallel; position tables stay whole."""
    model, batch = build(name)
    program = fxpar.trace(model, example_kwargs=batch)
    local, info = tensor_parallel(program, 2, 0)
    assert share(program, local) <= most
    cols = [f for f, d in info.sharded.items() if f.endswith(("k_proj.weight", "value.weight", "v_proj.weight"))]
    assert cols, "key/value projections left whole"
    positions = [f for f in program.params if "position" in f and f.endswith("weight")]
    assert not any(f in info.sharded for f in positions)


def test_inferred_styles_cut_uneven_dims_and_leave_heads_that_do_not_divide_whole():
    """3 heads of 16 at tp=2: the attention pair stays whole (the heads view does not divide), the MLP
    and the vocabulary are cut; at tp=3 the heads divide, and the vocabulary (256) and the MLP width (128),
    which 3 does not divide, are cut into torch.chunk's shares. A user's plan cutting those heads raises."""
    model = zoo.build("gpt2", n_head=3, n_embd=48)
    program = fxpar.trace(model, example_kwargs=zoo.example_inputs("gpt2", model))
    styles = styles_for(program, None, 2)
    assert "transformer.h.0.attn.c_attn" not in styles and "transformer.h.0.mlp.c_fc" in styles
    assert "does not divide by tp=2" in styles.skipped["transformer.h.0.attn.c_attn"]
    _, info = tensor_parallel(program, 2, 0)
    assert "transformer.h.0.mlp.c_fc.weight" in info.sharded and "transformer.wte.weight" in info.sharded
    _, info3 = tensor_parallel(program, 3, 0)
    uneven = info3.uneven()
    assert uneven["transformer.wte.weight"] == [86, 86, 84] and \
        uneven["transformer.h.0.mlp.c_fc.weight"] == [43, 43, 42]
    assert "transformer.h.0.attn.c_attn.weight" in info3.sharded and "transformer.h.0.attn.c_attn.weight" not in uneven
    with pytest.raises(PlanError, match="3 attention heads"):
        tensor_parallel(program, 2, 0, {"transformer.h.*.attn.c_attn": "colwise"})


def tp_step(name: str) -> dict:
    """One forward and backward at tp=2 on this rank vs the single-process model."""
    groups.register_group("tp:0,1", dist.group.WORLD)
    rank = dist.get_rank()
    model, batch = build(name)
    program = fxpar.trace(model, example_kwargs=batch)
    local, info = tensor_parallel(program, 2, rank)
    out = local(**batch)
    out.loss.backward()
    ref, _ = build(name)
    expected = ref(**batch)
    expected.loss.backward()
    ref_grads = grads_by_fqn(ref)
    grad = shard_grad_diff(local, info, ref_grads, rank)
    return {"loss": (out.loss - expected.loss).abs().item(), "grad": grad, "share": share(program, local)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bitnet", "hunyuan_v1_dense", "opt"])
def test_inferred_coverage_equals_one_process(name, pool2):
    for r in pool2.run(tp_step, name, timeout=120):
        assert r["loss"] <= TOL and r["grad"] <= TOL, r
        assert r["share"] < 0.56
