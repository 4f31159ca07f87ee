"""The search: price the plan space (:mod:`fxpar.planner.space`) with :class:`~fxpar.planner.price.Pricer`
and rank it, saying why every loser lost.

Two passes keep it fast. The first prices every factorisation, microbatch count, ZeRO stage, sequence
parallelism and recompute policy under 1F1B (schedules on their closed form); per ``(dp, pp, tp)`` the
three fastest microbatch counts that fit go on to the second, which adds the other schedules. The best
ones are then priced again on their schedule's exact DAG until the top of the table is exact. The usual
hand-made plan (TP across a node, PP across nodes just deep enough to fit, the rest DP, ZeRO-1, 1F1B) is
always priced, so the table shows what the search gained over it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from itertools import product

from fxpar.cost.estimate import Estimate, Pricer, gb
from fxpar.cost.memory import fit_bound, fused_saving
from fxpar.ir.errors import PlanError
from fxpar.ir.plan import Plan
from fxpar.ir.resolved import microbatch_size
from fxpar.ir.schedule import SCHEDULE_RECORDS
from fxpar.planner.space import (
    cp_attention_options,
    cp_options,
    divisors,
    factorisations,
    microbatch_options,
    schedule_variants,
    variants,
)

__all__ = ["AutoPlan", "baseline_plan", "describe", "search"]

KEEP_M = 3  # microbatch counts per (dp, pp, tp) kept for the second pass


# the memory parts' names where frozen weights are priced (a LoRA's base): what the trained ones are
_LORA = {"frozen": "base (frozen)", "params": "adapters", "grads": "adapter grads", "optimizer": "adapter optimizer"}


def estimate_text(e: Estimate) -> str:
    """One :class:`Estimate` in a few lines, as ``fxpar plan --plan`` prints it: step time by part, memory
    by part, bytes sent by axis, bubble and MFU (the numbers ``--auto`` ranks plans by)."""
    ms = {k: f"{k} {1e3 * v:.3f}" for k, v in e.parts.items()}
    return "\n".join([
        f"estimate ({describe(e.plan)}): {1e3 * e.step_time:.3f} ms/step{'' if e.exact else ' (closed form)'} = "
        + " + ".join(ms.values()) + " ms",
        "  memory per rank: " + ", ".join(f"{_LORA.get(k, k) if e.memory.get('frozen') else k} {gb(v)}"
                                          for k, v in e.memory.items())
        + ("" if e.fits else f" (does not fit: {e.why_not})"),
        "  sent per rank and step: " + ", ".join(f"{k} {gb(v)}" for k, v in e.comm_bytes.items()),
        f"  bubble {100 * e.bubble:.1f}%, MFU {100 * e.mfu:.1f}%, {e.tokens_per_s:.0f} tokens/s"])


def describe(plan: Plan) -> str:
    """``dp=16 pp=8 tp=8 zero=1 m=32 dp_replicate=2 1f1b sp recompute=selective``: the fields the planner
    chooses."""
    out = f"dp={plan.dp} pp={plan.pp} tp={plan.tp} zero={plan.zero} m={plan.microbatches}"
    if plan.ep > 1:
        out += f" ep={plan.ep}"
    if plan.cp > 1:
        out += f" cp={plan.cp}" + (f" cp_attention={plan.cp_attention}" if plan.cp_attention != "allgather" else "")
    if plan.dp_replicate > 1:
        out += f" dp_replicate={plan.dp_replicate}"
    if plan.comm_dtype:
        out += f" comm_dtype={plan.comm_dtype}"
    if plan.pp > 1:
        out += f" {plan.schedule}"
    if plan.sequence_parallel:
        out += " sp"
    if plan.recompute != "none":
        out += f" recompute={plan.recompute}"
    if plan.fused_loss:
        out += " fused_loss"
    return out


def _key(e: Estimate) -> tuple:
    p = e.plan
    return (round(e.step_time, 9), p.pp, p.tp, p.zero, p.recompute != "none", p.microbatches or 0,
            p.schedule, p.sequence_parallel, p.recompute, p.dp_replicate, p.ep, p.comm_dtype or "", p.fused_loss, p.cp,
            p.cp_attention)


@dataclass
class AutoPlan:
    best: Plan
    estimate: Estimate
    ranked: list[Estimate]  # feasible, best first
    rejected: list[Estimate]  # infeasible (why_not set)
    reasons: dict[str, int]  # losers per reason: memory, time, divisibility, topology, schedule
    baseline: Estimate | None
    world: int
    profile: object
    seconds: float  # the search: enumerating, pricing and ranking the plans
    excluded: list[tuple[str, str]] = field(default_factory=list)  # combinations never priced, with reasons
    global_batch: int = 0
    seq: int = 0  # tokens per sequence the plans were priced for
    profile_why: str = ""  # why the predictions are for this profile (fxpar.planner.auto.device_profile)
    trace_seconds: float = 0.0  # tracing the model's parts and costing them (fxpar.autoplan; 0: costs given)

    def to_text(self, top: int = 5) -> str:
        e = self.estimate
        lines = [f"chosen plan: {describe(self.best)}",
                 f"  predicted step {e.step_time:.3f} s, {e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}, "
                 f"bubble {e.bubble:.1%} ({self.world} ranks on {self.profile.name}, global batch "
                 f"{self.global_batch})",
                 "  time: " + ", ".join(f"{k} {v:.3f} s" for k, v in e.parts.items()),
                 "  memory per rank: " + ", ".join(f"{k} {gb(v)}" for k, v in e.memory.items()),
                 ""]
        rows, seen = [], set()
        for x in self.ranked:  # the first ``top`` distinct rows: equal twins (e.g. ZeRO-2 where gradients
            same = (round(x.step_time, 6), x.memory["total"] // 2**20)  # accumulate whole) are one row
            if same not in seen:
                seen.add(same)
                rows.append((str(len(rows) + 1), x))
            if len(rows) == top:
                break
        if self.baseline is not None:
            rows.append(("base", self.baseline))
        wide = max(len(describe(x.plan)) for _, x in rows)
        lines.append(f"{'#':>4} {'plan':<{wide}} {'step s':>9} {'x best':>7} {'MFU':>6} {'mem GB':>7} "
                     f"{'bubble':>7}  comm GB tp/pp/dp")
        for tag, x in rows:
            c = x.comm_bytes
            ratio = x.step_time / e.step_time
            lines.append(f"{tag:>4} {describe(x.plan):<{wide}} {x.step_time:8.3f}{' ' if x.exact else '*'} "
                         f"{ratio:6.2f}x {x.mfu:6.1%} "
                         f"{x.memory['total'] / 1e9:7.1f} {x.bubble:7.1%} "
                         f"{c['tp'] / 1e9:6.1f}/{c['pp'] / 1e9:.1f}/{c['dp'] / 1e9:.1f}"
                         + ("" if x.fits else "  (does not fit)"))
        if not all(x.exact for _, x in rows):
            lines.append("  * schedule priced by its closed form (too many actions for the DAG in the time budget)")
        if self.baseline is not None:
            lines.append(f"  base = the hand-made plan (TP in a node, PP across nodes just enough to fit, the rest "
                         f"DP, ZeRO-1, 1F1B): {self.baseline.step_time / e.step_time:.2f}x the chosen step time")
        n = len(self.ranked) + len(self.rejected)
        lines += ["", f"why the others lost ({n} plans priced in {self.seconds:.2f} s; "
                      f"{len(self.excluded)} combinations excluded before pricing):"]
        for reason, count in sorted(self.reasons.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {reason}: {count}")
            for ex in self._examples(reason)[:2]:
                lines.append(f"    e.g. {ex}")
        return "\n".join(lines)

    def _examples(self, reason: str) -> list[str]:
        if reason == "time":
            return [f"{describe(x.plan)}: {x.why_not}" for x in self.ranked[1:3]]
        lost = [x for x in self.rejected if (x.why_not or "").startswith(reason)]
        if lost:
            return [f"{describe(x.plan)}: {x.why_not}" for x in sorted(lost, key=_key)[:2]]
        return [f"{what}: {why.split(': ', 1)[-1]}" for what, why in self.excluded if why.startswith(reason)]

    def to_dict(self, top: int = 5) -> dict:
        def est(x: Estimate) -> dict:
            d = asdict(x)
            d["plan"] = {k: v for k, v in x.plan.to_dict().items() if k != "tp_plan"}
            return d
        return {"best": est(self.estimate), "ranked": [est(x) for x in self.ranked[:top]],
                "baseline": est(self.baseline) if self.baseline else None, "reasons": dict(self.reasons),
                "world": self.world, "profile": self.profile.name, "profile_why": self.profile_why, "seq": self.seq,
                "global_batch": self.global_batch, "seconds": self.seconds, "trace_seconds": self.trace_seconds,
                "priced": len(self.ranked) + len(self.rejected), "feasible": len(self.ranked),
                "excluded": [list(x) for x in self.excluded[:50]]}


def baseline_plan(costs, world: int, global_batch: int, pricer: Pricer, ranks_per_node: int) -> Estimate | None:
    """The usual hand-made plan: TP = the largest allowed degree within a node, PP across nodes just deep
    enough to fit (1F1B, microbatches 4 x pp where the batch allows), the rest DP with ZeRO-1."""
    tps = [t for t in divisors(world) if t <= ranks_per_node and costs.tp_allowed.get(t, "") is None]
    if not tps:
        return None
    tp = max(tps)
    last = None
    tiers = [(False, "none")] + [(True, rc) for rc in ("none", "selective", "layer")
                                 if tp > 1 and (tp, True) in costs.parts["pre"]
                                 and not (getattr(costs, "sp_allowed", {}) or {}).get(tp)]
    tiers += [(False, rc) for rc in ("selective", "layer") if len(tiers) == 1]
    for sp, rc in tiers:  # sequence parallelism, then recompute, only where no pipeline depth fits without
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            if pp > len(costs.layers) or global_batch % dp:
                continue
            per = global_batch // dp
            ms = [k * pp for k in (4, 2, 8, 1) if per % (k * pp) == 0] if pp > 1 else [1]
            if not ms:
                continue
            plan = Plan(dp=dp, pp=pp, tp=tp, zero=1 if dp > 1 else 0, microbatches=ms[0], schedule="1f1b",
                        recompute=rc, sequence_parallel=sp)
            last = pricer.price(plan)
            if last.fits:
                return last
    return last


def search(costs, world: int, profile, *, global_batch: int, memory_per_rank: int | None = None, top: int = 5,
           plans: list[Plan] | None = None, allow: Callable[[Plan], str | None] | None = None,
           int8: bool = False) -> AutoPlan:
    """The best plan for ``world`` ranks of ``profile`` and the ranked alternatives; PlanError when none runs.

    ``plans``: price these instead of searching the space. ``allow``: plan -> None if it may run, else the
    reason it may not (what the costs cannot know, e.g. weights tied across pipeline ranks under ZeRO-3);
    such plans are priced but not chosen. ``int8``: also price ZeRO-3 with int8 gathers (lossy: asked for,
    never chosen on the search's own)."""
    t0 = time.perf_counter()
    pricer = Pricer(costs, profile, global_batch=global_batch, memory_per_rank=memory_per_rank)
    rpn = profile.ranks_per_node
    excluded: list[tuple[str, str]] = []
    if plans is not None:
        priced = []
        for plan in plans:
            try:
                priced.append(pricer.price(plan))
            except PlanError as e:
                excluded.append((describe(plan), f"invalid: {e}"))
    else:
        priced, excluded = _explore(costs, world, global_batch, pricer, rpn, cross_node_tp=False, int8=int8)
        # context parallelism for long sequences, or where nothing fits without it (fxpar.planner.space.cp_options)
        needed = not any(e.fits for e in priced)
        for cp in cp_options(costs, world, rpn, needed=needed):
            try:  # cp x tp within a node (the cp ranks are next to the tp ranks: fxpar.ir.mesh) unless needed
                more, why = _explore(costs, world, global_batch, pricer, rpn if needed else max(1, rpn // cp),
                                     cross_node_tp=False, cp=cp)
            except PlanError as e:
                more, why = [], [(f"cp={cp}", f"divisibility: {e}")]
            why = [(f"cp={cp} {w}", f"topology: cp={cp} x {w} spans nodes of {rpn} ranks" if r.startswith("topology")
                    else r) for w, r in why]
            priced, excluded = priced + more, excluded + why
        if not any(e.fits for e in priced):
            more, _ = _explore(costs, world, global_batch, pricer, rpn, cross_node_tp=True, int8=int8)
            priced += [e for e in more if e.plan.tp > rpn]
        priced += _fused(pricer, priced)
    if allow is not None:
        for e in priced:
            why = allow(e.plan)
            if why is not None and e.fits:
                e.fits, e.why_not = False, f"not allowed: {why}"
    fitting = sorted((e for e in priced if e.fits), key=_key)
    if not fitting:
        raise _no_fit(priced, pricer, world, rpn)
    fitting, dropped = _refine(fitting, pricer, top)
    priced = [e for e in priced if not e.fits] + dropped + fitting
    if not fitting:
        raise _no_fit(priced, pricer, world, rpn)
    base = baseline_plan(costs, world, global_batch, pricer, rpn)
    best = fitting[0]
    reasons: dict[str, int] = {}
    for e in fitting[1:]:
        e.why_not = f"time: {e.step_time / best.step_time:.2f}x the best"
    rejected = [e for e in priced if not e.fits]
    for e in rejected:
        e.why_not = e.why_not or "memory"
        kind = e.why_not.split(":", 1)[0]
        reasons[kind] = reasons.get(kind, 0) + 1
    if fitting[1:]:
        reasons["time"] = len(fitting) - 1
    for _, why in excluded:
        kind = why.split(":", 1)[0]
        reasons[kind] = reasons.get(kind, 0) + 1
    return AutoPlan(best.plan, best, fitting, rejected, reasons, base, world, profile,
                    time.perf_counter() - t0, excluded, global_batch)


ULYSSES_OF = 4  # first-pass plans per microbatch count priced again with Ulysses attention


def _explore(costs, world, global_batch, pricer, rpn, *, cross_node_tp, int8=False, cp=1):
    """The first and second passes over ``dp x pp x tp = world / cp`` (each plan with ``cp``)."""
    triples, excluded = factorisations(costs, world // cp, global_batch, ranks_per_node=rpn,
                                       cross_node_tp=cross_node_tp)
    if not triples:
        raise _no_factorisation(costs, world, global_batch, excluded, rpn)
    priced: list[Estimate] = []
    sp_ok = getattr(costs, "sp_allowed", {}) or {}
    sps = [sp for sp in (False, True) if any(k[1] == sp for k in costs.parts["pre"])]
    for dp, pp, tp in triples:
        ms = microbatch_options(global_batch, dp, pp)
        if not ms:
            excluded.append((f"dp={dp} x pp={pp} x tp={tp}", f"divisibility: {global_batch // dp} sequences per "
                             f"replica cannot make {pp} microbatches"))
            continue
        # cp where a microbatch's sequences divide over the cp ranks is dominated: dp x cp replicas compute as
        # much with no KV gathers and less memory (the whole keys and values), their gradients over as many ranks
        ms = [m for m in ms if cp == 1 or microbatch_size(global_batch, dp, m) % cp]
        first: dict[int, list[Estimate]] = {}
        # HSDP (dp_replicate > 1) with ZeRO where the dp group spans nodes: shard groups inside a node; ep for
        # models with expert layers, carved out of the dp replicas (fxpar.planner.space.variants)
        sps_here = [sp for sp in sps if (tp, sp) in costs.parts["pre"] and not (sp and (tp == 1 or sp_ok.get(tp)))]
        vs = variants(costs, dp, pp * tp, tp, rpn, sps_here, int8=int8, cp=cp)
        modes = cp_attention_options(costs, cp, tp)
        for m in ms:
            for sp, z, rc, r, e, q in vs:
                plan = Plan(dp=dp // e, ep=e, pp=pp, tp=tp, zero=z, microbatches=m, sequence_parallel=sp,
                            recompute=rc, schedule="1f1b", dp_replicate=r, comm_dtype=q, cp=cp)
                room = None if len(modes) > 1 else fit_bound(pricer, plan)  # (Ulysses picks among all times)
                first.setdefault(m, []).append(pricer.price(plan, exact=False, times_up_to=room))
            # Ulysses for the fastest of them (it changes the attention's bytes and memory, not how ZeRO,
            # recompute or HSDP rank against each other): the 70B x 1024 search priced 10% more plans without it
            fastest = sorted(first[m], key=lambda est: est.step_time)[:ULYSSES_OF] if len(modes) > 1 else []
            first[m] += [pricer.price(replace(est.plan, cp_attention=a), exact=False)
                         for est in fastest for a in modes[1:]]
        for est in first.values():
            priced += est
        if pp == 1:
            continue
        best_m = sorted(first, key=lambda m: min((e.step_time for e in first[m] if e.fits), default=math.inf))
        for m in best_m[:KEEP_M]:
            if not any(e.fits for e in first[m]):
                continue
            base = Plan(dp=dp, pp=pp, tp=tp, microbatches=m, cp=cp)
            others = tuple(n for n, r in SCHEDULE_RECORDS.items() if r.searched and n != base.schedule)
            got, why = schedule_variants(base, others, len(costs.layers) + 2)
            excluded += why
            # the other schedules with the cp attention that won under 1F1B (it moves the same bytes under any)
            won = min((e for e in first[m] if e.fits), key=lambda e: e.step_time).plan.cp_attention
            for g in got:
                for (sp, z, rc, r, e, q), a in product(vs, (won,)):
                    plan = replace(g, dp=dp // e, ep=e, zero=z, sequence_parallel=sp, recompute=rc, dp_replicate=r,
                                   comm_dtype=q, cp_attention=a)
                    priced.append(pricer.price(plan, exact=False, times_up_to=fit_bound(pricer, plan)))
    return priced, excluded


def _fused(pricer: Pricer, priced: list[Estimate]) -> list[Estimate]:
    """The fused loss for the plans it may make fit and win (a dominance rule): those it may bring under the
    memory and ahead of the best plan that fits, by bounds of the bytes and seconds it can save
    (:func:`fxpar.cost.memory.fused_saving`: at most the unfused head and loss's). It costs the head's
    matmul again in backward and saves the loss's elementwise passes over the logits and their memory."""
    if pricer.costs.fused is None:
        return []
    best = min((e.step_time for e in priced if e.fits), default=math.inf)
    out = []
    for e in priced:
        if e.step_time == math.inf:  # too large even for the fused loss's saving (fit_bound)
            continue
        saves, faster = fused_saving(pricer, e.plan)
        if e.step_time - faster < best and e.memory["total"] - saves <= pricer.memory:
            out.append(pricer.price(replace(e.plan, fused_loss=True), exact=False, times_up_to=pricer.memory))
    return out



def _refine(fitting: list[Estimate], pricer: Pricer, top: int) -> tuple[list[Estimate], list[Estimate]]:
    """Price the leaders on their schedule's exact DAG until the first ``top + 1`` are all exact; also
    returns those that no longer fit once priced exactly."""
    done: set[int] = set()
    dropped: list[Estimate] = []
    for _ in range(20):
        head = fitting[:top + 1]
        todo = [i for i, e in enumerate(head) if id(e) not in done]
        if not todo:
            break
        for i in todo:
            e = pricer.price(fitting[i].plan)
            done.add(id(e))
            fitting[i] = e
        dropped += [e for e in fitting if not e.fits]
        fitting = [e for e in fitting if e.fits]
        fitting.sort(key=_key)
    return fitting, dropped


def _no_factorisation(costs, world, global_batch, excluded, rpn) -> PlanError:
    tps = [t for t, r in sorted(costs.tp_allowed.items()) if r is None]
    bad = "; ".join(f"tp={t}: {r}" for t, r in sorted(costs.tp_allowed.items()) if r is not None)
    layers = len(costs.layers)
    near = [w for w in range(max(1, world - 8), world + 9) if w != world and any(
        w % t == 0 and global_batch % (w // t // pp) == 0 for t in tps if t <= rpn
        for pp in divisors(w // t) if pp <= layers)]
    examples = "; ".join(f"{w}: {why}" for w, why in excluded[:4])
    return PlanError(
        f"fxpar.planner.search: no dp x pp x tp factorisation of world {world} works: tp can be "
        f"{', '.join(map(str, tps))}{f' ({bad})' if bad else ''}, pp at most {layers} (layers), dp must divide "
        f"the global batch {global_batch} ({examples}); worlds near {world} that work: "
        f"{', '.join(map(str, near[:6])) or 'none'}, or a global batch that is a multiple of {world}")


def _no_fit(priced: list[Estimate], pricer: Pricer, world: int, rpn: int) -> PlanError:
    least = min(priced, key=lambda e: (e.memory["total"], e.step_time))
    mem, have = least.memory, pricer.memory
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    fixed = mem["total"] - states
    p = least.plan
    where = (f"zero={p.zero}, dp={p.dp}, pp={p.pp}, tp={p.tp}, recompute={p.recompute}, microbatch "
             f"{microbatch_size(pricer.batch, p.dp, p.microbatches or 1)}")
    if have > fixed:
        need = math.ceil(world * states / (have - fixed))
        need = math.ceil(need / rpn) * rpn
        fix = f"use >= {need} ranks (the sharded states scale with the ranks), or a device with more memory"
    else:
        fix = (f"its activations and buffers alone take {gb(fixed)}: use a shorter sequence, a smaller global "
               f"batch per replica, or a device with more memory")
    return PlanError(f"fxpar.planner.search: the model does not fit on {world} ranks: it needs {gb(mem['total'])} "
                     f"per rank even at {where} (params {gb(mem['params'])}, grads {gb(mem['grads'])}, optimizer "
                     f"{gb(mem['optimizer'])}, activations {gb(mem['activations'])}); the device has {gb(have)}: "
                     f"{fix}")
