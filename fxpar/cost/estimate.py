"""The price of a plan, the one :class:`Estimate` (``fxpar.price``, the planner's ranking, ``fxpar plan``):
predicted step time, its parts, memory per rank, communication and MFU, from a model's per-part costs
(:class:`~fxpar.planner.model_costs.ModelCosts`, read off one trace) and a device profile.

It follows what fxpar builds and runs: stages are balanced contiguous groups of the model's parts (pre,
layers, post; as fxpar's cost-balanced cuts), each rank's TP collectives block its compute (unless
collective matmul hides them behind the chunks), the pipeline schedule's critical path comes from
:mod:`fxpar.cost.schedule`, the data-parallel engine (``runtime/data_parallel.py``) all-reduces
fp32 gradient buckets as they fill during the last microbatch's backward (ZeRO-1/2 then all-gather the
updated fp32 shards), ZeRO-3 (``runtime/zero3.py``) gathers every layer's bucket in each microbatch's
forward and again in its backward and reduce-scatters its gradient, one bucket ahead of use; HSDP's shard
and replica groups are priced each on its own link (:mod:`fxpar.cost.data_parallel`); expert and context
parallelism change each part as :mod:`fxpar.cost.experts` and :mod:`fxpar.cost.context_parallel` say. Memory is
fp32 master state by ZeRO stage (:func:`fxpar.cost.memory.state_bytes`, AdamW: 2 states), the
activations of the microbatches the schedule keeps in flight (plus the backward's transient: recomputed
forward and the gradients alive at once, largest at the loss; and the program's outputs, kept to the
step's end), and buffers. ``memory["total"]`` is the rank's peak, which is less than the sum of the
parts: the gradients a step makes and its activations do not peak together (see :func:`fxpar.cost.memory.per_rank`).

:class:`Pricer` caches everything that does not depend on the whole plan (part times per tp, sequence
parallelism, microbatch size and recompute; stage cuts; the schedule's DAG), so a search prices tens of
thousands of plans in seconds; :func:`price_plan` prices one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache, partial

from fxpar.cost.comm import sent_bytes as _sent
from fxpar.cost.context_parallel import check_cp, cp_comm, cp_groups, cp_part_of, variant_cp
from fxpar.cost.experts import check_ep, dp_sent, ep_comm, ep_groups, ep_part_of, variant_part
from fxpar.cost.memory import RankSums, activation_peaks, per_rank
from fxpar.cost.overheads import (
    StepCounts,
    call_time,
    comm_share,
    dp_bucket_count,
    overheads,
)
from fxpar.cost.roofline import is_matmul, work_time
from fxpar.cost.schedule import EXACT_LIMIT, critical_path, n_actions
from fxpar.cost.stages import Segments
from fxpar.cost.zero3_times import head_figures, head_on_shards_entries, shard_head, zero3_times
from fxpar.ir import schedule as sched
from fxpar.ir.errors import PlanError
from fxpar.ir.plan import Plan
from fxpar.ir.resolved import microbatch_size
from fxpar.ir.wire import INT8_BLOCK

__all__ = ["Estimate", "Pricer", "price_plan"]


@dataclass
class Estimate:
    plan: Plan
    step_time: float  # seconds per optimizer step (global batch)
    parts: dict[str, float]  # compute, tp_comm, pp_comm, dp_comm (exposed), bubble, optimizer, runtime[, ep/cp_comm]
    bubble: float  # fraction of the step a pipeline rank idles
    memory: dict[str, int]  # bytes on the fullest rank: params, grads, optimizer, activations, buffers, total
    comm_bytes: dict[str, int]  # bytes one rank sends per step: tp, pp, dp (dp_inter: of dp, across nodes)[, ep, cp]
    mfu: float
    tokens_per_s: float
    fits: bool
    why_not: str | None = None
    exact: bool = field(default=True, repr=False)  # schedule priced on its DAG (False: the closed form)


def price_plan(costs, plan: Plan, profile, *, global_batch: int, memory_per_rank: int | None = None) -> Estimate:
    """Predict ``plan``'s training step for ``global_batch`` sequences of ``costs.seq`` tokens on ``profile``."""
    return Pricer(costs, profile, global_batch=global_batch, memory_per_rank=memory_per_rank).price(plan)


def gb(n: float) -> str:
    """Bytes for messages: GB, MB or KB (a tiny model never reads "0.0 GB")."""
    unit, scale = next(((u, x) for u, x in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)) if abs(n) >= x), ("B", 1))
    return f"{n / scale:.1f} {unit}"


@lru_cache(maxsize=4096)
def _spans_nodes(world: int, rpn: int, stride: int, size: int) -> bool:
    """Whether any group of ``size`` ranks ``stride`` apart (the mesh's dp/pp/tp groups) crosses nodes."""
    if size <= 1:
        return False
    for first in range(world):
        if (first // stride) % size == 0 and first // rpn != (first + stride * (size - 1)) // rpn:
            return True
    return False


class Pricer:
    """Prices plans of one model, device and global batch; caches what plans share."""

    def __init__(self, costs, profile, *, global_batch: int, memory_per_rank: int | None = None):
        self.costs, self.profile, self.batch = costs, profile, global_batch
        self.memory = int(memory_per_rank if memory_per_rank is not None else profile.memory)
        self.names = ["pre", *costs.layers, "post"]
        self._kinds: dict = {}
        # the model's segments as compile's cut candidates make them; units: (part index, share of the part)
        self.segs = Segments(costs, profile, self.names)
        self.segments, self.units, self.points = self.segs.rows, self.segs.units, self.segs.points
        self.last_unit = {i: j for j, (i, _) in enumerate(self.units)}  # part -> the index of its last unit
        self._stage_cache: dict = {}

    # ---- per part --------------------------------------------------------------------------------
    def kind(self, name: str, tp: int, sp: bool, b: int, recompute: str, world: int, dtype: str, ep: int = 1,
             ep_inter: bool = False, fused: bool = False, cp: int = 1, cp_inter: bool = False, cp_mode="allgather"):
        """(fwd, bwd incl. recompute, weight-grad, tp fwd, tp bwd, params, kept, transient, out, outputs, *ep_comm,
        *cp_comm, frozen) of one part; transient: what its backward adds on top of the kept activations (the
        recomputed forward and the gradients alive at once); outputs: the program's outputs it makes, kept to the
        step's end; frozen: of params, the entries that do not train (a LoRA's base)."""
        key = (name, tp, sp, b, recompute, world, dtype, ep, ep_inter, fused, cp, cp_inter, cp_mode)
        got = self._kinds.get(key)
        if got is not None:
            return got
        part = variant_part(self.costs, self._kinds, name, tp, sp, ep, fused)
        part = variant_cp(self._kinds, (name, tp, sp, ep, fused, cp), part, cp, cp_mode)  # this rank's S / cp tokens
        p = self.profile
        share = p.share(min(world, p.ranks_per_node))
        fwd, bwd = part.time(p, b, dtype)
        cheap = 0.0
        if recompute == "selective" and name not in ("pre", "post"):
            for f, _, act, weight, *_ in part.nodes:
                if not is_matmul(f * b, act * b + weight):  # not a matrix product: recomputed
                    cheap += work_time(p, f * b, 0.0, act * b + weight, 0.0, dtype)[0]
        extra = fwd if recompute == "layer" and name not in ("pre", "post") else cheap
        tf, tb = _tp_times(p, part, tp, b, world, share)
        if recompute == "layer" and name not in ("pre", "post"):
            tb += tf  # the recomputed forward runs its collectives again
        act = part.act.get(recompute) or part.act.get("none") or (0, 0)
        again = recompute == "layer" and name not in ("pre", "post")
        got = ((fwd) / share, (bwd + extra) / share, bwd / 2 / share, tf, tb, part.params,
               act[0] * b, (act[1] + part.grad_bytes) * b, part.out_bytes * b, part.kept_out * b,
               *ep_comm(p, part, ep, b, ep_inter, again, share=share),
               *cp_comm(p, part, cp, b, cp_inter, again, name == "post", share=share, mode=cp_mode), part.frozen)
        self._kinds[key] = got
        return got

    def plan_cuts(self, plan: Plan) -> list[str | None]:
        """The modules where ``plan``'s stages 2.. begin: the cuts ``fxpar.compile`` makes for it."""
        _, v, m = self.check(plan)
        return self.segs.modules(plan.pp * v, microbatch_size(self.batch, plan.replicas, m), self.dtype(plan))

    def dtype(self, plan: Plan) -> str:
        """What ``plan``'s step computes in: bf16 under autocast, else the costs' dtype."""
        return "bf16" if plan.mixed_precision == "bf16" else self.costs.dtype

    def _stages(self, n_stages: int, tp: int, sp: bool, b: int, rc: str, world: int, dtype: str,
                var: tuple = (1, False, False, 1, False)) -> dict[str, list]:
        """Per stage of the balanced cuts: compute, TP comm, params, activations, outputs, EP (cached;
        ``var``: _variant)."""
        key = (n_stages, tp, sp, b, rc, world, dtype, var)
        got = self._stage_cache.get(key)
        if got is not None:
            return got
        got = {k: [] for k in ("F B W tf tb params kept trans outs tpsent big kout bigt ef eb eparams esent cf cb "
                               "csent frozen bigh head pre").split()}  # the last 3: zero3_times.head_figures
        head = shard_head(self, tp, var[2])
        bounds = self.segs.cuts(n_stages, b, dtype)
        for s, e in bounds:
            units: dict[int, float] = {}  # part -> its share in the stage (two halves of a layer: whole)
            for i, f in self.units[s:e]:
                units[i] = units.get(i, 0.0) + f
            ks = [(self.kind(self.names[i], tp, sp, b, rc, world, dtype, *var), f) for i, f in units.items()]
            for name, i in (("F", 0), ("B", 1), ("W", 2), ("tf", 3), ("tb", 4), ("params", 5), ("kept", 6),
                            ("kout", 9), ("ef", 10), ("eb", 11), ("eparams", 12), ("esent", 13), ("cf", 14),
                            ("cb", 15), ("csent", 16), ("frozen", 17)):
                got[name].append(sum(k[i] * f for k, f in ks))
            got["trans"].append(max(k[7] for k, _ in ks))
            got["params"][-1] += _borrowed(self, s, e, tp, sp)
            # what a cut after the stage sends: at a part's end the part's bytes (on this tp), mid-part the
            # unsharded segment's
            nxt = self.segments[e] if e < len(self.segments) else None
            got["outs"].append(0 if nxt is None else nxt[3] * b // var[3] if nxt[0] == self.segments[e - 1][0] and
                               nxt[2] is not None else ks[-1][0][8])
            got["big"].append(max(k[5] for k, _ in ks))
            for name, x in zip(("head", "pre", "bigh"), head_figures([self.names[i] for i in units], ks, head)):
                got[name].append(x)
            itemsize = 2 if self.costs.dtype in ("bf16", "fp16") else 4  # entries of the largest weight
            got["bigt"].append(max(self.costs.part(self.names[i], tp, sp).largest_weight() for i in units) // itemsize)
            got["tpsent"].append(sum(_tp_sent(self, self.names[i], tp, sp, b) * f for i, f in units.items()))
        self._stage_cache[key] = got
        return got

    # ---- the plan --------------------------------------------------------------------------------
    def check(self, plan: Plan) -> tuple[str, int, int]:
        """Schedule name, stages per rank and microbatches per replica; PlanError when they do not fit."""
        c = self.costs
        reason = c.tp_allowed.get(plan.tp, f"tp={plan.tp} was not priced (costs have tp {sorted(c.tp_allowed)})")
        if reason is not None:
            raise PlanError(f"fxpar.planner.price: tp={plan.tp} cannot be used: {reason}")
        if (plan.tp, plan.sequence_parallel) not in next(iter(c.parts.values())):
            raise PlanError(f"fxpar.planner.price: no costs for tp={plan.tp}, sequence_parallel="
                            f"{plan.sequence_parallel}; price it with model_costs(tp_degrees=...)")
        name = sched.normalize_schedule(plan.schedule)
        v = sched.stages_per_rank(name, plan.virtual_stages)
        m = sched.microbatches(plan)
        dp = plan.replicas  # data replicas: dp x ep
        if self.batch % (dp * m):
            raise PlanError(f"fxpar.planner.price: global batch {self.batch} does not divide into {dp} replicas x "
                            f"{m} microbatches; pick microbatches dividing {self.batch // dp}" if self.batch % dp == 0
                            else f"fxpar.planner.price: global batch {self.batch} is not a multiple of dp={dp}")
        check_ep(c, plan.ep)
        check_cp(c, plan)
        if plan.pp * v > len(self.points) + 1:
            raise PlanError(f"fxpar.planner.price: {plan.pp} x {v} stages but the model offers {len(self.points)} "
                            f"cut points ({len(c.layers)} layers, their children, pre and post); "
                            f"use pp <= {(len(self.points) + 1) // v}")
        r = plan.resolve(plan.world_size, self.batch)  # the schedule's own checks; compile's defaults
        return r.schedule, r.virtual_stages, r.microbatches

    def price(self, plan: Plan, exact: bool | None = None, times_up_to: float | None = None) -> Estimate:
        """``plan``'s Estimate; ``exact``: its schedule on the DAG (None: where small enough). ``times_up_to``:
        bytes per rank above which the plan's times are not worked out (``step_time`` inf, ``parts`` empty): a
        search's bound past which no variant of the plan can fit (its memory is priced in full either way)."""
        name, v, m = self.check(plan)
        p = self.profile
        world, pp, tp, dp = plan.world_size, plan.pp, plan.tp, plan.replicas
        b = microbatch_size(self.batch, dp, m)
        sp, rc = plan.sequence_parallel, plan.recompute
        n_stages = pp * v
        # HSDP: the shard group and the replica group, each on the link its ranks need (fxpar.cost.data_parallel);
        # ep: dense parameters over the dp x ep replicas (dplan), the expert slices over dp (experts)
        spans = partial(_spans_nodes, world, p.ranks_per_node)
        dplan, groups, experts = ep_groups(plan, spans) if plan.cp == 1 else (*cp_groups(plan, spans), None)
        gbytes = 1 + 4 / INT8_BLOCK if plan.comm_dtype else (2 if plan.mixed_precision == "bf16" else 4)
        dtype = self.dtype(plan)
        st = self._stages(n_stages, tp, sp, b, rc, world, dtype, _variant(self, plan))
        params, kept, trans, outs = st["params"], st["kept"], st["trans"], st["outs"]
        trained = [x - y for x, y in zip(params, st["frozen"])]  # no gradient, reduction or step for frozen ones
        is_exact = exact if exact is not None else sched_exact(name, pp, m, v)
        mine = _owned(name, pp, n_stages)
        pkey = ("peaks", n_stages, tp, sp, b, rc, world, dtype, name, pp, m, v, is_exact, _variant(self, plan))
        acts = self._stage_cache.get(pkey)
        if acts is None:  # plans differing only in data parallelism share them
            acts = self._stage_cache[pkey] = activation_peaks(name, pp, m, v, mine, kept, trans, st["kout"], trained,
                                                              is_exact)
        skey = ("ranks", n_stages, tp, sp, b, rc, world, dtype, _variant(self, plan), name, pp)
        ranks = self._stage_cache.get(skey)
        if ranks is None:  # plans differing only in data parallelism share them
            ranks = self._stage_cache[skey] = RankSums.of(st, mine, shard_head(self, tp, _variant(self, plan)[2]))
        if times_up_to is not None:  # the memory alone first (it reads no time): past the bound, no times
            worst = per_rank(p, dplan, m, ranks, None, acts, groups, gbytes, experts)[2]
            if worst[0] > times_up_to:  # (its bytes: those of the rank with the most work)
                r0 = max(range(pp), key=lambda r: sum(st["F"][s] + st["B"][s] for s in mine[r]))
                return _estimate(self, plan, m, math.inf, {}, 0.0, worst, st, mine, r0, dplan, groups, experts,
                                 gbytes, is_exact)
        tf, tb = st["tf"], st["tb"]
        if plan.collective_matmul:  # the chunks' collectives hide behind the matmuls
            k = plan.collective_matmul
            tf = [x / k + max(0.0, x - y) for x, y in zip(tf, st["F"])]
            tb = [x / k + max(0.0, x - y) for x, y in zip(tb, st["B"])]
        if plan.ep > 1 or plan.cp > 1:  # EP all-to-alls, CP KV gathers: they block as TP's do
            tf = [x + y + z for x, y, z in zip(tf, st["ef"], st["cf"])]
            tb = [x + y + z for x, y, z in zip(tb, st["eb"], st["cb"])]
        zf, zb = zero3_times(self, plan, n_stages, b, dtype, groups, gbytes, _variant(self, plan))
        # the pipeline runtime's bookkeeping per action (fxpar.cost.overheads; 0 where not measured)
        act = p.pipeline_action.get(name, 0.0) / p.share(min(world, p.ranks_per_node)) if pp > 1 else 0.0
        split = name in sched.SPLIT_BACKWARD  # its backward is two actions, I (= B - W) and W
        F = [x + y + z + act for x, y, z in zip(st["F"], tf, zf)]
        B = [x + y + z + act * (2 if split else 1) for x, y, z in zip(st["B"], tb, zb)]
        W = [x + act for x in st["W"]] if split else st["W"]
        tpc = [x + y for x, y in zip(tf, tb)]
        z3 = [x + y for x, y in zip(zf, zb)]
        pp_inter = pp > 1 and _spans_nodes(world, p.ranks_per_node, plan.cp * tp, pp)
        hop = max(outs[:-1], default=0)
        comm = p.collective_time("send", hop, 2, pp_inter) if pp > 1 else 0.0
        makespan, bubble = critical_path(name, pp, m, v, F, B, W, comm, exact=exact)
        if p.compute_share and pp > 1:  # ranks sharing a host's cores: while some idle, the others run faster
            host = min(world, p.ranks_per_node)
            busy = max(1, round(host * (1.0 - bubble)))
            makespan *= p.share(host) / p.share(busy)
        # the slowest rank's busy time and its parts
        busy = [m * sum(F[s] + B[s] for s in st) for st in mine]
        r0 = max(range(pp), key=lambda r: busy[r])
        tp_time = m * sum(tpc[s] for s in mine[r0])
        z3_time = m * sum(z3[s] for s in mine[r0])
        compute = busy[r0] - tp_time - z3_time
        # data parallel: buckets reduce as they fill in the last microbatch's backward
        hidden = [sum(B[s] for s in x) for x in mine] if dplan.dp > 1 and p.comm_overlaps else None
        dp_exposed, opt_time, worst = per_rank(p, dplan, m, ranks, hidden, acts, groups, gbytes, experts)
        # fxpar's own costs outside the actions (those inside are in F/B/W above): buckets, optimizer tensors
        runtime = _runtime(self, dplan, mine[r0], trained, gbytes, world, (n_stages, b, dtype)).total
        step = makespan + dp_exposed + opt_time + runtime
        pp_comm = min(max(0.0, makespan - busy[r0]), 2 * (n_stages - 1) * comm)
        idle = max(0.0, makespan - busy[r0] - pp_comm)
        parts = {"compute": compute, "tp_comm": tp_time, "pp_comm": pp_comm, "dp_comm": z3_time + dp_exposed,
                 "bubble": idle, "optimizer": opt_time, "runtime": runtime}
        return _estimate(self, plan, m, step, parts, bubble, worst, st, mine, r0, dplan, groups, experts, gbytes,
                         is_exact)


def _estimate(self: Pricer, plan: Plan, m: int, step: float, parts: dict, bubble: float, worst: tuple, st: dict,
              mine, r0: int, dplan: Plan, groups, experts, gbytes: float, is_exact: bool) -> Estimate:
    """The Estimate of a priced plan: its memory, the bytes rank ``r0`` sends, MFU (``parts``: its time by
    part; empty where the times were not worked out, ``step`` then inf)."""
    c, p, n_stages = self.costs, self.profile, len(st["F"])
    into = parts or {"tp_comm": 0.0}  # (without times: only the bytes)
    ep = {**ep_part_of(plan, into, st, mine[r0], m), **cp_part_of(plan, into, st, mine[r0], m)}  # apart from TP
    memory = {**worst[1], "activations": int(worst[2]), "buffers": int(worst[3]), "total": int(worst[0])}
    trained = [x - y for x, y in zip(st["params"], st["frozen"])]
    n0, f0 = (sum(x[s] for s in mine[r0]) for x in (trained, st["frozen"]))
    # a head left on its shards moves none of its bytes (the hidden states gathered in its place are not counted)
    on_shards, head_trains = head_on_shards_entries(self, plan, st, mine[r0], groups.shard, _variant(self, plan)[2])
    n0, f0 = (n0 - on_shards, f0) if head_trains else (n0, f0 - on_shards)
    tp_bytes = m * sum(st["tpsent"][x] for x in mine[r0])
    inside, across = dp_sent(dplan, n0, sum(st["eparams"][s] for s in mine[r0]), m, gbytes, groups, experts, f0)
    dp_inter = inside * groups.shard_inter + across * groups.replicas_inter  # of it, over inter-node links
    outs = st["outs"]
    pp_bytes = max(2 * m * sum(outs[s] for s in x if s < n_stages - 1) for x in mine) if plan.pp > 1 else 0
    tokens = self.batch * c.seq
    dtype = self.dtype(plan)
    peak = p.peak_flops.get(dtype) or p.matmul_flops(dtype)
    fast = 0 < step < math.inf
    mfu = c.flops_per_token * tokens / (step * plan.world_size * peak) if fast else 0.0
    fits = memory["total"] <= self.memory
    return Estimate(plan, step, parts, bubble, memory, {"tp": int(tp_bytes), "pp": int(pp_bytes),
                    "dp": int(inside + across), "dp_inter": int(dp_inter), **ep},
                    mfu, tokens / step if fast else 0.0, fits,
                    None if fits else f"memory: {gb(memory['total'])} > {gb(self.memory)}", is_exact)

def _tensors(self: Pricer, stages: list[int], n_stages: int, b: int, dtype: str) -> int:
    """Parameter tensors of ``stages`` of ``n_stages`` (the optimizer steps each one): the nodes reading a
    weight, an upper bound (a tied weight read twice counts twice)."""
    bounds = self.segs.cuts(n_stages, b, dtype)
    parts = {i for s in stages for i, _ in self.units[bounds[s][0]:bounds[s][1]]}
    total = 0
    for i in parts:
        key = ("tensors", self.names[i])
        if key not in self._kinds:
            self._kinds[key] = sum(1 for n in self.costs.part(self.names[i], 1, False).nodes if n[3] > 0)
        total += self._kinds[key]
    return total


def _borrowed(self: Pricer, s: int, e: int, tp: int, sp: bool) -> int:
    """Entries of the weights a stage (units ``s`` to ``e``) reads that a part outside it counts: a tied
    embedding and head on the first and the last pipeline stage each hold a copy. The borrowing part ("post":
    the head is its last op) reads it where its last unit runs."""
    present = {i for i, _ in self.units[s:e]}
    here = {self.names[i] for i in present}
    extra: dict[str, int] = {}
    for i in present:
        if s <= self.last_unit[i] < e:
            extra.update({name: n for name, (owner, n) in self.costs.part(self.names[i], tp, sp).borrowed.items()
                          if owner not in here})
    return sum(extra.values())


def _runtime(self: Pricer, plan: Plan, stages: list[int], params: list, gbytes: int, world: int, cut: tuple):
    """fxpar's own per-step costs outside the actions (fxpar.cost.overheads): the data-parallel engine's
    buckets (hooks, the gradients' copies in) and the optimizer's fixed cost per stepped tensor and group."""
    n0 = sum(params[s] for s in stages)
    dp = plan.replicas
    grads = n0 * gbytes if dp > 1 and plan.zero < 3 else 0
    buckets = dp_bucket_count(grads)
    tensors = buckets if plan.zero in (1, 2) and dp > 1 else _tensors(self, stages, *cut)
    return overheads(self.profile, StepCounts(dp_buckets=buckets, dp_bucket_bytes=grads, optimizer_tensors=tensors,
                                              optimizer_groups=1, busy_ranks=min(world, self.profile.ranks_per_node)))


def _tp_times(p, part, tp: int, b: int, world: int, share: float) -> tuple[float, float]:
    """(forward, backward) seconds of ``part``'s TP collectives for a microbatch of ``b`` sequences: each one's
    alpha-beta, slowed by the ranks computing beside it where they share cores, plus what fxpar's op spends
    around it on the rank's own core (fxpar.cost.overheads)."""
    inter = _spans_nodes(world, p.ranks_per_node, 1, tp)
    slow = comm_share(p, min(world, p.ranks_per_node), tp)
    times = {d: sum(p.collective_time(k, n * b, tp, inter) / slow + call_time(p, k, n * b) / share
                    for k, n, dd in part.comm if (dd == "fwd") == (d == "fwd")) for d in ("fwd", "bwd")}
    return times["fwd"], times["bwd"]


def _tp_sent(self: Pricer, name: str, tp: int, sp: bool, b: int) -> float:
    key = ("sent", name, tp, sp, b)
    got = self._kinds.get(key)
    if got is None:
        got = self._kinds[key] = sum(_sent(kind, nb * b, tp) for kind, nb, _ in self.costs.part(name, tp, sp).comm)
    return got


def _variant(self: Pricer, plan: Plan) -> tuple[int, bool, bool, int, bool, str]:
    """What ``plan`` changes in its parts beyond tp: (ep, whether an ep group spans nodes, fused loss, cp,
    whether a cp group spans nodes, how attention reads the sequence across cp)."""
    world, rpn = plan.world_size, self.profile.ranks_per_node
    inter = _spans_nodes(world, rpn, plan.pp * plan.tp, plan.ep)
    return (plan.ep, inter, bool(plan.fused_loss and self.costs.fused is not None), plan.cp,
            _spans_nodes(world, rpn, plan.tp, plan.cp), plan.cp_attention)


@lru_cache(maxsize=1024)
def _owned(name: str, pp: int, n_stages: int) -> list[list[int]]:
    place = sched.stage_to_rank(name, pp, n_stages)
    return [[s for s in range(n_stages) if place[s] == r] for r in range(pp)]


def sched_exact(name: str, pp: int, m: int, v: int) -> bool:
    return n_actions(name, pp, m, v) <= EXACT_LIMIT
