"""Tensor parallelism as a graph pass: placements, collectives and local shapes for one TP rank.

Reads: ``fxpar.module``, ``fxpar.param``, ``val``; the plan's styles (module FQN globs -> style).
Writes: ``fxpar.placement`` (``(Shard(d),)``, ``(Replicate(),)``) on every node, ``torch.ops.fxpar.*``
collective nodes, local sizes in view-like ops, and a per-rank :class:`Program` bound to this rank's
shards (fresh Parameters holding slices of the model's tensors).

Rules (Megatron): a column-parallel linear shards its weight and bias by output features, takes a
replicated input through ``identity_fwd_all_reduce_bwd`` (inserted once per input value) and yields
``Shard(-1)``; a row-parallel linear shards its weight by input features, takes ``Shard(-1)`` and
all-reduces its output (bias added after). Placements then flow through ATen ops: elementwise ops keep
a shard (a replicated operand that is not broadcast along the sharded dim is sliced locally, without
communication), view/reshape map a shard of a merged dim to its leading factor, transpose/permute move
it, reductions and softmax over other dims keep it, attention keeps a shard of the heads dim. Any other
op gets replicated inputs (gathered): correct, and visible to the collective counter. Vocabulary-
parallel embeddings do a masked local lookup and an all-reduce.
"""

from __future__ import annotations

import fnmatch
import math
import operator

import torch
import torch.fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.program import ParamInfo, Program
from fxpar.passes.pipeline_split import needs_grad
from fxpar.runtime import ops as fxops

aten = torch.ops.aten
fxpar_ops = torch.ops.fxpar

# Style names are those of transformers' ``base_model_tp_plan`` (and the issue's user plans). The pass
# needs from a style only how the module's parameters are cut; what happens between layers follows
# from the graph (a "gather_output" or "split_input" variant gathers only where a consumer needs it).
_COLWISE = frozenset({"colwise", "colwise_gather_output", "packed_colwise"})  # output features
_ROWWISE = frozenset({"rowwise", "rowwise_split_input", "packed_rowwise"})  # input features
_VOCAB = frozenset({"vocab_parallel", "embedding_rowwise"})  # embedding rows (the vocabulary)
_EMBEDDING_COLWISE = frozenset({"embedding_colwise"})  # embedding columns (hidden features)
# markers: parameters stay whole (a replicated parameter that meets a sharded value gets its gradient
# all-reduced by the graph rule anyway; an MoE experts module's output is a partial sum by the rules)
_MARKERS = frozenset({"replicate", "replicated_with_grad_allreduce", "moe_tp_experts", "local_params",
                      "mla_kv_a_proj", "sequence_parallel"})
STYLES = tuple(sorted(_COLWISE | _ROWWISE | _VOCAB | _EMBEDDING_COLWISE | _MARKERS))
_PARTIAL = "partial"  # placement of a value that is a sum over the TP ranks (DTensor's Partial())
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view}
_PASS = {aten.contiguous, aten.alias, aten.clone, aten.detach, aten.dropout, aten.to, aten._to_copy,
         aten.lift_fresh_copy}
_SKIP = {aten._assert_tensor_metadata}
_REDUCTIONS = {aten.mean, aten.sum, aten.amax, aten.amin}
_SOFTMAX = {aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax}


def resolve_styles(program: Program, plan: dict[str, str], strict: bool = True) -> dict[str, str]:
    """Module (or parameter) FQN -> style, from globs over FQNs; unknown styles and empty globs are
    errors. ``strict=False`` (a model's own plan): entries with a style this pass does not know are
    left out, so those modules stay replicated."""
    names = [n for n, _ in program.root.named_modules()] if program.root is not None else []
    if program.root is not None:
        names += [n for n, _ in program.root.named_parameters()]
    out: dict[str, str] = {}
    for glob, style in plan.items():
        if style not in STYLES:
            if not strict:
                continue
            raise PlanError(f"tensor-parallel style {style!r} for {glob!r} is unknown; styles: {', '.join(STYLES)}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if not hits and not strict:  # a model's plan covers layer variants this config may not build
            continue
        if not hits:
            near = sorted({".".join(n.split(".")[:3]) for n in names if n})[:10]
            raise PlanError(f"tensor-parallel plan entry {glob!r} matches no module; modules include {near}")
        for n in hits:
            out[n] = style
    return out


class _Rewriter:
    def __init__(self, program: Program, styles: dict[str, str], tp: int, rank: int, group: str):
        self.program, self.styles, self.tp, self.rank, self.group = program, styles, tp, rank, group
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.place: dict[torch.fx.Node, int | None] = {}  # new node -> sharded dim (None: replicated)
        self.f_cache: dict[torch.fx.Node, torch.fx.Node] = {}
        self.param_dim: dict[str, int] = {}  # canonical FQN -> sharded dim
        self.fallbacks: list[str] = []
        self.grad_flows = needs_grad(program)  # old nodes a gradient flows through
        self.keep_outputs: set[int] | None = None  # graph outputs to compute (None: all)
        self.sp = False  # sequence parallel
        # weights an addmm reads as [in, out] (GPT-2's Conv1D), found from the graph
        self.transposed = {n.args[2].meta.get(meta.PARAM) for n in program.graph.nodes
                           if getattr(n.target, "overloadpacket", None) is aten.addmm
                           and isinstance(n.args[2], torch.fx.Node)} - {None}
        # fused projections ([q; k; v], [gate; up]) cut part by part: split op -> parts, FQN -> parts
        self.packed_splits, self.segments = _packed_segments(program, tp)
        self.partial_src: dict[torch.fx.Node, torch.fx.Node] = {}  # partial new node -> its old node
        self.reduced: dict[torch.fx.Node, torch.fx.Node] = {}  # partial new node -> its sum

    # ---- helpers ------------------------------------------------------------------------------------
    def call(self, target, args, kwargs=None, like: torch.fx.Node | None = None, shard: int | None = None):
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        if like is not None:
            node.meta.update({k: v for k, v in like.meta.items() if k in (meta.MODULE, "nn_module_stack")})
        self.place[node] = shard
        if shard == _PARTIAL:
            self.partial_src[node] = like
        return node

    def ndim(self, old: torch.fx.Node) -> int:
        v = old.meta.get(meta.VAL)
        return v.dim() if isinstance(v, torch.Tensor) else 0

    def replicate(self, new: torch.fx.Node, old: torch.fx.Node) -> torch.fx.Node:
        if self.place.get(new) == _PARTIAL:
            new = self.materialize(new)
        d = self.place.get(new)
        if d is None:
            return new
        return self.call(fxpar_ops.all_gather.default, (new, self.group, d), like=old)

    def slice_to(self, new: torch.fx.Node, old: torch.fx.Node, d: int) -> torch.fx.Node:
        """A replicated value cut to this rank's part along d (no communication)."""
        cur = self.place.get(new)
        if cur == d:
            return new
        if cur is not None:
            new = self.replicate(new, old)
        return self.call(fxpar_ops.scatter_slice.default, (new, self.group, d), like=old, shard=d)

    def style_of(self, old: torch.fx.Node) -> str | None:
        return self.styles.get(old.meta.get(meta.MODULE, ""))

    # ---- the pass -----------------------------------------------------------------------------------
    def run(self) -> torch.fx.Graph:
        for old in self.program.graph.nodes:
            if old.op == "placeholder":
                new = self.graph.placeholder(old.name)
                new.meta = dict(old.meta)
                self.place[new] = self.param_placement(old)
            elif old.op == "get_attr":
                new = self.graph.get_attr(old.target)
                new.meta = dict(old.meta)
                self.place[new] = None
            elif old.op == "output":
                outs = [None if self.keep_outputs is not None and i not in self.keep_outputs
                        else self.replicate(self.env[a], a) if isinstance(a, torch.fx.Node) else a
                        for i, a in enumerate(old.args[0])]
                new = self.graph.output(tuple(outs))
            else:
                new = self.rewrite(old)
            self.env[old] = new
        return self.graph

    def param_placement(self, old: torch.fx.Node) -> int | None:
        fqn = old.meta.get(meta.PARAM)
        if not fqn:
            return None
        info = self.program.params[fqn]
        style = None
        for name in info.fqns:
            style = self.styles.get(name) or self.styles.get(name.rpartition(".")[0]) or style
        nd, t = len(info.shape), fqn in self.transposed
        d = None
        if nd == 0:  # a scalar (e.g. a normaliser buffer) is never cut
            pass
        elif style in _COLWISE or style in _VOCAB:  # [.., out, in] (or [in, out] for Conv1D), bias [out]
            d = 0 if nd == 1 else nd - 1 if t else nd - 2
        elif style in _ROWWISE and nd >= 2:  # a row-parallel layer's bias is added after the reduction
            d = nd - 2 if t else nd - 1
        elif style in _EMBEDDING_COLWISE and nd == 2:
            d = 1
        if d is not None:
            for size in self.segments.get(fqn, [info.shape[d]]):
                if size % self.tp:
                    raise PlanError(f"{fqn} has {info.shape[d]} rows along dim {d}"
                                    f"{f' (packed parts {self.segments[fqn]})' if fqn in self.segments else ''}, "
                                    f"not divisible by tp={self.tp}; module {fqn.rpartition('.')[0]} cannot be "
                                    f"{style}: use a tp degree that divides {size}, or mark it 'replicate'")
            self.param_dim[fqn] = d
        return d

    def args(self, old):
        return torch.fx.node.map_arg(old.args, lambda a: self.env[a]), \
            torch.fx.node.map_arg(old.kwargs, lambda a: self.env[a])

    def rewrite(self, old: torch.fx.Node) -> torch.fx.Node:
        pkt = getattr(old.target, "overloadpacket", None)
        args, kwargs = self.args(old)
        if any(self.place.get(self.env[a]) == _PARTIAL for a in old.all_input_nodes):
            kept = self.keep_partial(old, pkt, args, kwargs)
            if kept is not None:
                return kept
            args, kwargs = torch.fx.node.map_arg(
                (args, kwargs), lambda n: self.materialize(n) if self.place.get(n) == _PARTIAL else n)
        if pkt in _SKIP:
            return self.call(old.target, args, kwargs, like=old)
        if pkt is aten.linear:
            return self.linear(old, args)
        if pkt is aten.addmm and self.place.get(args[2]) is not None:
            return self.addmm(old, args, kwargs)
        if pkt is aten.embedding:
            return self.embedding(old, args, kwargs)
        if _is_grouped_mm(old):
            return self.grouped_mm(old, args, kwargs)
        if pkt in _SPLITS or (pkt is aten.slice and self.place.get(args[0]) is not None):
            return self.split(old, pkt, args, kwargs)
        if pkt in _VIEWS:
            return self.view(old, args, kwargs)
        if pkt is aten.transpose:
            return self.keep(old, args, kwargs, _transpose_map(old.args[1], old.args[2], self.ndim(old)))
        if pkt in (aten.numpy_T, aten.t):
            return self.keep(old, args, kwargs, lambda d: self.ndim(old) - 1 - d)
        if pkt is aten.flatten:
            return self.flatten(old, args, kwargs)
        if pkt is aten.index and self.place.get(args[0]) is not None:
            return self.index(old, args, kwargs)
        if pkt is aten.permute:
            perm = [p % self.ndim(old) for p in old.args[1]]
            return self.keep(old, args, kwargs, lambda d: perm.index(d))
        if pkt is aten.unsqueeze:
            u = old.args[1] % self.ndim(old)
            return self.keep(old, args, kwargs, lambda d: d + 1 if d >= u else d)
        if pkt in _PASS:
            return self.keep(old, args, kwargs, lambda d: d)
        if pkt is aten.scaled_dot_product_attention:
            return self.attention(old, args, kwargs)
        if pkt is aten.cross_entropy_loss and self.place.get(args[0]) == self.ndim(old.args[0]) - 1:
            return self.vocab_parallel_cross_entropy(old, args, kwargs)
        if pkt in (aten.expand, aten.broadcast_to) and self.place.get(args[0]) is not None:
            return self.expand(old, args, kwargs)
        if pkt is aten.cat:
            return self.cat(old, args, kwargs)
        if pkt in _REDUCTIONS and self.place.get(args[0]) is not None:
            return self.reduction(old, args, kwargs)
        if pkt is aten.matmul and (self.place.get(args[0]) is not None or self.place.get(args[1]) is not None):
            return self.matmul(old, args, kwargs)
        if pkt in _SOFTMAX and self.place.get(args[0]) is not None:
            if old.args[1] % self.ndim(old) != self.place[args[0]]:
                return self.keep(old, args, kwargs, lambda d: d)
        if old.target is operator.getitem:  # a piece of a split keeps the split's shard
            src = args[0]
            shard = self.place.get(src) if getattr(src.target, "overloadpacket", None) in _SPLITS else None
            return self.call(old.target, args, kwargs, like=old, shard=shard)
        return self.pointwise_or_gather(old, args, kwargs)

    def keep(self, old, args, kwargs, mapping):
        """An op that moves dims but never mixes them: the shard follows ``mapping``."""
        d = self.place.get(args[0])
        return self.call(old.target, args, kwargs, like=old, shard=None if d is None else mapping(d))

    def linear(self, old, args):
        x, w = args[0], args[1]
        b = args[2] if len(args) > 2 else None
        xo = old.args[0]
        wd = self.place.get(w)
        last = self.ndim(old) - 1
        if wd == 0:  # column-parallel
            x = self.column_input(x, xo)
            out = self.call(old.target, (x, w, b) if b is not None else (x, w), like=old, shard=last)
            return out  # colwise_gather_output too: gathered only where a consumer needs the full tensor
        if wd == 1:  # row-parallel: a partial sum, reduced where a consumer needs the sum
            x = self.slice_to(x, xo, self.ndim(xo) - 1)
            out = self.call(old.target, (x, w), like=old, shard=_PARTIAL)
            if b is not None:
                out = self.materialize(out)
                out = self.call(aten.add.Tensor, (out, self.grad_reduced(b, out)), like=old, shard=self.place[out])
            return out
        return self.call(old.target, (self.replicate(x, xo), w, b) if b is not None else (self.replicate(x, xo), w),
                         like=old, shard=None)

    def column_input(self, x, xo):
        """The input of a column-parallel layer, once per value: replicated with an all-reduce of its
        gradient (Megatron's f), or, under sequence parallel, gathered along the sequence with a
        reduce-scatter of its gradient."""
        if x not in self.f_cache:
            if self.sp and self.place.get(x) == 1 and self.ndim(xo) == 3:
                self.f_cache[x] = self.call(fxpar_ops.all_gather_rs_bwd.default, (x, self.group, 1), like=xo)
            else:
                y = self.replicate(x, xo)
                self.f_cache[x] = self.call(fxpar_ops.identity_fwd_all_reduce_bwd.default, (y, self.group), like=xo)
        return self.f_cache[x]

    def reduce_partial(self, out, old):
        """Sum the ranks' partial results: all-reduce, or reduce-scatter along the sequence (sequence
        parallel: what follows between blocks, norms and residual adds, runs on sequence shards)."""
        v = old.meta.get(meta.VAL)
        if self.sp and isinstance(v, torch.Tensor) and v.dim() == 3 and v.shape[1] % self.tp == 0:
            return self.call(fxpar_ops.reduce_scatter.default, (out, self.group, 1), like=old, shard=1)
        return self.call(fxpar_ops.all_reduce.default, (out, self.group), like=old, shard=None)

    def grad_reduced(self, p, out):
        """A replicated parameter added to a sequence shard: its gradient is a partial sum over ranks."""
        if self.place.get(p) is not None or self.place.get(out) is None:
            return p
        if p not in self.f_cache:
            self.f_cache[p] = self.call(fxpar_ops.identity_fwd_all_reduce_bwd.default, (p, self.group))
        return self.f_cache[p]

    def addmm(self, old, args, kwargs):
        """``addmm(bias, x, w)`` with ``w`` laid out [in, out] (GPT-2's Conv1D): column-parallel shards
        w by columns, row-parallel by rows."""
        b, x, w = args[0], args[1], args[2]
        xo = old.args[1]
        if self.place[w] == 1:  # column-parallel
            x = self.replicate(x, xo)
            if x not in self.f_cache:
                self.f_cache[x] = self.call(fxpar_ops.identity_fwd_all_reduce_bwd.default, (x, self.group), like=xo)
            return self.call(old.target, (b, self.f_cache[x], w), kwargs, like=old, shard=1)
        x = self.slice_to(x, xo, 1)  # row-parallel
        out = self.materialize(self.call(aten.mm.default, (x, w), like=old, shard=_PARTIAL))
        return self.call(aten.add.Tensor, (out, self.grad_reduced(b, out)), like=old, shard=self.place[out])

    def embedding(self, old, args, kwargs):
        w, ids = args[0], args[1]
        if self.place.get(w) == 1:  # embedding_colwise: each rank looks up its hidden features
            return self.call(old.target, args, kwargs, like=old, shard=self.ndim(old) - 1)
        if self.place.get(w) != 0:
            return self.call(old.target, args, kwargs, like=old, shard=None)
        vocab = old.args[0].meta[meta.VAL].shape[0]
        per = vocab // self.tp
        lo, hi = self.rank * per, (self.rank + 1) * per
        outside = self.call(aten.__or__.Tensor, (self.call(aten.lt.Scalar, (ids, lo), like=old),
                                                 self.call(aten.ge.Scalar, (ids, hi), like=old)), like=old)
        local = self.call(aten.masked_fill.Scalar, (self.call(aten.sub.Tensor, (ids, lo), like=old), outside, 0),
                          like=old)
        out = self.call(old.target, (w, local, *args[2:]), kwargs, like=old)
        return self.call(aten.masked_fill.Scalar, (out, self.call(aten.unsqueeze.default, (outside, -1), like=old),
                                                   0.0), like=old, shard=_PARTIAL)

    def materialize(self, new: torch.fx.Node) -> torch.fx.Node:
        """The sum of a partial value (once per value): all-reduce, or reduce-scatter under SP."""
        if new not in self.reduced:
            self.reduced[new] = self.reduce_partial(new, self.partial_src[new])
        return self.reduced[new]

    def keep_partial(self, old, pkt, args, kwargs) -> torch.fx.Node | None:
        """Ops linear in their partial operand stay partial, so the sum is taken later, on what is
        often a smaller tensor (an MoE block sums its experts' outputs before reducing). Only along
        single-use chains: a partial value used twice is reduced once, where it is made (so the
        residual stream is summed where Megatron sums it). None: reduce first."""
        olds = old.all_input_nodes
        partial = [a for a in olds if self.place.get(self.env[a]) == _PARTIAL]
        if any(self.place.get(self.env[a]) not in (None, _PARTIAL) for a in olds):
            return None  # a sharded operand: reduce first
        if any(sum(getattr(u.target, "overloadpacket", None) not in _SKIP for u in a.users) != 1 for a in partial):
            return None
        first = old.args[0] if old.args and isinstance(old.args[0], torch.fx.Node) else None
        ok = False
        if pkt in _LINEAR_UNARY or pkt in _SKIP or pkt is aten.index:
            ok = partial == [first]
        elif pkt in (aten.mul, aten.neg):
            ok = len(partial) == 1
        elif pkt is aten.div:
            ok = partial == [first]
        elif pkt in (aten.add, aten.sub, aten.add_):
            ok = len(partial) == len(olds) and kwargs.get("alpha", 1) == 1 and (len(args) < 3 or args[2] == 1)
        if not ok:
            return None
        fixed = {}
        for a in olds:  # a replicated factor of a partial value gets a partial gradient: sum it
            if a not in partial and a in self.grad_flows:
                n = self.env[a]
                if n not in self.f_cache:
                    self.f_cache[n] = self.call(fxpar_ops.identity_fwd_all_reduce_bwd.default, (n, self.group),
                                                like=a)
                fixed[n] = self.f_cache[n]
        args, kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: fixed.get(n, n))
        return self.call(old.target, args, kwargs, like=old, shard=_PARTIAL)

    def grouped_mm(self, old, args, kwargs):
        """Grouped (per-expert) matmul ``x[T, K] @ w[E, K, N]``: experts' weights cut along N are
        column-parallel, along K row-parallel (transformers' moe_tp_experts)."""
        x, w = args[0], args[1]
        dw, nw = self.place.get(w), self.ndim(old.args[1])
        if dw == nw - 1 and self.place.get(x) is None:
            x = self.column_input(x, old.args[0])
            return self.call(old.target, (x, *args[1:]), kwargs, like=old, shard=self.ndim(old) - 1)
        if dw == nw - 2 and self.place.get(x) == self.ndim(old.args[0]) - 1:
            return self.call(old.target, args, kwargs, like=old, shard=_PARTIAL)
        return self.pointwise_or_gather(old, args, kwargs, force_gather=True)

    def split(self, old, pkt, args, kwargs):
        """chunk/split/split_with_sizes/slice. Along another dim than the shard: the shard stays. Along
        the shard of a fused projection cut part by part: local pieces, no communication. Along any
        other shard: gathered first."""
        x = args[0]
        d = self.place.get(x)
        if d is None:
            return self.call(old.target, args, kwargs, like=old, shard=None)
        nd = self.ndim(old.args[0])
        dim = _split_dim(old) % nd
        if dim != d:
            return self.call(old.target, args, kwargs, like=old, shard=d)
        if old not in self.packed_splits:
            x = self.replicate(x, old.args[0])
            return self.call(old.target, (x, *args[1:]), kwargs, like=old, shard=None)
        size = old.args[0].meta[meta.VAL].shape[dim]
        given = dict(zip(_SPLIT_ARGS[pkt], old.args)) | dict(old.kwargs)
        if pkt is aten.chunk:
            local = (x, given["chunks"], dim)
        elif pkt is aten.split:
            local = (x, given["split_size"] // self.tp, dim)
        elif pkt is aten.split_with_sizes:
            local = (x, [s // self.tp for s in given["split_sizes"]], dim)
        else:  # slice
            start, end = _slice_bounds(given, size)
            local = (x, dim, start // self.tp, end // self.tp)
        return self.call(old.target, local, {}, like=old, shard=d)

    def view(self, old, args, kwargs):
        x = args[0]
        d = self.place.get(x)
        if d is None:
            return self.call(old.target, args, kwargs, like=old, shard=None)
        src = tuple(old.args[0].meta[meta.VAL].shape)
        dst = tuple(old.meta[meta.VAL].shape)
        od = _reshape_dim(src, dst, d)
        if od is None or dst[od] % self.tp:
            x = self.replicate(x, old.args[0])
            return self.call(old.target, (x, *args[1:]), kwargs, like=old, shard=None)
        sizes = list(args[1])
        if sizes[od] != -1:
            sizes[od] = dst[od] // self.tp
        return self.call(old.target, (x, sizes, *args[2:]), kwargs, like=old, shard=od)

    def expand(self, old, args, kwargs):
        """expand keeps the shard; the size it names at the sharded dim becomes the local one."""
        x = args[0]
        d = self.place[x] + self.ndim(old) - self.ndim(old.args[0])
        sizes = list(args[1])
        if sizes[d] not in (-1, 1):
            sizes[d] = sizes[d] // self.tp
        return self.call(old.target, (x, sizes, *args[2:]), kwargs, like=old, shard=d)

    def reduction(self, old, args, kwargs):
        """A reduction over other dims than the shard keeps it (moved left past removed dims)."""
        d = self.place[args[0]]
        nd = self.ndim(old.args[0])
        dims = old.args[1] if len(old.args) > 1 else kwargs.get("dim")
        dims = [dims] if isinstance(dims, int) else list(dims or range(nd))
        dims = [x % nd for x in dims]
        keep = old.args[2] if len(old.args) > 2 else kwargs.get("keepdim", False)
        if d in dims:
            return self.pointwise_or_gather(old, args, kwargs, force_gather=True)
        return self.call(old.target, args, kwargs, like=old, shard=d if keep else d - sum(x < d for x in dims))

    def matmul(self, old, args, kwargs):
        """Batched matmul with both operands sharded on the same batch dim keeps it (attention heads).
        ``x @ W.T`` with a 2-D parameter W (a linear written as matmul) is column- or row-parallel."""
        a, b = args[0], args[1]
        na, nb, no = self.ndim(old.args[0]), self.ndim(old.args[1]), self.ndim(old)
        da, db = self.place.get(a), self.place.get(b)
        if da is not None and db is not None and da - na == db - nb and da < na - 2 and db < nb - 2:
            return self.call(old.target, args, kwargs, like=old, shard=da - na + no)
        if da is not None and db is None and na == nb and da < na - 2:  # e.g. scores of this rank's heads
            return self.call(old.target, (a, self.slice_to(b, old.args[1], da)), kwargs, like=old, shard=da - na + no)
        if db is not None and da is None and na == nb and db < nb - 2:
            return self.call(old.target, (self.slice_to(a, old.args[0], db), b), kwargs, like=old, shard=db - nb + no)
        if nb == 2 and _linear_weight(old)[0] is not None:
            if db == 1 and da is None:  # column-parallel
                return self.call(old.target, (self.column_input(a, old.args[0]), b), kwargs, like=old, shard=no - 1)
            if db == 0 and da is not None:  # row-parallel
                a = self.slice_to(a, old.args[0], na - 1)
                return self.call(old.target, (a, b), kwargs, like=old, shard=_PARTIAL)
        return self.pointwise_or_gather(old, args, kwargs, force_gather=True)

    def flatten(self, old, args, kwargs):
        """flatten(start, end) keeps a shard outside the range, or on its first dim (the leading factor)."""
        d = self.place.get(args[0])
        if d is None:
            return self.call(old.target, args, kwargs, like=old, shard=None)
        nd = self.ndim(old.args[0])
        start = (args[1] if len(args) > 1 else 0) % nd
        end = (args[2] if len(args) > 2 else -1) % nd
        if start < d <= end:
            return self.call(old.target, (self.replicate(args[0], old.args[0]), *args[1:]), kwargs, like=old)
        return self.call(old.target, args, kwargs, like=old, shard=d - (end - start) if d > end else d)

    def index(self, old, args, kwargs):
        """Advanced indexing with replicated index tensors, all after the shard, keeps it."""
        x, indices = args[0], list(args[1])
        d = self.place.get(x)
        used = [i for i, t in enumerate(indices) if t is not None]
        if (d is not None and used and min(used) > d
                and all(self.place.get(t) is None for t in indices if isinstance(t, torch.fx.Node))):
            return self.call(old.target, args, kwargs, like=old, shard=d)
        return self.pointwise_or_gather(old, args, kwargs, force_gather=True)

    def cat(self, old, args, kwargs):
        """cat along another dim than a shard shared by every input keeps it; else replicate."""
        parts, olds = list(args[0]), list(old.args[0])
        dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % self.ndim(old)
        shards = {self.place.get(p) for p in parts}
        if len(shards) == 1 and None not in shards and dim not in shards:
            return self.call(old.target, args, kwargs, like=old, shard=shards.pop())
        parts = [self.replicate(p, o) for p, o in zip(parts, olds)]
        return self.call(old.target, (parts, *args[1:]), kwargs, like=old, shard=None)

    def vocab_parallel_cross_entropy(self, old, args, kwargs):
        """Cross-entropy over vocabulary-sharded logits without gathering them: the max, the sum of
        exponentials and the target's logit are reduced across ranks (Megatron's parallel loss).
        Every all-reduce's backward is the identity: the loss is replicated on every rank."""
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        given = dict(zip(names, args)) | dict(kwargs)
        reduction, ignore = given.get("reduction", 1), given.get("ignore_index", -100)
        if given.get("weight") is not None or given.get("label_smoothing", 0.0) or old.args[0].meta[meta.VAL].dim() != 2:
            return self.pointwise_or_gather(old, args, kwargs, force_gather=True)
        x, target = given["input"], given["target"]
        vocab = old.args[0].meta[meta.VAL].shape[-1]
        per = vocab // self.tp
        c = lambda target_, *a, shard=None: self.call(target_, a, like=old, shard=shard)  # noqa: E731
        x = c(aten.to.dtype, x, torch.float32, shard=1)
        top = c(fxpar_ops.all_reduce.default, c(aten.amax.default, c(aten.detach.default, x, shard=1), [-1]),
                self.group, "max")
        shifted = c(aten.sub.Tensor, x, c(aten.unsqueeze.default, top, -1), shard=1)
        sumexp = c(fxpar_ops.all_reduce.default, c(aten.sum.dim_IntList, c(aten.exp.default, shifted, shard=1), [-1]),
                   self.group)
        local = c(aten.sub.Tensor, target, self.rank * per)
        inside = c(aten.__and__.Tensor, c(aten.ge.Scalar, local, 0), c(aten.lt.Scalar, local, per))
        index = c(aten.unsqueeze.default, c(aten.masked_fill.Scalar, local, c(aten.logical_not.default, inside), 0), -1)
        picked = c(aten.squeeze.dim, c(aten.gather.default, shifted, 1, index), -1)
        picked = c(fxpar_ops.all_reduce.default, c(aten.mul.Tensor, picked, inside), self.group)
        valid = c(aten.ne.Scalar, target, ignore)
        per_token = c(aten.mul.Tensor, c(aten.sub.Tensor, c(aten.log.default, sumexp), picked), valid)
        if reduction == 0:
            return per_token
        total = c(aten.sum.default, per_token)
        if reduction == 2:
            return total
        return c(aten.div.Tensor, total, c(aten.sum.default, valid))

    def attention(self, old, args, kwargs):
        q, k, v = args[:3]
        if self.place.get(q) == 1:  # keys/values replicated (fewer KV heads than ranks): take this rank's
            k = self.slice_to(k, old.args[1], 1) if self.place.get(k) is None else k
            v = self.slice_to(v, old.args[2], 1) if self.place.get(v) is None else v
        if self.place.get(q) != 1 or self.place.get(k) != 1 or self.place.get(v) != 1:
            return self.pointwise_or_gather(old, args, kwargs, force_gather=True)
        rest = list(args[3:])
        mask = rest[0] if rest else kwargs.get("attn_mask")
        if isinstance(mask, torch.fx.Node):
            mval = (old.args[3] if len(old.args) > 3 else old.kwargs["attn_mask"]).meta[meta.VAL]
            if mval.dim() == 4 and mval.shape[1] > 1:  # per-head bias (ALiBi): this rank's heads
                mask = self.slice_to(mask, old, 1)
            if rest:
                rest[0] = mask
            else:
                kwargs = {**kwargs, "attn_mask": mask}
        return self.call(old.target, (q, k, v, *rest), kwargs, like=old, shard=1)

    def pointwise_or_gather(self, old, args, kwargs, force_gather: bool = False):
        """Elementwise ops keep a shard; everything else runs on replicated inputs."""
        current = [self.reduced.get(self.env[a], self.env[a]) for a in old.all_input_nodes]  # partials summed
        tensor_args = list(zip(old.all_input_nodes, current))
        sharded = [(o, n) for o, n in tensor_args if self.place.get(n) is not None]
        if not sharded:
            return self.call(old.target, args, kwargs, like=old, shard=None)
        out_val = old.meta.get(meta.VAL)
        d_out = None
        if not force_gather and isinstance(out_val, torch.Tensor) and _is_pointwise(old):
            nd = out_val.dim()
            dims = {self.place[n] - self.ndim(o) + nd for o, n in sharded}
            if len(dims) == 1:
                d_out = dims.pop()
        if d_out is None:
            self.fallbacks.append(f"{old.name} ({old.target}) in {old.meta.get(meta.MODULE, '')}")
            new_inputs = {n: self.replicate(n, o) for o, n in tensor_args}
            a2, k2 = torch.fx.node.map_arg((args, kwargs), lambda n: new_inputs.get(n, n))
            return self.call(old.target, a2, k2, like=old, shard=None)
        fixed = {}
        for o, n in tensor_args:
            if self.place.get(n) is None:
                dd = d_out - (out_val.dim() - self.ndim(o))
                if dd >= 0 and o.meta[meta.VAL].shape[dd] > 1:
                    fixed[n] = self.slice_to(n, o, dd)
                elif o in self.grad_flows:
                    # broadcast along the shard: each rank's gradient is a partial sum over its shard
                    if n not in self.f_cache:
                        self.f_cache[n] = self.call(fxpar_ops.identity_fwd_all_reduce_bwd.default,
                                                    (n, self.group), like=o, shard=None)
                    fixed[n] = self.f_cache[n]
        a2, k2 = torch.fx.node.map_arg((args, kwargs), lambda n: fixed.get(n, n))
        return self.call(old.target, a2, k2, like=old, shard=d_out)


_LINEAR_UNARY = _VIEWS | (_PASS - {aten.dropout}) | {aten.transpose, aten.permute, aten.unsqueeze, aten.squeeze,
                                                     aten.expand, aten.sum, aten.mean, aten.t}
_SPLITS = {aten.chunk, aten.split, aten.split_with_sizes}
_SPLIT_ARGS = {aten.chunk: ("self", "chunks", "dim"), aten.split: ("self", "split_size", "dim"),
               aten.split_with_sizes: ("self", "split_sizes", "dim"), aten.slice: ("self", "dim", "start", "end", "step")}
_GROUPED_MM = ("_grouped_mm", "grouped_mm", "grouped_mm_fallback")


def _is_grouped_mm(node: torch.fx.Node) -> bool:
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
    return node.op == "call_function" and name in _GROUPED_MM


def _ndim(node) -> int:
    v = node.meta.get(meta.VAL) if isinstance(node, torch.fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else -1


def _split_dim(node: torch.fx.Node) -> int:
    pkt = node.target.overloadpacket
    given = dict(zip(_SPLIT_ARGS[pkt], node.args)) | dict(node.kwargs)
    return given.get("dim", 0)


def _slice_bounds(given: dict, size: int) -> tuple[int, int]:
    start = given.get("start") or 0
    end = given.get("end")
    end = size if end is None or end > size else end
    start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
    return max(0, min(start, size)), max(0, min(end, size))


def _linear_weight(node: torch.fx.Node) -> tuple[torch.fx.Node | None, torch.fx.Node | None]:
    """(weight parameter, bias parameter or None) of a linear-like node (linear, addmm, grouped mm,
    weight possibly reached through a transpose), else (None, None)."""
    pkt = getattr(node.target, "overloadpacket", None)
    w = b = None
    if pkt is aten.linear:
        w, b = node.args[1], node.args[2] if len(node.args) > 2 else None
    elif pkt is aten.addmm:
        w, b = node.args[2], node.args[0]
    elif _is_grouped_mm(node) or (pkt is aten.matmul and _ndim(node.args[1]) == 2):
        w = node.args[1]
        while isinstance(w, torch.fx.Node) and getattr(w.target, "overloadpacket", None) in (aten.transpose, aten.t, aten.numpy_T):
            w = w.args[0]
        if pkt is aten.matmul and w is node.args[1]:  # x @ W with W not transposed: not a linear layer
            w = None
    w = w if isinstance(w, torch.fx.Node) and w.meta.get(meta.PARAM) else None
    b = b if isinstance(b, torch.fx.Node) and b.meta.get(meta.PARAM) else None
    return w, b


def _packed_segments(program: Program, tp: int) -> tuple[dict, dict]:
    """Fused projections: a linear-like node whose output features are only ever cut into pieces
    (chunk/split/slice along the last dim, after views that keep it) is laid out as the concatenation
    of those pieces ([q; k; v], [gate; up]); sharding it cuts every piece, so each rank's pieces are
    the local q, k, v. Returns (split node -> piece sizes, parameter FQN -> piece sizes)."""
    splits: dict[torch.fx.Node, list[int]] = {}
    params: dict[str, list[int]] = {}
    for node in program.graph.nodes:
        w, b = _linear_weight(node)
        v = node.meta.get(meta.VAL)
        if w is None or not isinstance(v, torch.Tensor) or v.dim() == 0:
            continue
        n_out = v.shape[-1]
        bounds, found, other, todo = {0, n_out}, [], False, list(node.users)
        while todo and not other:
            user = todo.pop()
            pkt = getattr(user.target, "overloadpacket", None)
            uv = user.meta.get(meta.VAL)
            if pkt in _SKIP:
                continue
            if pkt in _PASS - {aten.dropout} or (pkt in _VIEWS and isinstance(uv, torch.Tensor)
                                                 and uv.shape[-1] == n_out):
                todo.extend(user.users)
            elif pkt in _SPLITS or pkt is aten.slice:
                nd = user.args[0].meta[meta.VAL].dim()
                given = dict(zip(_SPLIT_ARGS[pkt], user.args)) | dict(user.kwargs)
                if given.get("dim", 0) % nd != nd - 1 or given.get("step", 1) != 1:
                    other = True
                elif pkt is aten.chunk:
                    other = n_out % given["chunks"] != 0
                    bounds |= set(range(0, n_out, n_out // given["chunks"]))
                elif pkt is aten.split:
                    bounds |= set(range(0, n_out, given["split_size"]))
                elif pkt is aten.split_with_sizes:
                    bounds |= {sum(given["split_sizes"][:i]) for i in range(len(given["split_sizes"]))}
                else:
                    bounds |= set(_slice_bounds(given, n_out))
                found.append(user)
            else:
                other = True
        edges = sorted(bounds)
        pieces = [hi - lo for lo, hi in zip(edges, edges[1:])]
        if other or not found or len(pieces) < 2 or any(p % tp for p in pieces):
            continue
        for user in found:
            splits[user] = pieces
        for p in (w, b):
            if p is not None:
                params[p.meta[meta.PARAM]] = pieces
    return splits, params


def _transpose_map(a: int, b: int, nd: int):
    a, b = a % nd, b % nd
    return lambda d: b if d == a else a if d == b else d


def _reshape_dim(src: tuple, dst: tuple, d: int) -> int | None:
    """The dim of ``dst`` that starts where ``src`` dim d starts (so it carries the leading part of a
    shard of d), or None when no dim of ``dst`` starts there."""
    before = math.prod(src[:d])
    acc = 1
    for i, s in enumerate(dst):
        if acc == before and s != 1:
            return i if (src[d] % s == 0 or s % src[d] == 0) else None
        acc *= s
        if acc > before:
            return None
    return None


_POINTWISE_TAGS = (torch.Tag.pointwise,)


def _is_pointwise(old: torch.fx.Node) -> bool:
    tags = getattr(old.target, "tags", ())
    return any(t in tags for t in _POINTWISE_TAGS)


_CARRIERS = {aten.view, aten.reshape, aten._unsafe_view, aten.transpose, aten.permute, aten.unsqueeze,
             aten.contiguous, aten.alias, aten.clone, aten.to, aten._to_copy, aten.dropout, aten.expand,
             aten.scaled_dot_product_attention, aten.matmul, aten.softmax, aten._softmax, aten.chunk, aten.split,
             aten.split_with_sizes, aten.slice, aten.index, aten.cat, aten.flatten, aten.broadcast_to, aten.squeeze}


def _weight(node: torch.fx.Node) -> torch.fx.Node | None:
    """The parameter placeholder a linear-like node multiplies by, or None."""
    return _linear_weight(node)[0]


def infer_styles(program: Program) -> dict[str, str]:
    """A column/row plan from the graph, for models without one: a linear whose output reaches, through
    views, transposes, elementwise ops and attention only, other linears is column-parallel, and those
    are row-parallel. A wrong guess costs only speed: the pass gathers where a shard cannot go on."""
    styles: dict[str, str] = {}
    for node in program.graph.nodes:
        if _weight(node) is None or node.meta.get(meta.MODULE) in styles:
            continue
        ends, ok, seen, todo = [], True, set(), list(node.users)
        while todo and ok:
            user = todo.pop()
            if user in seen:
                continue
            seen.add(user)
            pkt = getattr(user.target, "overloadpacket", None)
            if _weight(user) is not None:
                ends.append(user)
            elif pkt in _CARRIERS or user.target is operator.getitem or (user.op == "call_function"
                                                                          and _is_pointwise(user)):
                todo.extend(user.users)
            else:
                ok = False
        if ok and ends and not any(e.meta.get(meta.MODULE) in styles for e in ends):
            styles[node.meta.get(meta.MODULE)] = "colwise"
            for e in ends:
                styles[e.meta.get(meta.MODULE)] = "rowwise"
    return styles


def tensor_parallel(program: Program, tp: int, rank: int, styles: dict[str, str] | None = None,
                    group: str = "tp", shards: dict[str, torch.Tensor] | None = None,
                    keep_outputs: set[int] | None = None, sequence_parallel: bool = False) -> tuple[Program, dict]:
    """This rank's program: sharded parameters, collectives in the graph, local shapes.

    ``shards``: this rank's shard tensors by FQN from an earlier call (another traced signature of the
    same model, e.g. inference after training), bound again instead of slicing the model's tensors;
    new shards are added to it. ``keep_outputs``: positions of the graph outputs still needed (a
    training step needs only the loss: the logits then stay sharded and are never gathered); the
    others become None. ``sequence_parallel``: between blocks (norms, residual adds, dropout) activations
    are sharded along the sequence; row-parallel outputs are reduce-scattered and column-parallel inputs
    gathered (Megatron's sequence parallelism), same communication volume, 1/tp of those activations.
    """
    shards = {} if shards is None else shards
    plan = styles if styles is not None else program.info.tp_plan
    resolved = resolve_styles(program, plan, strict=styles is not None) if plan else infer_styles(program)
    sequence_parallel = sequence_parallel or "sequence_parallel" in resolved.values()
    _check_heads(program, resolved, tp)
    rw = _Rewriter(program, resolved, tp, rank, group)
    rw.keep_outputs = keep_outputs
    rw.sp = sequence_parallel
    graph = rw.run()
    graph.eliminate_dead_code()
    gm = torch.fx.GraphModule(program.gm, graph)
    tensors, params = {}, {}
    for fqn, info in program.params.items():
        t = program.tensor(fqn)
        d = rw.param_dim.get(fqn)
        if d is not None:
            if fqn not in shards:
                piece = shard_of(t.detach(), d, rw.segments.get(fqn), tp, rank)
                shards[fqn] = torch.nn.Parameter(piece, requires_grad=t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else piece
            t = shards[fqn]
            info = ParamInfo(info.fqn, tuple(t.shape), info.dtype, info.requires_grad, info.is_buffer, info.aliases)
        tensors[fqn], params[fqn] = t, info
    local = Program(gm, inputs=program.inputs, outputs=program.outputs, in_spec=program.in_spec,
                    out_spec=program.out_spec, params=params, tensors=tensors, constants=program.constants,
                    info=program.info, frontend=program.frontend, root=program.root)
    _refresh_vals(local, tp, group)
    for node in gm.graph.nodes:
        d = rw.place.get(node)
        node.meta[meta.PLACEMENT] = (Partial(),) if d == _PARTIAL else (Shard(d),) if d is not None else (Replicate(),)
    pieces = {fqn: rw.segments[fqn] for fqn in rw.param_dim if fqn in rw.segments}
    return local, {"sharded": dict(rw.param_dim), "pieces": pieces, "fallbacks": list(rw.fallbacks)}


_HEADS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads")


def _check_heads(program: Program, styles: dict[str, str], tp: int) -> None:
    """Attention heads must divide over the TP ranks when the plan shards attention projections; key/
    value heads may be fewer than the ranks (each rank then uses a copy of its group's KV head)."""
    config = getattr(program.root, "config", None)
    attn = sorted({m.rpartition(".")[0] for m, st in styles.items() if st in _COLWISE
                   and "att" in m.rpartition(".")[0].lower()})
    if config is None or not attn or tp == 1:
        return
    fix = "use a tp degree that divides it, or leave the attention projections out of tp_plan"
    for key in _HEADS:
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            ok = [d for d in range(1, heads + 1) if heads % d == 0]
            raise PlanError(f"{attn[0]}: {heads} attention heads ({key}) do not divide over tp={tp} "
                            f"(tp must be one of {ok}); {fix}")
    for key in _KV_HEADS:
        kv = getattr(config, key, None)
        if isinstance(kv, int) and kv % tp and tp % kv:
            raise PlanError(f"{attn[0]}: {kv} key/value heads ({key}) neither divide over tp={tp} nor divide it "
                            f"(each rank needs whole KV heads or a copy of one); {fix}")


def shard_of(full: torch.Tensor, dim: int, pieces: list[int] | None, tp: int, rank: int) -> torch.Tensor:
    """This rank's shard of a full tensor cut along ``dim``; a fused tensor (``pieces``: the sizes of
    its parts along dim, e.g. [q, k, v]) is cut part by part."""
    parts = full.split(pieces, dim=dim) if pieces else [full]
    return torch.cat([part.chunk(tp, dim=dim)[rank] for part in parts], dim=dim).clone()


def unshard(shards: list[torch.Tensor], dim: int, pieces: list[int] | None) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (inverse of :func:`shard_of`)."""
    if not pieces:
        return torch.cat(shards, dim=dim)
    tp = len(shards)
    split = [s.split([p // tp for p in pieces], dim=dim) for s in shards]
    return torch.cat([torch.cat([split[r][i] for r in range(tp)], dim=dim) for i in range(len(pieces))], dim=dim)


def _refresh_vals(program: Program, tp: int, group: str) -> None:
    """Recompute every node's ``val`` with local shapes (FakeTensorProp over the rewritten graph)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if group not in fxops.registered_groups():
        fxops.register_group(group, size=tp)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    phs = [n for n in program.gm.graph.nodes if n.op == "placeholder"]
    bound = {b.placeholder: b for b in program.inputs}
    fakes = []
    users = [n.meta.get(meta.VAL) for n in phs if bound[n.name].kind == "user"]
    device = next((v.device for v in users if isinstance(v, torch.Tensor)), None)
    for n in phs:
        b = bound[n.name]
        if b.kind in ("parameter", "buffer"):
            t = program.tensor(b.target).detach()
            # a meta-traced program may already hold some real shards: shapes are what matter here
            fakes.append(mode.from_tensor(t.to(device) if device is not None and t.device != device else t))
        else:
            v = n.meta.get(meta.VAL)
            if isinstance(v, torch.Tensor):
                with mode:
                    v = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            fakes.append(v)
    FakeTensorProp(program.gm, mode).propagate_dont_convert_inputs(*fakes)
