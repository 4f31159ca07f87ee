"""Inspection: golden graph printouts, the module table, JSON, DOT pictures and the CLI."""

from __future__ import annotations

import json
import re
import shutil

import expecttest
import torch

import fxpar
from fxpar.report.graph import to_dot


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(x + self.mlp(x))


def _tiny_program():
    torch.manual_seed(0)
    return fxpar.trace(Tiny(), (torch.randn(4, 8),))


class TestGolden(expecttest.TestCase):
    # regenerate on purpose with EXPECTTEST_ACCEPT=1
    def test_graph_printout(self):
        p = _tiny_program()
        self.assertExpectedInline(fxpar.inspect(p, quiet=True).graph(), """\
%mlp.fc1.weight = param -> f32[16, 8]  # mlp.fc1
%mlp.fc1.bias = param -> f32[16]  # mlp.fc1
%mlp.fc2.weight = param -> f32[8, 16]  # mlp.fc2
%norm.weight = param -> f32[8]  # norm
%norm.bias = param -> f32[8]  # norm
%x = input -> f32[4, 8]  # <root>
%linear = aten.linear(%x, %mlp.fc1.weight, %mlp.fc1.bias) -> f32[4, 16]  # mlp.fc1  1.09K FLOPs
%relu = aten.relu(%linear) -> f32[4, 16]  # mlp  64 FLOPs
%linear_1 = aten.linear(%relu, %mlp.fc2.weight) -> f32[4, 8]  # mlp.fc2  1.02K FLOPs
%add = aten.add.Tensor(%x, %linear_1) -> f32[4, 8]  # <root>  32 FLOPs
%layer_norm = aten.layer_norm(%add, [8], %norm.weight, %norm.bias, 1e-05, False) -> f32[4, 8]  # norm  32 FLOPs
return [%layer_norm]""")

    def test_module_graph_printout(self):
        p = _tiny_program()
        self.assertExpectedInline(fxpar.inspect(p, quiet=True).graph("mlp.fc2"), """\
%mlp.fc2.weight = param -> f32[8, 16]  # mlp.fc2
%linear_1 = aten.linear(%relu, %mlp.fc2.weight) -> f32[4, 8]  # mlp.fc2  1.02K FLOPs""")

    def test_table(self):
        p = _tiny_program()
        self.assertExpectedInline(fxpar.inspect(p, quiet=True).table(), """\
module   params  fwd FLOPs  bwd FLOPs  act bytes   share
-------  ------  ---------  ---------  ---------  ------
(total)     288      2.24K      4.35K       896B  100.0%
  mlp       272      2.18K      4.29K       640B   97.1%
    fc1     144      1.09K      2.18K       256B   48.6%
    fc2     128      1.02K      2.05K       128B   45.7%
  norm       16         32         32       128B    1.4%""")


def test_table_numbers_are_exact_for_linears():
    p = _tiny_program()
    rows = fxpar.inspect(p, quiet=True).rows
    assert rows["mlp.fc1"].flops == 2 * 4 * 8 * 16 + 4 * 16  # matmul + bias
    assert rows["mlp.fc2"].flops == 2 * 4 * 16 * 8
    assert rows["mlp.fc1"].params == 16 * 8 + 16
    assert rows[""].params == sum(q.numel() for q in Tiny().parameters())
    assert abs(sum(r.share for k, r in rows.items() if k.count(".") == 0 and k)
               - rows[""].flops / rows[""].flops) < 0.05


def test_json_has_the_same_rows():
    p = _tiny_program()
    report = fxpar.inspect(p, quiet=True, depth=None)
    data = json.loads(report.to_json())
    assert [m["module"] for m in data["modules"]] == ["", "mlp", "mlp.fc1", "mlp.fc2", "norm"]
    assert data["total"]["flops"] == report.total.flops
    assert {q["fqn"] for q in data["params"]} == {n for n, _ in Tiny().named_parameters()}


def test_dot_has_one_cluster_per_module(tmp_path):
    p = _tiny_program()
    dot = to_dot(p)
    labels = re.findall(r'label="([^"]+)"; style=rounded', dot)
    assert labels == ["mlp", "mlp.fc1", "mlp.fc2", "norm"]
    report = fxpar.inspect(p, picture=tmp_path / "tiny.dot", quiet=True)
    assert report.pictures[0].read_text() == dot
    assert report.pictures[0].name == "tiny.dot"
    if shutil.which("dot"):  # graphviz installed (CI installs it): the SVG is rendered beside the DOT
        assert [p.name for p in report.pictures] == ["tiny.dot", "tiny.svg"]
        assert "<svg" in report.pictures[1].read_text()


def test_inspect_unknown_module_lists_what_exists():
    p = _tiny_program()
    try:
        fxpar.inspect(p, module="mlp.fc3", quiet=True)
    except KeyError as e:
        assert "mlp.fc3" in str(e) and "mlp" in str(e)
    else:
        raise AssertionError("no error for an unknown module")


def test_traced_program_shows_predicted_activations():
    text = fxpar.inspect(_tiny_program(), quiet=True).to_text()
    assert "activation memory per rank, predicted" in text
    for policy in ("none", "layer", "selective"):
        assert re.search(rf"^{policy}\s+\S+B", text, re.M), policy


def test_priced_plan_flops_communication_and_memory_are_predictions():
    """dp=2 x pp=2 x tp=2, ZeRO-1 on one process: each TP rank's stage FLOPs add up to the unsharded
    model's over tp (replicated norms and rotary are counted on every rank: within 3%), every layer
    costs something, the step's communication equals the formulas, and nothing is 'measured'."""
    from fxpar import zoo
    from fxpar.api import price
    from fxpar.cost import comm
    from fxpar.report.budget import graph_flops, stage_flops

    model = zoo.build("llama")
    kwargs = zoo.example_inputs("llama", model, batch=8, seq=32)
    c = price(model, "dp=2,pp=2,tp=2,zero=1", example_kwargs=kwargs,
              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    report = fxpar.inspect(c, quiet=True)
    fwd, bwd = graph_flops(c.result.traced.gm)
    stages = stage_flops(c)
    assert abs(2 * sum(s["flops"] for s in stages) / fwd - 1) <= 0.03
    assert abs(2 * sum(s["bwd_flops"] for s in stages) / bwd - 1) <= 0.03
    for layer in ("model.layers.0", "model.layers.1", "lm_head"):
        assert report.rows[layer].flops > 0 and report.rows[layer].bwd_flops > 0, layer
    rows = {(r["axis"], r["collective"], r["what"]): r for r in report.communication()}
    mine = c.pipeline.stages_of(c.pp_rank)
    numel = sum(c.program.tensor(f).numel() for s in mine for f in s.params if c.program.tensor(f).requires_grad)
    assert rows["dp", "all_reduce", "gradients"]["payload"] == 4 * numel
    assert rows["dp", "all_reduce", "gradients"]["sent"] == comm.ring_bytes("all_reduce", 4 * numel, 2)
    assert rows["dp", "all_gather", "parameters"]["sent"] == comm.ring_bytes("all_gather", 4 * numel, 2)
    tp_fwd = sum(comm.collective_bytes(s.gm)["all_reduce"] for s in mine) * c.m
    assert tp_fwd > 0 and rows["tp", "all_reduce", "forward"]["payload"] == tp_fwd
    assert rows["pp", "send", "activations"]["payload"] == c.m * mine[0].send_bytes
    assert "measured" not in c.memory()
    text = report.to_text()
    assert "memory per rank, predicted" in text and "measured" not in text
    assert "communication per step, predicted" in text and "none (plan)" in text
    acts = report.activations()
    assert acts["none"]["peak"] > acts["selective"]["peak"] > acts["layer"]["peak"] > 0


def test_tp_program_header_counts_backward():
    from fxpar import zoo
    from fxpar.api import price

    model = zoo.build("llama")
    c = price(model, "tp=2", example_kwargs=zoo.example_inputs("llama", model, batch=2, seq=16))
    header = fxpar.inspect(c, quiet=True).header()
    assert re.search(r"backward [1-9][\d.]*[KM]FLOPs per microbatch on one TP rank of 2", header), header
