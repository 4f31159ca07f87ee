"""drop_dtype_asserts before/after: under bf16 autocast the dtype asserts torch.export records for
``.to`` go; everything else stays."""

from __future__ import annotations


def test_the_dtype_asserts_go(kit, golden):
    before, stage = kit.run_stage_pass("drop_dtype_asserts", kit.tiny_program(), kit.context("mixed_precision=bf16"))
    golden(kit.graph_text(stage.gm), before)


def test_the_asserts_of_nested_graphs_go_too():
    """A ``torch.no_grad()`` block (a rotary embedding's) is exported as a ``wrap_with_set_grad_enabled``
    subgraph: its asserts go with the top graph's (on CUDA they failed ``torch.compile``'s fake tensors)."""
    from types import SimpleNamespace

    import torch

    from fxpar.passes.drop_dtype_asserts import drop_dtype_asserts

    class Rotary(torch.nn.Module):
        def forward(self, x, pos):
            with torch.no_grad():
                angle = pos[:, None, :].to(torch.float32)
            return x * angle.transpose(1, 2).sum()

    gm = torch.export.export(Rotary(), (torch.randn(2, 4), torch.arange(4).view(1, 4)), strict=False).module()

    def asserts():
        return sum(n.target is torch.ops.aten._assert_tensor_metadata.default for m in gm.modules()
                   if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)

    assert asserts() >= 1
    drop_dtype_asserts(SimpleNamespace(gm=gm), None)  # the pass reads only the stage's graph
    assert asserts() == 0
    x, pos = torch.randn(2, 4), torch.arange(4).view(1, 4)
    torch.testing.assert_close(gm(x, pos), Rotary()(x, pos))
