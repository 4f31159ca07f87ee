"""Expert parallelism (``Plan(ep=N)``): each MoE layer's experts split over the ep ranks, tokens sent to
their experts' rank and back by all-to-all, found from the graph.

Reads: the traced program (after the fused-loss and TP passes, before the pipeline split, so each stage
keeps the ops of its own layers), the ep degree and this rank's ep coordinate. Writes: this rank's
program: every expert parameter cut to its ``E / ep`` experts along dim 0, and per MoE layer the ops of
:mod:`fxpar.ir.expert_ops`; the :class:`~fxpar.ir.expert_ops.EpResult` saying what was cut.

What an expert region is, read from the graph and never from a model's name: the grouped matmuls
(``transformers::grouped_mm_fallback``, ``aten::_grouped_mm``) whose weights are 3-D parameters
``[E, ...]`` (through views and transposes) and that share one ``offs`` (the router's cumulative
per-expert counts, ``histc`` -> ``cumsum`` in transformers 5). Its entry is the one tensor of sorted
tokens its matmuls read from outside, its exit the one matmul whose output leaves the region; between
them only row-wise ops (the activation, ``chunk``, the gate's product). The rewrite::

    counts = ep_counts(offs)                     # [ep, E]: every rank's tokens per expert
    x'     = ep_dispatch(x, counts)              # [ep * N, H]: this rank's experts' tokens, then zeros
    offs'  = cumsum(counts[:, lo:hi].sum(0))     # the local experts' offsets in x'
    ...    grouped mms on x', W[lo:hi], offs'    # unchanged ops between
    y      = ep_combine(y', counts)              # [N, H]: back in x's order; the unsort follows as traced

The zero rows past ``offs'[-1]`` give zeros through the grouped matmuls (rows past the last offset are
not computed) and are never sent back. A region whose inner values escape it, an expert count ``ep`` does
not divide, or a model with no region raise :class:`~fxpar.ir.errors.PlanError` (:func:`expert_regions`
runs before any communication: ``fxpar.compile`` calls it on the first trace).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from fxpar.cost.flops import annotate_costs
from fxpar.ir import expert_ops, meta
from fxpar.ir.errors import PlanError
from fxpar.ir.expert_ops import EpResult
from fxpar.ir.op_classes import WEIGHT_VIEWS, expert_matmuls, packet
from fxpar.ir.program import Program, graph_module
from fxpar.passes.ep_loops import loop_chains, loop_regions, rewrite, strip_asserts
from fxpar.passes.local import bind_local


@dataclass
class Region:
    """One MoE layer's experts: its grouped matmuls, their shared offsets, entry and exit, the expert
    parameters and the number of experts."""

    mms: list[torch.fx.Node]
    offs: torch.fx.Node
    entry: torch.fx.Node
    exit: torch.fx.Node
    params: list[str]
    n_experts: int
    layer: str
    sides: dict[torch.fx.Node, list[torch.fx.Node]]  # per-row inputs from outside (expert biases) -> readers


def _chain(node) -> list[torch.fx.Node]:
    """A weight argument and the views it reads through, down to what they view (last)."""
    out = [node]
    while node.op == "call_function" and packet(node) in WEIGHT_VIEWS:
        node = node.args[0]
        out.append(node)
    return out


def _param_of(node, bound: dict[str, str]) -> str | None:
    """The parameter FQN a weight argument reads through views, or None."""
    last = _chain(node)[-1]
    return bound.get(last.name) if last.op == "placeholder" else None


def descendants(start: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """Every node that uses, directly or through others, a node of ``start`` (``start`` itself only where
    one of them reaches another)."""
    seen, todo = set(), list(start)
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def expert_regions(program: Program, ep: int) -> list[Region]:
    """Every expert region of ``program`` in graph order, checked for ``ep`` ranks (PlanError otherwise)."""
    bound = {b.placeholder: b.target for b in program.inputs if b.kind == "parameter"}
    by_offs: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    grouped = expert_matmuls()
    for n in program.graph.nodes:
        if n.op == "call_function" and packet(n) in grouped and len(n.args) >= 3 \
                and isinstance(n.args[2], torch.fx.Node) and _param_of(n.args[1], bound):
            by_offs.setdefault(n.args[2], []).append(n)
    where = f"{program.info.model_class or 'the model'}"
    if not by_offs:
        if loop_chains(program):  # experts run as a loop over the experts: fxpar.passes.ep_loops splits those
            return []
        raise PlanError(f"Plan(ep={ep}): {where} has no expert layers (3-D expert parameters used by grouped "
                        "matmuls with router offsets, or a loop over the experts adding each one's output with "
                        "index_add_; fxpar/passes/expert_parallel.py); use dp instead of ep")
    regions = []
    mm_set = {m for mms in by_offs.values() for m in mms}
    chains = {n for mms in by_offs.values() for m in mms for n in _chain(m.args[1])}
    for offs, mms in by_offs.items():
        params = [_param_of(m.args[1], bound) for m in mms]
        n_exp = int(offs.meta[meta.VAL].shape[0])
        layer = mms[-1].meta.get(meta.MODULE, "")
        if n_exp % ep:
            raise PlanError(f"Plan(ep={ep}): {layer or where} has {n_exp} experts, which do not split over "
                            f"{ep} ranks; pick an ep dividing {n_exp}")
        for m, fqn in zip(mms, params):
            shape = tuple(program.params[fqn].shape)
            others = [u.name for n in _chain(m.args[1]) for u in n.users if u not in chains and u not in mm_set]
            if shape[0] != n_exp or others:
                raise PlanError(f"Plan(ep={ep}): expert parameter {fqn} {shape} of {layer} is "
                                + (f"also read by {others[:3]}" if others else f"not {n_exp} experts along dim 0")
                                + "; expert parallelism cuts it along dim 0 for the grouped matmuls only "
                                "(fxpar/passes/expert_parallel.py)")
        inside = descendants(mms)
        entries = {m.args[0] for m in mms if m.args[0] not in inside}
        exits = [m for m in mms if not (descendants([m]) & set(mms))]
        if len(entries) != 1 or len(exits) != 1:
            raise PlanError(f"Plan(ep={ep}): the experts of {layer} read {len(entries)} token tensors and give "
                            f"{len(exits)} outputs; expert parallelism needs one of each "
                            "(fxpar/passes/expert_parallel.py)")
        inner = (set(mms) | inside) - descendants(exits) - set(exits)
        leaks = [n.name for n in inner if any(u not in inner and u is not exits[0] for u in n.users)]
        if leaks:
            raise PlanError(f"Plan(ep={ep}): values {leaks[:3]} inside the experts of {layer} are used outside "
                            "them; only the last grouped matmul's output may leave (fxpar/passes/expert_parallel.py)")
        entry = entries.pop()
        regions.append(Region(mms, offs, entry, exits[0], params, n_exp, layer,
                              _sides(inner | set(exits), entry, offs, chains, ep, layer)))
    return regions


def _sides(inner: set, entry, offs, chains: set, ep: int, layer: str) -> dict:
    """Inputs of the region's ops from outside it that hold one row per routed token, like the entry (an
    expert bias indexed by the sorted expert ids): each is dispatched as the tokens are."""
    rows, out = entry.meta[meta.VAL].shape[0], {}
    for n in inner:
        for a in n.all_input_nodes:
            v = a.meta.get(meta.VAL)
            if a in inner or a is entry or a is offs or a in chains or not isinstance(v, torch.Tensor) \
                    or v.dim() == 0 or v.shape[0] != rows:
                continue
            if v.dim() != 2:
                raise PlanError(f"Plan(ep={ep}): {a.name} {tuple(v.shape)} enters the experts of {layer} with one "
                                "row per token but is not [rows, features]; only such inputs are dispatched "
                                "(fxpar/passes/expert_parallel.py)")
            out.setdefault(a, []).append(n)
    return out


def _op(name: str):
    assert name in expert_ops.EP_OPS  # registered by importing fxpar.ir.expert_ops
    return getattr(torch.ops.fxpar, name).default


def _insert(graph: torch.fx.Graph, like: torch.fx.Node, target, args) -> torch.fx.Node:
    node = graph.call_function(target, args)
    node.meta = {k: v for k, v in like.meta.items() if k not in (meta.VAL, "tensor_meta", meta.COST)}
    return node


def expert_parallel(program: Program, ep: int, rank: int, group: str,
                    shards: dict[str, torch.Tensor] | None = None) -> tuple[Program, EpResult]:
    """This ep rank's program: expert parameters cut to its experts, tokens dispatched and combined over
    ``group`` (a name of ``ep`` ranks). ``shards``: slices from an earlier signature, bound again."""
    shards = {} if shards is None else shards
    regions = expert_regions(program, ep)
    result = EpResult(parts=ep, rank=rank)
    graph, new = torch.fx.Graph(), {}
    out = graph.graph_copy(program.graph, new)  # the traced program stays as it was
    graph.output(out)
    names = {old.name: new[old] for old in program.graph.nodes if old in new}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for r in regions:
        mms = [names[m.name] for m in r.mms]
        offs, entry, exit_ = names[r.offs.name], names[r.entry.name], names[r.exit.name]
        lo, hi = result.local_range(r.n_experts, rank)
        first = min(mms, key=order.__getitem__)
        with graph.inserting_before(first):
            counts = _insert(graph, first, _op("ep_counts"), (offs, group, r.layer))
            sent = _insert(graph, first, _op("ep_dispatch"), (entry, counts, group, r.layer))
            mine = _insert(graph, first, torch.ops.aten.slice.Tensor, (counts, 1, lo, hi))
            total = _insert(graph, first, torch.ops.aten.sum.dim_IntList, (mine, [0]))
            local = _insert(graph, first, torch.ops.aten.cumsum.default, (total, 0))
            local.kwargs = {"dtype": r.offs.meta[meta.VAL].dtype}
        for m in mms:
            m.args = (sent if m.args[0] is entry else m.args[0], m.args[1], local, *m.args[3:])
        for side, readers in r.sides.items():  # per-row inputs (expert biases) travel with their tokens
            readers = [names[u.name] for u in readers]
            with graph.inserting_before(min(readers, key=order.__getitem__)):
                moved = _insert(graph, readers[0], _op("ep_dispatch"), (names[side.name], counts, group, r.layer))
            for u in readers:
                u.replace_input_with(names[side.name], moved)
        with graph.inserting_after(exit_):
            back = _insert(graph, exit_, _op("ep_combine"), (exit_, counts, group, r.layer))
        exit_.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
        for fqn in r.params:
            result.experts[fqn] = (0, r.n_experts)
        result.layers.append(r.layer)
    bodies = []
    for r in loop_regions(program, ep) if not regions else []:  # experts run as a loop over the experts
        cut, kept = rewrite(graph, r, names, ep, rank, group, lambda *a: _insert(graph, *a))
        result.experts.update({fqn: (0, rows) for fqn, rows in cut.items()})
        result.layers.append(r.layer)
        bodies += kept
    graph.lint()
    gm = graph_module(program.gm, graph)
    strip_asserts(gm, bodies)

    def cut(fqn, t):
        if fqn not in result.experts:
            return None
        lo, hi = result.local_range(result.experts[fqn][1], rank)
        return t[lo:hi].clone()

    local_program = bind_local(program, gm, shards, cut)
    annotate_costs(local_program)  # the new nodes and the experts' matmuls priced on this rank's shapes
    return local_program, result


def router_load(program: Program, ep: int, microbatches: list[list]) -> dict[str, torch.Tensor]:
    """Per MoE layer, ``[len(microbatches), E]``: the tokens each microbatch (flat user inputs) routes to
    each expert, read from the region's ``offs`` while the traced program runs on this one process (no
    communication; what ``fxpar plan`` shows for an ep plan before anything launches)."""
    watch = {r.offs: r.layer for r in expert_regions(program, ep)}
    out: dict[str, list] = {layer: [] for layer in watch.values()}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            v = super().run_node(n)
            if n in watch:
                out[watch[n]].append(torch.diff(v.long(), prepend=v.new_zeros(1).long()))
            return v

    with torch.no_grad():
        for flat in microbatches:
            Recorder(program.gm).run(*program.bind(flat))
    return {layer: torch.stack(rows) for layer, rows in out.items()}
