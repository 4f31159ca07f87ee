"""The plan space the planner searches: every ``dp x pp x tp = world`` factorisation the model allows, each
with ZeRO 0-3 (with ZeRO, HSDP's ``dp_replicate`` where the dp group spans nodes:
:func:`fxpar.planner.dp_groups.replica_options`), sequence parallelism (tp > 1), microbatch counts the
global batch divides into, pipeline schedules with their virtual stages, and recompute policies; for long
sequences, context parallelism (:func:`cp_options`: ``dp x pp x cp x tp = world``). What cannot run is kept with
its reason (``(what, reason)``), so the planner can say why a degree never appeared.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product

from fxpar.cost.context_parallel import ulysses_at
from fxpar.ir import schedule as sched
from fxpar.ir.errors import PlanError
from fxpar.ir.plan import RECOMPUTE, Plan
from fxpar.planner.dp_groups import replica_options

__all__ = ["CP_MIN_SEQ", "candidates", "cp_options", "divisors", "ep_options", "factorisations", "microbatch_options",
           "schedule_variants", "variants"]


CP_MIN_SEQ = 4096  # from this sequence length on cp is searched; below it only where no plan without cp fits


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_options(costs, world: int, ranks_per_node: int, needed: bool = False) -> list[int]:
    """Context-parallel degrees above 1 to search for ``world`` ranks: each divisor of the world whose ``2 cp``
    chunks divide the sequence (``passes/context_parallel.py`` cuts each sequence so), for a model whose
    attention the costs found, at sequences of at least :data:`CP_MIN_SEQ` tokens or where ``needed`` (no plan
    without cp fits). A cp group within a node (every layer gathers its keys and values over it; the search
    then keeps ``cp x tp`` within a node), unless ``needed``."""
    attends = any(p.attention and p.attention.gathers for by in costs.parts.values() for p in by.values())
    if not attends or (costs.seq < CP_MIN_SEQ and not needed):
        return []
    return [c for c in divisors(world) if c > 1 and costs.seq % (2 * c) == 0 and (needed or c <= ranks_per_node)]


def factorisations(costs, world: int, global_batch: int, *, ranks_per_node: int,
                   cross_node_tp: bool = False) -> tuple[list[tuple[int, int, int]], list[tuple[str, str]]]:
    """``(dp, pp, tp)`` triples for ``world`` and the rejected ones with their reasons."""
    out, rejected = [], []
    parts = len(costs.layers) + 2
    for tp in divisors(world):
        reason = costs.tp_allowed.get(tp, "not priced" if tp > 1 else None)
        if tp not in costs.tp_allowed and tp > max(costs.tp_allowed, default=1):
            reason = f"tp={tp} is above the degrees priced ({max(costs.tp_allowed, default=1)})"
        if reason is not None:
            rejected.append((f"tp={tp}", f"divisibility: {reason}"))
            continue
        if tp > ranks_per_node and not cross_node_tp:
            rejected.append((f"tp={tp}", f"topology: tp={tp} spans nodes of {ranks_per_node} ranks"))
            continue
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            what = f"dp={dp} x pp={pp} x tp={tp}"
            if pp > parts - 2 and pp > 1:
                rejected.append((what, f"divisibility: pp={pp} > {len(costs.layers)} layers"))
            elif global_batch % dp:
                rejected.append((what, f"divisibility: global batch {global_batch} is not a multiple of dp={dp}"))
            else:
                out.append((dp, pp, tp))
    return out, rejected


def microbatch_options(global_batch: int, dp: int, pp: int) -> list[int]:
    """Microbatch counts per replica: divisors of the replica's batch, at least pp when pipelined."""
    return [m for m in divisors(global_batch // dp) if m >= pp]


def ep_options(costs, replicas: int, tp: int) -> list[int]:
    """Expert-parallel degrees for ``replicas`` data replicas (ep is carved out of them): 1, and for a model
    with expert layers the EP pass accepts, at tp=1 (ep does not compose with tp), each divisor of the
    replicas that divides every MoE layer's experts."""
    if tp > 1 or getattr(costs, "ep_allowed", "") is not None:
        return [1]
    n = [x.n_experts for part in costs.parts.values() if (x := part[(1, False)].experts)]
    return [e for e in divisors(replicas) if all(k % e == 0 for k in n)]


def cp_attention_options(costs, cp: int, tp: int) -> tuple[str, ...]:
    """``Plan.cp_attention`` values to search at ``cp`` context-parallel ranks and ``tp``: the all-gather of keys
    and values, and Ulysses' all-to-alls where cp divides the heads (per TP rank) of at least one attention of
    the model (elsewhere ``"ulysses"`` keeps the all-gather, so it would only repeat that plan)."""
    if cp == 1:
        return ("allgather",)
    takes = any(ulysses_at(v.attention, cp)[0] for part in costs.parts.values()
                if (v := part.get((tp, False))) is not None)
    return ("allgather", "ulysses") if takes else ("allgather",)


def variants(costs, replicas: int, inner: int, tp: int, ranks_per_node: int, sps, recompute=RECOMPUTE,
             zero=(0, 1, 2, 3), int8: bool = False, cp: int = 1) -> list[tuple]:
    """``(sequence_parallel, zero, recompute, dp_replicate, ep, comm_dtype)`` for ``replicas`` data replicas
    ``inner`` (pp x tp) ranks apart: ZeRO where there is more than one replica (not ZeRO-3 with ep); with
    ZeRO and ep=1, HSDP's ``dp_replicate`` (:func:`replica_options`); with ``int8``, ZeRO-3 over a shard group
    of more than one rank also with int8 gathers (``comm_dtype="int8"``: lossy, so only when asked for).
    With ``cp > 1`` (``Plan`` refuses ep, HSDP and sequence parallelism with it): ZeRO over the ``dp x cp``
    ranks and recompute only."""
    if cp > 1:
        return [(False, z, rc, 1, 1, None) for z in zero for rc in recompute] if False in sps else []
    out = []
    for e in ep_options(costs, replicas, tp):
        dp = replicas // e
        for sp, z, rc in product(sps, [z for z in zero if replicas > 1 or z == 0], recompute):
            if e > 1 and z == 3:
                continue  # ZeRO-3 would shard the expert slices again (Plan refuses it)
            for r in (replica_options(dp, inner, ranks_per_node) if z and e == 1 else (1,)):
                for q in ((None, "int8") if int8 and z == 3 and dp // r > 1 else (None,)):
                    out.append((sp, z, rc, r, e, q))
    return out


def schedule_variants(plan: Plan, schedules=sched.SCHEDULES, parts: int | None = None
                      ) -> tuple[list[Plan], list[tuple[str, str]]]:
    """``plan`` under each pipeline schedule that can run its microbatches over ``parts`` model parts
    (layers + pre + post; pp=1: just its own)."""
    if plan.pp == 1:
        return [plan], []
    out, rejected = [], []
    m = plan.microbatches
    for name in schedules:
        v = sched.stages_per_rank(name, None)
        if parts is not None and plan.pp * v > parts:
            rejected.append((f"{name} pp={plan.pp}", f"divisibility: {plan.pp} x {v} stages > {parts} model parts"))
            continue
        try:
            sched.validate(name, plan.pp, m, plan.pp * v)
        except PlanError as e:
            rejected.append((f"{name} pp={plan.pp} m={m}", f"schedule: {str(e).split(': ', 1)[-1][:120]}"))
            continue
        out.append(replace(plan, schedule=name, virtual_stages=None if v == 1 else v))
    return out, rejected


def candidates(costs, world: int, global_batch: int, *, ranks_per_node: int, schedules=sched.SCHEDULES,
               recompute=RECOMPUTE, zero=(0, 1, 2, 3), cross_node_tp: bool = False, int8: bool = False
               ) -> tuple[list[Plan], list[tuple[str, str]]]:
    """Every plan of the space and the rejected combinations with their reasons."""
    plans: list[Plan] = []
    triples, rejected = factorisations(costs, world, global_batch, ranks_per_node=ranks_per_node,
                                       cross_node_tp=cross_node_tp)
    for dp, pp, tp in triples:
        ms = microbatch_options(global_batch, dp, pp)
        if not ms:
            rejected.append((f"dp={dp} x pp={pp} x tp={tp}", f"divisibility: {global_batch // dp} sequences per "
                             f"replica cannot make {pp} microbatches"))
        for m in ms:
            for sp in ((False, True) if tp > 1 else (False,)):
                if (tp, sp) not in costs.parts["pre"] or (sp and (getattr(costs, "sp_allowed", {}) or {}).get(tp)):
                    continue
                for _, z, rc, r, e, q in variants(costs, dp, pp * tp, tp, ranks_per_node, (sp,), recompute, zero,
                                                    int8):
                    base = Plan(dp=dp // e, ep=e, pp=pp, tp=tp, zero=z, microbatches=m, sequence_parallel=sp,
                                recompute=rc, dp_replicate=r, comm_dtype=q)
                    got, why = schedule_variants(base, schedules, len(costs.layers) + 2)
                    plans += got
                    rejected += why
    return plans, rejected
