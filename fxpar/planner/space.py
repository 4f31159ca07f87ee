"""The plan space the planner searches: every ``dp x pp x tp = world`` factorisation the model allows, each
with ZeRO 0-3 (with ZeRO, HSDP's ``dp_replicate`` where the dp group spans nodes:
:func:`fxpar.planner.dp_groups.replica_options`), sequence parallelism (tp > 1), microbatch counts the
global batch divides into, pipeline schedules with their virtual stages, and recompute policies. What cannot run is kept with its reason
(``(what, reason)``), so the planner can say why a degree never appeared.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product

from fxpar.ir import schedule as sched
from fxpar.ir.errors import PlanError
from fxpar.ir.plan import RECOMPUTE, Plan
from fxpar.planner.dp_groups import replica_options

__all__ = ["candidates", "divisors", "factorisations", "microbatch_options", "schedule_variants"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
               recompute=RECOMPUTE, zero=(0, 1, 2, 3), cross_node_tp: bool = False
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
                for z in zero:
                    if z and dp == 1:
                        continue  # ZeRO over one replica shards nothing
                    for rc, r in product(recompute, replica_options(dp, pp * tp, ranks_per_node) if z else (1,)):
                        base = Plan(dp=dp, pp=pp, tp=tp, zero=z, microbatches=m, sequence_parallel=sp, recompute=rc,
                                    dp_replicate=r)
                        got, why = schedule_variants(base, schedules, len(costs.layers) + 2)
                        plans += got
                        rejected += why
    return plans, rejected
