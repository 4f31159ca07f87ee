"""Ulysses attention for context parallelism (``Plan(cp=N, cp_attention="ulysses")``): each attention trades
the sequence for heads by all-to-all instead of gathering its keys and values.

Reads: the graph copy :mod:`fxpar.passes.context_parallel` rewrites, where its keys and values start
(:func:`fxpar.passes.cp_rules.kv_roots`) and the cp degree. Writes: that graph, in place, through the
:class:`~fxpar.passes.cp_rewriter.Rewriter` (which calls :func:`root` at each key/value root and
:func:`attention` at each attention this module took).

**What moves.** A rank holds its two chunks (``2c`` rows, head chunk then tail chunk) of every head. Before
an SDPA, its queries, and its keys and values at their root (before any grouped-query expansion, so each KV
head is sent once), go through ``fxpar::all_to_all``: the heads are cut into ``cp`` contiguous groups,
group ``j`` goes to rank ``j``, and each rank receives every rank's chunks of its own group, put back in
sequence order. Each rank then attends with ``heads / cp`` query heads (and ``kv heads / cp`` key/value
heads: contiguous groups keep the grouped-query pairing) over the whole sequence, with the model's own
(uncut) mask or ``is_causal``; the output goes back by the reverse all-to-all to this rank's rows of every
head. Each all-to-all sends ``(cp - 1) / cp`` of its local tensor; its backward is the same all-to-all.

**Eager attention** (``q @ k^T``, elementwise ops and a softmax on the scores, ``p @ v``: soft-capping,
an additive mask) runs the same way: the queries of ``q @ k^T`` and the output of ``p @ v`` go by
all-to-all, the ops between them run unchanged on this rank's heads (a whole mask broadcasts over them).

**Where it does not apply** (the attention keeps the all-gather, its reason in ``CpResult.kept`` and on
the node, which ``fxpar inspect`` shows): query or key/value heads (after TP's split) that ``cp`` does not
divide (multi-query keys included), keys or values not split along the sequence, a mask with per-head rows
of another count (of an eager attention: any per-head input), eager scores through other ops (a reshape, a
concatenated sink) or read elsewhere, queries without a heads dim of their own (``[batch * heads, seq,
dim]`` products), or keys and values shared with such an attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx

from fxpar.ir.numeric import nbytes
from fxpar.ir.op_classes import (
    ACTIVATION_PRODUCTS,
    ASSERTS,
    ELEMENTWISE_LIKE,
    PASS_THROUGH,
    SAME_ORDER_RESHAPES,
    SHAPE_ARG_OPS,
    SOFTMAX,
    is_pointwise,
)
from fxpar.passes.cp_rules import PARTIAL, SDPA, Sh, packet, shape_of, tensor_args

aten = torch.ops.aten
fxpar_ops = torch.ops.fxpar
META_KEY = "fxpar.cp_attention"  # on each attention node: "ulysses", or why it keeps the all-gather


@dataclass
class Plan:
    """The attentions Ulysses takes, and where each one's heads sit on the way to it. An attention is an SDPA
    call, or an eager pair: ``q @ k^T`` (its queries go to heads) and ``p @ v`` (its output comes back), the
    scores between them elementwise ops and a softmax on the heads the rank holds."""

    attention: set = field(default_factory=set)  # SDPA calls, and both products of each eager pair
    scores: set = field(default_factory=set)  # the ``q @ k^T`` products of eager pairs
    # key/value root -> {the root and each layout node down to its attentions: (heads dim, block size)}
    roots: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)  # attention name -> why it keeps the all-gather
    heads: dict = field(default_factory=dict)  # SDPA or ``p @ v`` taken -> (query heads, key/value heads)
    moved: dict = field(default_factory=dict)  # the same -> (queries, output, key root, value root)


def plan(gm: torch.fx.GraphModule, roots: dict, cp: int, fed_by_tokens: set, mode: str = "ulysses") -> Plan:
    """Which attentions of ``gm`` run as Ulysses on ``cp`` ranks (``roots``: :func:`kv_roots`' map;
    ``fed_by_tokens``: :func:`~fxpar.passes.cp_rules.token_fed`; ``mode`` ``"auto"``: only those whose
    all-to-alls send fewer bytes than the all-gather, :func:`fewer_bytes`)."""
    out = Plan()
    attentions = [n for n in gm.graph.nodes if n.op == "call_function" and
                  (packet(n) is SDPA or packet(n) in ACTIVATION_PRODUCTS)]
    paths: dict[tuple, tuple] = {}  # (attention, operand position) -> (root, layout nodes down to it)
    fed: dict = {}  # root -> the attentions it feeds
    for r, readers in roots.items():
        for reader, pos in readers:
            chain, cur = [], reader
            while cur not in attentions and len(cur.users) == 1:
                chain.append(cur)
                cur = next(iter(cur.users))
            paths[(cur, list(cur.args).index(chain[-1]) if chain else pos)] = (r, chain)
            fed.setdefault(r, set()).add(cur)
    took: dict = {}  # SDPA or p @ v -> {root: its heads' places, "heads": ..., "moved": ..., "pair": q @ k^T}
    unit = {}  # attention -> the SDPA or p @ v it is part of
    for n in attentions:
        if packet(n) is SDPA:
            why = _check(n, n.args[0], n, (n, 1), (n, 2), _mask_of(n), paths, cp, took)
        else:
            why = _eager(n, paths, cp, took, fed_by_tokens)
        unit[n] = n
        if why:
            out.kept[n.name] = why
        elif n in took and "pair" in took[n]:
            unit[took[n]["pair"]] = n
            out.kept.pop(took[n]["pair"].name, None)
    for n in [n for n in took if mode == "auto" and not fewer_bytes(*_moved_bytes(took[n]["moved"]), cp)]:
        qo, kv = _moved_bytes(took.pop(n)["moved"])
        out.kept[n.name] = (f"cp_attention='auto': the all-gather sends no more bytes per rank ({kv * (cp - 1) // cp} "
                            f"against Ulysses' {(qo + kv) * (cp - 1) // cp // cp})")
    changed = True
    while changed:  # keys and values shared with an attention that keeps the all-gather keep it too
        changed = False
        for users in fed.values():
            other = next((u for u in users if unit[u] not in took), None)
            for a in {unit[u] for u in users if unit[u] in took} if other is not None else ():
                pair = took.pop(a).get("pair")
                for x in (a, pair) if pair is not None else (a,):
                    out.kept[x.name] = f"its keys or values also feed {other.name}, which gathers them"
                changed = True
    for n, places in took.items():
        out.heads[n], out.moved[n] = places.pop("heads"), places.pop("moved")
        pair = places.pop("pair", None)
        out.attention.update((n,) if pair is None else (n, pair))
        out.scores.update(() if pair is None else (pair,))
        for r, at in places.items():
            out.roots.setdefault(r, {}).update(at)
    return out


def fewer_bytes(qo: int, kv: int, cp: int) -> bool:
    """Whether Ulysses' all-to-alls send fewer bytes per rank than the all-gather: ``(cp - 1) / cp`` of this
    rank's ``1 / cp`` of the queries, output, keys and values (``qo``, ``kv``: whole-sequence bytes) against
    ``(cp - 1) / cp`` of the whole keys and values."""
    return qo + kv < cp * kv


def _moved_bytes(moved) -> tuple[int, int]:
    q, o, k, v = (nbytes(x.meta.get("val")) or 0 for x in moved)
    return q + o, k + v


def mark(gm: torch.fx.GraphModule, taken: Plan) -> None:
    """Say on each attention node of ``gm`` how it reads the sequence (what ``fxpar inspect`` shows)."""
    for n in gm.graph.nodes:
        if n in taken.attention:
            n.meta[META_KEY] = "ulysses"
        elif n.name in taken.kept:
            n.meta[META_KEY] = f"all-gather: {taken.kept[n.name]}"


def _mask_of(n):
    mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    return [mask] if isinstance(mask, torch.fx.Node) else []


def _check(n, q, o, kp, vp, others, paths, cp, took, pair=None) -> str:
    """Why attention ``n`` (queries ``q``, output ``o``, keys and values at ``kp`` / ``vp`` of ``paths``, other
    whole inputs ``others``) cannot run as Ulysses on ``cp`` ranks; '' when it can (``took[n]`` then holds the
    heads' place in each key/value root and layout node down to it)."""
    qs = shape_of(q)
    if qs is None or len(qs) < 3 or (pair is not None and len(qs) < 4):
        return f"queries of shape {qs}: no heads dim of their own before the sequence"
    hq = qs[-3]
    places, kvs = {}, []
    for at_ in (kp, vp):
        if at_ not in paths:
            return "its keys or values are not split along the sequence"
        r, chain = paths[at_]
        at, kv = _up([r, *chain], cp)
        if at is None or hq % cp:
            return (f"{hq} query heads and {kv} key/value heads (per TP rank, before grouped-query expansion) "
                    f"do not both divide by cp={cp}; use a cp that divides both, or cp_attention='allgather'")
        places[r] = at
        kvs.append(kv)
    for m in filter(None, map(shape_of, others)):
        if len(m) >= 3 and m[-3] not in (1, hq):
            return f"its input of shape {m} has {m[-3]} head rows for {hq} query heads"
        if pair is not None and len(m) >= 3 and m[-3] > 1:
            return f"its input of shape {m} has a row per head: Ulysses cuts only an SDPA mask's"
    took[n] = {**places, "heads": (hq, kvs[0]), "moved": (q, o, *places)}
    if pair is not None:
        took[n]["pair"] = pair
    return ""


def _eager(n, paths, cp, took, fed_by_tokens) -> str:
    """An eager attention's ``p @ v`` product ``n``: its scores ``p`` computed from one ``q @ k^T`` product by
    elementwise ops and a softmax read by nothing else, keys and values split along the sequence."""
    first = 1 if packet(n) is aten.baddbmm else 0
    if (n, first + 1) not in paths:
        return "an eager attention product whose values are not split along the sequence"
    region, scores, whole, todo = set(), set(), [], [n.args[first]]
    while todo:
        x = todo.pop()
        if not isinstance(x, torch.fx.Node) or x in region or x in scores:
            continue
        if x not in fed_by_tokens:
            whole.append(x)
        elif packet(x) in ACTIVATION_PRODUCTS and (x, 1 + (packet(x) is aten.baddbmm)) in paths:
            scores.add(x)
        elif packet(x) in SOFTMAX or packet(x) in ELEMENTWISE_LIKE or is_pointwise(x):
            region.add(x)
            todo.extend(tensor_args(x))
        else:
            return ("part of an eager attention (q @ k^T, p @ v) whose scores pass through "
                    f"{x.name} ({packet(x)}): Ulysses takes elementwise ops and a softmax between them")
    outside = [u for x in region | scores for u in x.users if u not in region and u is not n and
               packet(u) not in ASSERTS]
    if len(scores) != 1 or outside:
        return "an eager attention whose scores are read elsewhere or come from several products"
    (s,) = scores
    q = s.args[1 if packet(s) is aten.baddbmm else 0]
    return _check(n, q, n, (s, 1 + (packet(s) is aten.baddbmm)), (n, first + 1), whole, paths, cp, took, pair=s)


def _up(nodes: list, cp: int) -> tuple[dict | None, int]:
    """Walking up from the attention's operand (``nodes[-1]``) to the root (``nodes[0]``): per node, (dim,
    size) of the block of heads a rank takes (the first ``cp``-th of the heads dim and everything inside it,
    as it lies in that node's shape); None where the heads do not cut so (a heads dim of an expanded size 1:
    multi-query keys, or a count cp does not divide). Also the key/value heads before any expansion."""
    shape = shape_of(nodes[-1])
    d = len(shape) - 3
    expanded = 1
    for c in nodes[1:]:
        if packet(c) is aten.expand:
            src, dst = shape_of(c.args[0]), shape_of(c)
            off = len(dst) - len(src)
            expanded *= math.prod(dst[i + off] for i in range(len(src)) if src[i] == 1 and dst[i + off] > 1)
            expanded *= math.prod(dst[:off])
    kv = shape[d] // expanded
    if shape[d] % cp:
        return None, kv
    at = {nodes[-1]: (d, shape[d] // cp)}
    for c, p in zip(reversed(nodes[1:]), reversed(nodes[:-1])):
        d, k = at[c]
        src, dst, op = shape_of(p), shape_of(c), packet(c)
        if op in PASS_THROUGH:
            got = (d, k)
        elif op is aten.transpose:
            a, b = (x % len(dst) for x in c.args[1:3])
            got = (b if d == a else a if d == b else d, k)
        elif op is aten.permute:
            got = ([x % len(dst) for x in c.args[1]][d], k)
        elif op is aten.expand:
            off = len(dst) - len(src)
            got = (d - off, k) if d >= off and src[d - off] == dst[d] else None
        elif op in SAME_ORDER_RESHAPES:
            got = _locate(k * math.prod(dst[d + 1:]), src, cp)
        else:
            got = None
        if got is None:
            return None, kv
        at[p] = got
    d, k = at[nodes[0]]
    return (at if shape_of(nodes[0])[d] == cp * k else None), kv


def _locate(after: int, shape: tuple, cp: int) -> tuple[int, int] | None:
    """The dim of ``shape`` (row-major) where a block of ``after`` elements, ``cp`` of which make a dim's
    outermost factor, sits: (dim, block size within it)."""
    for j in reversed(range(len(shape))):
        inner = math.prod(shape[j + 1:])
        if after % inner == 0 and shape[j] % (cp * (after // inner)) == 0:
            return j, after // inner
    return None


# ---- the rewrite ----------------------------------------------------------------------------------

def heads_to_seq(rw, x: torch.fx.Node, d: int, s: int) -> torch.fx.Node:
    """Sharded ``x`` (this rank's ``2c`` rows along ``s``, every head along ``d``) -> this rank's group of
    heads over the whole sequence, in sequence order: one all-to-all."""
    n, c = rw.l.cp, rw.l.chunk
    local = list(shape_of(x))
    local[s] = 2 * c
    nd = len(local)
    split = rw.call(aten.view.default, x, local[:d] + [n, local[d] // n] + local[d + 1:])
    front = rw.call(aten.permute.default, split, [d] + [i for i in range(nd + 1) if i != d])
    got = rw.call(fxpar_ops.all_to_all.default, front, rw.l.group)
    back = rw.call(aten.permute.default, got, list(range(1, s + 1)) + [0] + list(range(s + 1, nd + 1)))
    whole = local[:d] + [local[d] // n] + local[d + 1:]
    whole[s] = rw.l.seq
    flat = rw.call(aten.reshape.default, back, whole)  # rank-major: each rank's head chunk, then its tail chunk
    parts = [rw.call(aten.slice.Tensor, flat, s, j * c, (j + 1) * c) for j in rw.l.natural_order()]
    return rw.call(aten.cat.default, parts, s)


def seq_to_heads(rw, y: torch.fx.Node, d: int, s: int, whole_shape: list[int]) -> torch.fx.Node:
    """The inverse of :func:`heads_to_seq`: ``y`` (this rank's heads, the whole sequence in order) -> this
    rank's ``2c`` rows of every head (``whole_shape``: the traced, whole value's shape)."""
    n, c = rw.l.cp, rw.l.chunk
    mine = list(whole_shape)
    mine[d] //= n
    order = [k for r in range(n) for k in (r, 2 * n - 1 - r)]  # rank-major: rank r's head and tail chunks
    ranked = rw.call(aten.cat.default, [rw.call(aten.slice.Tensor, y, s, k * c, (k + 1) * c) for k in order], s)
    nd = len(mine)
    split = rw.call(aten.view.default, ranked, mine[:s] + [n, 2 * c] + mine[s + 1:])
    front = rw.call(aten.permute.default, split, [s] + [i for i in range(nd + 1) if i != s])
    got = rw.call(fxpar_ops.all_to_all.default, front, rw.l.group)
    back = rw.call(aten.permute.default, got, list(range(1, d + 1)) + [0] + list(range(d + 1, nd + 1)))
    out = list(whole_shape)
    out[s] = 2 * c
    return rw.call(aten.reshape.default, back, out)


def _my_heads(rw, node, x: torch.fx.Node, d: int, k: int) -> torch.fx.Node:
    """This rank's group of heads of ``x`` (``k`` along ``d``), over the whole sequence: for a value not split
    as the all-to-all takes it (whole, a sum over the sequence, or split along another layout)."""
    s = rw.state.get(x)
    if s == PARTIAL:
        x = rw.materialize(x)
    elif isinstance(s, Sh):
        x = rw.gather(x, s)
    rw.res.gathered.append(node.name)
    return rw.call(aten.slice.Tensor, x, d, rw.l.rank * k, (rw.l.rank + 1) * k)


def root(rw, node: torch.fx.Node) -> None:
    """A key/value root of Ulysses attentions: to this rank's heads over the whole sequence, and each layout
    op down to the attentions reshaped for ``1 / cp`` of the heads."""
    places = rw.uly.roots[node]
    d, k = places[node]
    s = rw.state.get(node)
    with rw.g.inserting_before(node.next):
        if isinstance(s, Sh) and s.outer == 1 and s.dim != d:
            full = heads_to_seq(rw, node, d, s.dim)
        else:
            full = _my_heads(rw, node, node, d, k)
    for reader, pos in rw.roots[node]:
        reader.update_arg(pos, full)
    for c, (dc, _) in places.items():
        if c is not node and packet(c) in SHAPE_ARG_OPS:
            shape = list(shape_of(c))
            shape[dc] //= rw.l.cp
            c.update_arg(1, shape)
    rw.res.all_to_alls.append(node.name)


def attention(rw, node: torch.fx.Node) -> None:
    """An attention Ulysses took: an SDPA's queries to this rank's heads over the whole sequence, its mask
    whole (per-head rows cut to this rank's heads), its output back to this rank's rows of every head; of an
    eager pair, the queries of ``q @ k^T``, the output of ``p @ v``."""
    if node in rw.uly.scores:
        return _queries(rw, node, 1 if packet(node) is aten.baddbmm else 0)
    if packet(node) is not SDPA:
        return _output(rw, node)
    hq = _queries(rw, node, 0)
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, torch.fx.Node):
        rw.whole(node, mask)  # a mask split along the sequence (rare: masks come from positions) made whole
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        m = shape_of(mask)
        if len(m) >= 3 and m[-3] == hq > 1:
            k = hq // rw.l.cp
            with rw.g.inserting_before(node):
                cut = rw.call(aten.slice.Tensor, mask, len(m) - 3, rw.l.rank * k, (rw.l.rank + 1) * k)
            node.replace_input_with(mask, cut)
    _output(rw, node)


def _queries(rw, node, pos: int) -> int:
    """Argument ``pos`` of ``node`` (queries ``[..., heads, seq, dim]``) to this rank's heads over the whole
    sequence; returns the head count."""
    q = node.args[pos]
    shape = list(shape_of(q))
    nd = len(shape)
    d, s = nd - 3, nd - 2
    sq = rw.state.get(q)
    with rw.g.inserting_before(node):
        mine = heads_to_seq(rw, q, d, s) if isinstance(sq, Sh) and (sq.dim, sq.outer) == (s, 1) else \
            _my_heads(rw, node, q, d, shape[d] // rw.l.cp)
    node.update_arg(pos, mine)
    return shape[d]


def _output(rw, node) -> None:
    """``node``'s output (this rank's heads over the whole sequence) back to this rank's rows of every head."""
    nd = len(shape_of(node))
    d, s = nd - 3, nd - 2
    users = list(node.users)
    with rw.g.inserting_before(node.next):
        out = seq_to_heads(rw, node, d, s, list(shape_of(node)))
    for u in users:
        u.replace_input_with(node, out)
    out.meta["val"] = node.meta.get("val")  # the traced (whole) shape, for the rules that read it
    rw.state[out] = Sh(s)
    rw.res.ulysses.append(node.name)
