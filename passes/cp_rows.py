"""Context parallelism's token-local rules that read row numbers (:mod:`fxpar.passes.cp_tokens` says what the
states mean and dispatches to these): picking rows by a sort's indices and putting them back, the experts'
per-expert counts and offsets, grouped matmuls and expert parallelism's dispatch and combine."""

from __future__ import annotations

import operator

import torch
import torch.fx

from fxpar.ir.expert_ops import ep_kind
from fxpar.ir.op_classes import PASS_THROUGH, SAME_ORDER_RESHAPES, writes_first
from fxpar.passes.cp_rules import (
    Aux,
    Canon,
    Disp,
    Perm,
    Pos,
    Tk,
    arg,
    data,
    is_local,
    packet,
    row_lay,
    shape_of,
    tensor_args,
)

aten = torch.ops.aten


def index(rw, node, op, src):
    """``x[..., p]`` with row numbers ``p`` of the layout ``x`` holds at that dim (a whole ``x`` cut to this
    rank's rows first): the picked rows, in ``p``'s order. A whole ``x`` read at ids in this rank's own order
    gives rows in that order."""
    x, idx = node.args[:2]
    picks = [(i, t) for i, t in enumerate(idx) if t is not None]
    if len(picks) != 1 or picks[0][0] != len(idx) - 1:
        return False
    d, p = picks[0]
    ps, sx = rw.state.get(p), rw.state.get(x)
    if isinstance(ps, Tk) and sx is None:  # a whole table read at each row's own ids (an expert's bias)
        rw.state[node] = data(d + ps.dim, ps.lay, src)
        return None
    if not isinstance(ps, Pos) or len(shape_of(p)) != 1:
        return False
    if sx is None:
        if not spans(rw, x, d, ps.to):
            return False
        with rw.g.inserting_before(node):
            node.update_arg(0, cut_rows(rw, x, d, ps.to))
    elif row_lay(sx) != (d, ps.to):
        return False
    rw.state[node] = data(d, ps.rows, src)
    return None


def spans(rw, x, d: int, lay) -> bool:
    """Whole ``x`` holds every row of canonical layout ``lay`` along dim ``d``."""
    return isinstance(lay, Canon) and shape_of(x)[d] == lay.outer * rw.l.seq * lay.inner


def cut_rows(rw, x: torch.fx.Node, d: int, lay: Canon) -> torch.fx.Node:
    """This rank's rows of whole ``x`` along ``d`` in layout ``lay`` (``inner`` rows per token), no
    communication; once per value, dim and layout."""
    if lay.inner == 1:
        return rw.cut(x, d, lay.outer)
    key = ("rows", x, d, lay)
    if key not in rw.cuts:
        shape, (o, i) = list(shape_of(x)), (lay.outer, lay.inner)
        src = rw.call(aten.view.default, x, shape[:d] + [o, rw.l.seq, i] + shape[d + 1:])
        parts = [rw.call(aten.slice.Tensor, src, d + 1, a, b) for a, b in rw.l.ranges()]
        out = rw.call(aten.cat.default, parts, d + 1)
        rw.cuts[key] = rw.call(aten.view.default, out, shape[:d] + [o * 2 * rw.l.chunk * i] + shape[d + 1:])
        rw.res.cut.append(x.name)
    return rw.cuts[key]


def index_put(rw, node, op, src):
    """``buf[p] = v``. With ``p`` a permutation and ``buf`` of its rows (read by nothing else), every row is
    written: ``v`` data rows in ``p``'s order give data rows in the order ``p`` numbers; ``v = arange(n)`` gives
    the inverse permutation (its ``n`` becomes this rank's count). With ``accumulate``, ``buf`` must hold the
    rows ``p`` numbers."""
    buf, idx, v = node.args[:3]
    acc = arg(node, 3, "accumulate", False)
    p = idx[0] if len(idx) == 1 else None
    ps, sb, sv = rw.state.get(p), rw.state.get(buf), rw.state.get(v)
    if not isinstance(ps, Pos) or len(shape_of(p)) != 1:
        return False
    if acc:
        if row_lay(sb) != (0, ps.to) or row_lay(sv) != (0, ps.rows):
            return False
        rw.state[node] = sb
        return None
    n = shape_of(p)[0]
    if not ps.perm or shape_of(buf)[:1] != (n,) or not is_local(sb) or len(buf.users) != 1:
        return False
    if row_lay(sv) == (0, ps.rows):
        rw.state[node] = data(0, ps.to, src)
    elif sv is None and is_arange(v, n) and len(v.users) == 1:
        with rw.g.inserting_before(node):
            node.update_arg(2, rw.call(aten.arange.default, n // rw.l.cp, **v.kwargs))
        rw.state[node] = Pos(ps.to, ps.rows, True, src)
    else:
        return False
    return None


def is_arange(v, n: int) -> bool:
    if not isinstance(v, torch.fx.Node) or v.op != "call_function":
        return False
    if v.target == aten.arange.default:
        return v.args == (n,)
    return v.target == aten.arange.start and v.args == (0, n)


def index_add(rw, node, op, src):
    """``out.index_add(dim, p, v)``: ``v``'s rows added to the rows of ``out`` that ``p`` numbers (a whole
    ``out`` of this rank's layout cut first where not written in place)."""
    out, dim, p, v = node.args[:4]
    ps, so = rw.state.get(p), rw.state.get(out)
    dim %= len(shape_of(out))
    if not isinstance(ps, Pos) or row_lay(rw.state.get(v)) != (dim, ps.rows):
        return False
    if so is None and not writes_first(node) and isinstance(ps.to, Canon) and ps.to.inner == 1 and \
            shape_of(out)[dim] == ps.to.outer * rw.l.seq:
        with rw.g.inserting_before(node):
            node.update_arg(0, rw.cut(out, dim, ps.to.outer))
    elif row_lay(so) != (dim, ps.to):
        return False
    rw.state[node] = data(dim, ps.to, src)
    return None


# ---- expert offsets, grouped matmuls, ep ------------------------------------------------------------------
def histc(rw, node, op, src):
    """The per-expert counts of the ascending sorted ids (top-k or argmax indices over ``n`` experts) in bins
    covering ``0 .. n - 1``: each sorted row then falls in its own expert's group of the grouped matmuls,
    whatever the other rows are."""
    x = node.args[0]
    s = rw.state.get(x)
    bins, lo, hi = (arg(node, i, k, dv) for i, k, dv in ((1, "bins", 100), (2, "min", 0), (3, "max", 0)))
    if not isinstance(s, Tk) or not isinstance(s.lay, Perm) or len(shape_of(x)) != 1:
        return False
    key = s.lay.key
    while packet(x) in PASS_THROUGH:
        x = x.args[0]
    if x.target is not operator.getitem or x.args != (key, 0) or \
            key.target not in (aten.sort.default, aten.sort.stable) or arg(key, 2, "descending", False):
        return False
    n = experts(key.args[0])
    whole = bins == 1 and lo == hi == 0  # one bin over the data's own range: every row in it
    if not whole and (n is None or not (hi > lo and lo <= 0 and hi >= n - 1 and bins >= 1)):
        return False
    rw.state[node] = Aux(s.lay, "counts", src)
    return None


def experts(ids) -> int | None:
    """Bound on the ids (they lie in ``0 .. n - 1``): the size of the dim a topk, max, min or argmax picked
    them along, through views, casts and concatenations; None where not known."""
    while packet(ids) in SAME_ORDER_RESHAPES or packet(ids) in PASS_THROUGH:
        ids = ids.args[0]
    if packet(ids) in (aten.cat, aten.concat):
        ns = [experts(x) for x in ids.args[0]]
        return None if None in ns else max(ns)
    at = None
    if ids.target is operator.getitem and ids.args[1] == 1:
        ids = ids.args[0]
        at = {aten.topk: (2, -1), aten.max: (1, None), aten.min: (1, None), aten.sort: (1, -1)}.get(packet(ids))
    elif packet(ids) in (aten.argmax, aten.argmin, aten.argsort):
        at = (1, -1 if packet(ids) is aten.argsort else None)
    dim = None if at is None else ids.kwargs.get("dim", arg(ids, at[0], "dim", at[1]))
    return None if dim is None else shape_of(ids.args[0])[dim]


def aux(rw, node, op, src):
    """Counts and offsets: casts, the offsets' cumsum, ep's slices and sums of its counts."""
    s = rw.state.get(node.args[0])
    others = [a for a in tensor_args(node) if a is not node.args[0]]
    if not isinstance(s, Aux) or others:
        return False
    if op in PASS_THROUGH:
        rw.state[node] = s
    elif op is aten.cumsum and s.kind == "counts":
        rw.state[node] = Aux(s.lay, "offsets", src)
    elif op is aten.cumsum and s.kind == "ep":
        rw.state[node] = Aux(Disp(s.lay.key), "offsets", src)  # the offsets of this rank's experts' rows
    elif op in (aten.slice, aten.sum) and s.kind == "ep":
        rw.state[node] = s
    else:
        return False
    return None


def gmm(rw, node, op, src):
    """A grouped matmul of rows in one layout by whole weights, its offsets that layout's."""
    x, w = node.args[:2]
    offs = arg(node, 2, "offs", None)
    so, rl = rw.state.get(offs), row_lay(rw.state.get(x))
    rest = [a for a in tensor_args(node) if a not in (x, offs)]
    if rl is None or rl[0] != 0 or len(shape_of(x)) != 2 or any(rw.state.get(a) is not None for a in rest) or \
            not (isinstance(so, Aux) and so.kind == "offsets" and so.lay == rl[1]):
        return False
    rw.state[node] = data(0, rl[1], src)
    return None


def ep_rule(rw, node, op, src):
    """ep's counts of sorted rows' offsets, their dispatch to this rank's experts and the combine back."""
    kind, a, b = ep_kind(node), rw.state.get(node.args[0]), rw.state.get(node.args[1])
    if kind == "ep_counts" and isinstance(a, Aux) and a.kind == "offsets" and isinstance(a.lay, Perm):
        rw.state[node] = Aux(a.lay, "ep", src)
    elif kind in ("ep_dispatch", "ep_combine") and isinstance(b, Aux) and b.kind == "ep" and \
            row_lay(a) == (0, b.lay if kind == "ep_dispatch" else Disp(b.lay.key)):
        rw.state[node] = data(0, Disp(b.lay.key) if kind == "ep_dispatch" else b.lay, src)
    else:
        return False
    return None


LOCAL_RULES = {aten.index: index, aten.index_put: index_put, aten.index_put_: index_put,
               aten.index_add: index_add, aten.index_add_: index_add, aten.histc: histc}
