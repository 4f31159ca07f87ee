"""The activation model: the bytes a microbatch keeps from its forward to its backward, per recompute policy.

One rule per policy (:meth:`Saves.keep`), read off what autograd saves (:class:`~fxpar.cost.saved.SavedTensors`,
each storage once):

* ``none``: a decoder layer keeps every tensor its ops save;
* ``layer``: it keeps only its inputs (what it reads from outside itself); its saved tensors are
  recomputed in backward, one layer at a time;
* ``selective``: its inputs and what its matrix products and attention make (every output, log-sum-exp
  included: :func:`fxpar.ir.op_classes.selective_product`, which the runtime's policy keeps); the cheap ops'
  saved tensors are recomputed.

Ops outside the decoder layers (embedding, final norm, head, loss) keep what they save under every policy.

Two views evaluate it. :func:`stage_activations` (compile's report and memory prediction): the nodes of one
pipeline stage together, each storage counted once across its layers, a node between two layers outside
them, the transient the largest layer's recomputation. :func:`part_activations` (the planner's per-part
costs): each part ("pre", one layer, "post") on its own, a node between two layers in the layer before
(its saves recomputed with it), and the values layers read from outside and no gradient flows through
(masks, rotary tables, positions: one storage every layer shares) counted once, with "pre".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch.fx

from fxpar.cost.saved import SavedTensors
from fxpar.ir import meta
from fxpar.ir.op_classes import selective_product
from fxpar.ir.program import Program

RECOMPUTE = ("none", "layer", "selective")
OUTSIDE = (None, "pre", "post")  # the groups of nodes outside the decoder layers

_NUMBERED = re.compile(r"^(.*?\.\d+)(\.|$)")


def layer_of(program: Program, module: str) -> str | None:
    """The decoder layer a module belongs to (``model.layers.3``), or None outside the layer container."""
    container = program.info.layer_container
    if container:
        if module.startswith(container + "."):
            return container + "." + module[len(container) + 1:].split(".")[0]
        return None
    m = _NUMBERED.match(module)
    return m.group(1) if m else None


@dataclass
class Saves:
    """What a program's nodes save for backward, by group (a layer, or one of :data:`OUTSIDE`); each dict
    maps a storage to its bytes."""

    saved: dict[object, dict] = field(default_factory=dict)  # what the group's ops save
    inputs: dict[object, dict] = field(default_factory=dict)  # what a layer reads from outside itself
    matmul: dict[object, dict] = field(default_factory=dict)  # what a layer's matrix products and attention keep
    shared: dict[str, dict] = field(default_factory=lambda: {"saved": {}, "inputs": {}})  # context, counted once

    def keep(self, layer, policy: str) -> dict:
        """What ``layer`` holds from its forward to its backward under ``policy``: the one rule per policy."""
        if policy == "none":
            return self.saved.get(layer, {})
        if policy == "layer":
            return self.inputs.get(layer, {})
        return {**self.inputs.get(layer, {}), **self.matmul.get(layer, {})}

    def layers(self) -> list:
        return [g for g in dict.fromkeys([*self.saved, *self.inputs]) if g not in OUTSIDE]


def saves(program: Program, nodes: Iterable[torch.fx.Node], group: Callable[[torch.fx.Node], object], *,
          share_context: bool = False) -> Saves:
    """What ``nodes`` of ``program`` save, in the group ``group(node)`` names. ``share_context``: the values a
    layer saves or reads whose producer is outside every layer (or none: an input) and no gradient flows
    through go to ``shared`` (one storage every layer reads) instead of the layer's own."""
    saved = SavedTensors(program)
    got = Saves()

    def context(kept) -> bool:
        p = kept.producer
        return share_context and (p is None or (p not in saved.flows and group(p) in OUTSIDE))

    for node in nodes:
        if node.op != "call_function":
            continue
        g = group(node)
        layer = g not in OUTSIDE
        for kept in saved.of(node):
            if layer and context(kept):
                got.shared["saved"][kept.key] = kept.nbytes
                continue
            got.saved.setdefault(g, {})[kept.key] = kept.nbytes
        if layer and selective_product(node.target):
            # selective recompute keeps these ops' outputs whether or not a backward reads them (torch's
            # selective checkpoint caches every output its policy saves), attention's log-sum-exp with them.
            # The TP collectives' outputs, which the runtime's policy (kept_by_selective) keeps too, are left
            # out: counting them puts a tiny Llama's tp=2 step above the same step without recompute, which
            # the allocator measured the other way round (1.85 MB against 2.03), and a Llama of hidden 256
            # at tp=2 at 174 MiB against 163 measured (142 without them)
            for kept in [*saved.value(node), *(k for k in saved.of(node) if k.producer is node)]:
                got.matmul.setdefault(g, {})[kept.key] = kept.nbytes
        for a in node.all_input_nodes if layer else ():
            for kept in ([] if a.op == "call_function" and group(a) == g else saved.value(a)):
                (got.shared["inputs"] if context(kept) else got.inputs.setdefault(g, {}))[kept.key] = kept.nbytes
    return got


def stage_activations(program: Program, nodes: set[str] | None = None) -> dict[str, tuple[int, int]]:
    """Activation bytes one microbatch of the nodes named ``nodes`` (a pipeline stage; None: all) holds
    for backward, per recompute policy: ``{policy: (kept, transient)}``, kept from the forward to the
    backward (each storage once across the stage), and transient: recomputed in backward, one decoder
    layer at a time (the largest). A node outside the layers keeps what it saves under every policy."""
    s = saves(program, (n for n in program.graph.nodes if nodes is None or n.name in nodes),
              lambda n: layer_of(program, n.meta.get(meta.MODULE, "")))
    outside = s.saved.get(None, {})

    def policy(p: str) -> tuple[int, int]:
        held = {**outside, **{k: b for layer in s.layers() for k, b in s.keep(layer, p).items()}}
        transient = max((sum(b for k, b in s.saved[layer].items() if k not in held)
                         for layer in s.layers() if layer in s.saved), default=0)
        return sum(held.values()), transient

    return {p: policy(p) for p in RECOMPUTE}


def part_activations(program: Program, nodes: Iterable[torch.fx.Node], part: dict[torch.fx.Node, str],
                     names: list[str]) -> dict[str, dict]:
    """Per part (``part``: top-level node -> "pre", a layer, "post"; ``names``: every part), ``{policy:
    (kept, transient)}`` bytes for one batch of the program's shapes: a layer part's by :meth:`Saves.keep`,
    its transient what its backward recomputes; "pre" and "post" keep what they save under every policy,
    and "pre" also the context every layer shares, once (under ``layer`` and ``selective`` only what layers
    read of it)."""
    s = saves(program, nodes, lambda n: part.get(n, "pre"), share_context=True)
    out = {}
    for k in names:
        if k in OUTSIDE:
            extra = {"none": s.shared["saved"], "layer": s.shared["inputs"],
                     "selective": s.shared["inputs"]} if k == "pre" else {}
            out[k] = {p: (sum({**s.saved.get(k, {}), **extra.get(p, {})}.values()), 0) for p in RECOMPUTE}
            continue
        every = s.saved.get(k, {})
        keep = {p: s.keep(k, p) for p in RECOMPUTE}
        out[k] = {p: (sum(h.values()), sum(b for key, b in every.items() if key not in h)) for p, h in keep.items()}
    return out
