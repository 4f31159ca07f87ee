"""A tensor a forward builds from Python data on its input's device, traced on the meta device, is lifted with
its values (built on the CPU, moved by a recorded ``.to``), so the program gives eager's numbers once its
device calls point at the CPU (``retarget_device``)."""

from __future__ import annotations

import torch

import fxpar
from fxpar.passes.retarget_device import retarget_gm


class FromPythonData(torch.nn.Module):
    def forward(self, x):
        sparsity = torch.tensor(0.95, dtype=torch.float32, device=x.device)  # gemma3n's MLP
        offsets = x.new_tensor([1.0, -2.0, 3.0, 0.5])
        picked = x[..., [-2]] + torch.as_tensor([[2, 3]], device=x.device)[:, [1]]  # Falcon's K/V: a list index
        return x * sparsity + offsets + picked


def test_constants_built_on_meta_keep_their_values():
    x = torch.randn(2, 3, 4)
    program = fxpar.trace(FromPythonData(), example_args=(x.to("meta"),))
    tensors = [v for v in program.constants.values() if isinstance(v, torch.Tensor)]
    assert len(tensors) >= 4 and not any(t.is_meta for t in tensors), program.constants
    retarget_gm(program.gm, torch.device("cpu"))
    torch.testing.assert_close(program(x), FromPythonData()(x), rtol=0, atol=0)
