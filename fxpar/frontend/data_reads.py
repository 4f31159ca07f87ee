"""Capture ``tensor.data`` as ``tensor.detach()``: a forward that updates a parameter in place through
``.data`` keeps the update in the graph.

Some models project a weight inside forward (``self.coefs.weight.data.clamp_(-c, c)`` before the weight
is used). Non-strict torch.export does not trace the ``.data`` read: the result is a fresh fake tensor that
export lifts as a constant ("We found a fake tensor in the exported program constant's list"), and the
in-place update would be lost. ``.data`` is the tensor's storage without autograd history, which is what
``detach()`` gives too, and ``detach`` is traced: under :func:`data_as_detach` the graph holds
``clamp_(detach(weight))`` before the weight's use, so running it updates the parameter in place and the
use reads the clamped values, as in eager (the gradient goes to the parameter, as there).

Reads: ``.data`` reads during the capture. Writes: nothing outside the capture.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["data_as_detach"]


class _DataAsDetach(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is torch._C.TensorBase.data and len(args) == 1:
            return args[0].detach()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def data_as_detach():
    """While active, ``t.data`` reads trace as ``t.detach()`` (see the module docstring)."""
    with _DataAsDetach():
        yield
