"""param_updates before/after: under ZeRO-3 a forward's in-place update of a parameter's detached value
(``w.data.clamp_(-c, c)``, gemma3n's AltUp) becomes ``clamp(detach(w))``, and the parameter's later reads read
``w - detach(w) + clamp(detach(w))``: no in-place op is left for ZeRO-3's bucket views, the numbers are eager's."""

from __future__ import annotations

import copy

import torch

import fxpar
from fxpar.testing import multiproc

pool2 = multiproc.rank_pool(2, shared=True)


class Clamped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.coefs = torch.nn.Linear(4, 4, bias=False)
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x):
        self.coefs.weight.data.clamp_(-0.1, 0.1)
        return self.out(self.coefs(x)).pow(2).mean()


class ClampedLoss(Clamped):
    """Clamped after a linear, so backward saves the clamped weight (for the linear's input gradient)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)

    def forward(self, x):
        return {"loss": super().forward(self.inp(x))}


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



def pp2_step() -> dict:
    """On each of 2 ranks: one SGD step of ClampedLoss under pp=2 (2 microbatches, both forwards before the
    backwards); the loss and worst gradient differences against one process."""
    torch.manual_seed(0)
    model = ClampedLoss()  # weights up to 0.5: the clamp changes them
    eager = copy.deepcopy(model)
    x = torch.randn(4, 4)
    plan = fxpar.Plan(pp=2, split_points={"out": "beginning"})  # coefs (clamped) on stage 0, out on stage 1
    compiled = fxpar.compile(model, plan, example_kwargs={"x": x}, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    loss = compiled.step(x=x)
    grads = compiled.full_state_dict(grads=True)
    want = eager(x)["loss"]
    want.backward()
    return {"loss": abs(loss.item() - want.item()),
            "grad": max((grads[n] - p.grad).abs().max().item() for n, p in eager.named_parameters())}


def test_an_in_place_update_under_pp2_equals_one_process(pool2):
    """pp=2 runs both microbatches' forwards before their backwards: the second forward's in-place update of
    ``detach(w)`` bumped ``w``'s version, which the first one's backward had saved ("modified by an inplace
    operation": gemma3n_text under pp=2). The update runs out of place there too: one process's numbers."""
    for r in pool2.run(pp2_step):
        assert r["loss"] <= 1e-6 and r["grad"] <= 1e-6, r
