"""Keep user ``torch.autograd.Function`` backwards through capture.

Non-strict torch.export runs ``Function.apply`` as ordinary Python: the graph gets the ATen ops of the
Function's forward and autograd later differentiates those, not the Function's hand-written backward.
Where the two differ (a straight-through estimator, a router's gradient estimator) the traced program's
gradients would be wrong although its outputs are exact.

:func:`keep_function_backwards` (entered around the capture) routes every such call through one opaque
node, ``torch.ops.fxpar.autograd_function`` (:mod:`fxpar.ir.function_op`), whose kernels call the
Function itself, so running the program calls its forward and its backward as eager does. A call is
routed when the Function is not torch's own (its class is defined outside the ``torch`` package),
grad mode is on and a tensor argument requires grad; any other call runs as before (no backward can
follow it).

The hook replaces ``torch.autograd.Function.apply`` for the duration of the capture (process-wide;
captures are not run concurrently), and steps aside inside the op's own kernels.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.utils import _pytree as pytree

from fxpar.ir.function_op import FunctionCall, autograd_function_op, register

_INSIDE = contextvars.ContextVar("fxpar_inside_function_op", default=False)


def _is_users(cls: type) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return module != "torch" and not module.startswith("torch.")


@contextlib.contextmanager
def keep_function_backwards():
    """While active, calls of user ``autograd.Function``s that could be differentiated become one
    ``fxpar.autograd_function`` op each (see the module docstring)."""
    original = torch.autograd.Function.__dict__["apply"]
    plain = original.__func__

    def apply(cls, *args, **kwargs):
        if _INSIDE.get() or not _is_users(cls) or not torch.is_grad_enabled():
            return plain(cls, *args, **kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        slots = tuple(i for i, v in enumerate(flat) if isinstance(v, torch.Tensor))
        tensors = [flat[i] for i in slots]
        if not any(t.requires_grad for t in tensors):
            return plain(cls, *args, **kwargs)
        call = FunctionCall(cls, spec, tuple(None if i in slots else v for i, v in enumerate(flat)), slots)
        key = register(call)
        token = _INSIDE.set(True)
        try:
            out = autograd_function_op(tensors, key)
        finally:
            _INSIDE.reset(token)
        return call.rebuild(out)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original
