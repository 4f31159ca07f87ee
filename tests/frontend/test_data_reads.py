"""Forward code torch.export cannot trace as written: a parameter updated in place through ``.data`` (the
program makes the update and uses the updated weight, :mod:`fxpar.frontend.data_reads`), a distribution
that checks its arguments with a branch on data (``fxpar.frontend.export.distribution_checks_off``)."""

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


class EntropyGate(torch.nn.Module):
    """Scales by the entropy of a categorical over its logits (a distribution built in forward)."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Linear(4, 5)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        entropy = torch.distributions.Categorical(logits=self.logits(x)).entropy()
        return self.head(x) * entropy.unsqueeze(-1)


def test_distribution_built_in_forward_traces():
    torch.manual_seed(0)
    model = EntropyGate()
    x = torch.randn(3, 4)
    dist_cls = torch.distributions.Distribution
    saved = dist_cls._validate_args  # the process's default (another module may have turned it off)
    dist_cls.set_default_validate_args(True)
    try:
        program = fxpar.trace(model, (x,))
        assert dist_cls._validate_args  # eager still checks after the capture
    finally:
        dist_cls.set_default_validate_args(saved)
    for batch in (x, 5 * torch.randn(6, 4)):
        model.zero_grad(set_to_none=True)
        want = model(batch)
        want.square().sum().backward()
        want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        got = program(batch)
        got.square().sum().backward()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want_grads[name], rtol=0, atol=1e-6, msg=name)
