"""Sizes as plain numbers: SymInt -> int and a tensor value's bytes, one definition for the project.

Reads: ``int`` / ``torch.SymInt`` sizes and ``meta["val"]`` tensors (real, fake or meta). Writes nothing.

Why one helper with a choice: a size traced symbolically carries a *hint* (the example's value). When
it has none, the cost model's estimates (``fxpar.cost.flops``) count the size as 1 and go on, while
byte accounting of collectives (``fxpar.cost.comm``) refuses: a wrong payload would be reported as a
measurement. ``missing=`` says which of the two a caller wants.
"""

from __future__ import annotations

import math

import torch

from fxpar.ir.errors import FxparError


def to_int(v, *, missing: int | None = None) -> int:
    """``v`` as an int: a ``SymInt``'s hint. A ``SymInt`` without a hint gives ``missing``, or raises
    :class:`FxparError` when ``missing`` is None."""
    if isinstance(v, torch.SymInt):
        hint = v.node.hint
        if hint is None:
            if missing is None:
                raise FxparError(f"a symbolic size without a hint ({v}) cannot be costed")
            return missing
        return int(hint)
    return int(v)


def nbytes(val, *, missing: int | None = None) -> int | None:
    """Bytes of a tensor value (numel x element size), None for anything else.

    ``missing=None``: the numel's hint, raising for a hint-less numel (the message names the whole
    symbolic numel). ``missing=k``: each hint-less dimension counts as ``k``."""
    if not isinstance(val, torch.Tensor):
        return None
    if missing is None:
        return to_int(val.numel()) * val.element_size()
    return math.prod(to_int(s, missing=missing) for s in val.shape) * val.element_size()
