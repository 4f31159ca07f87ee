"""The expert-parallel ops of fxpar's IR: ``fxpar::ep_counts``, ``fxpar::ep_dispatch``, ``fxpar::ep_combine``
(schemas, fake kernels, autograd) and :class:`EpResult`, what the expert-parallel pass did.

Reads: nothing at import but torch and :mod:`fxpar.ir.ops`. Writes nothing: the three ops are records of
:mod:`fxpar.ir.collectives`, defined by :mod:`fxpar.ir.ops` and named here. ``ep_counts`` runs the
runtime's ``all_gather`` pattern on the counts its record's ``prepare`` hook makes of the offsets, and its
``tally`` hook gives the step's counters the load statistics; the all-to-alls run the ``all_to_all``
pattern with :mod:`fxpar.ir.ep_layout`'s split sizes (:mod:`fxpar.runtime.collectives` runs every
pattern). Until the runtime is imported, running one on real tensors raises
:class:`~fxpar.ir.errors.CollectiveError`.

Why three ops and these shapes: an MoE layer's tokens, sorted by expert, go to the ranks owning their
experts and come back; how many go where is only known at run time, but a traced graph needs static
shapes. So:

* ``ep_counts(offs, group, layer)``: this rank's per-expert token counts (from the router's cumulative
  ``offs``) all-gathered over the ep group: ``[ep, E]`` int64, row ``s`` the counts of ep rank ``s``.
  Every rank then knows every split size (the exchange the all-to-alls need first) and the load of
  every expert (the statistics ``CompiledModel.ep.stats`` shows).
* ``ep_dispatch(x, counts, group, layer, backward)``: ``x`` ``[N, H]`` (rows sorted by expert) goes by
  one all-to-all to the owners of its rows' experts; the result is ``[ep * N, H]``, a static worst case
  (every rank's rows all routed here), whose first rows are the received tokens grouped by local expert
  (expert-major, source rank within), then zeros. Only real rows travel.
* ``ep_combine(y, counts, group, layer, backward)``: the inverse: ``y`` ``[ep * N, H]`` (the local
  experts' outputs in the dispatch's order) back to the ranks the rows came from, ``[N, H]`` in ``x``'s
  order.

Autograd: dispatch's backward is a combine of the gradient and combine's backward a dispatch (the
padding rows' gradients are dropped: they came from no token). ``backward=True`` tells the kernel which
way the bytes count (``CompiledModel.ep.comm``, the records' ``counter``); ``layer`` names the MoE module for the
statistics. These ops are not in :data:`fxpar.ir.ops.COLLECTIVE_OPS` (their records say ``counted=False``:
the TP/ZeRO collective counts stay as they were); :func:`ep_nodes` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from fxpar.ir.ops import OPS

EP_OPS = ("ep_counts", "ep_dispatch", "ep_combine", "ep_gather", "ep_scatter")


@dataclass
class EpResult:
    """What the expert-parallel pass did: ``experts``: canonical FQN -> (dim cut, experts in the model)
    of every expert parameter this rank holds a slice of; ``layers``: the MoE modules rewritten, in
    graph order; ``parts``/``rank``: the ep degree and this rank's ep coordinate."""

    experts: dict[str, tuple[int, int]] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)
    parts: int = 1
    rank: int = 0

    def local_range(self, n_experts: int, rank: int | None = None) -> tuple[int, int]:
        """``[lo, hi)``: the experts ep rank ``rank`` (default: this one) holds."""
        k = n_experts // self.parts
        r = self.rank if rank is None else rank
        return r * k, (r + 1) * k


ep_counts = OPS["ep_counts"]  # records of fxpar.ir.collectives
ep_dispatch = OPS["ep_dispatch"]
ep_combine = OPS["ep_combine"]
ep_gather = OPS["ep_gather"]  # experts run as a loop over the experts (fxpar.passes.ep_loops)
ep_scatter = OPS["ep_scatter"]


def ep_kind(node: torch.fx.Node) -> str | None:
    """The expert-parallel op a node calls ("ep_dispatch", ...), or None."""
    if node.op != "call_function":
        return None
    packet = getattr(node.target, "overloadpacket", node.target)
    namespace, _, name = getattr(packet, "_qualified_op_name", "").partition("::")
    return name if namespace == "fxpar" and name in EP_OPS else None


def ep_nodes(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.Node]]:
    """(kind, node) for every expert-parallel op node of ``gm``."""
    return [(k, n) for n in gm.graph.nodes if (k := ep_kind(n)) is not None]
