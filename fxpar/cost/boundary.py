"""What crosses a pipeline boundary: which values a stage recomputes instead of receiving, and the bytes
the split really sends for given stage bounds.

Reads: ``val``, ``fxpar.cost``, the program's input bindings. Writes nothing. The split
(:mod:`fxpar.passes.pipeline_split`) and the cost model (:mod:`fxpar.cost.partition`) both read these
definitions, so the bytes the cuts are balanced on are the bytes the stages send.

**The rule.** Every stage has the user inputs, the buffers and the constants (they are given to every
rank or bound as ``get_attr``). A value computed only from those (an attention mask, rotary tables,
position ids) is *recomputed* on each later stage that reads it, its producing nodes (its *cone*)
copied into that stage, when

- its cone reads no parameter (trainable or frozen: a stage must not hold another stage's weights for
  it) and nothing a gradient flows through (``fxpar.ir.analysis.grad_flow``, user inputs that require
  grad included);
- no node of the cone (nor of a higher-order op's body in it) is impure: random (dropout, ``rand``),
  mutating or otherwise side-effecting (``torch.fx.Node.is_impure``); no input of the cone is mutated;
- the cone is cheap: its forward FLOPs are at most :data:`RECOMPUTE_FLOPS_PER_ELEMENT` per element of
  the value. Receiving costs a transfer of every element; a cone within this bound costs a few
  elementwise operations per element, orders of magnitude less than the link on any device
  model here, and rules out anything matmul-class with a real reduction (a ``[T, K] @ [K, N]`` costs
  ``2K`` per element; an outer product, ``K = 1``, as rotary tables use, passes). The bound is per
  value, not per stage, so the decision does not depend on where the cuts fall, and the balanced cuts
  stay an exact dynamic program.

Everything in the cone of a recomputed value is recomputable too (closing the set downward), so a
stage never both receives a value and recomputes it. Anything else read by a later stage is sent:
activations and whatever depends on a parameter or on a value only an earlier stage has.
"""

from __future__ import annotations

import torch.fx

from fxpar.ir import meta
from fxpar.ir.analysis import grad_flow
from fxpar.ir.numeric import nbytes
from fxpar.ir.program import Program, iter_nodes, subgraphs_of

RECOMPUTE_FLOPS_PER_ELEMENT = 64
_SKIP = ("placeholder", "output", "get_attr")


def _elements(val) -> int:
    if isinstance(val, (tuple, list)):
        return sum(_elements(v) for v in val)
    return val.numel() if isinstance(val, torch.Tensor) else 0


def value_bytes(val) -> int:
    """Bytes of a value: a tensor's, summed over tuples and lists, 0 for anything else."""
    if isinstance(val, (tuple, list)):
        return sum(value_bytes(v) for v in val)
    return nbytes(val, missing=1) or 0


def _impure(node: torch.fx.Node) -> bool:
    """Random, mutating or side-effecting; an assertion (``_assert_tensor_metadata``) only checks, so it
    may run twice."""
    name = getattr(node.target, "__name__", "")
    return node.is_impure() and not name.startswith(("_assert", "sym_constrain_range"))


def _impure_cone(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    return _impure(node) or any(inner.op == "call_function" and _impure(inner)
                                for sub in subgraphs_of(gm, node) for inner in iter_nodes(sub))


def _flops(node: torch.fx.Node, gm: torch.fx.GraphModule) -> int:
    total = node.meta.get(meta.COST, meta.ZERO_COST).flops
    for sub in subgraphs_of(gm, node):
        total += sum(n.meta.get(meta.COST, meta.ZERO_COST).flops for n in iter_nodes(sub))
    return total


def recomputable(program: Program, flops_per_element: int = RECOMPUTE_FLOPS_PER_ELEMENT) -> set[torch.fx.Node]:
    """Top-level nodes that a later stage recomputes rather than receives (see the module's rule)."""
    gm = program.gm
    grad = grad_flow(program, user_inputs=True)
    params = {b.placeholder for b in program.inputs if b.kind == "parameter"}
    mutated = {a for n in program.graph.nodes if getattr(getattr(n.target, "_schema", None), "is_mutable", False)
               for a in n.all_input_nodes}
    local: set[torch.fx.Node] = set()
    for node in program.graph.nodes:
        if node in grad or node in mutated:
            continue
        if node.op == "placeholder":
            ok = node.name not in params
        elif node.op == "get_attr":
            ok = True
        elif node.op == "call_function":
            ok = all(a in local for a in node.all_input_nodes) and not _impure_cone(node, gm)
        else:
            ok = False
        if ok:
            local.add(node)
    cones: dict[torch.fx.Node, frozenset] = {}
    chosen: set[torch.fx.Node] = set()
    for node in program.graph.nodes:
        if node not in local or node.op in _SKIP:
            continue
        cone = {node}
        for a in node.all_input_nodes:
            cone |= cones.get(a, frozenset())
        cones[node] = frozenset(cone)
        if sum(_flops(n, gm) for n in cone) <= flops_per_element * _elements(node.meta.get(meta.VAL)):
            chosen |= cone
    return chosen


def stage_index(program: Program, bounds: list[int]) -> dict[torch.fx.Node, int]:
    """Top-level node -> its stage, for stages ``[bounds[i], bounds[i + 1])`` of top-level positions."""
    nodes = [n for n in program.graph.nodes if n.op not in _SKIP]
    return {n: s for s in range(len(bounds) - 1) for n in nodes[bounds[s]:bounds[s + 1]]}


def routed_bytes(program: Program, bounds: list[int], recompute: set[torch.fx.Node] | None = None) -> dict:
    """Bytes the split sends per traced batch for stages ``[bounds[i], bounds[i + 1])``.

    Each value read by later stages is sent once to each of them, straight from the stage that made it;
    its gradient comes back from each when one flows through it. Returns per-stage lists ``send``,
    ``recv``, ``grad_send`` (gradients this stage sends back), ``grad_recv``.
    """
    recompute = recomputable(program) if recompute is None else recompute
    grad = grad_flow(program)
    stage_of = stage_index(program, bounds)
    n = len(bounds) - 1
    out = {k: [0] * n for k in ("send", "recv", "grad_send", "grad_recv")}
    for node, p in stage_of.items():
        if node in recompute:
            continue
        readers = {stage_of[u] for u in node.users if u in stage_of and stage_of[u] != p}
        if not readers:
            continue
        b = value_bytes(node.meta.get(meta.VAL))
        out["send"][p] += b * len(readers)
        for s in readers:
            out["recv"][s] += b
        if node in grad:
            out["grad_recv"][p] += b * len(readers)
            for s in readers:
                out["grad_send"][s] += b
    return out
