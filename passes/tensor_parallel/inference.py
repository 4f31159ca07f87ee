"""Column/row pairs, vocabulary-parallel embeddings and the LM head, inferred from the graph.

Reads: the traced graph (``val``, ``fxpar.param``, ``fxpar.module``), the config's vocabulary size. Writes
nothing: :func:`infer_pairs` returns module FQN -> style for the linears, embeddings and heads it can cut.

A linear is column-parallel when its output, followed with the dim its shard would be on, reaches other
linears only as their contracted (last) input dim, through ops that keep a shard where the pass keeps it
(views, transposes, elementwise ops, softmax and reductions over other dims, batched matmuls and
attention over the heads dim, splits of a fused projection cut part by part); those linears are
row-parallel. Several columns may share rows (``q``, ``k``, ``v`` -> ``o``; ``gate``, ``up`` ->
``down``). An elementwise op may meet another full-width operand only where that operand is itself made
from linears or parameters (a gate, rotary halves): a residual stream, made from the embedding, stops
the walk, so a block's output never starts a pair into the next block. A reshape whose heads do not
divide by tp (the view splitting ``[.., H*D]`` into ``[.., H, D]``) stops it too: the pair stays whole,
with the reason in ``skipped``. Pairs that need no gather are taken first, then the LM head (so a
head after a norm stays column-parallel rather than the row of the dense before it), then, for
linears still whole, pairs across a norm over the shard (one reduction of a small tensor, or an
all-gather).

The token embedding (a lookup of user-input ids in a table of at least the vocabulary's rows, so also
per-layer token tables) is vocabulary-parallel; position, type and other small tables stay replicated
as in Megatron (a table indexed by computed positions is small and its all-reduce would cost as much as
the lookup). A linear whose output only reaches the graph's outputs or a cross-entropy (the LM head) is
column-parallel: the loss is vocabulary-parallel and a training step never gathers the logits.

Sizes a trace reads from the data (unbacked symbols: a patch or token count) are compared only where the
answer is statically known (``statically_known_true``): two shapes are the same, a dim is 1 or divides by tp,
only when the symbols' facts prove it, else the walk takes the cautious answer instead of guarding.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true as known
from torch.fx.experimental.symbolic_shapes import sym_eq

from fxpar.ir import meta
from fxpar.ir.op_classes import (
    ASSERTS,
    BATCHED_MATMULS,
    CACHE_WRITES,
    DIM_MOVES_AND_CUTS,
    LOSSES,
    NORMS,
    PASS_THROUGH,
    REDUCTIONS,
    RESHAPES,
    SOFTMAX,
    SPLITS,
    is_pointwise,
    packet,
)
from fxpar.ir.placement import chunk_fits
from fxpar.ir.program import Program
from fxpar.passes.tensor_parallel.dim_moves import moved
from fxpar.passes.tensor_parallel.layouts import linear_weight, packed_segments, split_dim
from fxpar.passes.tensor_parallel.packing import find_packing

aten = torch.ops.aten


def _ndim(node) -> int:
    v = node.meta.get(meta.VAL) if isinstance(node, torch.fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else -1


def _shape(node) -> tuple:
    v = node.meta.get(meta.VAL) if isinstance(node, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _input_of(node: torch.fx.Node):
    """The activation a linear-like node contracts (not its weight)."""
    return node.args[1] if packet(node) is aten.addmm else node.args[0]


class _Graph:
    """Per-program facts the walks share: packed split nodes, and which values are made from linears
    and parameters only (memoised back-walks)."""

    def __init__(self, program: Program, tp: int):
        self.program, self.tp = program, tp
        self.packed, _ = packed_segments(program, tp)
        self.fused = find_packing(program, tp, linear_weight).values  # views of fused values (whole pieces)
        self.users = {b.placeholder for b in program.inputs if b.kind == "user"}
        self.order = {n: i for i, n in enumerate(program.graph.nodes)}
        self._made: dict[torch.fx.Node, bool] = {}

    def made_of_linears(self, node) -> bool:
        """True when every path back from ``node`` (through views and elementwise ops) ends at a linear's
        output, a parameter or a constant: a gate or a sibling projection, not a residual stream."""
        if not isinstance(node, torch.fx.Node):
            return True
        if node in self._made:
            return self._made[node]
        self._made[node] = False  # cycles cannot happen in a DAG; this only guards re-entry
        if node.op == "placeholder":
            ok = node.name not in self.users
        elif node.op == "get_attr" or linear_weight(node)[0] is not None:
            ok = True
        elif node.op != "call_function":
            ok = False
        else:
            pkt = packet(node)
            carrier = pkt in RESHAPES or pkt in PASS_THROUGH or pkt in DIM_MOVES_AND_CUTS or pkt in SPLITS \
                or pkt is aten.cat or node.target is operator.getitem or is_pointwise(node)
            # operands broadcast into it (rotary tables, scales) are not what it is made of
            ok = carrier and all(self.made_of_linears(a) for a in node.all_input_nodes
                                 if known(sym_eq(_shape(a), _shape(node))) or len(node.all_input_nodes) == 1)
        self._made[node] = ok
        return ok


def _moved(user: torch.fx.Node, src: torch.fx.Node, d: int, tp: int) -> int | None:
    """The dim a shard of ``src`` at ``d`` lands on in ``user`` (a view-like op, :mod:`.dim_moves`), or None
    (lost or gathered). A reshape keeps it at the same size, divisible or not; split or merged, tp must
    divide both sizes."""
    od = moved(user, d)
    if od is None or packet(user) not in RESHAPES:
        return od
    keeps = known(_shape(user)[od] == _shape(src)[d]) or (known(_shape(user)[od] % tp == 0)
                                                          and known(_shape(src)[d] % tp == 0))
    return od if keeps else None


class _Walk:
    """Follows a linear's output with its would-be shard dim (see the module docstring)."""

    def __init__(self, g: _Graph, start: torch.fx.Node, gathers: bool, head: bool = False):
        self.g, self.gathers, self.head = g, gathers, head
        self.ends: list[torch.fx.Node] = []
        self.seen: dict[torch.fx.Node, int] = {}
        self.why = ""
        self.sinks = 0
        self.pending: list[tuple[torch.fx.Node, int]] = []
        self.unpacked = False
        self.start = start
        self.ok = self._run(start, _ndim(start) - 1) and not self.unpacked and all(
            self.seen.get(a) == ad or self.g.made_of_linears(a) for a, ad in self.pending)

    def _run(self, start, d0) -> bool:
        todo = [(start, d0)]
        while todo:
            node, d = todo.pop()
            if node in self.seen:
                if self.seen[node] != d:
                    return False
                continue
            self.seen[node] = d
            for user in node.users:
                nxt = self._step(node, d, user)
                if nxt is False:
                    return False
                if nxt is not True:
                    todo.append((user, nxt))
        return True

    def _others_fit(self, user, out_dim: int, skip) -> bool:
        """Every other tensor operand of ``user`` either broadcasts along ``out_dim``, is sharded alike
        already, or is made from linears and parameters (the pass slices it, no communication)."""
        no = _ndim(user)
        for a in user.all_input_nodes:
            if a is skip:
                continue
            ad = out_dim - (no - _ndim(a))
            if ad < 0 or _ndim(a) < 0 or known(_shape(a)[ad] == 1) or self.seen.get(a) == ad:
                continue
            if self.g.order[a] < self.g.order[self.start] and not self.g.made_of_linears(a):
                return False  # made before the walk's linear (a residual stream): fail now
            self.pending.append((a, ad))  # sharded alike by a later step of this walk, or made of linears
        return True

    def _step(self, node, d, user):
        """True: a sink (nothing to follow); False: the walk fails; an int: follow ``user`` at that dim."""
        pkt, nd, tp = packet(user), _ndim(node), self.g.tp
        if user.op == "output" or pkt in LOSSES:
            self.sinks += 1
            return self.head and (user.op == "output" or d == _ndim(node) - 1)
        if pkt in ASSERTS:
            return True
        if linear_weight(user)[0] is not None and not self.head:
            if _input_of(user) is node and d == nd - 1:
                self.ends.append(user)
                return True
            return False
        if pkt in CACHE_WRITES and user.args[3] is node:
            return d
        if user.target is operator.getitem:
            return d
        cut = (pkt in SPLITS and split_dim(user) % nd == d) or (
            pkt is aten.slice and (user.args[1] if len(user.args) > 1 else 0) % nd == d)
        if cut and user not in self.g.packed:
            self.unpacked = True  # a fused layout packing.py does not cut here: followed only to find a reason
            return d
        if pkt in SPLITS or cut:
            return d
        if pkt in PASS_THROUGH:
            return d
        if pkt in RESHAPES or pkt in DIM_MOVES_AND_CUTS:
            out = _moved(user, node, d, 1 if user in self.g.fused else tp)  # local sizes from the pieces
            if out is None:
                self.why = f"{user.name} {_shape(node)} -> {_shape(user)}: the shard's dim does not divide by tp={tp}"
                return False
            return out
        if pkt in SOFTMAX or pkt in REDUCTIONS:
            dims = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", list(range(nd)))
            dims = [x % nd for x in ([dims] if isinstance(dims, int) else list(dims or range(nd)))]
            if d not in dims:
                keep = pkt in SOFTMAX or (user.args[2] if len(user.args) > 2 else user.kwargs.get("keepdim", False))
                return d if keep else d - sum(x < d for x in dims)
            return True if self.gathers and not self.head else False  # a norm's statistic over the shard
        if pkt in NORMS:  # layer_norm / rms_norm over the trailing normalized_shape; group_norm over channels
            last = len(user.args[1]) if pkt is not aten.group_norm and pkt is not aten.native_group_norm else nd - 1
            return d if d < nd - last or (self.gathers and not self.head) else False
        if pkt is aten.cat:
            dim = (user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)) % _ndim(user)
            return d if dim != d and self._others_fit(user, d, node) else False
        if pkt in BATCHED_MATMULS and nd >= 3 and d < nd - 2:
            out = d + _ndim(user) - nd
            return out if self._others_fit(user, out, node) else False
        if pkt is aten.scaled_dot_product_attention and d == 1 and nd == 4 and node in user.args[:3]:
            for a in user.args[:3]:
                h = _shape(a)[1] if _ndim(a) == 4 else 1
                if a is not node and self.seen.get(a) != 1 and h > 1:
                    if h % tp and tp % h:
                        return False
                    self.pending.append((a, 1))
            return 1
        if user.op == "call_function" and is_pointwise(user):
            out = d + _ndim(user) - nd
            return out if self._others_fit(user, out, node) else False
        return False


def _vocab(program: Program) -> int | None:
    config = getattr(program.root, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    v = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None)
    return v if isinstance(v, int) else None


def _ids_from_user(g: _Graph, ids, depth: int = 8) -> bool:
    """The lookup ids come from a user input through views, copies and elementwise ops (a mask of ids
    out of a per-layer table's range); positions made by arange or a cumulative sum do not."""
    if not isinstance(ids, torch.fx.Node) or depth == 0:
        return False
    if ids.op == "placeholder":
        return ids.name in g.users
    pkt = packet(ids)
    if ids.op != "call_function" or not (pkt in RESHAPES or pkt in PASS_THROUGH or pkt in DIM_MOVES_AND_CUTS
                                         or is_pointwise(ids) or pkt in (aten.where, aten.masked_fill)):
        return False
    return any(_ids_from_user(g, a, depth - 1) for a in ids.all_input_nodes)


def infer_pairs(program: Program, tp: int, taken: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Styles for what ``taken`` (module FQN -> style, e.g. the model's plan) leaves unstyled: column/row
    pairs, vocabulary-parallel token embeddings and the LM head. Returns (new styles, skipped module ->
    why a candidate stays whole)."""
    g = _Graph(program, tp)
    styles, skipped = dict(taken), {}

    linears = [n for n in program.graph.nodes if linear_weight(n)[0] is not None and _ndim(n) >= 2]
    _pairs(g, linears, styles, skipped, gathers=False)
    for node in linears:  # heads: outputs that only reach the graph's outputs or a loss
        if not _free(node, styles) or packet(node) not in (aten.linear, aten.matmul):
            continue
        walk = _Walk(g, node, False, head=True)
        if walk.ok and walk.sinks and chunk_fits(_shape(node)[-1], tp):  # tp need not divide: torch.chunk's shares
            styles[_module(node)] = "colwise"
        elif walk.ok and walk.sinks:
            skipped[_module(node)] = f"{_shape(node)[-1]} output features are too few for tp={tp}"
    _pairs(g, linears, styles, skipped, gathers=True)
    vocab = _vocab(program)
    for node in program.graph.nodes:
        if packet(node) is not aten.embedding or not isinstance(node.args[0], torch.fx.Node):
            continue
        fqn = node.args[0].meta.get(meta.PARAM)
        rows = _shape(node.args[0])[0] if _ndim(node.args[0]) == 2 else 0
        if not fqn or fqn in styles or _module(node) in styles or not _ids_from_user(g, node.args[1]):
            continue
        if vocab is not None and rows < vocab:
            continue
        if not chunk_fits(rows, tp):
            skipped[fqn] = f"{rows} rows are too few for tp={tp}"
            continue
        styles[fqn] = "embedding_rowwise"
    return {k: v for k, v in styles.items() if k not in taken and k is not None}, skipped


def _module(n):
    return n.meta.get(meta.MODULE)


def _free(n, styles) -> bool:
    w = linear_weight(n)[0]
    return w is not None and _module(n) not in styles and w.meta[meta.PARAM] not in styles


def _pairs(g: _Graph, linears, styles: dict, skipped: dict, gathers: bool) -> None:
    """Column/row pairs in graph order; a column may join rows another column already feeds."""
    tp, module = g.tp, _module
    for node in linears:
        if not _free(node, styles):
            continue
        walk = _Walk(g, node, gathers)
        if not walk.ok or not walk.ends:
            if walk.why:
                skipped[module(node)] = walk.why
            continue
        if any(styles.get(module(e)) not in (None, "rowwise", "rowwise_split_input", "rowwise_rep") for e in walk.ends):
            continue
        bad = [n for n in (node, *[_input_of(e) for e in walk.ends]) if not chunk_fits(_shape(n)[-1], tp)]
        if bad:
            skipped[module(node)] = f"{_shape(bad[0])[-1]} features are too few for tp={tp}"
            continue
        styles[module(node)] = "colwise"
        skipped.pop(module(node), None)
        for e in walk.ends:
            styles[module(e)] = "rowwise"
