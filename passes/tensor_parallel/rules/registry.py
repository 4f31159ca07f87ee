"""The table of tensor-parallel rules and the decorator that fills it (see :mod:`..rules`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx

# (rw: Rewriter, old: traced node, args, kwargs mapped into the new graph) -> the new node
Rule = Callable[..., torch.fx.Node]
RULES: dict[Any, Rule] = {}


def rule(*ops) -> Callable[[Rule], Rule]:
    """Register the decorated function as the rule of each op in ``ops``."""
    def register(fn: Rule) -> Rule:
        for op in ops:
            if op in RULES:
                raise ValueError(f"tensor-parallel rule for {op} given twice: {RULES[op].__name__}, {fn.__name__}")
            RULES[op] = fn
        return fn
    return register
