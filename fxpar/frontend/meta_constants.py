"""Capture a tensor a meta-device forward builds from Python data with its values: built on the CPU, moved.

A model traced on the meta device (a meta-built model, or ZeRO-3 of a built one, which takes the model's tensors)
may build constant tensors from Python data on its input's device: ``torch.tensor(0.95, device=x.device)``
(gemma3n's activation sparsity), ``x[..., [-2]]`` (Falcon's fused K/V: the list becomes an index tensor), also
``torch.as_tensor`` and ``x.new_tensor``. On the meta device torch makes such a tensor without ever writing its
data, and export lifts it as a constant with a shape and no values: the program would run with values it never
had. Under :func:`constants_with_values` (entered around the capture) each such call whose tensor would land on
the meta device builds it on the CPU from the same Python data, where export lifts a constant that holds the
values, and moves it to the meta device with ``.to``, which the graph records as an op
(``_to_copy(lifted_tensor_0, device=meta)``): ``fxpar.passes.retarget_device`` points it at the device the stage
runs on, as it does every factory call of a meta trace. The numbers are eager's: the same data, converted by the
same rules, on the device eager builds it on. Calls on any other device, and data that holds a tensor or a symbol
(a value the graph computes, not a constant), are left as they are. A constant a meta trace still lifts without
values (built some other way) stays a PlanError at compile (``fxpar.planner.feasibility.check_meta_constants``).

Reads: tensor-building calls and list indices during the capture. Writes: nothing outside the capture.
"""

from __future__ import annotations

import contextlib
import numbers

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["constants_with_values"]

_META = torch.device("meta")
_BUILDERS = {torch.tensor, torch.as_tensor}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


def _python_data(data) -> bool:
    """Numbers, or lists and tuples of them (nested): data with nothing the graph computes."""
    if isinstance(data, (list, tuple)):
        return all(_python_data(d) for d in data)
    return isinstance(data, numbers.Number) and not isinstance(data, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _index_list(i) -> bool:
    """A list of numbers inside an index: torch turns it into an index tensor on the indexed tensor's device."""
    return isinstance(i, list) and bool(i) and _python_data(i)


class _ConstantsWithValues(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BUILDERS and args and _python_data(args[0]) and _device(kwargs.get("device")) == _META:
            return func(args[0], **{**kwargs, "device": "cpu"}).to(_META)
        if func is torch.Tensor.new_tensor and len(args) > 1 and _python_data(args[1]):
            device = _device(kwargs.get("device", args[0].device))
            if device == _META:
                dtype = kwargs.get("dtype", args[0].dtype)
                built = torch.tensor(args[1], dtype=dtype, device="cpu", requires_grad=kwargs.get("requires_grad",
                                                                                                  False))
                return built.to(_META)
        if func in _INDEXING and len(args) > 1 and args[0].device == _META:
            index = args[1]
            if isinstance(index, tuple) and any(_index_list(i) for i in index):
                index = tuple(_on_meta(i) if _index_list(i) else i for i in index)
                args = (args[0], index, *args[2:])
            elif _index_list(index) and all(not isinstance(i, (list, tuple)) for i in index):
                args = (args[0], _on_meta(index), *args[2:])
        return func(*args, **kwargs)


def _device(device) -> torch.device | None:
    return torch.device(device) if isinstance(device, (str, torch.device)) else None


def _on_meta(data) -> torch.Tensor:
    """``data`` as torch makes an index of it (booleans: bool, anything else: int64), built on the CPU, moved."""
    index = torch.tensor(data, device="cpu")
    return (index if index.dtype in (torch.bool, torch.uint8) else index.long()).to(_META)


@contextlib.contextmanager
def constants_with_values():
    """While active, tensors built from Python data on the meta device keep their values (module docstring)."""
    with _ConstantsWithValues():
        yield
