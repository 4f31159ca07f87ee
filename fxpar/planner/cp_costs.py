"""What context parallelism needs of a model's costs, read off the same trace as the rest of
:class:`~fxpar.planner.model_costs.ModelCosts`: per part, the attention layers' keys and values that
``passes/context_parallel.py`` all-gathers (found as the pass finds them:
:func:`fxpar.passes.cp_rules.kv_roots`), and the attentions Ulysses can take (:func:`fxpar.passes.cp_ulysses.plan`)
with their head counts and the bytes their all-to-alls move, as an
:class:`~fxpar.cost.context_parallel.Attention`. Their price is :mod:`fxpar.cost.context_parallel`; nothing is
priced here.
"""

from __future__ import annotations

import torch.fx

from fxpar.cost.activations import RECOMPUTE, saves
from fxpar.cost.context_parallel import Attention
from fxpar.cost.saved import storage_key
from fxpar.ir import meta
from fxpar.ir.numeric import nbytes
from fxpar.ir.op_classes import LAYOUT_CHAIN
from fxpar.passes import cp_ulysses
from fxpar.passes.cp_rules import kv_roots, packet, token_fed

__all__ = ["read_attention"]


def read_attention(program, assign: dict, first: dict) -> dict[str, Attention]:
    """Per part of ``program`` (``assign``: top-level node -> part) with attention, its :class:`Attention`:
    the gathered keys and values (each root's bytes, once), the attention rows with the bytes of the whole
    sequence they read, the layout rows between a gather and its attention, and the whole-sequence bytes
    each recompute policy keeps and recomputes. ``first``: top-level node -> (its part, its first row there)."""
    roots = kv_roots(program.gm, program)
    found: dict[str, dict] = {}
    keys: dict[str, set] = {}  # part -> the storages of the attention operands that hold whole sequences
    attention: set[torch.fx.Node] = set()
    for root, readers in roots.items():
        part = assign.get(root)
        if part is None:
            continue
        got = found.setdefault(part, {"kv": 0, "gathers": 0, "rows": {}, "whole": set()})
        got["kv"] += nbytes(root.meta.get(meta.VAL)) or 0
        got["gathers"] += 1
        for node, _ in readers:
            operand = root  # what the attention reads of the gathered value
            while _is_layout(node):  # down the layout chain from the gather to the attention
                if first.get(node, ("",))[0] == part:
                    got["whole"].add(first[node][1])
                operand, node = node, next(iter(node.users))
            attention.add(node)
            # what the attention keeps of it is the whole sequence's (a view of the gathered value, or the
            # grouped-query expansion's copy); the local value before the gather stays this rank's
            keys.setdefault(part, set()).add(storage_key(operand.meta.get(meta.VAL)))
            if first.get(node, ("",))[0] == part:
                row = first[node][1]
                got["rows"][row] = got["rows"].get(row, 0) + (nbytes(operand.meta.get(meta.VAL)) or 0)
    if not found:
        return {}
    # the attentions Ulysses can take, where cp divides their heads
    taken = cp_ulysses.plan(program.gm, roots, 1, token_fed(program.gm, program))
    for n, (hq, hkv) in taken.heads.items():
        part = assign.get(n)
        if part in found:
            moved = [nbytes(x.meta.get(meta.VAL)) or 0 for x in taken.moved[n]]
            found[part].setdefault("ulysses", []).append((hq, hkv, moved[0] + moved[1], moved[2] + moved[3]))
    s = saves(program, (n for n in program.graph.nodes if n in assign), lambda n: assign.get(n, "pre"),
              share_context=True)
    out = {}
    for part, got in found.items():
        whole = keys[part]
        every = s.saved.get(part, {})
        act = {}
        for p in RECOMPUTE:
            held = s.keep(part, p)
            act[p] = (sum(b for k, b in held.items() if k in whole),
                      sum(b for k, b in every.items() if k in whole and k not in held))
        layers = sum(1 for n in attention if assign.get(n) == part)
        out[part] = Attention(got["kv"], got["gathers"], layers, tuple(sorted(got["rows"].items())),
                              tuple(sorted(got["whole"])), act, tuple(got.get("ulysses", ())))
    return out


def _is_layout(node: torch.fx.Node) -> bool:
    """Whether ``node`` is one of the layout ops between a gather and its attention (what :func:`kv_roots`
    walked up through from the attention: a layout op with one reader)."""
    return packet(node) in LAYOUT_CHAIN and len(node.users) == 1
