"""Expert weights under tensor parallelism: 3-D ``[experts, out, in]`` or ``[experts, in, out]``
parameters cut along the expert-inner dimension (TP inside each expert), read from the graph.

Reads: ``fxpar.param``, ``val`` of the traced graph and the resolved styles. Writes nothing: pure
functions of the graph, which the rewriter asks once per pass.

An *expert matmul* is a matrix product whose weight operand is a 3-D parameter seen through ops that
keep its dims apart: a grouped mm ``x[S, K] @ w[E, K, N]`` (``torch._grouped_mm``, transformers'
``grouped_mm_fallback``), a ``bmm``/3-D ``matmul`` of the weights gathered per token by router output
(``w[expert_ids]``, either side of the product), or a ``linear`` with one expert's weight
(``w[i]``, a loop over experts). Each use says which parameter dim is contracted (input features)
and which comes out (output features); transposes on the way are followed.

Like a Megatron MLP, a first expert matmul whose output reaches, through elementwise ops, casts,
views, squeezes and the gate/up cut only, the activation side of second expert matmuls is cut along
its output features (column-parallel, its ``[experts, out]`` bias with it), and those along their input
features (row-parallel, a partial sum reduced where the experts' outputs are summed; their bias stays
whole, added after the reduction). A ``[gate; up]`` concatenation cut by ``chunk``/``split`` along the
features is cut piece by piece (each rank's gate rows match its up rows); a ``[::2]``/``[1::2]``
interleaving needs nothing more, as long as each rank's part holds whole groups of the stride. A
weight that does not divide over the ranks stays whole.

Communication, as for an MLP: the first matmuls' input gradient is all-reduced once (Megatron's f),
taken on the tokens before the router's gather (``x[token_ids]``, ``repeat_interleave``, a split by
tokens per expert: :func:`expert_input`), so ``T x H`` rather than ``top_k x T x H``, once for all
experts of a loop; the second matmuls' partial sums stay partial through the routing weights and the
sum over experts and are all-reduced once, after it. The routing weights multiply a partial sum, so
their gradient is one too: a second backward all-reduce of ``top_k x T`` numbers (a second matmul with
a bias is reduced before the bias, and needs none). The router's softmax and top-k run replicated.
Gpt-oss's experts at tp=2::

    gate_up_proj [E, H, 2I] (in, out): Shard(2)     h = grouped_mm(x, gate_up_proj) + bias[ids]  # Shard(1)
    gate_up_proj_bias [E, 2I]: Shard(1)             glu = clamp(h[:, ::2]) * (clamp(h[:, 1::2]) + 1)
    down_proj [E, I, H] (in, out): Shard(1)         y = grouped_mm(glu, down_proj)               # Partial()
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.op_classes import (
    ASSERTS,
    PASS_THROUGH,
    RESHAPES,
    SPLITS,
    TOKEN_GATHERS,
    is_grouped_mm,
    is_pointwise,
    packet,
)
from fxpar.ir.program import Program
from fxpar.passes.tensor_parallel.dim_moves import moved, relabel
from fxpar.passes.tensor_parallel.layouts import slice_bounds, split_args

aten = torch.ops.aten
KEEP_WHOLE = frozenset({"replicate", "local_params"})  # styles that ask for a parameter whole


@dataclass
class ExpertLayouts:
    """``dims``: FQN -> the dim cut (None: kept whole on purpose, a second matmul's bias). ``pieces``:
    FQN -> the sizes of a fused ``[gate; up]`` weight's parts along that dim. ``splits``: split nodes
    that cut such a weight's output into its parts -> the part sizes. ``pairs``: (first, second expert
    matmul nodes) per expert block, for inspection and tests."""

    dims: dict[str, int | None] = field(default_factory=dict)
    pieces: dict[str, list[int]] = field(default_factory=dict)
    splits: dict[torch.fx.Node, list[int]] = field(default_factory=dict)
    pairs: list[tuple[torch.fx.Node, list[torch.fx.Node]]] = field(default_factory=list)


@dataclass(frozen=True)
class ExpertMatmul:
    """One use of a 3-D expert weight: the parameter node, its dim of output and of input features, the
    activation operand and its contracted dim, and the dim of the matmul's output that holds the output
    features."""

    param: torch.fx.Node
    out_dim: int
    in_dim: int
    act: torch.fx.Node
    act_dim: int
    feature: int


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def expert_layouts(program: Program, styles: dict[str, str], tp: int) -> ExpertLayouts:
    """How the program's 3-D expert weights are cut over ``tp`` ranks (cached per graph, styles and tp)."""
    key = (tp, tuple(sorted(styles.items())))
    per_graph = _CACHE.setdefault(program.graph, {})
    if key not in per_graph:
        per_graph[key] = _analyze(program, styles, tp)
    return per_graph[key]


def _analyze(program: Program, styles: dict[str, str], tp: int) -> ExpertLayouts:
    out = ExpertLayouts()
    uses = {n: m for n in program.graph.nodes if (m := expert_matmul(n)) is not None}
    for node, first in uses.items():
        seconds, biases, cuts = _downstream(node, first, uses)
        if not seconds or _kept_whole(program, styles, [first.param] + [uses[s].param for s in seconds]):
            continue
        size = node.meta[meta.VAL].shape[first.feature]
        bounds = sorted({0, size} | {b for c in cuts.values() for b in c[0]})
        pieces = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
        strides = {c[1] for c in cuts.values()}
        if any(p % tp for p in pieces) or any((size // tp) % s for s in strides) or \
                any(program.params[uses[s].param.meta[meta.PARAM]].shape[uses[s].in_dim] % tp for s in seconds):
            continue  # does not divide: the experts stay whole
        fqn = first.param.meta[meta.PARAM]
        out.dims[fqn] = first.out_dim
        for b in biases:
            out.dims[b.meta[meta.PARAM]] = 1
        if len(pieces) > 1:
            out.pieces[fqn] = pieces
            for b in biases:
                out.pieces[b.meta[meta.PARAM]] = pieces
            out.splits.update({c: pieces for c, (_, s) in cuts.items() if s == 1})
        for s in seconds:
            out.dims[uses[s].param.meta[meta.PARAM]] = uses[s].in_dim
            for b in _second_biases(s):
                out.dims.setdefault(b.meta[meta.PARAM], None)
        out.pairs.append((node, seconds))
    return out


def _kept_whole(program: Program, styles: dict[str, str], params: list[torch.fx.Node]) -> bool:
    for p in params:
        for name in program.params[p.meta[meta.PARAM]].fqns:
            parts = name.split(".")
            if any(styles.get(".".join(parts[:i])) in KEEP_WHOLE for i in range(len(parts), 0, -1)):
                return True
    return False


def expert_matmul(node: torch.fx.Node) -> ExpertMatmul | None:
    """The expert-weight use of a matrix-product node, or None when no operand is a 3-D parameter."""
    if node.op != "call_function":
        return None
    pkt = packet(node)
    a, b = (node.args + (None, None))[:2]
    nd = _ndim(node)
    if is_grouped_mm(node):  # x[S, K] @ w[E, K, N]
        src = param_dims(b)
        return ExpertMatmul(src[0], src[1][2], src[1][1], a, 1, nd - 1) if _is_expert(src, 3) else None
    if pkt in (aten.bmm, aten.matmul) and _ndim(a) == 3 and _ndim(b) == 3:
        src = param_dims(a)
        if _is_expert(src, 3) and src[1][0] is None:  # w[ids] @ x: [S, out, in]
            return ExpertMatmul(src[0], src[1][1], src[1][2], b, 1, 1)
        src = param_dims(b)
        if _is_expert(src, 3) and src[1][0] is None:  # x @ w[ids]: [S, in, out]
            return ExpertMatmul(src[0], src[1][2], src[1][1], a, 2, 2)
    if pkt is aten.linear:  # x @ w[i].T: one expert's [out, in]
        src = param_dims(b)
        if _is_expert(src, 2):
            return ExpertMatmul(src[0], src[1][0], src[1][1], a, _ndim(a) - 1, nd - 1)
    return None


def _is_expert(src, nd: int) -> bool:
    if src is None:
        return False
    p, dims = src
    full = p.meta[meta.VAL].dim()
    return full == 3 and len(dims) == nd and all(d is not None for d in dims[-2:])


def param_dims(node) -> tuple[torch.fx.Node, tuple] | None:
    """(parameter node, the parameter's dim at each dim of ``node``, None: not one of its dims) when
    ``node`` is a parameter seen through transposes, casts, and indexing or selecting of its first dim."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "placeholder":
        v = node.meta.get(meta.VAL)
        return (node, tuple(range(v.dim()))) if node.meta.get(meta.PARAM) and isinstance(v, torch.Tensor) else None
    pkt = packet(node)
    src = param_dims(node.args[0]) if node.args else None
    if src is None:
        return None
    p, dims = src
    if pkt in PASS_THROUGH - {aten.dropout}:
        return src
    if pkt in (aten.transpose, aten.t):
        return p, relabel(node, dims)
    if pkt is aten.select and node.args[1] % len(dims) == 0:
        return p, dims[1:]
    if pkt is aten.index and len(node.args[1]) == 1 and node.args[1][0] is not None:
        lead = _ndim(node) - (len(dims) - 1)  # the index tensor's dims replace the first dim
        return p, (None,) * lead + dims[1:]
    return None


def _downstream(node: torch.fx.Node, first: ExpertMatmul, uses: dict):
    """From a first expert matmul: the second expert matmuls its output reaches as their activation
    (empty when it also goes elsewhere), the ``[experts, out]`` biases added on the way, and the cuts of
    its features: split node -> (bounds, stride)."""
    seconds, biases, cuts = [], [], {}
    todo, seen = [(u, node, first.feature) for u in node.users], set()
    while todo:
        user, src, f = todo.pop()
        if (user, f) in seen:
            continue
        seen.add((user, f))
        pkt = packet(user)
        uv = user.meta.get(meta.VAL)
        if pkt in ASSERTS:
            continue
        if user in uses:
            if uses[user].act is not src or f != uses[user].act_dim:
                return [], [], {}
            seconds.append(user)
            continue
        if pkt in SPLITS or pkt is aten.slice:
            given = split_args(user)
            dim = given.get("dim", 0) % _ndim(src)
            if dim == f:
                cut = _cut(user, pkt, given, src.meta[meta.VAL].shape[f])
                if cut is None:
                    return [], [], {}
                cuts[user] = cut
            todo.extend((u, user, f) for u in user.users)
            continue
        if user.target is operator.getitem:
            todo.extend((u, user, f) for u in user.users)
            continue
        nf = _follow(user, src, f, uv)
        if nf is None:
            return [], [], {}
        if user.op == "call_function" and is_pointwise(user):
            biases += [b for b in (_bias(o, first) for o in user.all_input_nodes if o is not src) if b is not None]
        todo.extend((u, user, nf) for u in user.users)
    return seconds, biases, cuts


def _follow(user: torch.fx.Node, src: torch.fx.Node, f: int, uv) -> int | None:
    """Where the feature dim ``f`` of ``src`` is in ``user``'s output, or None when it does not go through."""
    if not isinstance(uv, torch.Tensor):
        return None
    pkt = packet(user)
    nd_in, nd_out = _ndim(src), uv.dim()
    if pkt in PASS_THROUGH or (user.op == "call_function" and is_pointwise(user)):
        return f + nd_out - nd_in
    if pkt in (aten.unsqueeze, aten.squeeze):  # a size-1 dim added or dropped (the features, if dropped, stop)
        return moved(user, f)
    if pkt in RESHAPES and f == nd_in - 1 and uv.shape[-1] == src.meta[meta.VAL].shape[f]:
        return nd_out - 1
    if pkt is aten.cat and (user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)) % nd_out != f:
        return f  # the experts' outputs put back together along the tokens
    return None


def dispatch_chain(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(the tokens before the experts' gather, the gather's nodes in order) for the activation of a first
    expert matmul: ``x[token_ids]``, ``x.repeat_interleave(k, 0)``, ``x.split(sizes)[i]`` along the
    tokens, casts and unsqueezes on the way; None when there is none."""
    chain = []
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        pkt = packet(node)
        if node.target is operator.getitem and packet(node.args[0]) in SPLITS and split_args(node.args[0]).get(
                "dim", 0) == 0:
            chain += [node, node.args[0]]
            node = node.args[0].args[0]
        elif pkt in TOKEN_GATHERS and (pkt is not aten.index or len(node.args[1]) == 1):
            chain.append(node)
            node = node.args[0]
        else:
            break
    gathers = any(packet(c) in SPLITS | {aten.index, aten.repeat_interleave} for c in chain)
    return (node, chain[::-1]) if gathers and isinstance(node, torch.fx.Node) else None


def expert_input(rw, old: torch.fx.Node, x: torch.fx.Node) -> torch.fx.Node:
    """The activation ``x`` of column-parallel expert matmul ``old`` with its gradient all-reduced
    (Megatron's f). Where the tokens were gathered for the experts, f is taken on the tokens before the
    gather (``T x H``, not ``top_k x T x H``; once for all experts of a loop) and the gather emitted
    again on it: the gradient of the gathered copy is summed by f's all-reduce."""
    xo = _act_node(old)
    found = dispatch_chain(xo)
    if found is None or not rw.is_replicated(x):
        return rw.column_input(x, xo)
    origin, chain = found
    f = rw.column_input(rw.env[origin], origin)
    mapping = {origin: f}
    for c in chain:
        key = (f, c)
        if key not in rw.dispatched:
            a, k = torch.fx.node.map_arg((c.args, c.kwargs), lambda n: mapping.get(n, rw.env[n]))
            rw.dispatched[key] = rw.call(c.target, a, k, like=c)
        mapping[c] = rw.dispatched[key]
    return mapping[xo]


def _act_node(old: torch.fx.Node) -> torch.fx.Node:
    m = expert_matmul(old)
    return m.act if m is not None else old.args[0]


def _cut(user: torch.fx.Node, pkt, given: dict, size: int) -> tuple[frozenset, int] | None:
    """(bounds, stride) of a split along the features: a chunk/split into parts, or a strided slice of
    one group of an interleaving (``[0::2]``, ``[1::2]``)."""
    if pkt is aten.chunk:
        n = given["chunks"]
        return (frozenset(range(0, size, size // n)), 1) if size % n == 0 else None
    if pkt is aten.split:
        return frozenset(range(0, size, given["split_size"])), 1
    if pkt is aten.split_with_sizes:
        return frozenset(sum(given["split_sizes"][:i]) for i in range(len(given["split_sizes"]))), 1
    start, end = slice_bounds(given, size)
    step = given.get("step", 1)
    if step == 1:
        return frozenset({start, end}), 1
    return (frozenset(), step) if start < step and end == size else None


def _bias(node: torch.fx.Node, first: ExpertMatmul) -> torch.fx.Node | None:
    """A 2-D ``[experts, out]`` parameter (gathered by expert id, unsqueezed, cast) added to the first
    matmul's output."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and (
            packet(node) in PASS_THROUGH | {aten.unsqueeze, aten.index, aten.expand}):
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or not node.meta.get(meta.PARAM):
        return None
    v, w = node.meta[meta.VAL], first.param.meta[meta.VAL]
    return node if v.dim() == 2 and v.shape == (w.shape[0], w.shape[first.out_dim]) else None


def _second_biases(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``[experts, out]`` parameters added to a second expert matmul's output (kept whole)."""
    m = expert_matmul(node)
    found, todo = [], [(u, node) for u in node.users]
    while todo:
        user, src = todo.pop()
        if packet(user) in PASS_THROUGH | {aten.squeeze}:
            todo += [(u, user) for u in user.users]
        elif user.op == "call_function" and is_pointwise(user):
            found += [b for o in user.all_input_nodes if o is not src and (b := _bias(o, m)) is not None]
    return found


def _ndim(node) -> int:
    v = node.meta.get(meta.VAL) if isinstance(node, torch.fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else -1
