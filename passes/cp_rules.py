"""Context parallelism's vocabulary: the sequence's layout over the cp ranks, a value's state, the op sets the
rules (:mod:`fxpar.passes.cp_ops`) dispatch on, and the analysis that places the key/value gathers
(:mod:`fxpar.passes.context_parallel` says what the pass does and why). Reads graphs; writes nothing.

A value's state is None (whole: the same on every cp rank), a :class:`Sh` (this rank's chunks of the
sequence along ``dim``; ``outer`` counts the blocks merged in front of the sequence in that dim, as a
``[batch * seq]`` flattening has ``batch``) or :data:`PARTIAL` (this rank's part of a sum over the sequence);
a token-local MoE's values have the states :class:`Tk`, :class:`Pos` and :class:`Aux`
(:mod:`fxpar.passes.cp_tokens` says what they mean and which rules read them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.op_classes import (
    ACTIVATION_PRODUCTS,
    DIM_VIEWS,
    ELEMENTWISE_LIKE,
    LAYOUT_CHAIN,
    SAME_ORDER_RESHAPES,
    is_pointwise,
    writes_first,
)

aten = torch.ops.aten
fxpar_ops = torch.ops.fxpar
PARTIAL = "partial"

SDPA = aten.scaled_dot_product_attention


def packet(node: torch.fx.Node):
    return getattr(node.target, "overloadpacket", None)


def shape_of(node) -> tuple | None:
    v = node.meta.get(meta.VAL) if isinstance(node, torch.fx.Node) else None
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def user_input_of(node, program) -> torch.fx.Node | None:
    """The user-input placeholder ``node`` is, through views and elementwise index arithmetic, else None:
    a vocabulary-parallel embedding shifts and masks the ids first; a model with placeholder tokens (image,
    audio) replaces them by ``where(mask, 0, ids)`` or ``ids[mask] = 0`` (the ids may be any argument of the
    shape of the result, not only the first); ids of several rows per sequence (codebooks) are picked by a
    ``select`` or ``slice`` of a dim other than the last (the sequence stays last)."""
    bound = {b.placeholder: b for b in program.inputs}
    seen: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        node = todo.pop()
        if not isinstance(node, torch.fx.Node) or node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            b = bound.get(node.name)
            if b is not None and b.kind == "user":
                return node
            continue
        if node.op != "call_function":
            continue
        op, shape = packet(node), shape_of(node)
        nd_in = len(shape_of(node.args[0]) or ()) if node.args else 0
        whole_slice = op is aten.slice and shape == shape_of(node.args[0])  # ids[:, -seq:] of seq ids
        if op in SAME_ORDER_RESHAPES or whole_slice or op in (aten.index_put, aten.index_put_) and masked_write(node):
            todo.append(node.args[0])
        elif op in (aten.select, aten.slice) and nd_in > 1 and \
                (node.args[1] if len(node.args) > 1 else 0) % nd_in != nd_in - 1:
            todo.append(node.args[0])
        elif op in ELEMENTWISE_LIKE or is_pointwise(node):
            todo.extend(a for a in tensor_args(node) if shape_of(a) == shape)
    return None


def masked_write(node: torch.fx.Node) -> bool:
    """``index_put(x, [mask], v)`` with one boolean mask of ``x``'s shape: elementwise (``where(mask, v, x)``)."""
    idx = node.args[1]
    return len(idx) == 1 and isinstance(idx[0], torch.fx.Node) and shape_of(idx[0]) == shape_of(node) and \
        idx[0].meta[meta.VAL].dtype == torch.bool


@dataclass(frozen=True)
class Layout:
    """The sequence's cut: ``2 * cp`` chunks; rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``."""

    seq: int
    cp: int
    rank: int
    group: str

    @property
    def chunk(self) -> int:
        return self.seq // (2 * self.cp)

    def ranges(self) -> list[tuple[int, int]]:
        """This rank's rows of the sequence, head chunk first."""
        c, r, n = self.chunk, self.rank, self.cp
        return [(r * c, (r + 1) * c), ((2 * n - 1 - r) * c, (2 * n - r) * c)]

    def natural_order(self) -> list[int]:
        """For each chunk of the sequence in order, where it sits in a gather (rank-major, head then tail)."""
        n = self.cp
        return [2 * k if k < n else 2 * (2 * n - 1 - k) + 1 for k in range(2 * n)]


@dataclass(frozen=True)
class Sh:
    """Sharded along ``dim``, whose whole size is ``outer * seq`` (the sequence innermost in it)."""

    dim: int
    outer: int = 1


# ---- token-local states (the rules: fxpar.passes.cp_tokens) ----------------------------------------------
@dataclass(frozen=True)
class Canon:
    """This rank's rows in chunk order, ``inner`` consecutive rows per token, ``outer`` blocks of the sequence."""

    outer: int
    inner: int


@dataclass(frozen=True)
class Perm:
    """The rows of ``base`` in the order the sort ``key`` read from this rank's data."""

    key: torch.fx.Node
    base: Canon


@dataclass(frozen=True)
class Disp:
    """The rows ep's dispatch of ``Perm(key)`` rows brought to this rank's experts."""

    key: torch.fx.Node


@dataclass(frozen=True)
class Tk:
    """Data whose dim ``dim`` holds rows of layout ``lay`` (never ``Canon(o, 1)``: that is ``Sh(dim, o)``)."""

    dim: int
    lay: object
    src: frozenset = field(default=frozenset(), compare=False)


@dataclass(frozen=True)
class Pos:
    """1-D row numbers: row i in layout ``rows``, its entry a row of layout ``to``; ``perm``: each row of ``to``
    exactly once (a sort's indices, its inverse)."""

    rows: object
    to: object
    perm: bool
    src: frozenset = field(default=frozenset(), compare=False)


@dataclass(frozen=True)
class Aux:
    """Of this rank's rows of ``lay``, with no row dim: ``kind`` "counts" / "offsets" per expert (a histogram of
    the sorted ids, its cumsum), "ep" (ep's counts of every ep rank's rows)."""

    lay: object
    kind: str
    src: frozenset = field(default=frozenset(), compare=False)


def is_local(s) -> bool:
    return isinstance(s, (Tk, Pos, Aux)) or isinstance(s, tuple) and any(is_local(x) for x in s)


def srcs(s) -> frozenset:
    if isinstance(s, tuple):
        return frozenset().union(*(srcs(x) for x in s))
    return s.src if isinstance(s, (Tk, Pos, Aux)) else frozenset()


def row_lay(s):
    """(row dim, row layout) of a data state (Sh or Tk), else None."""
    if isinstance(s, Sh):
        return s.dim, Canon(s.outer, 1)
    return (s.dim, s.lay) if isinstance(s, Tk) else None


def data(dim: int, lay, src: frozenset):
    return Sh(dim, lay.outer) if isinstance(lay, Canon) and lay.inner == 1 else Tk(dim, lay, src)


def arg(node, i: int, name: str, default):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def seq_dim_after(src: tuple, d: int, outer: int, dst: tuple, seq: int) -> Sh | None:
    """Where the sequence factor of dim ``d`` of ``src`` lands in ``dst`` (a reshape of the same elements):
    the dim whose inner elements equal the sequence factor's, with the sequence innermost in it."""
    after, before = math.prod(src[d + 1:]), math.prod(src[:d]) * outer
    for j, size in enumerate(dst):
        if math.prod(dst[j + 1:]) == after and size % seq == 0 and math.prod(dst[:j]) * (size // seq) == before:
            return Sh(j, size // seq)
    return None


def lost_write(node: torch.fx.Node, x: torch.fx.Node) -> bool:
    """Replacing input ``x`` of ``node`` by a gathered copy would lose a write: ``node`` writes ``x`` in place,
    or a later op writes into ``node``'s view of it, and ``x`` is read again after that write (a buffer filled
    step by step). A write whose only reader is the writing op's own output keeps its value."""
    chain, writers, todo = {node}, [node] if writes_first(node) and node.args[0] is x else [], [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.args and u.args[0] is n and writes_first(u):
                writers.append(u)
            elif packet(u) in DIM_VIEWS and u.args[0] is n:
                chain.add(u)
                todo.append(u)
    if not writers:
        return False
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    first = min(order[w] for w in writers)
    return any(order[u] > first for u in x.users if u not in chain and u not in writers)


def tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    out = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda a: out.append(a) if isinstance(a, torch.fx.Node) else None)
    return out


def token_fed(gm: torch.fx.GraphModule, program) -> set[torch.fx.Node]:
    """The nodes the token ids feed: an embedding lookup of a user input and everything computed from it."""
    tainted: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if (packet(n) is aten.embedding and user_input_of(n.args[1], program) is not None) or \
                any(a in tainted for a in tensor_args(n)):
            tainted.add(n)
    return tainted


def kv_roots(gm: torch.fx.GraphModule, program) -> dict[torch.fx.Node, list[tuple[torch.fx.Node, int]]]:
    """Where each attention's keys and values are gathered: node -> (reader, argument position) of each
    reader of the gathered value. Found on the graph's taint by the token ids (what the embedding of a user
    input feeds), walking up from each key/value operand through
    :data:`~fxpar.ir.op_classes.LAYOUT_CHAIN` ops that feed only the next one (so the gather comes before any
    grouped-query expansion)."""
    tainted = token_fed(gm, program)
    roots: dict[torch.fx.Node, list[tuple[torch.fx.Node, int]]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        first = 1 if packet(n) is aten.baddbmm else 0  # baddbmm(scores, q, k^T): its product's operands follow
        if packet(n) is SDPA:
            operands = [1, 2]
        elif packet(n) in ACTIVATION_PRODUCTS and \
                all(a in tainted for a in n.args[first:first + 2] if isinstance(a, torch.fx.Node)):
            operands = [first + 1]
        else:
            continue
        for pos in operands:
            o = n.args[pos]
            if not isinstance(o, torch.fx.Node) or o not in tainted:
                continue
            reader, cur = (n, pos), o
            while packet(cur) in LAYOUT_CHAIN and len(cur.users) == 1 and cur is not n.args[first] \
                    and cur.args[0] in tainted:
                reader, cur = (cur, 0), cur.args[0]
            roots.setdefault(cur, []).append(reader)
    return roots
