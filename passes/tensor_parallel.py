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
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.program import ParamInfo, Program
from fxpar.passes.pipeline_split import needs_grad
from fxpar.runtime import ops as fxops

aten = torch.ops.aten
fxpar_ops = torch.ops.fxpar

STYLES = ("colwise", "rowwise", "colwise_gather_output", "vocab_parallel", "embedding_rowwise", "replicate",
          "replicated_with_grad_allreduce")
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view}
_PASS = {aten.contiguous, aten.alias, aten.clone, aten.detach, aten.dropout, aten.to, aten._to_copy,
         aten.lift_fresh_copy}
_SKIP = {aten._assert_tensor_metadata}
_REDUCTIONS = {aten.mean, aten.sum, aten.amax, aten.amin}
_SOFTMAX = {aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax}


def resolve_styles(program: Program, plan: dict[str, str]) -> dict[str, str]:
    """Module FQN -> style, from globs over module FQNs; unknown styles and empty globs are errors."""
    names = [n for n, _ in program.root.named_modules()] if program.root is not None else []
    out: dict[str, str] = {}
    for glob, style in plan.items():
        if style not in STYLES:
            raise PlanError(f"tensor-parallel style {style!r} for {glob!r} is unknown; styles: {', '.join(STYLES)}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, glob)]
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

    # ---- helpers ------------------------------------------------------------------------------------
    def call(self, target, args, kwargs=None, like: torch.fx.Node | None = None, shard: int | None = None):
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        if like is not None:
            node.meta.update({k: v for k, v in like.meta.items() if k in (meta.MODULE, "nn_module_stack")})
        self.place[node] = shard
        return node

    def ndim(self, old: torch.fx.Node) -> int:
        v = old.meta.get(meta.VAL)
        return v.dim() if isinstance(v, torch.Tensor) else 0

    def replicate(self, new: torch.fx.Node, old: torch.fx.Node) -> torch.fx.Node:
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
            style = self.styles.get(name.rpartition(".")[0]) or style
        leaf = fqn.rpartition(".")[2]
        d = None
        if style in ("colwise", "colwise_gather_output", "vocab_parallel", "embedding_rowwise"):
            d = 1 if fqn in self.transposed and leaf != "bias" else 0
        elif style == "rowwise" and leaf != "bias":
            d = 0 if fqn in self.transposed else 1
        if d is not None and d >= len(info.shape):  # e.g. a row-parallel layer's 1-D bias or scale
            d = None
        if d is not None:
            if info.shape[d] % self.tp:
                raise PlanError(f"{fqn} has {info.shape[d]} rows along dim {d}, not divisible by tp={self.tp}; "
                                f"module {fqn.rpartition('.')[0]} cannot be {style}: use another tp degree or "
                                "mark it 'replicate'")
            self.param_dim[fqn] = d
        return d

    def args(self, old):
        return torch.fx.node.map_arg(old.args, lambda a: self.env[a]), \
            torch.fx.node.map_arg(old.kwargs, lambda a: self.env[a])

    def rewrite(self, old: torch.fx.Node) -> torch.fx.Node:
        pkt = getattr(old.target, "overloadpacket", None)
        args, kwargs = self.args(old)
        if pkt in _SKIP:
            return self.call(old.target, args, kwargs, like=old)
        if pkt is aten.linear:
            return self.linear(old, args)
        if pkt is aten.addmm and self.place.get(args[2]) is not None:
            return self.addmm(old, args, kwargs)
        if pkt is aten.embedding:
            return self.embedding(old, args, kwargs)
        if pkt in _VIEWS:
            return self.view(old, args, kwargs)
        if pkt is aten.transpose:
            return self.keep(old, args, kwargs, _transpose_map(old.args[1], old.args[2], self.ndim(old)))
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
        if pkt is aten.slice and self.place.get(args[0]) is not None:
            dim = (old.args[1] if len(old.args) > 1 else 0) % self.ndim(old)
            if dim != self.place[args[0]]:
                return self.keep(old, args, kwargs, lambda d: d)
        if pkt is aten.expand and self.place.get(args[0]) is not None:
            return self.expand(old, args, kwargs)
        if pkt is aten.cat:
            return self.cat(old, args, kwargs)
        if pkt in _REDUCTIONS and self.place.get(args[0]) is not None:
            return self.reduction(old, args, kwargs)
        if pkt is aten.matmul and self.place.get(args[0]) is not None:
            return self.matmul(old, args, kwargs)
        if pkt in _SOFTMAX and self.place.get(args[0]) is not None:
            if old.args[1] % self.ndim(old) != self.place[args[0]]:
                return self.keep(old, args, kwargs, lambda d: d)
        if old.target is operator.getitem:
            return self.call(old.target, args, kwargs, like=old, shard=None)
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
        if wd == 1:  # row-parallel
            x = self.slice_to(x, xo, self.ndim(xo) - 1)
            out = self.reduce_partial(self.call(old.target, (x, w), like=old, shard=None), old)
            if b is not None:
                out = self.call(aten.add.Tensor, (out, self.grad_reduced(b)), like=old, shard=self.place[out])
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

    def grad_reduced(self, p):
        """A replicated parameter added to a sequence shard: its gradient is a partial sum over ranks."""
        if self.place.get(p) is not None or not self.sp:
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
        out = self.call(aten.mm.default, (x, w), like=old)
        out = self.call(fxpar_ops.all_reduce.default, (out, self.group), like=old)
        return self.call(aten.add.Tensor, (out, b), like=old)

    def embedding(self, old, args, kwargs):
        w, ids = args[0], args[1]
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
        out = self.call(aten.masked_fill.Scalar, (out, self.call(aten.unsqueeze.default, (outside, -1), like=old),
                                                  0.0), like=old)
        return self.reduce_partial(out, old)

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
        """Batched matmul with both operands sharded on the same batch dim keeps it (attention heads)."""
        a, b = args[0], args[1]
        na, nb, no = self.ndim(old.args[0]), self.ndim(old.args[1]), self.ndim(old)
        da, db = self.place.get(a), self.place.get(b)
        if da is not None and db is not None and da - na == db - nb and da < na - 2 and db < nb - 2:
            return self.call(old.target, args, kwargs, like=old, shard=da - na + no)
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
        tensor_args = [(o, n) for o, n in zip(old.all_input_nodes, [self.env[a] for a in old.all_input_nodes])]
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
             aten.scaled_dot_product_attention, aten.matmul, aten.softmax, aten._softmax}


def _weight(node: torch.fx.Node) -> torch.fx.Node | None:
    """The parameter placeholder a linear-like node multiplies by, or None."""
    pkt = getattr(node.target, "overloadpacket", None)
    w = node.args[1] if pkt is aten.linear else node.args[2] if pkt is aten.addmm else None
    return w if isinstance(w, torch.fx.Node) and w.meta.get(meta.PARAM) else None


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
            if _weight(user) is not None and user.args[1 if pkt is aten.linear else 2] is not node:
                ends.append(user)
            elif pkt in _CARRIERS or (user.op == "call_function" and _is_pointwise(user)):
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
    resolved = resolve_styles(program, plan) if plan else infer_styles(program)
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
                piece = t.detach().chunk(tp, dim=d)[rank].clone()
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
        node.meta[meta.PLACEMENT] = (Shard(d),) if d is not None else (Replicate(),)
    return local, {"sharded": dict(rw.param_dim), "fallbacks": list(rw.fallbacks)}


def _refresh_vals(program: Program, tp: int, group: str) -> None:
    """Recompute every node's ``val`` with local shapes (FakeTensorProp over the rewritten graph)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if group not in fxops.registered_groups():
        fxops.register_group(group, size=tp)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    phs = [n for n in program.gm.graph.nodes if n.op == "placeholder"]
    bound = {b.placeholder: b for b in program.inputs}
    fakes = []
    for n in phs:
        b = bound[n.name]
        if b.kind in ("parameter", "buffer"):
            t = program.tensor(b.target)
            fakes.append(mode.from_tensor(t.detach()))
        else:
            v = n.meta.get(meta.VAL)
            if isinstance(v, torch.Tensor):
                with mode:
                    v = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            fakes.append(v)
    FakeTensorProp(program.gm, mode).propagate_dont_convert_inputs(*fakes)
