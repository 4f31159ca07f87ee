"""Expert parallelism for MoE layers whose experts run as a loop over the experts (``Plan(ep=N)``).

Reads: the traced program (the loop form :mod:`fxpar.frontend.expert_loops` captures: per expert, its tokens
found by a ``where`` on the router's one-hot, gathered with ``index``, run through the expert and added back
with ``index_add_`` into one accumulator), the ep degree, this rank's ep coordinate. Writes: the rewritten
graph of :func:`fxpar.passes.expert_parallel.expert_parallel` (which calls :func:`rewrite`) and the expert
parameters it cuts. Found from the graph, never from a model's name:

* a **loop region** is a chain of ``index_add`` into one accumulator (``T`` rows) with two or more links
  reading parameters; link ``i``'s own ops are the ancestors of its index and source that no other link
  and not the accumulator need (its ``where``, ``index``, the expert's ops and its weight views);
* a link's **expert** is the index its ops ``select`` its parameters at (through views: dbrx's
  ``w1.view(-1, ffn, H)[e]``); the ``E`` such links go to ep rank ``e * ep // E``, the links that read no
  parameter (longcat_flash's zero-compute experts) in blocks of their order;
* a parameter every path of which is ``[views ->] select(0, e)`` with ``E`` experts along dim 0 is **cut**:
  ep rank ``r`` holds rows ``[r, r + 1) * rows / ep`` (its experts), its selects re-indexed; one with more
  rows than experts (longcat_flash's ``gate_up_proj`` counts its zero-compute experts) stays whole on
  every rank (each rank's experts give the gradient of their rows, reduced with the dense parameters').

The rewrite, per region: the inputs the links read from outside with one row per token (the hidden
states, the routing weights, the top-k indices) are ``ep_gather``-ed over the ep group (``[ep * T, ...]``);
integer routing ops between those and the links (the one-hot, its permute) run again on the gathered
indices; each rank keeps only its links, accumulating into a fresh ``[ep * T, ...]`` zero buffer, which
``ep_scatter`` sums over the ranks keeping this rank's ``T`` rows. Autograd: the gather's backward is a
reduce-scatter, the scatter's an all-gather, so every token's gradient comes back to its rank and every
expert's gradient holds every rank's tokens. The asserts the trace made on the per-expert token counts
(``u0 <= T * k``) go: the gathered tokens change the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.op_classes import packet

__all__ = ["LoopRegion", "loop_chains", "loop_regions", "rewrite"]

_WHERE = "fxpar/passes/ep_loops.py"


def loop_chains(program) -> list[list[torch.fx.Node]]:
    """Each chain of ``index_add`` into one accumulator with two or more links, one of which reads a parameter
    (through any ops): an MoE layer run as a loop over its experts."""
    adds = (torch.ops.aten.index_add, torch.ops.aten.index_add_)
    is_add = {n for n in program.graph.nodes if packet(n) in adds}
    params = {b.placeholder for b in program.inputs if b.kind == "parameter"}
    out = []
    for head in [n for n in program.graph.nodes if n in is_add and n.args[0] not in is_add]:
        chain, node = [head], head
        while (nxt := next((u for u in node.users if u in is_add and u.args[0] is node), None)) is not None:
            chain.append(nxt)
            node = nxt
        if len(chain) > 1 and any(a.name in params for link in chain for a in _ancestors([link.args[3]])):
            out.append(chain)
    return out


def _ancestors(start, stop=frozenset()) -> set[torch.fx.Node]:
    """``start`` and every node they read, directly or not, without walking past ``stop``."""
    seen, todo = set(start), list(start)
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen and a not in stop:
                seen.add(a)
                todo.append(a)
    return seen


@dataclass
class LoopRegion:
    """One loop-form MoE layer: its links in order, their own ops and dead-end checks, per link its expert
    (None: it reads no parameter) and ep rank, the inputs gathered, the routing ops run again, the parameters
    cut (FQN -> experts along dim 0) and the selects and views to re-index."""

    layer: str
    links: list[torch.fx.Node]
    acc: torch.fx.Node
    own: list[set]
    sinks: list[set]
    expert: list[int | None]
    owner: list[int]
    gathered: list[torch.fx.Node]
    pulled: list[torch.fx.Node]
    cut: dict[str, int] = field(default_factory=dict)
    selects: list[tuple[torch.fx.Node, list[torch.fx.Node], str]] = field(default_factory=list)
    n_experts: int = 0


def _tensors(v) -> list:
    return [t for t in (v if isinstance(v, (tuple, list)) else [v]) if isinstance(t, torch.Tensor)]


def _integer(node) -> bool:
    vals = _tensors(node.meta.get(meta.VAL))
    return bool(vals) and all(not (t.is_floating_point() or t.is_complex()) for t in vals)


def _pullable(node) -> bool:
    """An integer op of integer inputs (an item of such a tuple): routing data run again on gathered inputs."""
    import operator

    if node.op != "call_function" or not _integer(node):
        return False
    if node.target is operator.getitem:
        return _pullable(node.args[0])
    return all(_integer(x) for x in node.all_input_nodes if x.op != "get_attr")


def _select_path(node, users_in) -> list | None:
    """``[views..., select]`` from a parameter placeholder's user ``node`` down to ``select(dim 0, e)``."""
    path = []
    views = (torch.ops.aten.view, torch.ops.aten.reshape, torch.ops.aten._unsafe_view)
    while packet(node) in views and len(node.users) == 1 and next(iter(node.users)) in users_in:
        path.append(node)
        node = next(iter(node.users))
    if packet(node) is torch.ops.aten.select and node.args[1] == 0 and isinstance(node.args[2], int):
        return path + [node]
    return None


def loop_regions(program, ep: int) -> list[LoopRegion]:
    """Every loop region of ``program``, checked for ``ep`` ranks (PlanError where it cannot be split)."""
    bound = {b.placeholder: b for b in program.inputs}
    live = _ancestors([n for n in program.graph.nodes if n.op == "output"])
    regions = []
    for links in loop_chains(program):
        layer = str(links[0].meta.get(meta.MODULE) or program.info.model_class or links[0].name)
        acc = links[0].args[0]
        rows = acc.meta[meta.VAL].shape[0]
        extra = [u.name for link in links[:-1] for u in link.users if u not in links] + \
            [u.name for u in acc.users if u is not links[0]]
        if extra:
            raise PlanError(f"Plan(ep={ep}): the expert loop of {layer} has its accumulator read before the last "
                            f"expert added to it ({extra[:3]}); expert parallelism needs one exit ({_WHERE})")
        stop = _ancestors([acc])
        anc = [_ancestors([link.args[2], link.args[3]], stop) for link in links]
        seen: dict = {}
        for a in anc:
            for n in a:
                seen[n] = seen.get(n, 0) + 1
        own = [{n for n in a if seen[n] == 1 and n not in stop and n.op != "placeholder"} for a in anc]
        sinks = []
        for i, (link, mine) in enumerate(zip(links, own)):
            leaks = [u.name for n in mine for u in n.users if u not in mine and u is not link and u in live]
            if leaks or link.args[2] not in mine or link.args[3] not in mine:
                raise PlanError(f"Plan(ep={ep}): the ops of expert block {i} of {layer} are also read by "
                                f"{leaks[:3] or 'other blocks'}; expert parallelism runs each block on one rank "
                                f"({_WHERE})")
            dead, todo = set(), list(mine)
            while todo:
                for u in todo.pop().users:
                    if u not in live and u not in dead and u not in mine:
                        dead.add(u)
                        todo.append(u)
            sinks.append(dead)
        regions.append(_classify(program, ep, layer, links, acc, rows, own, sinks, bound))
    return regions


def _classify(program, ep, layer, links, acc, rows, own, sinks, bound) -> LoopRegion:
    everything = set().union(*own)
    ext = {a: i for i, mine in enumerate(own) for n in mine for a in n.all_input_nodes if a not in mine}
    gathered, pulled, reads = [], [], {}
    todo = [a for a in ext if a.op != "placeholder"]
    while todo:
        a = todo.pop()
        if a in gathered or a in pulled or a.op == "get_attr":
            continue
        v = a.meta.get(meta.VAL)
        if _pullable(a):
            pulled.append(a)  # routing data (one-hot, permute): run again on the gathered indices
            todo += [x for x in a.all_input_nodes if x.op != "placeholder"]
            if len(pulled) > 64:
                raise PlanError(f"Plan(ep={ep}): the expert loop of {layer} reads more than 64 integer ops of "
                                f"routing ({_WHERE})")
        elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows:
            gathered.append(a)
        elif not (isinstance(v, torch.Tensor) and v.dim() == 0) and v is not None and _tensors(v):
            raise PlanError(f"Plan(ep={ep}): {a.name} {tuple(v.shape) if isinstance(v, torch.Tensor) else ''} enters "
                            f"the expert loop of {layer} without one row per token ({rows}); expert parallelism "
                            f"gathers only such inputs ({_WHERE})")
    for a in ext:
        if a.op != "placeholder":
            continue
        b = bound[a.name]
        if b.kind != "parameter":
            raise PlanError(f"Plan(ep={ep}): the expert loop of {layer} reads input {b.target!r} ({_WHERE})")
        paths = [(_select_path(u, everything), u) for u in a.users]
        reads[b.target] = (a, paths)
    link_of = {n: i for i, mine in enumerate(own) for n in mine}
    expert: list[int | None] = [None] * len(links)
    whole_read = {}
    for fqn, (ph, paths) in reads.items():
        for path, u in paths:
            if u not in link_of:
                continue
            i = link_of[u]
            if path is None:
                whole_read.setdefault(i, fqn)
                continue
            e = path[-1].args[2]
            if expert[i] not in (None, e):
                raise PlanError(f"Plan(ep={ep}): expert block {i} of {layer} selects experts {expert[i]} and {e} "
                                f"({_WHERE})")
            expert[i] = e
    if whole_read:
        i, fqn = next(iter(whole_read.items()))
        raise PlanError(f"Plan(ep={ep}): expert block {i} of {layer} reads parameter {fqn} whole; expert "
                        "parallelism splits experts that select their rows of stacked [E, ...] parameters "
                        f"({_WHERE})")
    ids = [e for e in expert if e is not None]
    n = len(ids)
    if sorted(ids) != list(range(n)):
        raise PlanError(f"Plan(ep={ep}): the expert blocks of {layer} select experts {sorted(ids)[:8]}, not each "
                        f"of 0..{n - 1} once ({_WHERE})")
    if n % ep:
        raise PlanError(f"Plan(ep={ep}): {layer} has {n} experts, which do not split over {ep} ranks; pick an ep "
                        f"dividing {n}")
    free = [i for i, e in enumerate(expert) if e is None]
    owner = [e * ep // n if e is not None else free.index(i) * ep // len(free) for i, e in enumerate(expert)]
    region = LoopRegion(layer, links, acc, own, sinks, expert, owner, gathered,
                        [x for x in program.graph.nodes if x in set(pulled)], n_experts=n)
    for fqn, (ph, paths) in reads.items():
        shape = tuple(program.params[fqn].shape)
        ok = all(p is not None and p[-1].args[0].meta[meta.VAL].shape[0] == n for p, _ in paths) \
            and shape[0] % n == 0
        if ok:
            region.cut[fqn] = shape[0]
            region.selects += [(p[-1], p[:-1], fqn) for p, _ in paths]
        elif len({owner[link_of[u]] for _, u in paths if u in link_of}) < ep:
            raise PlanError(f"Plan(ep={ep}): parameter {fqn} {shape} of {layer} is read by the experts of some ep "
                            f"ranks only and is not {n} experts along dim 0 ({_WHERE})")
    return region


def _is_assert(node) -> bool:
    return packet(node) in (torch.ops.aten._assert_scalar, torch.ops.aten.sym_constrain_range_for_size,
                            torch.ops.aten.sym_constrain_range)


def strip_asserts(gm: torch.fx.GraphModule, targets) -> None:
    """The submodules ``targets`` of ``gm`` (bodies of a kept link's higher-order ops: dbrx's no-grad
    ``where``) replaced by copies without the trace's asserts on data-dependent sizes (``u0 <= 16``), which
    the gathered tokens exceed; the traced program's own submodules stay as they were."""
    import copy

    for target in sorted(set(targets)):
        sub = getattr(gm, target, None)
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        sub = copy.deepcopy(sub)
        for node in reversed(list(sub.graph.nodes)):
            if _is_assert(node) or (not node.users and node.op == "call_function"
                                    and not isinstance(node.target, torch._ops.OpOverload)):
                sub.graph.erase_node(node)  # an assert, or the comparison it read (a plain Python operator)
        sub.recompile()
        setattr(gm, target, sub)


def rewrite(graph: torch.fx.Graph, region: LoopRegion, names: dict, ep: int, rank: int, group: str,
            insert) -> tuple[dict[str, int], list[str]]:
    """Rewrite ``region`` (found on the traced graph; ``names``: name -> node of ``graph``) for ep rank
    ``rank``; returns the parameters cut (FQN -> rows along dim 0) and the submodules of the kept links
    (:func:`strip_asserts` them once the graph module is made). ``insert(like, target, args)`` makes a
    node where the graph inserts now."""
    def m(node):
        return names[node.name]

    gather, scatter = torch.ops.fxpar.ep_gather.default, torch.ops.fxpar.ep_scatter.default
    mapping = {}
    for a in region.gathered:
        with graph.inserting_after(m(a)):
            mapping[m(a)] = insert(m(a), gather, (m(a), group, region.layer))
    for p in region.pulled:
        with graph.inserting_after(m(p)):
            mapping[m(p)] = graph.node_copy(m(p), lambda x: mapping.get(x, x))
    lo = rank * region.n_experts // ep
    for sel, views, _ in region.selects:
        if region.owner[next(i for i, own in enumerate(region.own) if sel in own)] != rank:
            continue
        s = m(sel)
        s.args = (s.args[0], 0, s.args[2] - lo)
        for v in views:
            v = m(v)
            if v.args[1][0] == region.n_experts:
                v.args = (v.args[0], [region.n_experts // ep, *v.args[1][1:]], *v.args[2:])
    acc = m(region.acc)
    rows = region.acc.meta[meta.VAL].shape
    with graph.inserting_after(acc):
        prev = insert(acc, torch.ops.aten.new_zeros.default, (acc, [ep * rows[0], *rows[1:]]))
    erase, bodies = [], []
    for i, link in enumerate(region.links):
        node = m(link)
        if region.owner[i] == rank:
            for n in region.own[i]:
                for old, new in mapping.items():
                    if old in m(n).all_input_nodes:
                        m(n).replace_input_with(old, new)
            node.args = (prev, *node.args[1:])
            prev = node
            erase += [m(x) for x in region.sinks[i]]
            bodies += [x.target for x in region.own[i] if x.op == "get_attr"]
        else:
            erase += [node] + [m(x) for x in region.own[i] | region.sinks[i]]
    tail = m(region.links[-1])
    with graph.inserting_after(tail):
        summed = out = insert(tail, scatter, (prev, group, region.layer))
    if packet(acc) not in (torch.ops.aten.zeros_like, torch.ops.aten.zeros, torch.ops.aten.new_zeros):
        with graph.inserting_after(summed):  # a non-zero start is added once, after the sum over the ranks
            out = insert(tail, torch.ops.aten.add.Tensor, (acc, summed))
    tail.replace_all_uses_with(out, delete_user_cb=lambda u: u is not summed)
    for node in graph.nodes:  # the trace's data-dependent sizes: the links kept here allocate them anew
        node.meta.pop("unbacked_bindings", None)
    order = {n: k for k, n in enumerate(graph.nodes)}
    for node in sorted(set(erase), key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    return dict(region.cut), bodies
