"""Fused projections found from the graph: which linear outputs are cut into pieces, where, and which
pieces every rank must hold whole.

Reads: ``fxpar.param``, ``val`` and the constants of the traced graph. Writes nothing.

A linear-like node whose output is only ever cut into pieces (after views, transposes and one-input
elementwise ops) is a fused projection: ``[all q | all k | all v]``, ``[gate | up]``, or a view to
``[.., H + 2, D]`` sliced and indexed by head (Falcon's multi-query attention). Sharding it cuts each
piece apart, so each rank's pieces are its local q, k, v. A cut inside the heads (bloom's ``[.., H, 3,
D]`` with ``select``, codegen's ``mp_num`` blocks split inside each block) needs no pieces: a plain
shard of the heads dim already gives each rank its heads' q, k and v.

A piece is held *whole* by every rank when its size in *units* does not divide over the ranks. A
piece's unit is read from its uses: a reshape that splits its dim into ``[n, d]`` makes ``d`` the
unit (n heads), an op that needs the dim uncut (attention or a batched matmul over it, a slice, cat,
reduction or norm over it) makes the whole piece one unit, elementwise ops and linears need none. A
piece of unit 1 (``[gate | up]`` of an MLP width of 130 at tp=4) is cut into ``torch.chunk``'s shares
where tp does not divide it (33, 33, 33, 31 of each piece); only one too small to give every rank a
part is whole.
Multi-query attention's one K/V head is then whole and its Q heads cut; so are grouped-query K/V
with fewer heads than ranks. Ops of other families say what they need in :data:`PIECE_UNITS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.op_classes import (
    ASSERTS,
    ATTENTION_PRODUCTS,
    DIM_MOVES,
    PASS_THROUGH,
    REDUCTIONS,
    RESHAPES,
    SOFTMAX,
    SPLIT_ARGS,
    SPLITS,
    is_pointwise,
    packet,
)
from fxpar.ir.placement import chunk_fits, chunk_sizes
from fxpar.ir.program import Program
from fxpar.passes.tensor_parallel.dim_moves import moved

aten = torch.ops.aten

# op packet -> fn(user, dim of the piece in the user's input) -> the unit it needs, in indices of that dim
# (the dim's size: it must stay uncut), or None to keep following the value
PIECE_UNITS: dict[object, Callable[[torch.fx.Node, int], int | None]] = {}



def split_args(node: torch.fx.Node) -> dict:
    """A split-like node's arguments by name."""
    return dict(zip(SPLIT_ARGS[node.target.overloadpacket], node.args)) | dict(node.kwargs)


def slice_bounds(given: dict, size: int) -> tuple[int, int]:
    """``[start, end)`` of a slice's arguments over a dim of ``size``, clamped as ``aten.slice`` does."""
    start = given.get("start") or 0
    end = given.get("end")
    end = size if end is None or end > size else end
    start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
    return max(0, min(start, size)), max(0, min(end, size))


@dataclass(frozen=True)
class Fused:
    """A fused value along ``dim``: its ``pieces`` (sizes in that dim's indices), ``whole`` the indices of
    the pieces every rank holds whole."""

    dim: int
    pieces: tuple[int, ...]
    whole: tuple[int, ...] = ()

    def local(self, tp: int, rank: int = 0) -> list[int]:
        """Each piece's size on ``rank`` (``torch.chunk``'s share where tp does not divide a piece)."""
        return [p if i in self.whole else chunk_sizes(p, tp)[rank] for i, p in enumerate(self.pieces)]

    def local_pos(self, pos: int, tp: int, rank: int = 0) -> int:
        """A position along ``dim`` (a piece boundary) on ``rank``."""
        out, start = 0, 0
        for i, p in enumerate(self.pieces):
            if pos <= start:
                break
            take = min(pos - start, p)
            out += take if i in self.whole else chunk_sizes(p, tp)[rank] if take == p else take // tp
            start += p
        return out

    def span(self, lo: int, hi: int) -> list[int]:
        """The pieces ``[lo, hi)`` covers."""
        edges = [sum(self.pieces[:i]) for i in range(len(self.pieces) + 1)]
        return [i for i in range(len(self.pieces)) if edges[i] < hi and edges[i + 1] > lo]

    def is_whole(self, lo: int, hi: int) -> bool:
        return all(i in self.whole for i in self.span(lo, hi))


@dataclass
class Packing:
    """Every fused projection of a graph: ``cuts`` (cut node -> its input's layout), ``values`` (old nodes
    from a linear to its cuts -> their layout), ``params`` (FQN -> piece sizes along the weight's output
    features), ``whole`` (FQN -> the whole pieces); ``spans``: the ``[lo, hi)`` each output of a cut takes
along its input's fused dim."""

    cuts: dict[torch.fx.Node, Fused] = field(default_factory=dict)
    spans: dict[torch.fx.Node, list[tuple[int, int]]] = field(default_factory=dict)  # cut -> [lo, hi) taken
    values: dict[torch.fx.Node, Fused] = field(default_factory=dict)
    params: dict[str, list[int]] = field(default_factory=dict)
    whole: dict[str, tuple[int, ...]] = field(default_factory=dict)


def find_packing(program: Program, tp: int, linear_weight: Callable) -> Packing:
    """The fused projections of ``program`` at ``tp`` ranks (``linear_weight``: a node's (weight, bias))."""
    consts = {b.placeholder: program.constants.get(b.target) for b in program.inputs if b.kind == "constant"}
    out = Packing()
    for node in program.graph.nodes:
        w, b = linear_weight(node)
        v = node.meta.get(meta.VAL)
        if w is None or not isinstance(v, torch.Tensor) or v.dim() == 0:
            continue
        walk = _Walk(node, consts, lambda n: linear_weight(n)[0] is not None)
        if not walk.ok or len(walk.pieces) < 2:
            continue
        whole = walk.whole_pieces(tp)
        if whole is None:
            continue
        for n, (d, scale) in walk.path.items():
            out.values[n] = Fused(d, tuple(p // scale for p in walk.pieces), whole)
        for cut, (d, scale) in walk.cuts.items():
            out.cuts[cut] = Fused(d, tuple(p // scale for p in walk.pieces), whole)
            out.spans[cut] = walk.spans[cut]
        for p in (w, b):
            if p is not None:
                out.params[p.meta[meta.PARAM]] = list(walk.pieces)
                if whole:
                    out.whole[p.meta[meta.PARAM]] = whole
    return out


def _val(node) -> torch.Tensor | None:
    v = node.meta.get(meta.VAL) if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _reshaped(user: torch.fx.Node, d: int, scale: int) -> tuple[int, int] | None:
    """Where reshape ``user`` puts dim ``d`` of its input (``scale`` features per index): (dim, its scale),
    when that dim starts where d does (:mod:`.dim_moves`) and its indices are whole features groups; else None."""
    od = moved(user, d)
    if od is None:
        return None
    total, s = _val(user.args[0]).shape[d] * scale, _val(user).shape[od]
    return (od, total // s) if total % s == 0 else None


class _Walk:
    """The cuts of one linear node's output: ``pieces`` (features), ``cuts`` and ``path`` (node -> (dim,
    features per index)), ``outs`` (each cut output: (node, dim, scale, [lo, hi) in features))."""

    def __init__(self, node: torch.fx.Node, consts: dict, linear_like: Callable = lambda n: False):
        self.consts, self.linear_like = consts, linear_like
        n = _val(node).shape[-1]
        self.path: dict[torch.fx.Node, tuple[int, int]] = {node: (_val(node).dim() - 1, 1)}
        self.cuts: dict[torch.fx.Node, tuple[int, int]] = {}
        self.spans: dict[torch.fx.Node, list[tuple[int, int]]] = {}
        self.outs: list[tuple[torch.fx.Node | None, int, int, int, int]] = []
        bounds, self.ok = {0, n}, True
        todo = [(u, node) for u in node.users]
        while todo and self.ok:
            user, src = todo.pop()
            d, scale = self.path[src]
            nxt = self._step(user, src, d, scale, bounds)
            if nxt is not None:
                self.path[user] = nxt
                todo.extend((u, user) for u in user.users)
        edges = sorted(bounds)
        self.pieces = [hi - lo for lo, hi in zip(edges, edges[1:])]
        self.ok = self.ok and bool(self.cuts)

    def _step(self, user, src, d, scale, bounds) -> tuple[int, int] | None:
        """Follow ``src`` (pieces along ``d``) into ``user``: its (dim, scale), None at a cut or an assert."""
        pkt, uv, sv = packet(user), _val(user), _val(src)
        if pkt in ASSERTS:
            return None
        if uv is None and not (pkt in SPLITS or pkt is aten.unbind):
            self.ok = False
        elif pkt in PASS_THROUGH - {aten.dropout} or (user.op == "call_function" and is_pointwise(user)
                                                      and len(user.all_input_nodes) == 1):
            return d, scale
        elif pkt in DIM_MOVES and user.args[0] is src:
            return moved(user, d), scale
        elif pkt in RESHAPES:
            got = _reshaped(user, d, scale)
            if got is None:
                self.ok = False
            return got
        else:
            span = self._cut(user, d, sv.shape[d])
            if span is None:
                self.ok = False
                return None
            self.cuts[user] = (d, scale)
            self.spans[user] = [(lo, hi) for _, lo, hi, _ in span]
            for node, lo, hi, dim_out in span:
                bounds |= {lo * scale, hi * scale}
                self.outs.append((node, dim_out, scale, lo * scale, hi * scale))
        return None

    def _cut(self, user, d, size) -> list[tuple[torch.fx.Node | None, int, int, int]] | None:
        """The pieces a cut op takes along ``d`` (of ``size``): (output node, lo, hi, its dim there)."""
        pkt = packet(user)
        if pkt in SPLITS or pkt is aten.slice:
            given = split_args(user)
            if given.get("dim", 0) % _val(user.args[0]).dim() != d or given.get("step", 1) != 1:
                return None
            if pkt is aten.slice:
                return [(user, *slice_bounds(given, size), d)]
            sizes = (given["split_sizes"] if pkt is aten.split_with_sizes else
                     [given["split_size"]] * -(-size // given["split_size"]) if pkt is aten.split else
                     [size // given["chunks"]] * given["chunks"] if size % given["chunks"] == 0 else None)
            if sizes is None:
                return None
            items = {u.args[1]: u for u in user.users if u.target.__name__ == "getitem"}
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            return [(items.get(i), lo, min(lo + s, size), d) for i, (lo, s) in enumerate(zip(starts, sizes))]
        if pkt is aten.select and user.args[1] % _val(user.args[0]).dim() == d:
            i = user.args[2] % size
            return [(user, i, i + 1, None)]
        if pkt is aten.index:
            idx = list(user.args[1])
            at = [k for k, t in enumerate(idx) if t is not None]
            src = idx[d] if at == [d] else None
            while isinstance(src, torch.fx.Node) and packet(src) in PASS_THROUGH:
                src = src.args[0]
            t = self.consts.get(src.name) if isinstance(src, torch.fx.Node) else None
            if isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() and t.dtype in (torch.int64, torch.int32):
                vals = [int(x) % size for x in t.tolist()]
                if vals == list(range(vals[0], vals[0] + len(vals))):
                    return [(user, vals[0], vals[-1] + 1, d)]
        return None

    def whole_pieces(self, tp: int) -> tuple[int, ...] | None:
        """The pieces every rank holds whole at ``tp`` ranks; None when no piece can be cut."""
        edges = [sum(self.pieces[:i]) for i in range(len(self.pieces) + 1)]
        units = [1] * len(self.pieces)
        for _, _, scale, lo, hi in self.outs:  # each cut's index must stay whole
            for i in range(len(self.pieces)):
                if edges[i] < hi and edges[i + 1] > lo:
                    units[i] = math.lcm(units[i], scale)
        for node, dim, scale, lo, hi in self.outs:
            known = node is not None and dim is not None  # a select's piece: one index, no dim left
            u = scale * (_unit(node, dim, _val(node).shape[dim], set(), self.linear_like) if known else 1)
            for i in range(len(self.pieces)):
                if edges[i] < hi and edges[i + 1] > lo:
                    units[i] = math.lcm(units[i], u)
        whole = {i for i, p in enumerate(self.pieces)  # unit 1: cut unevenly where tp does not divide
                 if (not chunk_fits(p, tp) if units[i] == 1 else p % units[i] or (p // units[i]) % tp)}
        changed = True
        while changed:  # a cut output holds whole pieces only or cut pieces only
            changed = False
            for _, _, _, lo, hi in self.outs:
                span = {i for i in range(len(self.pieces)) if edges[i] < hi and edges[i + 1] > lo}
                if span & whole and span - whole:
                    whole |= span
                    changed = True
        if len(whole) == len(self.pieces):
            return None
        return tuple(sorted(whole))


def _unit(node: torch.fx.Node, d: int, n: int, seen: set, linear_like: Callable) -> int:
    """The unit (in indices of dim ``d``, of size ``n``) ``node``'s uses need along ``d``."""
    if (node, d) in seen:
        return 1
    seen.add((node, d))
    unit, nd = 1, _val(node).dim()
    for user in node.users:
        pkt, uv = packet(user), _val(user)
        got = PIECE_UNITS[pkt](user, d) if pkt in PIECE_UNITS else None
        if got is not None:
            unit = math.lcm(unit, got)
        elif pkt in ASSERTS or (uv is None and pkt not in SPLITS) or linear_like(user):
            continue
        elif pkt in ATTENTION_PRODUCTS:
            unit = math.lcm(unit, n if d >= nd - 2 else 1)
        elif pkt in PASS_THROUGH or (user.op == "call_function" and is_pointwise(user)):
            unit = math.lcm(unit, _unit(user, d + uv.dim() - nd, n, seen, linear_like))
        elif pkt in DIM_MOVES and user.args[0] is node:
            unit = math.lcm(unit, _unit(user, moved(user, d), n, seen, linear_like))
        elif pkt in RESHAPES:
            got = _reshaped(user, d, 1)
            if got is not None and uv.shape[got[0]] == n:
                unit = math.lcm(unit, _unit(user, got[0], n, seen, linear_like))
            elif got is not None and uv.shape[got[0]] < n:
                unit = math.lcm(unit, n // uv.shape[got[0]])  # split into [heads, d]: d per head
        elif _over(user, d, nd):
            unit = math.lcm(unit, n)
        elif pkt in (aten.slice, aten.cat):  # along another dim: the pieces go on
            unit = math.lcm(unit, _unit(user, d, n, seen, linear_like))
        elif pkt in SPLITS:
            for item in user.users:
                unit = math.lcm(unit, _unit(item, d, n, seen, linear_like))
    return unit


def _over(user: torch.fx.Node, d: int, nd: int) -> bool:
    """Whether ``user`` cuts, joins, reduces or normalises over dim ``d`` (so it must stay uncut)."""
    pkt = packet(user)
    if pkt in SPLITS or pkt in (aten.slice, aten.select, aten.narrow):
        dim = user.args[1] if pkt in (aten.select, aten.narrow) else split_args(user).get("dim", 0)
        return dim % nd == d
    if pkt is aten.cat:
        return (user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)) % _val(user).dim() == d
    if pkt in REDUCTIONS or pkt in SOFTMAX:
        dims = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
        dims = range(nd) if dims is None else [dims] if isinstance(dims, int) else dims
        return d in [x % nd for x in dims]
    if pkt in (aten.layer_norm, aten.rms_norm, aten.group_norm):
        return pkt is aten.group_norm or d >= nd - len(user.args[1])
    return False


