"""``torch.ops.fxpar.autograd_function``: one opaque graph node for a call of a user's
``torch.autograd.Function``, so that the program keeps the Function's own backward.

Reads: the registry entry named by the op's ``key`` argument. Writes: the ``fxpar`` op namespace
(schema, Autograd / CompositeExplicitAutograd / fake kernels) and, through :func:`register`, the
registry.

Why: non-strict torch.export runs ``Function.apply`` as Python and records only the ATen ops of its
forward, so a traced program would differentiate the forward instead of calling the Function's
backward (a straight-through estimator, a router's gradient estimator). The frontend
(:mod:`fxpar.frontend.functions`) routes each such call through this op instead. The op's tensor
arguments are the call's tensor leaves (in pytree order); everything else of the call (the Function
class, non-tensor arguments, the structure of its result) is kept in a process-wide registry under an
integer ``key``, the op's second argument. Every kernel rebuilds the call and runs ``Function.apply``:

* Autograd (a real run that records gradients): ``apply`` with grad on, so the output's ``grad_fn`` is
  the Function's own backward node;
* CompositeExplicitAutograd (no autograd key: inference mode, below autograd): ``apply`` as well;
* fake (FakeTensorMode, meta tensors): ``apply`` under ``no_grad`` on the fake inputs, which is how the
  node's ``val`` is found.

The op returns the tensor leaves of the Function's result as a list (each a fresh tensor: a leaf that
aliases an input is cloned, so the op stays functional); the frontend rebuilds the structure.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["FunctionCall", "autograd_function_op", "call_of", "is_function_node", "register", "run_call"]

_LIB = torch.library.Library("fxpar", "FRAGMENT")
_LIB.define("autograd_function(Tensor[] tensors, int key) -> Tensor[]")


@dataclass
class FunctionCall:
    """One captured ``Function.apply`` call: the class, the argument tree with its tensor leaves left
    out (``slots`` marks where they go); the result's tree spec and leaves (tensors as None) are
    written by the first kernel that runs it."""

    cls: type
    spec: Any  # pytree spec of (args, kwargs)
    leaves: tuple  # every leaf; None where a tensor goes
    slots: tuple[int, ...]  # leaf positions holding tensors, in the op's argument order
    out_spec: Any = None
    out_leaves: tuple | None = None
    _elementwise: bool | None = None

    @property
    def elementwise(self) -> bool:
        """Whether the Function maps one floating tensor to one of its shape element by element, forward
        and backward: run on a small random tensor and on a permutation of its elements, the outputs and
        the input gradients must be the same permutation of each other. Such a call can keep a
        tensor-parallel shard (a GeLU written as a Function); any other is gathered around. Probed on
        first use, outside any tracing or fake mode; the global RNG is left untouched."""
        if self._elementwise is None:
            try:
                self._elementwise = len(self.slots) == 1 and _probe(self)
            except Exception:  # a Function that does not run on a probe tensor: treated as opaque
                self._elementwise = False
        return self._elementwise

    def rebuild(self, tensors) -> Any:
        """The Function's result from the op's output list."""
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if v is None else v for v in self.out_leaves], self.out_spec)


def _probe(call: FunctionCall) -> bool:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def run(x, g):
        x = x.detach().requires_grad_(True)
        out = run_call(call, [x])
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            return None
        (grad,) = torch.autograd.grad(out, x, g)
        return out.detach(), grad

    with unset_fake_temporarily(), torch.random.fork_rng(devices=[]), torch.enable_grad():
        gen = torch.Generator().manual_seed(0)
        x, g = torch.randn(3, 5, 7, generator=gen), torch.randn(3, 5, 7, generator=gen)
        perm = torch.randperm(x.numel(), generator=gen)
        base, permuted = run(x, g), run(x.flatten()[perm].view_as(x), g.flatten()[perm].view_as(g))
        if base is None or permuted is None:
            return False
        # close, not equal: vectorised kernels round a tensor's tail elements differently; an op that is
        # not elementwise moves values far more than this
        return all(torch.allclose(p.flatten(), b.flatten()[perm], rtol=1e-5, atol=1e-6)
                   for p, b in zip(permuted, base))


_REGISTRY: dict[int, FunctionCall] = {}
_KEYS = itertools.count()
_LOCK = threading.Lock()


def register(call: FunctionCall) -> int:
    """Keep ``call`` for the life of the process; returns the op's ``key``."""
    with _LOCK:
        key = next(_KEYS)
        _REGISTRY[key] = call
    return key


def call_of(key: int) -> FunctionCall:
    call = _REGISTRY.get(key)
    if call is None:
        raise KeyError(f"fxpar.autograd_function: no captured Function call under key {key} in this process "
                       "(a program holding this op runs only in the process that traced it)")
    return call


def run_call(call: FunctionCall, tensors) -> Any:
    """``call.cls.apply`` on the captured arguments with ``tensors`` in the tensor slots."""
    leaves = list(call.leaves)
    for slot, t in zip(call.slots, tensors, strict=True):
        leaves[slot] = t
    args, kwargs = pytree.tree_unflatten(leaves, call.spec)
    return call.cls.apply(*args, **kwargs)


def _tensor_results(call: FunctionCall, result, inputs) -> list[torch.Tensor]:
    leaves, spec = pytree.tree_flatten(result)
    if call.out_spec is None:
        call.out_spec = spec
        call.out_leaves = tuple(None if isinstance(v, torch.Tensor) else v for v in leaves)
    ids = {id(t) for t in inputs}
    out = [t for t in leaves if isinstance(t, torch.Tensor)]
    return [t.clone() if id(t) in ids or any(t._is_view() and t._base is i for i in inputs) else t for t in out]


def _autograd_kernel(tensors, key):
    call = call_of(key)
    return _tensor_results(call, run_call(call, tensors), tensors)


def _plain_kernel(tensors, key):
    call = call_of(key)
    with torch.no_grad():
        return _tensor_results(call, run_call(call, tensors), tensors)


_LIB.impl("autograd_function", _autograd_kernel, "Autograd")
_LIB.impl("autograd_function", _plain_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("fxpar::autograd_function", _plain_kernel, lib=_LIB)

autograd_function_op = torch.ops.fxpar.autograd_function.default


def is_function_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is autograd_function_op
