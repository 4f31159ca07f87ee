"""The context-parallel rule of each op: how the sequence dim moves through it and what the op needs cut,
gathered or summed (:class:`fxpar.passes.cp_rewriter.Rewriter` holds the states and the building blocks). A
new op's rule is one function here and one entry of :func:`rule_for`.

Each rule is ``rule(rw, node, op)``: it reads its inputs' states in ``rw.state``, rewrites ``node``'s inputs
or arguments where needed, and sets ``rw.state[node]``. The rules of a token-local MoE's ops (row numbers, an
order only this rank knows) are :mod:`fxpar.passes.cp_tokens`'s, tried first.
"""

from __future__ import annotations

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.op_classes import (
    ACTIVATION_PRODUCTS,
    DIM_REDUCTIONS,
    DIM_VIEWS,
    ELEMENTWISE_LIKE,
    LAST_DIM_NORMS,
    SAME_ORDER_RESHAPES,
    SHAPE_ARG_OPS,
    SPLITS,
    is_pointwise,
    writes_first,
)
from fxpar.ir.ops import collective_kind
from fxpar.passes.cp_rules import (
    PARTIAL,
    SDPA,
    Sh,
    is_local,
    seq_dim_after,
    shape_of,
    srcs,
    tensor_args,
)

aten = torch.ops.aten
fxpar_ops = torch.ops.fxpar
# other passes' collectives (TP's): an all-reduce is elementwise along the sequence; a gather or scatter along
# another dim moves no token
ELEMENTWISE_COLLECTIVES = {"all_reduce", "identity_fwd_all_reduce_bwd"}
DIM_COLLECTIVES = {"all_gather", "all_gather_rs_bwd", "reduce_scatter", "scatter_slice"}


def rule_for(node: torch.fx.Node, op):
    """The rule of ``node`` (an op ``op``), or None: its sharded inputs are gathered."""
    if collective_kind(node) in ELEMENTWISE_COLLECTIVES | DIM_COLLECTIVES:
        return collective
    if op is SDPA:
        return attention
    if op is aten.cross_entropy_loss:
        return cross_entropy
    if op in DIM_VIEWS:
        return view
    if op is aten.linear:
        return linear
    if op in ACTIVATION_PRODUCTS or op is aten.addmm:
        return product
    if op in LAST_DIM_NORMS or op in DIM_REDUCTIONS:
        return reduction
    if op in ELEMENTWISE_LIKE or is_pointwise(node) or out_of_place(op) in ELEMENTWISE_LIKE:
        return pointwise
    if op in (aten.cat, aten.concat):
        return concat
    if op is aten.stack:
        return stack
    if op in SPLITS or op is aten.unbind:
        return split
    if op is aten.gather:
        return take_along
    return None


def out_of_place(op):
    """The op an in-place one (``masked_fill_``) writes the result of, else None."""
    name = getattr(op, "_qualified_op_name", "").split("::")[-1]
    return getattr(aten, name[:-1], None) if name.endswith("_") and not name.startswith("_") else None


def collective(rw, node, op) -> None:
    """Another pass's collective: the state passes through, unless it gathers or scatters the sequence."""
    s = rw.state.get(node.args[0])
    if collective_kind(node) in DIM_COLLECTIVES:
        if not isinstance(s, Sh) or node.args[2] % len(shape_of(node.args[0])) == s.dim:
            return rw.fallback(node)
    rw.state[node] = s


def view(rw, node, op) -> None:
    x = node.args[0]
    s = rw.input_state(node, x)
    if s is None:
        return
    src, dst, nd = shape_of(x), shape_of(node), len(shape_of(x))
    out = None
    if op in SAME_ORDER_RESHAPES:
        out = seq_dim_after(src, s.dim, s.outer, dst, rw.l.seq)
    elif op is aten.expand:
        out = Sh(s.dim + len(dst) - nd, s.outer)
    elif op in (aten.transpose, aten.t):
        a, b = (node.args[1] % nd, node.args[2] % nd) if op is aten.transpose else (0, 1)
        out = Sh(b if s.dim == a else a if s.dim == b else s.dim, s.outer)
    elif op is aten.permute:
        out = Sh([p % nd for p in node.args[1]].index(s.dim), s.outer)
    elif (node.args[1] if len(node.args) > 1 else 0) % nd != s.dim:  # slice / select on another dim
        out = Sh(s.dim - (op is aten.select and node.args[1] % nd < s.dim), s.outer)
    if out is None:
        return rw.fallback(node)
    if op in SHAPE_ARG_OPS:
        node.update_arg(1, rw.local_shape(node, out))
    rw.state[node] = out

def pointwise(rw, node, op) -> None:
    """Broadcasting elementwise: whole inputs cut where the sequence lies. An elementwise autograd.Function
    returns a list of outputs of one shape: each output has the state."""
    xs = dict.fromkeys(tensor_args(node))
    partial = [x for x in xs if rw.state.get(x) == PARTIAL]
    if partial:
        return partial_arith(rw, node, op, xs)
    val = node.meta.get(meta.VAL)
    outs = val if isinstance(val, (list, tuple)) else None
    shape = shape_of(node) or next((tuple(v.shape) for v in outs or () if isinstance(v, torch.Tensor)), ())
    nd = len(shape)
    sh = [(x, rw.state[x]) for x in xs if isinstance(rw.state.get(x), Sh)]
    x0, s0 = sh[0]
    want = Sh(s0.dim + nd - len(shape_of(x0)), s0.outer)
    if writes_first(node) and rw.state.get(node.args[0]) != want:
        return rw.fallback(node)  # an in-place write into a whole value: it stays whole (a cut copy loses it)
    if not rw.aligned(node, want, nd):
        return rw.fallback(node)
    rw.state[node] = want if outs is None else tuple(want for _ in outs)

def partial_arith(rw, node, op, xs) -> None:
    """A partial sum times or over a whole value stays partial, as does a sum of partials; a whole value
    added to a partial one is split evenly over the ranks; anything else sums the partials first."""
    states = {x: rw.state.get(x) for x in xs}
    if op in (aten.mul, aten.div) and all(s in (None, PARTIAL) for s in states.values()) and \
            (op is aten.mul or states.get(node.args[1]) is None) and \
            sum(s == PARTIAL for s in states.values()) == 1:
        rw.state[node] = PARTIAL
    elif op in (aten.add, aten.sub) and all(s in (None, PARTIAL) for s in states.values()):
        for x, s in states.items():
            if s is None:
                with rw.g.inserting_before(node):
                    node.replace_input_with(x, rw.call(aten.div.Tensor, x, rw.l.cp))
        rw.state[node] = PARTIAL
    else:
        rw.fallback(node)

def linear(rw, node, op=None) -> None:
    s = rw.input_state(node, node.args[0])
    if not isinstance(s, Sh) or s.dim == len(shape_of(node.args[0])) - 1 or \
            any(rw.state.get(a) is not None for a in node.args[1:]):
        return rw.fallback(node)
    rw.state[node] = s

def product(rw, node, op=None) -> None:
    """``a @ b`` with ``a``'s rows sharded: ``b`` (keys or values not gathered at a root) made whole; the
    added input of ``baddbmm`` / ``addmm`` (a bias, or the zeros eager attention starts its scores from) cut
    to this rank's rows where it spans them."""
    added = op in (aten.baddbmm, aten.addmm)
    a, b = node.args[1:3] if added else node.args[:2]
    s = rw.input_state(node, a)
    nd_a, nd_b, nd = len(shape_of(a)), len(shape_of(b)), len(shape_of(node))
    if not isinstance(s, Sh) or s.dim == nd_a - 1:
        rw.whole(node, b)
        return rw.fallback(node)
    out = Sh(s.dim + nd - nd_a, s.outer)
    at = out.dim - (nd - nd_b)  # where b meets the sequence, broadcasting from the right
    if s.dim < nd_a - 2 and 0 <= at < nd_b - 2 and shape_of(b)[at] == out.outer * rw.l.seq:
        # the sequence is a batch dim of the product (a per-token matrix product, not attention): b's rows are
        # this rank's, not the whole sequence's (a key/value gather at b's root is cut back to them)
        if rw.state.get(b) is None:
            with rw.g.inserting_before(node):
                node.replace_input_with(b, rw.cut(b, at, out.outer))
        elif rw.state.get(b) != out:
            return rw.fallback(node)
    else:
        rw.whole(node, b)
    if added:
        c, shape = node.args[0], shape_of(node.args[0])
        at = out.dim - (len(shape_of(node)) - len(shape))
        if rw.input_state(node, c) is not None or (at >= 0 and shape[at] not in (1, out.outer * rw.l.seq)):
            return rw.fallback(node)
        if at >= 0 and shape[at] > 1:
            with rw.g.inserting_before(node):
                node.update_arg(0, rw.cut(c, at, out.outer))
    rw.state[node] = out

def reduction(rw, node, op) -> None:
    x = node.args[0]
    s = rw.input_state(node, x)
    nd = len(shape_of(x))
    dims, keep = reduced(node, op, nd)
    if isinstance(s, Sh) and s.dim in dims and op in (aten.sum, aten.mean):
        return partial_sum(rw, node, op)
    if not isinstance(s, Sh) or s.dim in dims:
        return rw.fallback(node)
    out = Sh(s.dim if keep else s.dim - sum(d < s.dim for d in dims), s.outer)
    vals = node.meta.get(meta.VAL)
    rw.state[node] = tuple(out for _ in vals) if isinstance(vals, (tuple, list)) else out

def reduced(node, op, nd: int) -> tuple[list[int], bool]:
    """The dims a reduction, norm or scan reads across (non-negative), and whether it keeps them."""
    if op in LAST_DIM_NORMS:
        dims, keep = list(range(nd - len(node.args[1]), nd)), True
    else:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", list(range(nd)))
        dims = [dims] if isinstance(dims, int) else list(dims or range(nd))
        keep = op in (aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.cumsum) or \
            (len(node.args) > 2 and node.args[2] is True) or node.kwargs.get("keepdim", False)
    return [d % nd for d in dims], keep

def partial_sum(rw, node, op) -> None:
    """A sum over the sequence is this rank's part of it; a mean, this rank's mean over cp."""
    rw.state[node] = PARTIAL
    if op is aten.mean:
        with rw.g.inserting_before(node.next):
            part = rw.call(aten.div.Tensor, node, rw.l.cp)
        node.replace_all_uses_with(part, delete_user_cb=lambda u: u is not part)
        rw.state[part] = PARTIAL

def take_along(rw, node, op=None) -> None:
    """``gather(x, dim, index)`` along another dim than the sequence's (a vocabulary-parallel loss picking each
    token's target logit): the index cut to this rank's rows, the output sharded as ``x``."""
    x, dim, index = node.args[:3]
    s = rw.input_state(node, x)
    nd = len(shape_of(x))
    if not isinstance(s, Sh) or dim % nd == s.dim or rw.state.get(index) is not None or \
            shape_of(index)[s.dim] != s.outer * rw.l.seq:
        return rw.fallback(node)
    with rw.g.inserting_before(node):
        node.replace_input_with(index, rw.cut(index, s.dim, s.outer))
    rw.state[node] = s


def concat(rw, node, op=None) -> None:
    xs = node.args[0]
    sh = [rw.state.get(x) for x in xs if isinstance(rw.state.get(x), Sh)]
    nd = len(shape_of(node))
    dim = (node.args[1] if len(node.args) > 1 else 0) % nd
    if any(rw.state.get(x) == PARTIAL for x in xs) or len(set(sh)) != 1 or sh[0].dim == dim or \
            not rw.aligned(node, sh[0]):
        return rw.fallback(node)
    rw.state[node] = sh[0]

def stack(rw, node, op=None) -> None:
    """Inputs of one shape stacked along a new dim: the sequence moves past it; whole inputs cut to match."""
    xs, nd = node.args[0], len(shape_of(node))
    dim = (node.args[1] if len(node.args) > 1 else 0) % nd
    sh = [rw.state.get(x) for x in xs if rw.state.get(x) is not None]
    if PARTIAL in sh or len(set(sh)) != 1:
        return rw.fallback(node)
    s = sh[0]
    for x in dict.fromkeys(xs):
        if rw.state.get(x) is None:
            with rw.g.inserting_before(node):
                node.replace_input_with(x, rw.cut(x, s.dim, s.outer))
    rw.state[node] = Sh(s.dim + (dim <= s.dim), s.outer)


def split(rw, node, op=None) -> None:
    """Pieces along another dim than the sequence (a fused projection's q, k, v): each keeps the state
    (``unbind`` drops its dim)."""
    x = node.args[0]
    s = rw.input_state(node, x)
    nd = len(shape_of(x))
    pos = 1 if op is aten.unbind else 2
    dim = (node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", 0)) % nd
    if not isinstance(s, Sh) or dim == s.dim:
        return rw.fallback(node)
    out = Sh(s.dim - (op is aten.unbind and dim < s.dim), s.outer)
    rw.state[node] = tuple(out for _ in node.meta[meta.VAL])


def attention(rw, node, op=None) -> None:
    """This rank's query rows against every key: the keys and values whole (gathered at their root, or
    here), the mask's rows for this rank, ``is_causal`` as this rank's causal mask."""
    names = ("attn_mask", "dropout_p", "is_causal")
    defaults = list(zip(names, (None, 0.0, False)))[len(node.args) - 3:]
    node.args = tuple(node.args) + tuple(node.kwargs.get(n, d) for n, d in defaults)
    node.kwargs = {k_: v_ for k_, v_ in node.kwargs.items() if k_ not in names}
    q, k, v = node.args[:3]
    rw.whole(node, k)
    rw.whole(node, v)
    s = rw.input_state(node, q)
    nd = len(shape_of(q))
    if not isinstance(s, Sh) or s.dim != nd - 2:
        return rw.fallback(node)
    args = list(node.args)
    mask, causal = args[3], args[5]
    boolean = causal or (isinstance(mask, torch.fx.Node) and mask.meta[meta.VAL].dtype == torch.bool)
    if isinstance(mask, torch.fx.Node) and rw.state.get(mask) is None and \
            shape_of(mask)[-2] == s.outer * rw.l.seq:
        with rw.g.inserting_before(node):
            args[3] = rw.cut(mask, len(shape_of(mask)) - 2, s.outer)
    elif isinstance(mask, torch.fx.Node) and rw.state.get(mask) is not None:
        return rw.fallback(node)
    if causal:
        with rw.g.inserting_before(node):
            args[3] = causal_mask(rw, q)
        args[5] = False
    if boolean:
        with rw.g.inserting_before(node):
            args[3] = additive(rw, args[3])
    node.args = tuple(args)
    rw.state[node] = s
    rw.res.attention.append(node.name)


def additive(rw, mask: torch.fx.Node) -> torch.fx.Node:
    """A boolean mask as the additive fp32 mask SDPA makes of it, once for every attention reading it: SDPA
    converts a boolean mask on each call and keeps each layer's copy for backward (measured on this CPU: an
    8-layer Llama at 2,048 tokens held 8 such ``[seq, seq]`` fp32 copies, 128 MiB); one shared copy is held once."""
    if ("additive", mask) not in rw.cuts:
        rw.cuts[("additive", mask)] = rw.call(aten.where.Scalar, mask, 0.0, float("-inf"))
    return rw.cuts[("additive", mask)]

def causal_mask(rw, q) -> torch.fx.Node:
    """``[2c, seq]`` booleans: query position (this rank's rows) >= key position (built once, before the
    first attention, which comes before every later one)."""
    device = q.meta[meta.VAL].device
    if ("causal", device) not in rw.cuts:
        rows = [rw.call(aten.arange.start, a, b, device=device) for a, b in rw.l.ranges()]
        qpos = rw.call(aten.unsqueeze.default, rw.call(aten.cat.default, rows), 1)
        kpos = rw.call(aten.unsqueeze.default, rw.call(aten.arange.default, rw.l.seq, device=device), 0)
        rw.cuts[("causal", device)] = rw.call(aten.ge.Tensor, qpos, kpos)
    return rw.cuts[("causal", device)]

def cross_entropy(rw, node, op=None) -> None:
    """Logits sharded, targets cut to match; a mean becomes this rank's sum over the whole count."""
    x, target = node.args[:2]
    s = rw.input_state(node, x)
    rest = list(node.args[2:]) + [None, 1, -100, 0.0][len(node.args) - 2:]
    weight, reduction, ignore = rest[0], rest[1], rest[2]
    if not isinstance(s, Sh) or s.dim != 0 or weight is not None or rw.state.get(target) is not None:
        return rw.fallback(node)
    with rw.g.inserting_before(node):
        count = None
        if reduction == 1:
            valid = rw.call(aten.ne.Scalar, target, ignore)
            count = rw.call(aten.sum.default, valid)
        node.replace_input_with(target, rw.cut(target, 0, s.outer))
    if reduction == 0:
        rw.state[node] = s
        return
    rest[1] = 2
    node.args = (node.args[0], node.args[1], *rest)
    rw.state[node] = PARTIAL
    if count is not None:
        with rw.g.inserting_before(node.next):
            mean = rw.call(aten.div.Tensor, node, count)
        node.replace_all_uses_with(mean, delete_user_cb=lambda u: u is not mean)
        rw.state[mean] = PARTIAL

def outputs(rw, node, keep: set[int] | None) -> None:
    """Partial outputs summed (the loss: each rank's backward starts from its own part, whose gradient sums
    over cp); a whole output that the sequence fed (a loss computed from summed parts) counts ``1 / cp`` on each
    rank before the sum; sharded ones gathered where kept (None: all), else None (a training step reads only
    the loss, as the TP pass leaves the logits)."""
    outs = list(node.args[0])
    for i, x in enumerate(outs):
        if not isinstance(x, torch.fx.Node) or (keep is not None and i not in keep and x not in rw.state):
            continue
        s = rw.state.get(x)
        if is_local(s):  # rows in an order only this rank knows: the pass runs again without their sources
            rw.broken |= srcs(s)
            continue
        with rw.g.inserting_before(node):
            if s == PARTIAL:
                outs[i] = rw.call(fxpar_ops.all_reduce.default, x, rw.l.group, "sum")
            elif s is None and x in rw.fed and keep is not None and i in keep:
                share = rw.call(aten.div.Tensor, x, rw.l.cp)
                outs[i] = rw.call(fxpar_ops.all_reduce.default, share, rw.l.group, "sum")
            elif isinstance(s, Sh):
                outs[i] = rw.gather(x, s) if keep is None or i in keep else None
    node.args = (type(node.args[0])(outs),)
