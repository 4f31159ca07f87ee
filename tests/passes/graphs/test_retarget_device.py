"""retarget_device before/after: a program traced on the meta device, its weights loaded: the factory
call (``arange`` of the positions) moves from the meta device to the CPU."""

from __future__ import annotations

import torch


def test_factory_calls_follow_the_weights(kit, golden):
    ctx = kit.context("pp=1", load=lambda fqns, layout, like: torch.zeros(like.shape, dtype=like.dtype),
                      traced_on_meta=True)
    before, stage = kit.run_stage_pass("retarget_device", kit.tiny_program("meta"), ctx,
                                       first=("materialize_weights",))
    golden(kit.graph_text(stage.gm), before)


class _CountsPerExpert(torch.nn.Module):
    """transformers' MoE layers count tokens per expert with ``histc`` of floats on the CPU, of integers
    elsewhere (meta included): traced on meta, the graph holds the integer ``histc`` the CPU cannot run."""

    def forward(self, ids):
        x = ids.float() if ids.device.type == "cpu" else ids.int()
        return torch.cumsum(torch.histc(x, bins=4, min=0, max=3), dim=0, dtype=torch.int32)


def test_an_integer_histc_traced_on_meta_runs_on_the_cpu():
    from fxpar.passes.retarget_device import retarget_gm

    ids = torch.tensor([3, 0, 1, 1, 3, 3])
    gm = torch.export.export(_CountsPerExpert(), (ids.to("meta"),)).module()
    retarget_gm(gm, torch.device("cpu"))
    assert torch.equal(gm(ids), _CountsPerExpert()(ids))  # [1, 3, 3, 6]
    assert gm(ids).dtype == torch.int32
