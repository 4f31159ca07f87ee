"""What context parallelism (``Plan(cp=N)``) changes in a part's price: the one place it is priced.

Reads a part's costs (:class:`~fxpar.planner.model_costs.RankPart`, read off one trace of whole sequences of
``S`` tokens) and its :class:`Attention` (what :func:`fxpar.planner.cp_costs.read_attention` found in the
same trace: the keys and values ``passes/context_parallel.py`` gathers); writes nothing. It follows the
pass and its runtime op (``fxpar::all_gather_rs_bwd``):

* each sequence is cut into ``2 cp`` chunks and each rank holds two (``S / cp`` tokens): every op runs on
  ``1 / cp`` of the rows, so its FLOPs, the activation bytes it moves and writes, what it keeps for backward
  and the bytes a pipeline cut sends are ``1 / cp`` of the whole sequence's, its weights the same. A MoE
  layer's router and experts too (``passes/cp_tokens.py`` keeps a token-local MoE on the rank's tokens), and
  with ep its all-to-alls send ``1 / cp`` of the rows (:func:`fxpar.cost.experts.ep_comm`). Attention
  takes this rank's ``S / cp`` query rows against all ``S`` keys: ``1 / cp`` of its FLOPs too, but it reads
  the whole sequence's keys and values;
* each attention's keys and values are all-gathered over cp before any grouped-query expansion (KV heads
  only), the expansion and the layout ops between the gather and the attention run on the whole sequence,
  and what the attention keeps of them for backward is the whole sequence's (:attr:`Attention.act`);
* per microbatch, each gathered tensor is one all-gather in forward (each rank receives the others'
  ``(cp - 1) / cp`` of it and sends its own to each: :data:`fxpar.cost.comm.RING`) and one reduce-scatter of
  its gradient in backward; they block their rank (the op is synchronous, as TP's collectives are: no
  overlap with the chunk's compute), layer recompute runs the forward's again; the loss is summed over cp
  (one scalar all-reduce per microbatch);
* with ``cp_attention="ulysses"``, each attention whose query and key/value heads cp divides instead sends its
  queries, keys, values (KV heads) and output by all-to-all (:mod:`fxpar.passes.cp_ulysses`): each rank sends
  ``(cp - 1) / cp`` of its ``S / cp`` rows of each, in forward and again in backward, and attends with
  ``heads / cp`` heads over the whole sequence (``1 / cp`` of the attention's work and of what it keeps, with
  no whole-sequence keys and values); an attention whose heads cp does not divide keeps the all-gather, and
  with ``"auto"`` so does one whose all-to-alls would send more bytes;
* the cp ranks of a replica share its batch; gradients reduce, and ZeRO shards, over the ``dp x cp`` ranks
  of one pipeline and TP position (``fxpar.ir.mesh``: cp between pp and tp).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fxpar.cost.comm import sent_bytes
from fxpar.cost.data_parallel import DpGroups
from fxpar.cost.overheads import call_time
from fxpar.ir.errors import PlanError

__all__ = ["LOSS_BYTES", "Attention", "check_cp", "cp_comm", "cp_groups", "cp_part", "cp_part_of", "ulysses_at",
           "variant_cp"]

LOSS_BYTES = 4  # the loss all-reduced over cp: one fp32 scalar


@dataclass(frozen=True)
class Attention:
    """One part's attention layers for one sequence (batch 1) at one tp degree: what context parallelism
    gathers and what stays whole."""

    kv: int  # bytes of the keys and values the pass gathers (before grouped-query expansion), summed over layers
    gathers: int  # the tensors gathered (a key and a value per attention layer)
    layers: int  # attention ops (SDPA, or an eager ``q @ k^T`` / ``p @ v`` product each)
    rows: tuple[tuple[int, int], ...] = ()  # (index in the part's ``nodes``, bytes of its whole-sequence operands)
    whole: tuple[int, ...] = ()  # rows on the whole sequence: the layout ops between a gather and its attention
    act: dict[str, tuple[int, int]] = field(default_factory=dict)  # policy -> whole-sequence (kept, transient)
    # the attentions Ulysses can take: (query heads, key/value heads, bytes of its queries and output, of its
    # keys and values), whole sequence, per TP rank; it takes those whose heads cp divides
    ulysses: tuple[tuple[int, int, int, int], ...] = ()


def ulysses_at(att: Attention | None, cp: int, mode: str = "ulysses") -> tuple[int, int, int]:
    """(attentions Ulysses takes on ``cp`` ranks, the bytes of their queries and outputs, of their keys and
    values: whole sequence, batch 1); ``mode`` ``"auto"``: those whose all-to-alls send fewer bytes, as the
    pass chooses (:func:`fxpar.passes.cp_ulysses.fewer_bytes`)."""
    if mode not in ("ulysses", "auto"):
        return 0, 0, 0
    took = [u for u in (att.ulysses if att else ()) if u[0] % cp == 0 and u[1] % cp == 0 and
            (mode == "ulysses" or u[2] + u[3] < cp * u[3])]
    return len(took), sum(u[2] for u in took), sum(u[3] for u in took)


def cp_part(part, cp: int, mode: str = "allgather"):
    """``part`` as one of ``cp`` context-parallel ranks computes and holds it (see the module docstring);
    ``mode``: ``Plan.cp_attention``."""
    if cp == 1:
        return part
    att = part.attention
    if att is not None and 2 * ulysses_at(att, cp, mode)[0] == att.gathers:
        att = None  # every attention on 1 / cp of the heads over the whole sequence: 1 / cp of it all
    rows = dict(att.rows) if att else {}
    whole = set(att.whole) if att else set()
    nodes = []
    for i, n in enumerate(part.nodes):
        if i in whole:
            nodes.append(n)
            continue
        keep = rows.get(i, 0)  # the attention's whole-sequence keys and values, read in full
        out = n[4] if len(n) > 4 else 0.0
        nodes.append((n[0] / cp, n[1] / cp, (n[2] - keep) / cp + keep, n[3], out / cp))
    act = {}
    for p, (kept, trans) in part.act.items():
        k, t = att.act.get(p, (0, 0)) if att else (0, 0)
        act[p] = ((kept - k) // cp + k, (trans - t) // cp + t)
    ex = part.experts  # a MoE layer's rows are this rank's tokens: its all-to-alls move 1 / cp of them
    ex = ex and replace(ex, dispatch=ex.dispatch // cp, combine=ex.combine // cp, saved=ex.saved // cp)
    return replace(part, nodes=nodes, act=act, out_bytes=part.out_bytes // cp, grad_bytes=part.grad_bytes // cp,
                   kept_out=part.kept_out // cp, units=[(r, x // cp, g // cp, m) for r, x, g, m in part.units],
                   experts=ex, _times={})


def variant_cp(cache: dict, key: tuple, part, cp: int, mode: str = "allgather"):
    """:func:`cp_part` of ``part``, kept in ``cache`` under ``key``."""
    if cp == 1:
        return part
    got = cache.get(("cp", *key, mode))
    if got is None:
        got = cache[("cp", *key, mode)] = cp_part(part, cp, mode)
    return got


def cp_comm(profile, part, cp: int, batch: int, inter: bool, again: bool, loss: bool,
            share: float = 1.0, mode: str = "allgather") -> tuple[float, float, float]:
    """(forward seconds, backward seconds, bytes this rank sends) of a microbatch of ``batch`` sequences'
    key/value gathers (or, ``mode="ulysses"``, all-to-alls) in ``part`` over ``cp`` ranks (``inter``: the cp
    group spans nodes; ``again``: layer recompute gathers again in backward; ``loss``: the part holds the loss,
    all-reduced over cp; ``share``: the compute's share of a core, dividing what fxpar's op spends on the
    rank's own core)."""
    att = part.attention
    if cp == 1:
        return 0.0, 0.0, 0.0
    fwd = bwd = sent = 0.0
    took, qo, kv_u = ulysses_at(att, cp, mode)
    if att is not None and att.gathers > 2 * took:  # the attentions that gather their keys and values
        kv, gathers = att.kv - kv_u, att.gathers - 2 * took
        each = kv * batch / gathers  # one gathered tensor (a layer's keys, or its values)
        gather = profile.collective_time("all_gather", each, cp, inter) + call_time(profile, "all_gather", each) / share
        rs = profile.collective_time("reduce_scatter", each, cp, inter) + \
            call_time(profile, "reduce_scatter", each) / share
        fwd, bwd = gathers * gather, gathers * rs
        sent = sent_bytes("all_gather", kv * batch, cp) + sent_bytes("reduce_scatter", kv * batch, cp)
    if took:  # Ulysses: queries, keys, values and output, this rank's rows of each, both ways
        local = (qo + kv_u) * batch / cp
        each = local / (4 * took)
        a2a = profile.collective_time("all_to_all", each, cp, inter) + call_time(profile, "all_to_all", each) / share
        fwd, bwd = fwd + 4 * took * a2a, bwd + 4 * took * a2a
        sent += 2 * sent_bytes("all_to_all", local, cp)
    if loss:
        fwd += profile.collective_time("all_reduce", LOSS_BYTES, cp, inter)
        sent += sent_bytes("all_reduce", LOSS_BYTES, cp)
    return fwd, bwd + (fwd if again else 0.0), sent


def check_cp(costs, plan) -> None:
    """PlanError unless ``costs`` can price ``plan``'s cp: ``2 cp`` chunks dividing the sequence, and the
    attention the pass gathers for found in the trace."""
    cp = plan.cp
    if cp == 1:
        return
    if costs.seq % (2 * cp):
        fits = [d for d in range(2, costs.seq // 2 + 1) if costs.seq % (2 * d) == 0][:8]
        raise PlanError(f"fxpar.planner.price: cp={cp} cuts each sequence into {2 * cp} chunks, which do not divide "
                        f"seq={costs.seq}; use cp in {fits or [1]} or a sequence that {2 * cp} divides")
    if not any(p.attention and p.attention.gathers for by_tp in costs.parts.values() for p in by_tp.values()):
        raise PlanError(f"fxpar.planner.price: cp={cp}: no attention whose keys and values context parallelism "
                        "gathers was found in the traced parts")


def cp_groups(plan, spans) -> tuple:
    """``(plan as data parallelism sees it, its DpGroups)`` with cp: gradients reduce and ZeRO shards over the
    ``dp x cp`` ranks (cp ranks ``tp`` apart, dp ranks ``pp x cp x tp`` apart: ``fxpar.ir.mesh``), a group
    spanning nodes where either does. ``spans(stride, size)``: whether such a group crosses nodes."""
    dense = replace(plan, dp=plan.dp * plan.cp, cp=1, cp_attention="allgather")
    inter = spans(plan.tp, plan.cp) or spans(plan.pp * plan.cp * plan.tp, plan.dp)
    return dense, DpGroups(dense.dp, inter)


def cp_part_of(plan, parts: dict, st: dict, stages: list[int], m: int) -> dict:
    """With cp: moves the slowest rank's gather time (``st``'s "cf"/"cb", counted with TP's collectives) from
    ``parts["tp_comm"]`` to ``parts["cp_comm"]``, and returns ``{"cp": bytes it sends}`` ({} without)."""
    if plan.cp == 1:
        return {}
    parts["cp_comm"] = m * sum(st["cf"][s] + st["cb"][s] for s in stages)
    parts["tp_comm"] -= parts["cp_comm"]
    return {"cp": int(m * sum(st["csent"][s] for s in stages))}
