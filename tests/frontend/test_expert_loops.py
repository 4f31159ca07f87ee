"""A loop over the experts a batch hit (``nonzero`` of a one-hot's presence vector) traces, and the
program stays right when another batch hits other experts (:mod:`fxpar.frontend.expert_loops`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fxpar


class LoopMoE(torch.nn.Module):
    """The eager dispatch of several Hugging Face MoE blocks: a padding class beyond the router's experts
    in the one-hot, ``int(e.item())``, an early ``continue`` on an empty token set, an identity expert."""

    def __init__(self, hidden=8, inner=6, experts=4, identity=1, top_k=2):
        super().__init__()
        self.experts, self.identity, self.top_k = experts, identity, top_k
        self.router = torch.nn.Linear(hidden, experts + identity, bias=False)
        self.up = torch.nn.Parameter(torch.randn(experts, inner, hidden) * 0.3)
        self.down = torch.nn.Parameter(torch.randn(experts, hidden, inner) * 0.3)
        self.head = torch.nn.Linear(hidden, 3)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, index = torch.topk(self.router(tokens).softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        with torch.no_grad():
            mask = F.one_hot(index, num_classes=self.experts + self.identity + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = int(e.item())
            slot, tok = torch.where(mask[e])
            if tok.numel() == 0:
                continue
            h = tokens[tok]
            if e < self.experts:
                h = F.linear(F.silu(F.linear(h, self.up[e])), self.down[e])
            out.index_add_(0, tok, h * weights[tok, slot, None])
        return self.head(out + tokens).reshape(*x.shape[:-1], 3)


def _hit(model, x) -> set[int]:
    _, index = torch.topk(model.router(x.reshape(-1, x.shape[-1])).softmax(-1), model.top_k, dim=-1)
    return set(index.flatten().tolist())


def _run(fn, model, x):
    model.zero_grad(set_to_none=True)
    out = fn(x)
    out.square().mean().backward()
    # a parameter eager never reached (an expert no token chose) has no gradient; the program that runs
    # every expert gives it zeros: the same gradient
    return out.detach(), {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                          for n, p in model.named_parameters()}


def test_expert_hit_loop_traces_and_follows_the_routing():
    torch.manual_seed(0)
    model = LoopMoE()
    x = torch.randn(2, 5, 8)
    program = fxpar.trace(model, (x,))
    # the example hits most experts; a batch pushed along one router row hits only a few of them
    other = (model.router.weight[1].detach() * 20).expand(2, 5, 8) + 0.01 * torch.randn(2, 5, 8)
    assert _hit(model, other) != _hit(model, x)
    for batch in (x, other):
        want, want_grads = _run(model, model, batch)
        got, got_grads = _run(program, model, batch)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for name, g in want_grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=0, atol=1e-6, msg=name)


def test_expert_parallel_finds_the_loop_over_the_experts():
    """The ep pass splits a loop-form MoE (fxpar/passes/ep_loops.py): one region, its 4 experts' blocks on the
    ep rank owning their rows of the stacked parameters, the identity expert's on rank 0; ep=3 is refused
    (before any communication: compile runs this check on its first trace)."""
    import pytest

    from fxpar.ir.errors import PlanError
    from fxpar.passes.ep_loops import loop_regions
    from fxpar.passes.expert_parallel import expert_regions

    program = fxpar.trace(LoopMoE(), (torch.randn(2, 5, 8),))
    assert expert_regions(program, 2) == []  # no grouped matmuls
    (region,) = loop_regions(program, 2)
    assert region.expert == [0, 1, 2, 3, None] and region.owner == [0, 0, 1, 1, 0]
    assert region.cut == {"up": 4, "down": 4} and region.n_experts == 4
    with pytest.raises(PlanError, match=r"Plan\(ep=3\): LoopMoE has 4 experts, which do not split over 3 ranks"):
        loop_regions(program, 3)
