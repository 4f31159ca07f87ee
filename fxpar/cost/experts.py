"""What expert parallelism (``Plan(ep=N)``) changes in a part's price: the one place it is priced.

Reads a part's costs (:class:`~fxpar.planner.model_costs.RankPart`, read at tp=1 off one trace) and its
:class:`Experts` (what :func:`fxpar.planner.variants.read_experts` found in the same trace); writes
nothing. It follows ``passes/expert_parallel.py`` and ``runtime/expert_parallel.py``:

* each ep rank holds ``E / ep`` of every MoE layer's experts: ``1 / ep`` of the expert parameters (their
  gradients and optimizer states follow them: the expert slices reduce over dp only, every other
  parameter over the ``dp x ep`` replicas, :func:`fxpar.cost.memory.per_rank`);
* its experts compute the tokens routed to them from the ``ep`` replicas: with balanced routing as many
  rows as the layer computes without ep, so the expert FLOPs stay, only the weight bytes they read drop;
* the routed rows travel by all-to-all: forward ``ep_dispatch`` (the region's entry, ``N x H``) and
  ``ep_combine`` (its exit), backward the same two the other way, each sending ``(ep - 1) / ep`` of its
  rows off-rank (:data:`fxpar.cost.comm.RING`), plus one all-gather of the ``E`` per-expert counts
  (int64) per MoE layer and microbatch;
* ``ep_dispatch`` writes into a static ``[ep * N, H]`` buffer (a rank may receive every token), and the
  expert ops after it are shaped by it: what they save for backward is ``ep`` times the tensors of the
  region without ep (kept under recompute none and selective; recomputed, so transient, under layer),
  and cost ``ep`` times their rows: a row-wise op (the activation, the gate's product) computes and moves
  every row, a grouped matmul computes the routed rows only but zero-fills its ``ep``-times output;
* experts run as a loop over the experts (``passes/ep_loops.py``, ``Experts.kind == "loop"``) have no
  all-to-all and no buffer: each layer's token inputs are all-gathered and its output reduce-scattered
  (:func:`_loop_comm`); each rank runs its ``E / ep`` experts on ``ep`` times the tokens, so the region's
  FLOPs and saved tensors stay, and only the experts' cut parameters drop to ``1 / ep``;
* fxpar's EP ops spend beyond their raw collectives what ``fxpar calibrate`` measured on their kernels
  (``profile.collective_call["ep_counts" | "ep_dispatch" | "ep_combine"]``: the layout read off the counts,
  the reorder into and out of the static buffer, the autograd record), per call and per byte of rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fxpar.cost.data_parallel import DpGroups, sent_bytes
from fxpar.cost.overheads import call_time
from fxpar.ir.errors import PlanError

__all__ = ["Experts", "check_ep", "dp_sent", "ep_comm", "ep_groups", "ep_part", "ep_part_of", "variant_part"]

COUNT_BYTES = 8  # the per-expert counts are int64


@dataclass(frozen=True)
class Experts:
    """One part's expert layers, for one sequence (batch 1) at tp=1."""

    n_experts: int  # experts per MoE layer (the smallest, where layers differ)
    params: int  # expert parameter entries of the part
    rows: tuple[int, ...]  # indices in the part's ``nodes`` of the ops between dispatch and combine
    dispatch: int  # bytes of the rows sent to their experts (the regions' entries, summed over the layers)
    combine: int  # bytes of the rows sent back (the regions' exits, summed)
    saved: int  # bytes the regions' ops save for backward (summed)
    layers: int = 1  # MoE layers in the part (each its all-to-alls and counts)
    mms: tuple[int, ...] = ()  # those of ``rows`` that are the grouped matmuls (the others are row-wise)
    # "loop": experts run as a loop over the experts (passes/ep_loops.py): ``dispatch`` is then the token inputs
    # all-gathered, ``combine`` the output reduce-scattered, ``back`` the gathered floats whose gradients
    # reduce-scatter back; no buffer, no counts
    kind: str = "a2a"
    back: int = 0


def ep_part(part, ex: Experts, ep: int):
    """``part`` as one of ``ep`` expert-parallel ranks holds and computes it (see the module docstring)."""
    if ep == 1:
        return part
    rows = set(ex.rows)
    mms = set(ex.mms)
    nodes = [_buffer_row(n, ep, i in mms) if i in rows else n for i, n in enumerate(part.nodes)]
    extra = (ep - 1) * ex.saved
    act = {p: (k + extra, t) if p != "layer" else (k, t + extra) for p, (k, t) in part.act.items()}
    params = part.params - ex.params + ex.params // ep
    return replace(part, nodes=nodes, params=params, frozen=min(part.frozen, params), act=act, _times={})


def _buffer_row(n: tuple, ep: int, mm: bool) -> tuple:
    """A region op's row ``(fwd_flops, bwd_flops, act_bytes, weight_bytes[, out_bytes])`` on the static
    ``[ep * N, H]`` buffer: a grouped matmul (``mm``) reads ``1 / ep`` of the weights and computes the same
    routed rows (those past the offsets are skipped) but zero-fills its ``ep``-times output (and its input's
    gradient); a row-wise op (the activation, the gate's product) computes and moves every row of the buffer."""
    out = n[4] if len(n) > 4 else 0.0
    if mm:
        return (n[0], n[1], n[2] + (ep - 1) * out, n[3] / ep, ep * out)
    return (ep * n[0], ep * n[1], ep * n[2], 0.0, ep * out)


def ep_comm(profile, part, ep: int, batch: int, inter: bool, again: bool,
            share: float = 1.0) -> tuple[float, float, int, float]:
    """(forward seconds, backward seconds, expert entries held, bytes this rank sends) of a microbatch of
    ``batch`` sequences' all-to-alls and counts in ``part``'s MoE layers, over ``ep`` ranks (``inter``: the
    group spans nodes; ``again``: recompute runs the forward's again in backward; ``share``: the compute's
    share of a core, :meth:`DeviceProfile.share`, dividing what the ops spend on the rank's own core)."""
    ex = part.experts
    if ep == 1 or ex is None:
        return 0.0, 0.0, 0, 0.0
    k = ex.layers
    if ex.kind == "loop":
        return _loop_comm(profile, ex, ep, batch, inter, again)
    a2a = profile.collective_time("all_to_all", ex.dispatch * batch / k, ep, inter) + \
        profile.collective_time("all_to_all", ex.combine * batch / k, ep, inter)
    counts = profile.collective_time("all_gather", COUNT_BYTES * ex.n_experts * ep, ep, inter)
    # fxpar's ops beyond the raw collectives (fxpar calibrate): the counts' wrapper, the layout read off the
    # counts, the reorder into and out of the static buffer; backward runs dispatch and combine once more each
    a2a += (call_time(profile, "ep_dispatch", ex.dispatch * batch / k)
            + call_time(profile, "ep_combine", ex.combine * batch / k)) / share
    counts += call_time(profile, "ep_counts", COUNT_BYTES * ex.n_experts) / share
    off_rank = (ep - 1) / ep  # the share of its rows a rank sends to the others
    sent = 2 * off_rank * (ex.dispatch + ex.combine) * batch + k * COUNT_BYTES * ex.n_experts * (ep - 1)
    fwd = k * (a2a + counts)
    return fwd, k * a2a + (fwd if again else 0.0), ex.params // ep, sent


def _loop_comm(profile, ex: Experts, ep: int, batch: int, inter: bool, again: bool) -> tuple:
    """:func:`ep_comm` of loop-form layers: forward, each layer's token inputs all-gathered (``ep x`` this
    rank's bytes in all) and its ``[ep * T, H]`` output reduce-scattered; backward, the output's gradient
    all-gathered and the gathered floats' gradients reduce-scattered. Each sends ``(ep - 1) / ep`` of the full
    tensor (:data:`fxpar.cost.comm.RING`), ``ep - 1`` times this rank's rows."""
    k = ex.layers
    per = batch / k  # one layer's bytes of this microbatch are ``per`` times the part's per-sequence sums

    def t(kind: str, nbytes: float) -> float:
        return profile.collective_time(kind, ep * nbytes * per, ep, inter)
    fwd = k * (t("all_gather", ex.dispatch) + t("reduce_scatter", ex.combine))
    bwd = k * (t("all_gather", ex.combine) + t("reduce_scatter", ex.back))
    sent = (ep - 1) * (ex.dispatch + 2 * ex.combine + ex.back) * batch
    return fwd, bwd + (fwd if again else 0.0), ex.params // ep, sent


def check_ep(costs, ep: int) -> None:
    """PlanError unless ``costs`` can price ``ep`` expert-parallel ranks (expert layers, ``ep`` dividing each
    one's experts: what ``passes/expert_parallel.py`` checks)."""
    if ep == 1:
        return
    if costs.ep_allowed is not None:
        raise PlanError(f"fxpar.planner.price: ep={ep} cannot be used: {costs.ep_allowed}")
    n = [x.n_experts for part in costs.parts.values() if (x := part[(1, False)].experts)]
    if any(k % ep for k in n):
        raise PlanError(f"fxpar.planner.price: ep={ep} does not divide the {min(n)} experts of a MoE layer; "
                        f"pick an ep dividing {min(n)}")


def variant_part(costs, cache: dict, name: str, tp: int, sp: bool, ep: int = 1, fused: bool = False):
    """Part ``name``'s costs as one of ``ep`` expert-parallel ranks holds it (:func:`ep_part`, kept in
    ``cache``); ``fused``: "post" with the fused loss (``costs.fused``)."""
    if fused and name == "post":
        return costs.fused.post(tp, sp)
    part = costs.part(name, tp, sp)
    if ep > 1 and part.experts:
        key = ("ep", name, tp, sp, ep)
        if key not in cache:
            cache[key] = ep_part(part, part.experts, ep)
        part = cache[key]
    return part


def ep_groups(plan, spans) -> tuple:
    """``(plan as its dense parameters see it, their DpGroups, the expert slices' DpGroups or None)``: with
    ``ep`` the dense parameters reduce over the ``dp x ep`` replicas, the expert slices over the ``dp`` ranks
    ``ep x pp x tp`` apart (``fxpar.ir.mesh``). ``spans(stride, size)``: whether such a group crosses nodes."""
    if plan.ep == 1:
        return plan, DpGroups.of(plan, spans), None
    dense = replace(plan, dp=plan.replicas, ep=1)
    return dense, DpGroups.of(dense, spans), DpGroups(plan.dp, spans(plan.ep * plan.pp * plan.tp, plan.dp))


def ep_part_of(plan, parts: dict, st: dict, stages: list[int], m: int) -> dict:
    """With ep: moves the slowest rank's all-to-all time (``st``'s "ef"/"eb", counted with TP's collectives)
    from ``parts["tp_comm"]`` to ``parts["ep_comm"]``, and returns ``{"ep": bytes it sends}`` ({} without)."""
    if plan.ep == 1:
        return {}
    parts["ep_comm"] = m * sum(st["ef"][s] + st["eb"][s] for s in stages)
    parts["tp_comm"] -= parts["ep_comm"]
    return {"ep": int(m * sum(st["esent"][s] for s in stages))}


def dp_sent(plan, n: float, ne: float, m: int, gbytes: float, groups: DpGroups, experts: DpGroups | None,
            frozen: int = 0):
    """Data parallelism's bytes one rank sends for ``n`` trainable entries of which ``ne`` are expert slices
    (over ``experts``), and ``frozen`` entries that do not train (ZeRO-3 gathers them), as
    :func:`fxpar.cost.data_parallel.sent_bytes`' ``(inside the shard group, across replicas)``."""
    if plan.replicas == 1:
        return 0.0, 0.0
    inside, across = sent_bytes(plan.zero, n - ne, m, gbytes, groups, int(frozen))
    if ne and experts is not None:
        inside += sent_bytes(plan.zero, ne, m, gbytes, experts)[0]
    return inside, across
