"""Capture a loop over "the experts a batch hit" as a loop over every expert the router can pick.

The common eager MoE dispatch (transformers' eager experts, and models that keep their own) reads::

    mask = one_hot(top_k_index, num_classes=E)              # [T, K, E] (or permuted)
    hit = (mask.sum(dims) > 0).nonzero()                    # [u0, 1]: data-dependent length
    for e in hit:                                           # Python loop over a data-dependent count
        idx, tok = torch.where(mask[e])                     # the tokens routed to expert e
        out.index_add_(0, tok, expert_e(x[tok]) * w[tok, idx, None])

torch.export cannot trace the loop: its trip count, and every ``int(e)`` the body branches on, are
unbacked values (``GuardOnDataDependentSymNode: Eq(u0, 0)``). :func:`expert_hit_loops` (entered around the
capture) recognises the pattern by the ops, never by a class name: a ``nonzero`` of a 1-D presence vector
reduced from a ``one_hot`` over its class axis. There the loop runs over every class the one-hot's index
can hold: ``arange(n)[:, None]`` instead of the ``nonzero``, where ``n`` is the index's bound when it comes
from ``topk`` over ``n`` scores (a padding class beyond the router's experts is never looped over) and the
one-hot's ``num_classes`` otherwise. The numbers are the same: for an expert no token chose, the body's
``where`` finds no token and adds nothing. Each element the loop yields is known (``e.item()``,
``int(e)``, ``e[0]``, ``w[e]``: a plain int, so ``w[e]`` is a ``select`` of the expert's weight), so the
body's branches on the expert index trace as in eager.

The per-expert token count stays data-dependent (an unbacked size: ``index``, ``mm``, ``index_add`` take
it); an early ``if tok.numel() == 0: continue`` on it is answered "not empty" (``numel()`` of those
``where`` results reads ``max(count, 1)`` in Python), because the body on zero rows adds nothing either.

Reads: the torch calls the model makes during the capture. Writes: nothing outside the capture.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["expert_hit_loops"]

# calls through which a one-hot stays "the one-hot" (its class axis moved, reduced, compared, cast)
_CARRY = {
    torch.Tensor.permute, torch.permute, torch.Tensor.transpose, torch.transpose, torch.Tensor.sum, torch.sum,
    torch.Tensor.any, torch.any, torch.Tensor.amax, torch.amax, torch.greater, torch.gt, torch.Tensor.gt,
    torch.Tensor.__gt__, torch.ne, torch.Tensor.ne, torch.Tensor.__ne__, torch.Tensor.to, torch.Tensor.bool,
    torch.Tensor.squeeze, torch.squeeze, torch.Tensor.view, torch.Tensor.reshape, torch.reshape,
    torch.Tensor.contiguous, torch.Tensor.type,
}
# calls through which an index keeps its value bound
_KEEP_BOUND = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
               torch.Tensor.to, torch.Tensor.long, torch.Tensor.contiguous, torch.Tensor.squeeze,
               torch.Tensor.unsqueeze}
_NONZERO = {torch.nonzero, torch.Tensor.nonzero}
_WHERE = {torch.where}
_INDEX_READS = {torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.tolist}


def _scalar(value):
    """The one number of a one-element value (``[[3]]`` -> 3), as ``item()`` reads it."""
    while isinstance(value, list):
        value = value[0]
    return value


def _dims(dims, ndim: int) -> list[int]:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [d % ndim for d in dims]


def _class_axis(func, args, kwargs, first, out, axis):
    """Where the one-hot's class axis is in ``out`` (None once it is merged, indexed or reduced away)."""
    if axis is None:
        return None
    if func in (torch.Tensor.permute, torch.permute):
        dims = args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:]
        return _dims(dims, first.dim()).index(axis)
    if func in (torch.Tensor.transpose, torch.transpose):
        a, b = _dims(args[1:3], first.dim())
        return b if axis == a else a if axis == b else axis
    if func in _REDUCE:
        dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if dims is None:
            return None
        dims = _dims(dims, first.dim())
        if axis in dims:
            return None
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        return axis if keepdim else axis - sum(d < axis for d in dims)
    return axis if out.shape == first.shape else None


_REDUCE = {torch.Tensor.sum, torch.sum, torch.Tensor.any, torch.any, torch.Tensor.amax, torch.amax}


class _ExpertHitMode(TorchFunctionMode):
    """Tracks one-hot tensors, index bounds and the known values of the loop; see the module docstring."""

    def __init__(self):
        super().__init__()
        # id -> (tensor, the one-hot's classes, how many the index can hold, where its class axis is now
        # (None: merged or gone), reduced over other axes yet)
        self.one_hot: dict[int, tuple[torch.Tensor, int, int, int | None, bool]] = {}
        self.bound: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (integer tensor, exclusive upper bound)
        self.known: dict[int, tuple[torch.Tensor, object]] = {}  # id -> (tensor, its value as Python data)
        self.routed: dict[int, tuple[torch.Tensor]] = {}  # the token sets of one expert (a where on the one-hot)

    @staticmethod
    def _get(table: dict, t):
        hit = table.get(id(t)) if isinstance(t, torch.Tensor) else None
        return hit if hit is not None and hit[0] is t else None

    def _value(self, t):
        hit = self._get(self.known, t)
        return None if hit is None else hit[1]

    def _known_or(self, t):
        v = self._value(t)
        return t if v is None or isinstance(v, list) and len(v) != 1 else _scalar(v)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NONZERO and not kwargs.get("as_tuple", False):
            entry = self._get(self.one_hot, args[0])
            if entry is not None and entry[4] and entry[3] == 0 and args[0].dim() == 1:
                return self._all_classes(args[0], entry[2])
        if func in _INDEX_READS:
            v = self._value(args[0])
            if v is not None:
                return v if func is torch.Tensor.tolist else _scalar(v)
        if func is torch.Tensor.numel and self._get(self.routed, args[0]) is not None:
            return torch.sym_max(func(*args, **kwargs), 1)
        if func is torch.Tensor.__getitem__ and self.known:
            index = args[1]
            args = (args[0], tuple(self._known_or(i) for i in index) if isinstance(index, tuple)
                    else self._known_or(index))
        out = func(*args, **kwargs)
        self._follow(func, args, kwargs, out)
        return out

    def _all_classes(self, t, n: int):
        out = torch.arange(n, device=t.device).unsqueeze(1)
        self.known[id(out)] = (out, [[i] for i in range(n)])
        return out

    def _follow(self, func, args, kwargs, out) -> None:
        first = args[0] if args else None
        if func is F.one_hot:
            bound = self._get(self.bound, first)
            classes = int(out.shape[-1])
            self.one_hot[id(out)] = (out, classes, min(classes, bound[1]) if bound else classes, out.dim() - 1, False)
        elif func in (torch.topk, torch.Tensor.topk):
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            self.bound[id(out[1])] = (out[1], int(first.shape[dim]))
        elif func in _KEEP_BOUND and isinstance(out, torch.Tensor) and self._get(self.bound, first):
            self.bound[id(out)] = (out, self.bound[id(first)][1])
        elif (func in _CARRY or func is torch.Tensor.__getitem__) and isinstance(out, torch.Tensor) \
                and self._get(self.one_hot, first):
            _, classes, n, axis, reduced = self.one_hot[id(first)]
            axis = _class_axis(func, args, kwargs, first, out, axis)
            self.one_hot[id(out)] = (out, classes, n, axis, reduced or func in _REDUCE)
        elif func is torch.Tensor.__getitem__ and isinstance(args[1], int) and \
                isinstance(self._value(first), list):
            self.known[id(out)] = (out, self._value(first)[args[1]])
        elif func in (torch.Tensor.unbind, torch.unbind) and isinstance(self._value(first), list) \
                and kwargs.get("dim", args[1] if len(args) > 1 else 0) == 0:
            for t, v in zip(out, self._value(first)):
                self.known[id(t)] = (t, v)
        elif func in _WHERE and len(args) == 1 and not kwargs and self._get(self.one_hot, first):
            for t in out:
                self.routed[id(t)] = (t,)


@contextlib.contextmanager
def expert_hit_loops():
    """While active, expert-hit loops trace over every expert (see the module docstring)."""
    with _ExpertHitMode():
        yield
