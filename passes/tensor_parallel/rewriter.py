"""The rewrite of the tensor-parallel pass: one TP rank's graph built from the traced one, node by node.

Reads: the traced graph, ``fxpar.param``, ``fxpar.module``, ``val``; the resolved styles. Writes: a new
:class:`torch.fx.Graph` (this rank's nodes, ``torch.ops.fxpar.*`` collectives) and, per new node, its
placement in :attr:`Rewriter.place` (torch's ``Shard(d)``, ``Replicate()``, ``Partial()``).

Each call node goes to the rule its op has in :data:`~fxpar.passes.tensor_parallel.rules.RULES` (an op
with none to the pointwise-or-gather fallback), with its arguments mapped into the new graph; partial
sums are reduced first unless the op is linear in them (:mod:`.rules.partial`). The rewriter holds the
environment and the placement helpers every rule shares: :meth:`~Rewriter.replicate`,
:meth:`~Rewriter.slice_to`, :meth:`~Rewriter.column_input`, :meth:`~Rewriter.materialize`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx
from torch.fx.node import map_arg

from fxpar.ir import meta
from fxpar.ir import ops as _ops  # noqa: F401  (defines torch.ops.fxpar.*)
from fxpar.ir.analysis import grad_flow
from fxpar.ir.placement import Partial, Placement, Replicate, Shard, as_placement, chunk_sizes, chunk_start
from fxpar.ir.program import Program
from fxpar.passes.tensor_parallel import uneven
from fxpar.passes.tensor_parallel.channels import ChannelParams
from fxpar.passes.tensor_parallel.experts import expert_layouts
from fxpar.passes.tensor_parallel.layouts import conv1d_weights, linear_weight
from fxpar.passes.tensor_parallel.packing import find_packing
from fxpar.passes.tensor_parallel.rules import fused, rule_for
from fxpar.passes.tensor_parallel.rules.partial import keep_partial
from fxpar.passes.tensor_parallel.styles import param_dim

fxpar_ops = torch.ops.fxpar
REPLICATE = Replicate()


class Rewriter:
    """One TP rank's graph from ``program``'s: ``env`` maps old nodes to new ones, ``place`` new nodes to
    their placements. ``keep_outputs``: graph outputs to compute (None: all); ``sequence_parallel``:
    activations between blocks are sharded along the sequence. ``derived``: per-channel parameters
    sharded though no style names them (:mod:`.channels`), FQN -> dim."""

    def __init__(self, program: Program, styles: dict[str, str], tp: int, rank: int, group: str, *,
                 keep_outputs: set[int] | None = None, sequence_parallel: bool = False,
                 derived: dict[str, int] | None = None):
        self.program, self.styles, self.tp, self.rank, self.group = program, styles, tp, rank, group
        self.keep_outputs, self.sp = keep_outputs, sequence_parallel
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.place: dict[torch.fx.Node, Placement] = {}
        self.f_cache: dict[torch.fx.Node, torch.fx.Node] = {}  # value -> it with its gradient all-reduced
        self.param_dim: dict[str, int] = {}  # canonical FQN -> sharded dim
        self.fallbacks: list[str] = []
        self.why_whole: dict[str, str] = {}  # FQN a rule keeps whole on purpose -> why (reasons.py)
        self.grad_flows = grad_flow(program)  # old nodes a gradient flows through
        self.transposed = conv1d_weights(program)  # weights an addmm reads as [in, out]
        # fused projections ([q; k; v], [gate; up]) cut part by part: split op -> parts, FQN -> parts; some
        # pieces whole on every rank (multi-query K/V, packing.py); per-output placements of their splits
        self.packing = find_packing(program, tp, linear_weight)
        self.packed_splits = {n: list(f.pieces) for n, f in self.packing.cuts.items()}
        self.segments = dict(self.packing.params)
        self.item_place: dict[torch.fx.Node, list[Placement]] = {}
        # 3-D expert weights, cut inside each expert as their matmuls use them (experts.py)
        self.experts = expert_layouts(program, styles, tp)
        self.packed_splits.update(self.experts.splits)
        self.segments.update(self.experts.pieces)
        self.dispatched: dict = {}  # (f on the tokens, a node of the experts' token gather) -> its copy
        self.partial_src: dict[torch.fx.Node, torch.fx.Node] = {}  # partial new node -> its old node
        self.reduced: dict[torch.fx.Node, torch.fx.Node] = {}  # partial new node -> its sum
        self.local_inputs: dict[str, int] = {}  # user inputs each rank passes a shard of (a KV cache) -> dim
        self.local_values: set[torch.fx.Node] = set()  # those shards updated in place: outputs kept ungathered
        self.channels = ChannelParams(program, derived or {})  # per-channel parameters wanted cut / whole

    # ---- placements ---------------------------------------------------------------------------------
    def call(self, target, args, kwargs=None, like: torch.fx.Node | None = None,
             place: Placement = REPLICATE) -> torch.fx.Node:
        """A new call node with placement ``place``; ``like``: the old node whose module it belongs to."""
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        if like is not None:
            node.meta.update({k: v for k, v in like.meta.items() if k in (meta.MODULE, "nn_module_stack")})
        self.place[node] = place
        if isinstance(place, Partial):
            self.partial_src[node] = like
        return node

    def shard_dim(self, new) -> int | None:
        """The dim a new node is sharded along; None when it is replicated or partial."""
        p = self.place.get(new)
        return p.dim if isinstance(p, Shard) else None

    def is_partial(self, new) -> bool:
        return isinstance(self.place.get(new), Partial)

    def is_replicated(self, new) -> bool:
        return isinstance(self.place.get(new, REPLICATE), Replicate)

    def ndim(self, old: torch.fx.Node) -> int:
        v = old.meta.get(meta.VAL)
        return v.dim() if isinstance(v, torch.Tensor) else 0

    # ---- sizes: a dim tp does not divide is cut as torch.chunk cuts it (fxpar.ir.placement.chunk_sizes) --
    def local_size(self, n: int) -> int:
        """This rank's share of a dim of full size ``n``."""
        return chunk_sizes(n, self.tp)[self.rank]

    def local_start(self, n: int) -> int:
        """Where this rank's share of a dim of full size ``n`` starts."""
        return chunk_start(n, self.tp, self.rank)

    def uneven(self, old: torch.fx.Node, d: int) -> int | None:
        """The full size of traced node ``old``'s dim ``d`` when tp does not divide it (its shards differ in
        size from rank to rank), else None."""
        v = old.meta.get(meta.VAL)
        n = v.shape[d % v.dim()] if isinstance(v, torch.Tensor) and v.dim() else None
        return n if isinstance(n, int) and n % self.tp and old not in self.packing.values else None

    def keep(self, old, args, kwargs, mapping: Callable[[int], int]) -> torch.fx.Node:
        """An op that moves dims but never mixes them: the shard follows ``mapping``."""
        d = self.shard_dim(args[0])
        return self.call(old.target, args, kwargs, like=old, place=as_placement(None if d is None else mapping(d)))

    def replicate(self, new: torch.fx.Node, old: torch.fx.Node) -> torch.fx.Node:
        """The whole value on every rank: a partial sum reduced, a shard all-gathered."""
        if self.is_partial(new):
            new = self.materialize(new)
        d = self.shard_dim(new)
        if d is None:
            return new
        self.channels.gathered(old)
        n = self.uneven(old, d)
        if n is not None:  # shares of different sizes (uneven.py)
            return uneven.gather(self, new, old, d, n)
        return self.call(fxpar_ops.all_gather.default, (new, self.group, d), like=old)

    def slice_to(self, new: torch.fx.Node, old: torch.fx.Node, d: int) -> torch.fx.Node:
        """A replicated value cut to this rank's part along d (no communication)."""
        if self.shard_dim(new) == d:
            return new
        if not self.is_replicated(new):
            new = self.replicate(new, old)
        self.channels.cut(old, d)
        n = self.uneven(old, d)
        if n is not None:  # shares of different sizes (uneven.py)
            return uneven.scatter(self, new, old, d, n, Shard(d))
        return self.call(fxpar_ops.scatter_slice.default, (new, self.group, d), like=old, place=Shard(d))

    def sum_grad(self, new: torch.fx.Node, like: torch.fx.Node | None = None) -> torch.fx.Node:
        """``new`` with its gradient all-reduced (Megatron's f), once per value."""
        if new not in self.f_cache:
            self.f_cache[new] = self.call(fxpar_ops.identity_fwd_all_reduce_bwd.default, (new, self.group), like=like)
        return self.f_cache[new]

    def column_input(self, x, xo):
        """The input of a column-parallel layer, once per value: replicated with an all-reduce of its
        gradient (Megatron's f), or, under sequence parallel, gathered along the sequence with a
        reduce-scatter of its gradient."""
        if x not in self.f_cache:
            if self.sp and self.shard_dim(x) == 1 and self.ndim(xo) == 3:
                self.f_cache[x] = self.call(fxpar_ops.all_gather_rs_bwd.default, (x, self.group, 1), like=xo)
            else:
                y = self.replicate(x, xo)
                self.f_cache[x] = self.call(fxpar_ops.identity_fwd_all_reduce_bwd.default, (y, self.group), like=xo)
        return self.f_cache[x]

    def materialize(self, new: torch.fx.Node) -> torch.fx.Node:
        """The sum of a partial value (once per value): all-reduce, or reduce-scatter under SP."""
        if new not in self.reduced:
            self.reduced[new] = self.reduce_partial(new, self.partial_src[new])
        return self.reduced[new]

    def reduce_partial(self, out, old):
        """Sum the ranks' partial results: all-reduce, or reduce-scatter along the sequence (sequence
        parallel: what follows between blocks, norms and residual adds, runs on sequence shards)."""
        v = old.meta.get(meta.VAL)
        if self.sp and isinstance(v, torch.Tensor) and v.dim() == 3 and v.shape[1] % self.tp == 0:
            return self.call(fxpar_ops.reduce_scatter.default, (out, self.group, 1), like=old, place=Shard(1))
        return self.call(fxpar_ops.all_reduce.default, (out, self.group), like=old)

    def grad_reduced(self, p, out):
        """A replicated parameter added to a sequence shard: its gradient is a partial sum over ranks."""
        if not self.is_replicated(p) or self.is_replicated(out):
            return p
        return self.sum_grad(p)

    # ---- the pass -----------------------------------------------------------------------------------
    def run(self) -> torch.fx.Graph:
        rows_scaled = False  # parameters with whole pieces: their rows' gradients, once after the inputs
        for old in self.program.graph.nodes:
            if old.op == "placeholder":
                new = self.graph.placeholder(old.name)
                new.meta = dict(old.meta)
                self.place[new] = as_placement(self.param_placement(old))
            elif old.op == "get_attr":
                new = self.graph.get_attr(old.target)
                new.meta = dict(old.meta)
                self.place[new] = REPLICATE
            elif old.op == "output":
                outs = [None if self.keep_outputs is not None and i not in self.keep_outputs
                        else self.env[a] if self.env.get(a) in self.local_values
                        else self.replicate(self.env[a], a) if isinstance(a, torch.fx.Node) else a
                        for i, a in enumerate(old.args[0])]
                new = self.graph.output(tuple(outs))
            else:
                if not rows_scaled:  # (rules/fused.py)
                    rows_scaled = True
                    fused.scale_whole_rows(self)
                new = self.rewrite(old)
            self.env[old] = new
        return self.graph

    def param_placement(self, old: torch.fx.Node) -> int | None:
        fqn = old.meta.get(meta.PARAM)
        if not fqn:
            return None
        if fqn in self.experts.dims:  # an expert weight: as the graph uses it, whatever its module's style
            d = self.experts.dims[fqn]
        else:
            d = param_dim(self.program, fqn, self.styles, self.transposed, self.segments, self.tp)
        d = self.channels.derived.get(fqn) if d is None else d
        if d is not None:
            self.param_dim[fqn] = d
        return d

    def rewrite(self, old: torch.fx.Node) -> torch.fx.Node:
        args = map_arg(old.args, lambda a: self.env[a])
        kwargs = map_arg(old.kwargs, lambda a: self.env[a])
        if any(self.is_partial(self.env[a]) for a in old.all_input_nodes):
            kept = keep_partial(self, old, args, kwargs)
            if kept is not None:
                return kept
            args, kwargs = map_arg((args, kwargs), lambda n: self.materialize(n) if self.is_partial(n) else n)
        if old in self.packing.cuts and fused.is_fused_cut(self, old, args):  # q, k, v out of a fused value
            return fused.cut(self, old, args, kwargs)
        return rule_for(old)(self, old, args, kwargs)
