"""param_updates before/after: under ZeRO-3 a forward's in-place update of a parameter's detached value
(``w.data.clamp_(-c, c)``, gemma3n's AltUp) becomes ``clamp(detach(w))``, and the parameter's later reads read
``w - detach(w) + clamp(detach(w))``: no in-place op is left for ZeRO-3's bucket views, the numbers are eager's."""

from __future__ import annotations

import copy

import torch

import fxpar


class Clamped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.coefs = torch.nn.Linear(4, 4, bias=False)
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x):
        self.coefs.weight.data.clamp_(-0.1, 0.1)
        return self.out(self.coefs(x)).pow(2).mean()


def test_an_in_place_update_of_a_parameter_becomes_out_of_place(kit, golden):
    torch.manual_seed(0)
    model = Clamped()  # weights up to 0.5: the clamp changes them
    eager = copy.deepcopy(model)
    x = torch.randn(3, 4)
    program = fxpar.trace(model, example_kwargs={"x": x})
    before, stage = kit.run_stage_pass("param_updates", program, kit.context("dp=2,zero=3"))
    golden(kit.graph_text(stage.gm), before)
    assert not any(getattr(getattr(n.target, "_schema", None), "is_mutable", False) for n in stage.gm.graph.nodes)
    loss = stage.gm(x)[stage.final[0]]
    loss.backward()
    want = eager(x)
    want.backward()
    assert (loss - want).abs().item() <= 1e-6
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-6, name
