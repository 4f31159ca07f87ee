"""The pipeline split: only what must cross a boundary crosses it.

The stages of a split are run in order in one process (each stage's inputs taken from the user inputs
or from the outputs of the stage its routing table names), and their outputs and the parameters'
gradients are compared with the unsplit model. Values a later stage can make from what every stage
has (the attention mask, rotary tables) are recomputed there; values that depend on a parameter, on a
random op or on an expensive cone are still sent, and the cost model's bytes are the routing table's.
"""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar import zoo
from fxpar.cost import boundary as B
from fxpar.cost import partition as P
from fxpar.passes.pipeline_split import split_pipeline
from fxpar.testing.compare import grads_by_fqn

TOL = 1e-5


def run_stages(pipeline, program, kwargs):
    """The stages in order in one process: the program's flattened user outputs (no detach between
    stages, so backward reaches every stage's parameters, which are the model's own)."""
    flat = program.flatten_inputs((), kwargs)
    outs = []
    for st in pipeline.stages:
        args = [flat[r.index] if r.is_user else outs[r.stage][r.index] for r in st.inputs]
        outs.append(list(st.gm(*args)))
    final = {j: outs[st.index][i] for st in pipeline.stages for j, i in st.final.items()}
    return [final[j] for j in range(pipeline.num_user_outputs)]


def check_against_unsplit(name_or_model, kwargs, cuts_for, build):
    """Split, run, backward; compare loss/outputs and every gradient with the unsplit model."""
    model = build()
    program = fxpar.trace(model, example_kwargs=kwargs)
    cuts = cuts_for(program)
    pipeline = split_pipeline(program, cuts, list(range(len(cuts) + 1)))
    outs = run_stages(pipeline, program, kwargs)
    ref_model = build()
    ref = ref_model(**kwargs)
    ref_outs = [ref.loss, ref.logits] if hasattr(ref, "loss") else [ref]
    for got, want in zip(outs, ref_outs):
        assert (got - want).abs().max().item() <= TOL
    outs[0].backward()
    ref_outs[0].backward()
    want = grads_by_fqn(ref_model)
    got = grads_by_fqn(model)
    assert set(got) == set(want)
    for fqn in want:
        assert got[fqn] is not None, fqn
        assert (got[fqn] - want[fqn]).abs().max().item() <= TOL, fqn
    return program, pipeline, cuts


# ---- llama: the hidden state and nothing else ----------------------------------------------------------
LAYERS = 4


def _llama():
    return zoo.build("llama", seed=0, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def llama_batch():
    return zoo.example_inputs("llama", _llama(), batch=2, seq=8)


@pytest.mark.parametrize("pp", [2, 4])
def test_llama_sends_only_the_hidden_state(pp, llama_batch):
    program, pipeline, cuts = check_against_unsplit(
        "llama", llama_batch, lambda prog: P.even_layer_cuts(prog, pp), _llama)
    hidden = 2 * 8 * _llama().config.hidden_size * 4  # batch x seq x hidden x fp32
    assert pipeline.links() == {(s, s + 1): hidden for s in range(pp - 1)}
    for st in pipeline.stages[:-1]:
        (name, b, cons), = st.sends()
        assert b == hidden and cons == [st.index + 1]
        val = next(n for n in st.output_nodes() if n.name == name).meta["val"]
        assert val.dtype == torch.float32 and val.dim() == 3
    for st in pipeline.stages[1:]:  # one value from the stage before; the mask and rotary made here
        assert [r.stage for r in st.inputs if not r.is_user] == [st.index - 1]
        assert any(n.op == "call_function" and "arange" in str(n.target) for n in st.gm.graph.nodes)
        assert "model.rotary_emb.inv_freq" in st.buffers
    # the cost model prices exactly these bytes, gradients back the same size
    costs = P.stage_costs(program, cuts)
    assert [c.send_bytes for c in costs] == [hidden] * (pp - 1) + [0]
    assert [c.recv_bytes for c in costs] == [0] + [hidden] * (pp - 1)
    assert [c.grad_send_bytes for c in costs] == [0] + [hidden] * (pp - 1)


def test_balanced_cuts_and_the_table_report_what_is_sent(llama_batch):
    model = _llama()
    program = fxpar.trace(model, example_kwargs=llama_batch)
    cuts = P.balanced_cuts(program, 3)
    pipeline = split_pipeline(program, cuts, [0, 1, 2])
    costs = P.stage_costs(program, cuts)
    links = pipeline.links()
    for st, c in zip(pipeline.stages, costs):
        assert c.send_bytes == sum(b for (frm, _), b in links.items() if frm == st.index)
        assert c.recv_bytes == sum(b for (_, to), b in links.items() if to == st.index)
    # with no value skipping a stage, the dynamic program's boundary bytes are the routed ones
    cross, gcross = P.crossing_bytes(program)
    spans = P.module_positions(program)
    for (m, w), c in zip(cuts, costs[1:]):
        pos = P.cut_position(spans, (m, w))
        assert cross[pos] == c.recv_bytes and gcross[pos] == c.recv_bytes


def test_recomputing_before_the_fix_would_have_sent_more(llama_batch):
    """Without recompute the mask and both rotary tables cross: the test can tell the difference."""
    program = fxpar.trace(_llama(), example_kwargs=llama_batch)
    bounds = [0, P.cut_position(P.module_positions(program), ("model.layers.2", "beginning")),
              len(P.top_nodes(program))]
    kept = B.routed_bytes(program, bounds)["send"][0]
    everything = B.routed_bytes(program, bounds, recompute=set())["send"][0]
    mask, rotary = 2 * 1 * 8 * 8 * 1, 2 * (1 * 8 * 16 * 4)  # bool [2,1,8,8]; f32 [1,8,16] cos and sin
    assert everything - kept == mask + rotary


# ---- a model whose cross-stage values must still be sent ----------------------------------------------
class Skip(torch.nn.Module):
    """Four blocks; block 3 reads block 0's output (parameter-dependent: sent, skipping stages), a
    random tensor made from the input alone (must not be drawn twice: sent) and a buffer product with a
    real reduction (too costly per element: sent); a cheap buffer-derived scale is recomputed."""

    def __init__(self, d=16, k=256):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(4))
        self.register_buffer("basis", torch.randn(d, k))
        self.register_buffer("steps", torch.arange(d, dtype=torch.float32))

    def forward(self, x):
        scale = torch.cos(self.steps) * 0.5 + 1.0  # cheap, parameter-free: recomputed
        gram = self.basis @ self.basis.T / self.basis.shape[1]  # 2k FLOPs per element: sent
        noise = torch.rand_like(x)  # random: sent, never drawn twice
        h0 = self.layers[0](x) * scale
        h = self.layers[1](h0) * scale
        h = self.layers[2](h) * scale
        return (self.layers[3](h) + h0 + noise * 0.0 + h @ gram).sum()


def _skip():
    torch.manual_seed(0)
    return Skip()


def test_values_that_depend_on_earlier_stages_are_still_sent():
    x = torch.randn(3, 16)
    cuts = [("layers.1", "beginning"), ("layers.2", "beginning"), ("layers.3", "beginning")]
    torch.manual_seed(1)
    program, pipeline, _ = check_against_unsplit("skip", {"x": x}, lambda prog: cuts, _skip)
    by_name = {n.name: n for n in program.graph.nodes}
    sends = {str(by_name[name].target).split(".")[1]: (b, cons) for name, b, cons in pipeline.stages[0].sends()}
    # the random tensor and the costly gram straight to the last stage; block 0's output to 1 and 3
    assert sends == {"rand_like": (3 * 16 * 4, [3]), "div": (16 * 16 * 4, [3]), "mul": (3 * 16 * 4, [1, 3])}
    for st in pipeline.stages[1:3]:  # the cheap scale is made again on the stages reading it, never sent
        assert [str(n.target) for n in st.gm.graph.nodes if "cos" in str(n.target)] == ["aten.cos.default"]
        assert "steps" in st.buffers and not any("cos" in str(by_name[name].target) for name, _, _ in st.sends())
    costs = P.stage_costs(program, cuts)
    links = pipeline.links()
    for st, c in zip(pipeline.stages, costs):
        assert c.send_bytes == sum(b for (frm, _), b in links.items() if frm == st.index)
        assert c.recv_bytes == sum(b for (_, to), b in links.items() if to == st.index)


def test_tied_embeddings_keep_the_weight_on_both_stages():
    build = lambda: zoo.build("gpt2", seed=0)  # noqa: E731
    batch = zoo.example_inputs("gpt2", build(), batch=2, seq=8)
    n = zoo.num_layers("gpt2")
    program, pipeline, _ = check_against_unsplit(
        "gpt2", batch, lambda prog: [(f"transformer.h.{n // 2}", "beginning")], build)
    assert pipeline.tied == {"transformer.wte.weight": [0, 1]}
    hidden = 2 * 8 * build().config.n_embd * 4
    assert pipeline.links() == {(0, 1): hidden}
