"""The tensor-parallel coverage report (fxpar/report/tp_coverage.py) and the reasons behind it
(passes/tensor_parallel/reasons.py): which weights a TP plan leaves whole and why, the share of the
parameters one TP rank holds (against the shapes the pass gave the rank's program), the warning of a
plan that leaves a large shardable part whole, and the CLI's table. One process: the TP pass needs no
process group."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import fxpar
from fxpar import zoo
from fxpar.api import price
from fxpar.cli import main
from fxpar.ir.errors import ShardingWarning
from fxpar.ir.placement import WHY_KINDS, why_kind
from fxpar.passes.tensor_parallel import tensor_parallel
from fxpar.passes.tensor_parallel.reasons import why_whole
from fxpar.report.tp_coverage import coverage, module_glob, sharding_warning

ATTENTION_ONLY = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                  "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}


@pytest.fixture(scope="module")
def llama():
    model = zoo.build("llama", seed=0)
    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=2, seq=8)
    return model, batch, fxpar.trace(model, example_kwargs=batch)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _kinds(info) -> dict[str, str]:
    return {fqn: why_kind(r) for fqn, r in info.replicated.items()}


def test_llama_leaves_only_norms_whole_and_the_share_counts_the_rank_program(llama):
    _, _, program = llama
    local, info = tensor_parallel(program, 2, 0)
    params = {f: p for f, p in program.params.items() if not p.is_buffer}
    assert set(info.replicated) == set(params) - set(info.sharded)  # every whole parameter has a reason
    assert set(_kinds(info).values()) == {"norm/bias/scalar"}
    assert all(len(params[f].shape) == 1 for f in info.replicated)
    cov = coverage(program.params, info)
    held = sum(math.prod(p.shape) for f, p in local.params.items() if not p.is_buffer)
    assert cov.local == held and cov.total == sum(p.numel for p in params.values())
    assert cov.share == pytest.approx(held / cov.total) and cov.shardable == 0
    q = next(r for r in cov.rows if r.module == "model.layers.*.self_attn.q_proj")  # one row for all layers
    assert q.params == q.sharded == sum(p.numel for f, p in params.items() if ".self_attn.q_proj." in f)
    assert sharding_warning(cov) is None


def test_reasons_of_a_partial_plan(llama):
    """No style: 'no plan entry'; a style that cuts no dim: 'layout not understood'; 'replicate': the plan's
    own choice; a dim too small for a part per rank: 'not divisible' with the numbers; a router gate: 'small'."""
    _, _, program = llama
    styles = {**ATTENTION_ONLY, "layers.*.mlp.up_proj": "local_params", "layers.*.mlp.down_proj": "replicate"}
    _, info = tensor_parallel(program, 2, 0, styles={"model." + k: v for k, v in styles.items()})
    kinds = _kinds(info)
    assert kinds["model.layers.0.mlp.gate_proj.weight"] == "no plan entry"
    assert kinds["model.layers.1.mlp.up_proj.weight"] == "layout not understood"
    assert "local_params" in info.replicated["model.layers.1.mlp.up_proj.weight"]
    assert kinds["model.layers.0.mlp.down_proj.weight"] == "replicated by plan"
    assert kinds["model.embed_tokens.weight"] == "no plan entry"
    assert "model.layers.0.self_attn.q_proj.weight" in info.sharded and set(kinds.values()) <= set(WHY_KINDS)
    fqn = "model.layers.0.self_attn.q_proj.weight"  # 64 rows over 9 ranks: torch.chunk's shares leave the last empty
    assert why_whole(program, fqn, {fqn: "colwise"}, set(), {}, 9, 0) == \
        "not divisible: 64 rows along dim 0, too few for a part on each of tp=9 ranks"
    inferred = type("Styles", (dict,), {"skipped": {"model.layers.0.self_attn.q_proj": "4 heads, tp=3"}})()
    assert why_whole(program, fqn, inferred, set(), {}, 3, 0) == "not divisible: 4 heads, tp=3"  # inference skipped it
    batch = zoo.example_inputs("mixtral", zoo.tiny_config("mixtral"), batch=2, seq=8)
    traced = fxpar.trace(zoo.build("mixtral", seed=0), example_kwargs=batch)
    _, minfo = tensor_parallel(traced, 2, 0)
    gates = {f: r for f, r in minfo.replicated.items() if len(traced.params[f].shape) == 2}
    assert gates and {why_kind(r) for r in gates.values()} == {"small"}, gates  # the router gates [experts, hidden]


def test_warning_names_the_mlp_left_out_once_and_stays_quiet_for_the_models_plan(llama):
    model, batch, _ = llama
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        priced = price(model, fxpar.Plan(tp=2, tp_plan={"model." + k: v for k, v in ATTENTION_ONLY.items()}),
                       example_kwargs=batch, optimizer=_sgd)
    found = [w for w in caught if issubclass(w.category, ShardingWarning)]
    assert len(found) == 1, [str(w.message) for w in found]
    text = str(found[0].message)
    assert "model.layers.*.mlp." in text and "tp_plan" in text and "no plan entry" in text
    cov = fxpar.inspect(priced, quiet=True).tp_coverage()
    mlp = sum(r.params for r in cov.rows if ".mlp." in r.module)
    assert cov.shardable >= mlp and cov.shardable_share > 0.10
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        price(model, fxpar.Plan(tp=2), example_kwargs=batch, optimizer=_sgd)
    assert not [w for w in caught if issubclass(w.category, ShardingWarning)]


def test_cli_plan_and_inspect_show_the_table(capsys):
    assert main(["plan", "llama", "--plan", "pp=2,tp=2", "--batch", "4", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "tensor-parallel coverage (tp=2): one TP rank holds" in out and "per stage: stage 0" in out
    row = next(line for line in out.splitlines() if line.startswith("model.layers.*.input_layernorm"))
    assert row.split()[1:4] == ["128", "0", "128"] and "norm/bias/scalar" in row  # 2 layers x 64, whole
    assert main(["inspect", "llama", "--plan", "tp=2", "--json", "--seq", "8"]) == 0
    cov = json.loads(capsys.readouterr().out)["tp_coverage"]
    assert cov["params"] == sum(p.numel() for p in zoo.build("llama").parameters())
    assert cov["tp"] == 2 and cov["share"] == pytest.approx(cov["local"] / cov["params"], abs=1e-4)
    assert {m["module"] for m in cov["modules"]} >= {"model.embed_tokens", "model.layers.*.mlp.up_proj"}


def test_module_glob():
    assert module_glob("model.layers.12.mlp.experts.3") == "model.layers.*.mlp.experts.*"
    assert module_glob("h2o.layer0.x") == "h2o.layer0.x" and module_glob("0.w") == "*.w"


def test_gathered_params_names_the_op_that_needs_a_cut_weight_whole():
    """A cut weight all-gathered where it is used (through a transpose): memory saved, compute not."""
    from fxpar.ir import meta
    from fxpar.passes.tensor_parallel.reasons import gathered_params

    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    w.meta[meta.PARAM] = "lin.weight"
    full = g.call_function(torch.ops.fxpar.all_gather.default, (g.call_function(torch.ops.aten.t.default, (w,)),
                                                                  "tp:0,1", 1))
    full.meta[meta.MODULE] = "lin"
    g.output(g.call_function(torch.ops.aten.mm.default, (x, full)))
    assert gathered_params(g, {"lin.weight": 0}) == {"lin.weight": "layout not understood: gathered whole for "
                                                                   "mm.default in lin"}
    assert gathered_params(g, {}) == {}  # a weight left whole is not "gathered"


def test_fused_pieces_held_whole_count_as_whole_elements():
    """A fused [q | k | v] weight with its one K/V head whole on every rank (multi-query attention): the
    cut part counts as sharded, the whole pieces as replicated, and the rank holds q/2 + k + v rows."""
    from fxpar.ir.placement import TpResult
    from fxpar.ir.program import ParamInfo

    params = {"attn.qkv.weight": ParamInfo("attn.qkv.weight", (6, 3), torch.float32, True)}
    tp = TpResult(sharded={"attn.qkv.weight": 0}, pieces={"attn.qkv.weight": [4, 1, 1]}, parts=2,
                  whole={"attn.qkv.weight": (1, 2)})
    cov = coverage(params, tp)
    (row,) = cov.rows
    assert (cov.total, cov.local, row.sharded, row.replicated) == (18, (2 + 1 + 1) * 3, 12, 6)
    assert row.why.startswith("not divisible: fused pieces [1, 1]") and cov.shardable == 0
