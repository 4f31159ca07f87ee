"""Parameters cut along with the activations they meet: per-channel and per-head weights that belong to
no linear layer (a Mamba mixer's ``A_log``, ``D`` and depthwise ``conv1d`` weight, a delta-net's
``dt_bias``), so no style names them; the rules find them instead.

Reads: the traced graph (``fxpar.param``, ``val``) and where the rewriter cuts or gathers values.
Writes nothing to the program: the parameters to shard, by FQN, which the rewriter then places.

A first rewrite runs with such parameters whole. Wherever a rule cuts a replicated value down to this
rank's part (:meth:`~.rewriter.Rewriter.slice_to`) and that value is one parameter seen through ops
that keep its dims apart (casts, unary elementwise ops, ``unsqueeze``/``squeeze``), the parameter
*wants* that cut: every rank would only ever read its part. The rewrite runs again with those
parameters sharded, each rank storing its part (no communication where the whole one needed a local
slice). A parameter some rule still needs whole is then gathered there
(:meth:`~.rewriter.Rewriter.replicate`): it is dropped from the set and the rewrite runs once more, so
the program never gathers a weight that was whole before. ``A_log`` of a Mamba mixer, before and
after::

    a = neg(exp(A_log))                  # A_log [d_inner, d_state]: Shard(0), this rank's channels
    dA = mul(unsqueeze(a, 0), dt)        # dt Shard(1) (channels): no scatter_slice of a any more
"""

from __future__ import annotations

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.op_classes import PASS_THROUGH, is_pointwise, packet
from fxpar.passes.tensor_parallel.dim_moves import relabel

aten = torch.ops.aten
Origin = tuple[str, tuple]  # (parameter FQN, the parameter's dim at each dim of the value, None: a new dim)
ROUNDS = 4  # rewrites at most: whole, with the wanted cuts, then (rarely) twice more without conflicts


def param_origins(program) -> dict[torch.fx.Node, Origin]:
    """Traced nodes that are one parameter seen through dim-keeping ops -> (FQN, dim map)."""
    out: dict[torch.fx.Node, Origin] = {}
    for node in program.graph.nodes:
        fqn = node.meta.get(meta.PARAM)
        v = node.meta.get(meta.VAL)
        if node.op == "placeholder":
            if fqn and isinstance(v, torch.Tensor):
                out[node] = (fqn, tuple(range(v.dim())))
            continue
        if node.op != "call_function" or len(node.all_input_nodes) != 1 or not isinstance(v, torch.Tensor):
            continue
        src = node.all_input_nodes[0]
        if src not in out or node.args[0] is not src:
            continue
        fqn, dims = out[src]
        pkt = packet(node)
        if pkt in PASS_THROUGH or (is_pointwise(node) and tuple(v.shape) == tuple(src.meta[meta.VAL].shape)):
            out[node] = (fqn, dims)
        elif pkt in (aten.unsqueeze, aten.squeeze):  # a dim added (None: no parameter dim), size-1 dims dropped
            out[node] = (fqn, relabel(node, dims))
    return out


class ChannelParams:
    """What one rewrite learnt about per-channel parameters: the cuts each wanted (FQN -> dim) and
    those a rule needed whole. ``derived``: the parameters this rewrite holds sharded (FQN -> dim)."""

    def __init__(self, program, derived: dict[str, int]):
        self.origins = param_origins(program)
        self.derived = dict(derived)
        self.wants: dict[str, set[int]] = {}
        self.whole: set[str] = set()

    def cut(self, old: torch.fx.Node, d: int) -> None:
        """A replicated value of traced node ``old`` is cut along its dim ``d``."""
        o = self.origins.get(old)
        if o is not None and isinstance(old.meta.get(meta.VAL), torch.Tensor):
            fqn, dims = o
            if 0 <= d < len(dims) and dims[d] is not None and old.meta[meta.VAL].shape[d] > 1:
                self.wants.setdefault(fqn, set()).add(dims[d])
            else:
                self.whole.add(fqn)

    def gathered(self, old: torch.fx.Node) -> None:
        """A sharded value of traced node ``old`` is gathered whole."""
        o = self.origins.get(old)
        if o is not None:
            self.whole.add(o[0])

    def next_round(self, styled: set[str]) -> dict[str, int] | None:
        """The parameters the next rewrite shards, or None when this one is final. ``styled``: FQNs a
        style already cuts (never derived)."""
        found = {f: next(iter(ds)) for f, ds in self.wants.items() if len(ds) == 1 and f not in styled}
        keep = {f: d for f, d in self.derived.items() if f not in self.whole}
        nxt = keep | {f: d for f, d in found.items() if f not in self.whole}
        return None if nxt == self.derived else nxt


def rewrite_with_channels(make):
    """Run ``make(derived) -> Rewriter`` until the per-channel parameters settle; the last rewriter and
    its graph."""
    derived: dict[str, int] = {}
    for _ in range(ROUNDS):
        rw = make(derived)
        graph = rw.run()
        nxt = rw.channels.next_round(set(rw.param_dim) - set(derived))
        if nxt is None:
            break
        derived = nxt
    return rw, graph
