"""Context parallelism's token-local rules: a MoE layer's router and experts run on this rank's tokens, with no
communication (:mod:`fxpar.passes.cp_ops` holds the other rules, :mod:`fxpar.passes.cp_rules` the layout).

A token-local MoE computes each token's output from that token's row alone, though its ops read across rows:
transformers 5's experts take ``topk`` over the experts, flatten the (token, k) pairs, ``sort`` them by
expert, pick the token rows in that order (``x[order // k]``), run grouped matmuls whose offsets are the
``cumsum`` of a ``histc`` of the sorted expert ids, and put the rows back by the sort's inverse
(``inv[order] = arange(n)``, ``y[inv]``). Run on this rank's rows, every step gives this rank's rows of what
one process computes for them, in an order only this rank knows. The states that say so (besides None,
:class:`~fxpar.passes.cp_rules.Sh` and PARTIAL) name the rows a dim holds by a row layout:

* :class:`Canon` ``(outer, inner)``: this rank's rows in the pass's chunk order, ``inner`` consecutive rows per
  token (a ``[batch * seq * k]`` flattening of top-k pairs: outer ``batch``, inner ``k``); ``Canon(o, 1)`` at
  a dim is ``Sh(dim, o)``. Row numbers of it count this rank's rows (``0 .. outer * inner * seq / cp``), the
  numbers this rank's own ``sort`` returns.
* :class:`Perm` ``(key, base)``: the rows of ``base`` in the order the ``sort`` ``key`` read from this rank's data.
* :class:`Disp` ``(key)``: the rows ep's dispatch of ``Perm(key)`` rows brought to this rank's experts.

A layout holds ``1 / cp`` of its whole rows. Value states: :class:`Tk` (data, rows along ``dim``),
:class:`Pos` (1-D row numbers: row i in layout ``rows``, its entry a row of layout ``to``) and :class:`Aux`
(per-expert counts or offsets of this rank's rows of a layout).

**Correctness first.** Such a value cannot be gathered (its rows are in an order only this rank knows), so
only the rules here read it. Any other reader (an op with no rule here, an output) adds the ops the value came
from (``src``: the sort, the flattening view) to ``Rewriter.broken``; the pass then runs again with them
refused, so they fall back as before (their inputs gathered, the MoE run on the whole sequence).
"""

from __future__ import annotations

import math

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.expert_ops import ep_kind
from fxpar.ir.op_classes import (
    ALONG_ONE_DIM,
    DIM_REDUCTIONS,
    ELEMENTWISE_LIKE,
    LAST_DIM_NORMS,
    PASS_THROUGH,
    SAME_ORDER_RESHAPES,
    SHAPE_ARG_OPS,
    SHAPED_LIKE,
    SPLITS,
    TAKES_AND_PUTS,
    is_grouped_mm,
    is_pointwise,
    writes_first,
)
from fxpar.passes.cp_ops import reduced
from fxpar.passes.cp_rows import LOCAL_RULES, aux, cut_rows, ep_rule, gmm, spans
from fxpar.passes.cp_rules import (
    Aux,
    Canon,
    Perm,
    Pos,
    Sh,
    Tk,
    arg,
    data,
    is_local,
    row_lay,
    seq_dim_after,
    shape_of,
    srcs,
    tensor_args,
)

aten = torch.ops.aten


# ---- dispatch -------------------------------------------------------------------------------------------
def rule(rw, node: torch.fx.Node, op) -> bool:
    """Apply the token-local rule of ``node``; False where none applies and no input is token-local (the other
    rules take it). A token-local input no rule here reads marks its sources broken."""
    if rw.refused is None:
        return False  # token-local rules off: a run with them raised a PlanError
    ins = {a: rw.state.get(a) for a in tensor_args(node)}
    src = frozenset().union(*(srcs(s) for s in ins.values()))
    if not any(is_local(s) for s in ins.values()):
        if node in rw.refused or not any(isinstance(s, Sh) for s in ins.values()) or not static(node):
            return False
        return entry(rw, node, op, src) is not False
    f = LOCAL_RULES.get(op) or (ep_rule if ep_kind(node) else gmm if is_grouped_mm(node) else None)
    if f is None:
        f = generic
    if not static(node) or f(rw, node, op, src) is False:
        rw.fallback(node)  # gathers what it can; a token-local input is recorded in rw.broken
    return True


def static(node: torch.fx.Node) -> bool:
    """Every tensor ``node`` reads and makes has a shape known at trace time (not one read from the data)."""
    vals = [a.meta.get(meta.VAL) for a in tensor_args(node)]
    out = node.meta.get(meta.VAL)
    vals += list(out) if isinstance(out, (tuple, list)) else [out]
    return all(isinstance(d, int) for v in vals if isinstance(v, torch.Tensor) for d in v.shape)


def entry(rw, node, op, src):
    """Ops that start token-local values from a sharded one: along another dim than the sequence's (topk,
    sort, one_hot: the state passes), a 1-D sort along the sequence, a view that flattens the sequence into
    a dim with several rows per token."""
    if op in ALONG_ONE_DIM:
        return along(rw, node, op, src | {node})
    if op in TAKES_AND_PUTS:
        return take_put(rw, node, op, src)
    s = rw.state.get(node.args[0])
    if op in SAME_ORDER_RESHAPES and isinstance(s, Sh) and \
            seq_dim_after(shape_of(node.args[0]), s.dim, s.outer, shape_of(node), rw.l.seq) is None:
        return view(rw, node, op, src | {node})
    return False


def generic(rw, node, op, src):
    ins = {a: rw.state.get(a) for a in tensor_args(node)}
    if any(isinstance(s, Aux) for s in ins.values()):
        return aux(rw, node, op, src)
    if op in PASS_THROUGH and len(ins) == 1:
        s = ins[node.args[0]]
        val = node.meta.get(meta.VAL)
        if isinstance(s, Pos) and isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
            return False  # a row number read as data differs from one process's
        rw.state[node] = s
        return None
    if any(isinstance(s, Pos) for s in ins.values()):
        return pos_arith(rw, node, op, src)
    if op in ALONG_ONE_DIM:
        return along(rw, node, op, src)
    if op in TAKES_AND_PUTS:
        return take_put(rw, node, op, src)
    if op in SAME_ORDER_RESHAPES or op in (aten.expand, aten.transpose, aten.t, aten.permute, aten.slice,
                                           aten.select):
        return view(rw, node, op, src)
    if op is aten.linear:
        return linear(rw, node, op, src)
    if op in SPLITS or op is aten.unbind:
        return split(rw, node, op, src)
    if op in LAST_DIM_NORMS or op in DIM_REDUCTIONS:
        return reduction(rw, node, op, src)
    if op in ELEMENTWISE_LIKE or is_pointwise(node):
        return pointwise(rw, node, op, src)
    return False


# ---- rows along another dim, sorts, views ------------------------------------------------------------------
def along(rw, node, op, src):
    """topk / sort / argsort / max / min along a dim other than the rows' (each token's own values: the state
    passes), one_hot (a new last dim); a 1-D sort or argsort along the rows: this rank's rows in the order of
    its values, the indices this rank's row numbers."""
    x = node.args[0]
    rl = row_lay(rw.state.get(x))
    if rl is None or len(tensor_args(node)) != 1:
        return False
    d, lay = rl
    nd = len(shape_of(x))
    val = node.meta.get(meta.VAL)
    n_out = len(val) if isinstance(val, (tuple, list)) else 0
    if op is aten.one_hot:
        if arg(node, 1, "num_classes", -1) <= 0:
            return False  # the class count read from the data: the whole sequence's max
        rw.state[node] = data(d, lay, src)
        return None
    if op in (aten.max, aten.min) and not n_out:
        return False  # max over every element
    at = {aten.topk: (2, -1), aten.max: (1, None), aten.min: (1, None)}.get(op, (1, -1))
    dim = node.kwargs["dim"] if "dim" in node.kwargs else arg(node, at[0], "dim", at[1])
    dim %= nd
    if dim != d:
        keep = op is not aten.max and op is not aten.min or arg(node, 2, "keepdim", False)
        out = data(d if keep else d - (dim < d), lay, src)
        rw.state[node] = tuple(out for _ in range(n_out)) if n_out else out
        return None
    if op not in (aten.sort, aten.argsort) or nd != 1 or not isinstance(lay, Canon):
        return False
    order = Perm(node, lay)
    idx = Pos(order, lay, True, src | {node})
    rw.state[node] = (Tk(0, order, src | {node}), idx) if op is aten.sort else idx
    return None


def take_put(rw, node, op, src):
    """gather / scatter along a dim other than the rows', the index (and any source) rows the value's: each
    token's own entries (the expert scores of its top-k, a mask of its chosen groups)."""
    x, dim, index = node.args[:3]
    rl, nd = row_lay(rw.state.get(x)), len(shape_of(x))
    ri = row_lay(rw.state.get(index))
    if rl is None or dim % nd == rl[0] or ri != rl or len(shape_of(index)) != nd or \
            shape_of(index)[rl[0]] != shape_of(x)[rl[0]]:
        return False
    v = node.args[3] if len(node.args) > 3 else node.kwargs.get("src", node.kwargs.get("value"))
    if isinstance(v, torch.fx.Node) and (row_lay(rw.state.get(v)) != rl or shape_of(v) != shape_of(index)):
        return False
    rw.state[node] = data(*rl, src)
    return None


def canon_after(src: tuple, d: int, lay: Canon, dst: tuple, seq: int):
    """Where canonical rows along dim ``d`` of ``src`` land in reshape ``dst``: (dim, Canon), else None."""
    before, per = math.prod(src[:d]) * lay.outer, lay.inner * math.prod(src[d + 1:])
    for j, size in enumerate(dst):
        p, a = math.prod(dst[:j]), math.prod(dst[j + 1:])
        if before % p == 0 and per % a == 0 and size == (before // p) * seq * (per // a):
            return j, Canon(before // p, per // a)
    return None


def view(rw, node, op, src):
    x = node.args[0]
    rl = row_lay(rw.state.get(x))
    if rl is None:
        return False
    d, lay = rl
    s_in, dst = shape_of(x), shape_of(node)
    nd = len(s_in)
    out = None
    if op in SAME_ORDER_RESHAPES:
        if isinstance(lay, Canon):
            found = seq_dim_after(s_in, d, lay.outer, dst, rw.l.seq) if lay.inner == 1 else None
            out = (found.dim, Canon(found.outer, 1)) if found else canon_after(s_in, d, lay, dst, rw.l.seq)
        else:  # rows in an order read from the data: the row dim must stay whole
            out = next(((j, lay) for j in range(len(dst)) if math.prod(dst[:j]) == math.prod(s_in[:d])
                        and dst[j] == s_in[d]), None)
    elif op is aten.expand:
        out = (d + len(dst) - nd, lay)
    elif op in (aten.transpose, aten.t):
        a, b = (node.args[1] % nd, node.args[2] % nd) if op is aten.transpose else (0, 1)
        out = (b if d == a else a if d == b else d, lay)
    elif op is aten.permute:
        out = ([p % nd for p in node.args[1]].index(d), lay)
    elif arg(node, 1, "dim", 0) % nd != d:  # slice / select on another dim
        out = (d - (op is aten.select and node.args[1] % nd < d), lay)
    if out is None:
        return False
    if op in SHAPE_ARG_OPS:
        shape = list(dst)
        shape[out[0]] //= rw.l.cp
        node.update_arg(1, shape)
    rw.state[node] = data(out[0], out[1], src)
    return None


# ---- row-wise compute --------------------------------------------------------------------------------------
def pointwise(rw, node, op, src):
    """Elementwise on rows of one layout at one dim; a whole input may broadcast along the rows only."""
    ins = {a: rw.state.get(a) for a in tensor_args(node)}
    val = node.meta.get(meta.VAL)
    outs = val if isinstance(val, (list, tuple)) else None
    shape = shape_of(node) or next((tuple(v.shape) for v in outs or () if isinstance(v, torch.Tensor)), ())
    nd, want = len(shape), None
    for x, s in ins.items():
        if s is None or shape_of(x) is None:
            continue
        rl = row_lay(s)
        if rl is None:
            return False
        w = (rl[0] + nd - len(shape_of(x)), rl[1])
        if want not in (None, w):
            return False
        want = w
    for x, s in ins.items():
        at = want[0] - (nd - len(shape_of(x) or ()))
        if s is not None or shape_of(x) is None or at < 0 or shape_of(x)[at] == 1:
            continue
        if not spans(rw, x, at, want[1]):
            return False  # a whole value along rows in this rank's own order: it cannot be put in that order
        with rw.g.inserting_before(node):
            node.replace_input_with(x, cut_rows(rw, x, at, want[1]))
    if writes_first(node) and row_lay(ins.get(node.args[0])) != want:
        return False
    out = data(*want, src)
    rw.state[node] = out if outs is None else tuple(out for _ in outs)
    return None


def pos_arith(rw, node, op, src):
    """Row numbers: ``// d`` of a layout with ``inner`` rows per token, ``d`` dividing it, numbers the rows of
    ``inner / d`` per token (``order // k``: the token of each (token, k) pair); ``empty_like`` and the like
    give data rows in the numbers' order. Anything else would read this rank's numbering as data."""
    p = node.args[0]
    s = rw.state.get(p)
    if op in SHAPED_LIKE and isinstance(s, Pos):
        rw.state[node] = data(0, s.rows, src)
        return None
    floor = op is aten.floor_divide or op is aten.div and node.kwargs.get("rounding_mode") == "floor"
    k = node.args[1] if len(node.args) > 1 else None
    if not (floor and isinstance(s, Pos) and isinstance(k, int) and k > 0 and isinstance(s.to, Canon)
            and s.to.inner % k == 0 and len(tensor_args(node)) == 1):
        return False
    rw.state[node] = Pos(s.rows, Canon(s.to.outer, s.to.inner // k), False, src)
    return None


def linear(rw, node, op, src):
    x = node.args[0]
    rl = row_lay(rw.state.get(x))
    if rl is None or rl[0] == len(shape_of(x)) - 1 or any(rw.state.get(a) is not None for a in node.args[1:]):
        return False
    rw.state[node] = data(*rl, src)
    return None


def split(rw, node, op, src):
    x = node.args[0]
    rl = row_lay(rw.state.get(x))
    nd = len(shape_of(x))
    pos = 1 if op is aten.unbind else 2
    dim = arg(node, pos, "dim", 0) % nd
    if rl is None or dim == rl[0]:
        return False
    out = data(rl[0] - (op is aten.unbind and dim < rl[0]), rl[1], src)
    rw.state[node] = tuple(out for _ in node.meta[meta.VAL])
    return None


def reduction(rw, node, op, src):
    x = node.args[0]
    rl = row_lay(rw.state.get(x))
    nd = len(shape_of(x))
    if rl is None:
        return False
    dims, keep = reduced(node, op, nd)
    if rl[0] in dims:
        return False
    out = data(rl[0] if keep else rl[0] - sum(d < rl[0] for d in dims), rl[1], src)
    vals = node.meta.get(meta.VAL)
    rw.state[node] = tuple(out for _ in vals) if isinstance(vals, (tuple, list)) else out
    return None
