"""A forward that updates a parameter in place through ``.data`` traces, and the program makes the update
and uses the updated weight as eager does (:mod:`fxpar.frontend.data_reads`)."""

from __future__ import annotations

import copy

import torch

import fxpar


class ClampedCoefs(torch.nn.Module):
    """Projects its weight into [-0.2, 0.2] in place before using it (the update eager keeps)."""

    def __init__(self):
        super().__init__()
        self.coefs = torch.nn.Linear(4, 4, bias=False)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        self.coefs.weight.data.clamp_(-0.2, 0.2)
        return self.head(torch.tanh(self.coefs(x)))


def test_in_place_update_through_data_is_kept():
    torch.manual_seed(0)
    eager = ClampedCoefs()
    with torch.no_grad():
        eager.coefs.weight.mul_(3.0)  # most entries outside the clamp
    traced = copy.deepcopy(eager)
    x = torch.randn(3, 4)
    program = fxpar.trace(traced, (x,))
    assert traced.coefs.weight.abs().max() > 0.2  # capturing did not touch the model
    want, got = eager(x), program(x)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), traced.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=f"{name} after the step")
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6, msg=f"{name} gradient")
